"""The entry point and its environment switch."""

import pytest
import scenario
from fake_sglang import write_tree

from sglang_lora_tma_guard.settings import read_switch


@pytest.mark.parametrize(
    "value, enabled, valid",
    [(None, False, True), ("1", True, True), ("true", True, True), (" ON ", True, True),
     ("TRUE", True, True), ("0", False, True), ("false", False, True), ("off", False, True),
     ("", False, True), ("yes please", False, False), ("2", False, False)],
)
def test_switch_values(value, enabled, valid):
    switch = read_switch({} if value is None else {"SGLANG_LORA_TMA_GUARD": value})
    assert (switch.enabled, switch.valid) == (enabled, valid)
    assert switch.plain is False


@pytest.mark.parametrize("value", ["plain", " Plain "])
def test_plain_turns_the_guard_on_with_the_plain_fix(value):
    switch = read_switch({"SGLANG_LORA_TMA_GUARD": value})
    assert (switch.enabled, switch.valid, switch.plain) == (True, True, True)
    assert "plain fix" in switch.describe()


SCHEDULER = """
import types
from sglang.srt.plugins.hook_registry import HookRegistry
target = "sglang.srt.managers.scheduler.configure_scheduler_process"
if WITH_SCHEDULER:
    # A stand-in for SGLang's scheduler module (its import needs GPU-only packages): the real
    # configure_scheduler_process sets up the rank's logging, as this one does with a TP0 prefix.
    scheduler = types.ModuleType("sglang.srt.managers.scheduler")
    def configure_scheduler_process(*args, **kwargs):
        logging.getLogger().handlers[0].setFormatter(logging.Formatter("[TP0] %(message)s"))
        return "dp rank"
    scheduler.configure_scheduler_process = configure_scheduler_process
    sys.modules[scheduler.__name__] = scheduler
    import sglang.srt.managers
    sglang.srt.managers.scheduler = scheduler
import sglang.srt.plugins
sglang.srt.plugins.load_plugins()
returned = sys.modules[scheduler.__name__].configure_scheduler_process(1, 2) if WITH_SCHEDULER else None
result = dict(registered=len(HookRegistry._hooks.get(target, [])), returned=returned,
              announced=[l for l in log().splitlines() if "active in this process" in l or "armed in" in l])
"""


@pytest.mark.real
@pytest.mark.parametrize("with_scheduler", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["scheduler-process", "other-process"])
def test_a_scheduler_process_announces_the_guard_after_its_logging_is_set_up(with_scheduler):
    result = scenario.run(f"WITH_SCHEDULER = {with_scheduler}\n" + SCHEDULER, None,
                          {"SGLANG_LORA_TMA_GUARD": "1", "TRITON_INTERPRET": "1"}, timeout=300)
    if not with_scheduler:
        assert result == dict(registered=0, returned=None, announced=[])
        return
    assert result["registered"] == 1 and result["returned"] == "dp rank"  # SGLang's result kept
    [line] = result["announced"]
    assert line.startswith("[TP0] sglang-lora-tma-guard: ")  # under the rank's own prefix


REGISTER = """
m = fm(); original = m._fused_moe_kernel_sequence
plugin.register()
result = dict(installed=g.status().installed, untouched=m._fused_moe_kernel_sequence is original,
              warnings=[l for l in log().splitlines() if l.startswith("WARNING")])
"""


@pytest.mark.parametrize("value, installed", [("1", True), ("on", True), ("0", False), ("off", False), (None, False)])
def test_register_follows_the_switch(tmp_path, value, installed):
    env = {} if value is None else {"SGLANG_LORA_TMA_GUARD": value}
    result = scenario.run(REGISTER, write_tree(tmp_path, "0.5.16"), env)
    assert result == dict(installed=installed, untouched=not installed, warnings=[])


def test_odd_value_warns_once_naming_the_accepted_values_and_patches_nothing(tmp_path):
    result = scenario.run(REGISTER, write_tree(tmp_path, "0.5.16"), {"SGLANG_LORA_TMA_GUARD": "enable"})
    assert result["installed"] is False and result["untouched"] is True
    [warning] = result["warnings"]
    assert "'enable'" in warning and "1, true, on" in warning and "0, false, off" in warning


def test_register_without_sglang_does_nothing_and_raises_nothing(tmp_path):
    result = scenario.run(
        """
        class NoSGLang:
            def find_spec(self, name, path=None, target=None):
                if name == "sglang" or name.startswith("sglang."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, NoSGLang())
        plugin.register()
        st = g.status()
        result = dict(active=st.active, installed=st.installed, errors="ERROR" in log())
        """,
        None,
        {"SGLANG_LORA_TMA_GUARD": "1"},
    )
    assert result == dict(active=True, installed=False, errors=False)


def test_register_logs_and_swallows_an_internal_failure(tmp_path):
    result = scenario.run(
        """
        def boom():
            raise RuntimeError("boom")
        plugin.serving.activate = boom
        plugin.register()
        result = [l for l in log().splitlines() if l.startswith("ERROR")]
        """,
        write_tree(tmp_path, "0.5.16"),
        {"SGLANG_LORA_TMA_GUARD": "1"},
    )
    assert len(result) == 1 and "activation failed; SGLang runs unguarded" in result[0]


def test_a_failure_inside_the_import_hook_never_breaks_sglangs_import(tmp_path):
    result = scenario.run(
        """
        def boom(*a, **k):
            raise RuntimeError("inspection blew up")
        guard.inspect_target = boom
        g.activate()
        m = fm()
        result = dict(imported=hasattr(m, "_fused_moe_kernel_sequence"),
                      installed=g.status().installed,
                      logged="TMA guard on " + TARGET + "._fused_moe_kernel_sequence could not be placed" in log())
        """,
        write_tree(tmp_path, "0.5.16"),
    )
    assert result == dict(imported=True, installed=False, logged=True)
