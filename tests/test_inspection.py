"""Strategy per release shape, decided from the function itself."""

import pytest
from fake_sglang import RELEASES, load_function, write_tree

from sglang_lora_tma_guard.inspection import (
    Strategy,
    has_native_guard,
    inspect_target,
    release_is_affected,
    version_note,
)

# The fakes carry no kernel launches, so no weight-TMA variant: the plain fix or nothing.
EXPECTED = {
    "0.5.11": Strategy.FLAG,
    "0.5.16": Strategy.FLAG,
    "0.5.17": Strategy.NATIVE,
    "0.5.23": Strategy.NATIVE,
    "0.5.16.dev3+renamed": Strategy.FALLBACK,
    "0.5.16+fork-resets-elsewhere": Strategy.FLAG,
}
# Without source nothing is proven: what SGLang would do by itself is never taken on trust.
EXPECTED_COMPILED = {**EXPECTED, "0.5.17": Strategy.FLAG, "0.5.23": Strategy.FLAG}


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_strategy_is_read_from_the_compiled_function(version):
    # Compiled from a string: no source to read, as in a compiled-only install.
    inspection = inspect_target(load_function(RELEASES[version], []))
    assert inspection.strategy is EXPECTED_COMPILED[version]
    assert inspection.native_guard is False
    if inspection.strategy is Strategy.FLAG:
        assert inspection.flag_index == 10
        assert inspection.hooks_index is None  # keyword-only in every release


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_strategy_is_read_from_the_source_file(version, tmp_path, monkeypatch):
    write_tree(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.util

    path = tmp_path / "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py"
    spec = importlib.util.spec_from_file_location("fake_fused_moe_" + version.replace(".", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inspection = inspect_target(module._fused_moe_kernel_sequence)
    assert inspection.strategy is EXPECTED[version]
    assert inspection.native_guard is (EXPECTED[version] is Strategy.NATIVE)


def test_missing_function_means_nothing_to_guard():
    inspection = inspect_target(None)
    assert inspection.strategy is Strategy.ABSENT
    assert "0.5.11" in inspection.reason


def test_function_without_hooks_means_nothing_to_guard():
    def _fused_moe_kernel_sequence(hidden_states, w1, w2, down_moe_use_tma):
        return hidden_states

    assert inspect_target(_fused_moe_kernel_sequence).strategy is Strategy.ABSENT


def test_keyword_only_flag_goes_to_the_fallback():
    def _fused_moe_kernel_sequence(hidden_states, *, down_moe_use_tma, hooks=None):
        return hidden_states

    inspection = inspect_target(_fused_moe_kernel_sequence)
    assert inspection.strategy is Strategy.FALLBACK
    assert "no positional 'down_moe_use_tma'" in inspection.reason


def test_unreadable_signature_is_unsupported_not_an_error():
    class Opaque:
        __signature__ = "not a signature"

        def __call__(self, *args, **kwargs):
            pass

    assert inspect_target(Opaque()).strategy is Strategy.UNSUPPORTED


def _load_source(tmp_path, name, source):
    import importlib.util

    (tmp_path / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._fused_moe_kernel_sequence


UPSTREAM_TEST = "hooks and (hooks.after_gate_up is not None or hooks.after_down is not None)"


@pytest.mark.parametrize(
    "body",
    [
        # The flag read before the guard: a call made before the reset already used it.
        f"use = down_moe_use_tma\nif {UPSTREAM_TEST}:\n    down_moe_use_tma = False",
        # The guard nested under another condition.
        f"if x:\n    if {UPSTREAM_TEST}:\n        down_moe_use_tma = False",
        # A test that misses calls with only after_down set.
        "if hooks and hooks.after_gate_up is not None:\n    down_moe_use_tma = False",
        # A further condition: some hooked calls keep TMA.
        f"if {UPSTREAM_TEST} and x:\n    down_moe_use_tma = False",
        # Reset to something other than False.
        "if hooks and (hooks.after_gate_up or hooks.after_down):\n    down_moe_use_tma = x",
    ],
    ids=["read-before", "nested", "one-hook-only", "extra-condition", "not-false"],
)
def test_only_a_guard_that_covers_every_hooked_call_counts_as_native(body, tmp_path):
    source = "def _fused_moe_kernel_sequence(x, down_moe_use_tma, *, hooks=None):\n"
    source += "".join("    " + line + "\n" for line in body.splitlines()) + "    return down_moe_use_tma\n"
    function = _load_source(tmp_path, "fork", source)
    assert not has_native_guard(function)
    assert inspect_target(function).strategy is Strategy.FLAG


@pytest.mark.parametrize(
    "test", [UPSTREAM_TEST, "hooks is not None and (hooks.after_down or hooks.after_gate_up)"],
    ids=["upstream", "respelled"],
)
def test_upstream_guard_and_its_spellings_count_as_native(test, tmp_path):
    source = (f"def _fused_moe_kernel_sequence(x, down_moe_use_tma, *, hooks=None):\n"
              f'    """Doc."""\n    n = x\n    if {test}:\n        down_moe_use_tma = False\n'
              "    return down_moe_use_tma\n")
    assert has_native_guard(_load_source(tmp_path, "upstream", source))


def test_a_flag_reset_outside_a_hooks_test_is_not_the_native_guard():
    def _fused_moe_kernel_sequence(x, down_moe_use_tma, *, hooks=None):
        if x is None:
            down_moe_use_tma = False
        return hooks.after_gate_up, down_moe_use_tma

    assert not has_native_guard(_fused_moe_kernel_sequence)
    assert inspect_target(_fused_moe_kernel_sequence).strategy is Strategy.FLAG


@pytest.mark.parametrize(
    "version, affected",
    [("0.5.10.post1", False), ("0.5.11", True), ("0.5.16.dev7+gabc", True), ("0.5.17", False),
     ("main", None)],
)
def test_version_number_alone(version, affected):
    assert release_is_affected(version) is affected


def test_versions_outside_the_checked_range_get_a_note():
    assert version_note("0.5.16") is None
    assert "outside the releases checked (>=0.5.11,<0.5.24)" in version_note("0.6.0")
    assert "not a release number" in version_note("main")
