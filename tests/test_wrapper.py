"""The wrapper's contract, on fake functions shaped like real releases."""

from types import SimpleNamespace

import pytest
from fake_sglang import RELEASES, load_function

from sglang_lora_tma_guard.guard import hooks_touch_buffers, make_guarded
from sglang_lora_tma_guard.inspection import inspect_target

ARGS = tuple(f"arg{i}" for i in range(10))


def noop(*_):
    pass


def guarded(version):
    calls = []
    original = load_function(RELEASES[version], calls)
    return make_guarded(original, inspect_target(original)), original, calls


@pytest.mark.parametrize("version", ["0.5.11", "0.5.16"])
def test_hooked_call_gets_tma_off_when_flag_is_positional(version):
    wrapper, _, calls = guarded(version)
    hooks = SimpleNamespace(after_gate_up=noop, after_down=None)
    assert wrapper(*ARGS, True, hooks=hooks)[0] == "plain"
    assert calls[-1]["tma"] is False and calls[-1]["hooks"] is hooks


def test_hooked_call_gets_tma_off_when_flag_is_a_keyword():
    wrapper, _, calls = guarded("0.5.16")
    hooks = SimpleNamespace(after_gate_up=None, after_down=noop)
    assert wrapper(*ARGS, down_moe_use_tma=True, hooks=hooks)[0] == "plain"
    assert calls[-1]["tma"] is False


@pytest.mark.parametrize(
    "hooks",
    [None, SimpleNamespace(after_gate_up=None, after_down=None)],
    ids=["no-hooks", "hooks-with-nothing-set"],
)
def test_call_without_active_hooks_keeps_tma(hooks):
    wrapper, _, calls = guarded("0.5.16")
    assert wrapper(*ARGS, True, hooks=hooks)[0] == "tma"
    assert calls[-1]["tma"] is True


def test_arguments_other_than_the_flag_are_passed_unchanged():
    seen = {}

    def _fused_moe_kernel_sequence(a, b, down_moe_use_tma, c=3, *, hooks=None, extra=None):
        seen.update(a=a, b=b, tma=down_moe_use_tma, c=c, hooks=hooks, extra=extra)

    wrapper = make_guarded(_fused_moe_kernel_sequence, inspect_target(_fused_moe_kernel_sequence))
    hooks = SimpleNamespace(after_gate_up=noop, after_down=noop)
    marker = object()
    wrapper(1, 2, True, 4, hooks=hooks, extra=marker)
    assert seen == dict(a=1, b=2, tma=False, c=4, hooks=hooks, extra=marker)


def test_missing_flag_argument_still_raises_sglangs_type_error():
    wrapper, original, _ = guarded("0.5.16")
    hooks = SimpleNamespace(after_gate_up=noop, after_down=None)
    with pytest.raises(TypeError) as ours:
        wrapper(*ARGS, hooks=hooks)
    with pytest.raises(TypeError) as theirs:
        original(*ARGS, hooks=hooks)
    assert str(ours.value) == str(theirs.value)


def test_hooks_of_another_shape_meet_sglangs_own_error():
    wrapper, original, calls = guarded("0.5.16")
    odd = SimpleNamespace(after_down=noop)  # no after_gate_up: SGLang raises AttributeError
    with pytest.raises(AttributeError) as ours:
        wrapper(*ARGS, True, hooks=odd)
    with pytest.raises(AttributeError) as theirs:
        original(*ARGS, True, hooks=odd)
    assert str(ours.value) == str(theirs.value)


def test_hooks_whose_truth_test_raises_pass_through_untouched():
    class Broken:
        def __bool__(self):
            raise RuntimeError("hooks are broken")

    assert hooks_touch_buffers(Broken()) is False
    wrapper, _, calls = guarded("0.5.16")
    with pytest.raises(RuntimeError, match="hooks are broken"):
        wrapper(*ARGS, True, hooks=Broken())
    assert calls[-1]["tma"] is True  # what SGLang was given is what the caller gave


def test_exceptions_from_hooks_propagate_unchanged():
    wrapper, _, _ = guarded("0.5.16")
    failure = ValueError("adapter exploded")

    def explode(*_):
        raise failure

    with pytest.raises(ValueError) as caught:
        wrapper(*ARGS, True, hooks=SimpleNamespace(after_gate_up=explode, after_down=None))
    assert caught.value is failure


def test_wrapper_looks_like_the_original():
    import inspect

    wrapper, original, _ = guarded("0.5.16")
    assert wrapper.__wrapped__ is original
    assert wrapper.__name__ == "_fused_moe_kernel_sequence"
    assert inspect.signature(wrapper) == inspect.signature(original)


def test_positional_hooks_parameter_is_honoured():
    seen = {}

    def _fused_moe_kernel_sequence(x, down_moe_use_tma, hooks=None):
        seen["tma"] = down_moe_use_tma

    inspection = inspect_target(_fused_moe_kernel_sequence)
    assert inspection.hooks_index == 2
    make_guarded(_fused_moe_kernel_sequence, inspection)(0, True, SimpleNamespace(after_gate_up=noop))
    assert seen["tma"] is False


def test_fallback_wrapper_sends_hookless_calls_to_sglang_and_refuses_unknown_arguments():
    from sglang_lora_tma_guard.fallback import FallbackUnsupported
    from sglang_lora_tma_guard.inspection import Strategy

    seen = []

    def _fused_moe_kernel_sequence(hidden_states, down_use_tma, *, hooks=None, secret_mode=None):
        seen.append(down_use_tma)
        return "sglang"

    inspection = inspect_target(_fused_moe_kernel_sequence)
    assert inspection.strategy is Strategy.FALLBACK
    wrapper = make_guarded(_fused_moe_kernel_sequence, inspection)
    assert wrapper(0, True) == "sglang" and seen == [True]
    hooks = SimpleNamespace(after_gate_up=noop, after_down=None)
    with pytest.raises(FallbackUnsupported, match=r"\['secret_mode'\]"):
        wrapper(0, True, hooks=hooks, secret_mode="on")
    with pytest.raises(TypeError):  # arguments SGLang itself would reject: SGLang's own error
        wrapper(0, True, 1, 2, hooks=hooks)
