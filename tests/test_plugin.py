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
        guard.activate = boom
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
                      logged="could not guard" in log())
        """,
        write_tree(tmp_path, "0.5.16"),
    )
    assert result == dict(imported=True, installed=False, logged=True)
