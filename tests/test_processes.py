"""Processes started the way SGLang starts its schedulers, and patch orders, on the real SGLang."""

import multiprocessing

import child
import pytest
import scenario

pytestmark = [pytest.mark.real, pytest.mark.slow]  # fresh interpreters importing SGLang


def test_scheduler_like_processes_are_guarded_exactly_when_the_switch_is_on(monkeypatch):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    # One scheduler per GPU rank: three with the switch on, two without, all at once.
    for name, value in [("on-0", "1"), ("on-1", "true"), ("on-2", "ON"), ("off-0", None), ("off-1", "0")]:
        if value is None:
            monkeypatch.delenv("SGLANG_LORA_TMA_GUARD", raising=False)
        else:
            monkeypatch.setenv("SGLANG_LORA_TMA_GUARD", value)
        proc = ctx.Process(target=child.scheduler_like, args=(queue, name))
        proc.start()  # a spawned child takes the environment as it is now
        procs.append(proc)
    results = {}
    for _ in procs:
        result = queue.get(timeout=600)
        results[result.pop("name")] = result
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    guarded = {"installed": True, "identical": True, "rows_wrong": 0}
    unguarded = {"installed": False, "identical": False, "rows_wrong": 4}
    assert results == {"on-0": guarded, "on-1": guarded, "on-2": guarded,
                       "off-0": unguarded, "off-1": unguarded}


ORDERS = """
import sglang.srt.plugins as plugins
import wrapt
if IMPORT_FIRST:
    m = fm()
plugins.load_plugins()
loaded_before_import = TARGET in sys.modules
m = fm()
original = wrapt.unwrapped(m._fused_moe_kernel_sequence)
plugins._plugins_loaded = False
plugins.load_plugins()          # a second load, as a second Engine in one process would do
once = m._fused_moe_kernel_sequence.__wrapped__ is original
states = []
for _ in range(2):
    g.deactivate(); states.append(m._fused_moe_kernel_sequence is original)
    g.activate(); states.append(m._fused_moe_kernel_sequence.__wrapped__ is original)
g.deactivate()
result = dict(loaded_before_import=loaded_before_import, once=once, states=states,
              restored=m._fused_moe_kernel_sequence is original,
              log_lines=log().count("strategy WEIGHT_TMA"))
"""


@pytest.mark.parametrize("import_first", [True, False], ids=["module-first", "plugin-first"])
def test_patch_orders_on_real_sglang(import_first):
    result = scenario.run(f"IMPORT_FIRST = {import_first}\n" + ORDERS, None,
                          {"SGLANG_LORA_TMA_GUARD": "1", "TRITON_INTERPRET": "1"}, timeout=300)
    assert result["loaded_before_import"] is import_first
    assert result["once"] and result["restored"] and result["states"] == [True] * 4
    assert result["log_lines"] == 3  # the first install and the two re-activations
