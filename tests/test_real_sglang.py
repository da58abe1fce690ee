"""The guard on the real SGLang 0.5.16 kernels (Triton's CPU interpreter), loaded by SGLang itself.

Every comparison is against SGLang's own non-TMA path for the same inputs and hooks.
"""

from __future__ import annotations

import pytest
import torch

import sglang_lora_tma_guard as guard
from harness import tiny_moe
from sglang_lora_tma_guard.inspection import TARGET_NAME

pytestmark = pytest.mark.real

# Batch sizes: a single token, a ragged batch, and one with more routes than a block holds.
SIZES = [1, 5, 24]


@pytest.fixture(scope="module")
def problems():
    return {n: tiny_moe.make_problem(num_tokens=n, seed=n) for n in SIZES}


@pytest.fixture(scope="module")
def references(fm, problems):
    """SGLang's non-TMA hooked output: what a correct hooked call returns."""
    return {
        n: tiny_moe.run_sequence(p, use_tma=False, hooks=tiny_moe.lora_hooks(p)) for n, p in problems.items()
    }


@pytest.mark.parametrize("tokens", SIZES)
def test_unguarded_hooked_tma_call_corrupts_every_row(fm, problems, references, tokens):
    problem = problems[tokens]
    assert not guard.status().installed
    output = tiny_moe.run_sequence(problem, use_tma=True, hooks=tiny_moe.lora_hooks(problem))
    result = tiny_moe.compare(output, references[tokens])
    assert result.rows_wrong == tokens, result


@pytest.mark.parametrize("tokens", SIZES)
def test_hooked_call_is_bit_identical_to_non_tma_path(sglang_plugins, problems, references, tokens):
    state = sglang_plugins()
    assert state.installed and state.strategy == "weight_tma"
    problem = problems[tokens]
    output = tiny_moe.run_sequence(problem, use_tma=True, hooks=tiny_moe.lora_hooks(problem))
    assert torch.equal(output, references[tokens]), tiny_moe.compare(output, references[tokens])


@pytest.mark.parametrize("gate_up, down", [(True, False), (False, True)], ids=["gate-up-only", "down-only"])
def test_a_single_hook_is_enough_to_turn_tma_off(sglang_plugins, problems, gate_up, down):
    problem = problems[5]
    hooks = tiny_moe.lora_hooks(problem, gate_up=gate_up, down=down)
    reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks)
    unguarded = tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks)
    assert tiny_moe.compare(unguarded, reference).rows_wrong > 0
    sglang_plugins()
    assert torch.equal(tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks), reference)


def test_hookless_call_still_reaches_the_kernel_with_tma_on(sglang_plugins, problems, launches):
    problem = problems[24]
    unguarded = tiny_moe.run_sequence(problem, use_tma=True, hooks=None)
    sglang_plugins()
    launches.clear()
    guarded = tiny_moe.run_sequence(problem, use_tma=True, hooks=None)
    gate_up, down = launches
    assert gate_up["c_sorted"] is True
    assert down["a_use_tma"] is True and down["b_use_tma"] is True
    assert torch.equal(guarded, unguarded)
    # SGLang's two paths agree without hooks: TMA was never the problem by itself.
    assert torch.equal(guarded, tiny_moe.run_sequence(problem, use_tma=False, hooks=None))


WEIGHT_TMA, NO_TMA = tiny_moe.WEIGHT_TMA_LAUNCH, tiny_moe.NO_TMA_LAUNCH


def test_hooked_call_keeps_tma_for_the_weights_only(sglang_plugins, problems, launches):
    sglang_plugins()
    problem = problems[5]
    tiny_moe.run_sequence(problem, use_tma=True, hooks=tiny_moe.lora_hooks(problem))
    assert launches == [WEIGHT_TMA, WEIGHT_TMA]  # gate-up, down: activations route-major


def test_hooked_call_without_tma_requested_is_left_without_it(sglang_plugins, problems, launches, references):
    sglang_plugins()
    problem = problems[5]
    output = tiny_moe.run_sequence(problem, use_tma=False, hooks=tiny_moe.lora_hooks(problem))
    assert launches == [NO_TMA, NO_TMA] and torch.equal(output, references[5])


def test_plain_switch_keeps_the_plain_fix(sglang_plugins, problems, launches, references):
    state = sglang_plugins("plain")
    assert state.installed and state.strategy == "flag"
    problem = problems[5]
    output = tiny_moe.run_sequence(problem, use_tma=True, hooks=tiny_moe.lora_hooks(problem))
    assert launches == [NO_TMA, NO_TMA] and torch.equal(output, references[5])


@pytest.mark.parametrize(
    "env_value, allow_list, installed",
    [("1", None, True), ("0", None, False), (None, None, False), ("1", "lora_tma_guard", True),
     ("1", "some_other_plugin", False)],
    ids=["on", "off", "unset", "allow-listed", "not-allow-listed"],
)
def test_load_plugins_honours_the_switch_and_the_allow_list(sglang_plugins, env_value, allow_list, installed):
    assert sglang_plugins(env_value, allow_list).installed is installed


def test_deactivate_brings_back_the_original_and_with_it_the_bug(sglang_plugins, fm, problems, references):
    original = getattr(fm, TARGET_NAME)
    sglang_plugins()
    guard.deactivate()
    assert getattr(fm, TARGET_NAME) is original
    problem = problems[5]
    output = tiny_moe.run_sequence(problem, use_tma=True, hooks=tiny_moe.lora_hooks(problem))
    assert tiny_moe.compare(output, references[5]).rows_wrong == 5


def test_guard_holds_in_a_caller_compiled_by_torch_compile(sglang_plugins, fm, problems, references, monkeypatch):
    # Dynamo cannot trace Triton's CPU interpreter, so SGLang's function itself is made opaque to
    # it (on a GPU Dynamo handles Triton kernels); the guard in front of it is traced as usual.
    monkeypatch.setattr(fm, TARGET_NAME, torch._dynamo.disable(getattr(fm, TARGET_NAME)))
    sglang_plugins()
    problem = problems[5]
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda hooks: tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks), backend="eager"
    )
    assert torch.equal(compiled(tiny_moe.lora_hooks(problem)), references[5])
    guard.deactivate()
    torch._dynamo.reset()
    assert tiny_moe.compare(compiled(tiny_moe.lora_hooks(problem)), references[5]).rows_wrong == 5


# Failures pass through unchanged: the caller sees SGLang's own behaviour and exception.


def outcome(call):
    try:
        return ("returned", call())
    except Exception as exc:  # noqa: BLE001 - the point is to compare whatever comes out
        return ("raised", type(exc), str(exc))


def both_ways(sglang_plugins, call):
    guard.deactivate()
    without = outcome(call)
    sglang_plugins()
    return without, outcome(call)


def test_an_exception_from_a_hook_reaches_the_caller_unchanged(sglang_plugins, problems):
    failure = RuntimeError("adapter weights missing")

    def broken_hook(*_):
        raise failure

    from sglang.srt.lora.lora_moe_runners import LoRAHooks

    sglang_plugins()
    with pytest.raises(RuntimeError) as caught:
        tiny_moe.run_sequence(problems[5], use_tma=True, hooks=LoRAHooks(after_down=broken_hook))
    assert caught.value is failure


def test_sglangs_own_errors_are_the_same_with_and_without_the_guard(sglang_plugins, problems):
    problem = problems[5]
    hooks = tiny_moe.lora_hooks(problem)
    bad_activation = lambda: tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks,  # noqa: E731
                                                activation="swish", is_gated=True)
    without, with_guard = both_ways(sglang_plugins, bad_activation)
    assert without[0] == "raised" and without == with_guard


def test_hooks_of_another_shape_meet_the_same_error_with_and_without_the_guard(sglang_plugins, problems):
    from types import SimpleNamespace

    problem = problems[5]
    odd = SimpleNamespace(after_down=tiny_moe.lora_hooks(problem).after_down)  # no after_gate_up
    without, with_guard = both_ways(
        sglang_plugins, lambda: tiny_moe.run_sequence(problem, use_tma=True, hooks=odd))
    assert without[0] == "raised" and without[1] is AttributeError and without == with_guard


def test_hooks_with_extra_attributes_are_guarded_like_sglangs_own(sglang_plugins, problems, references):
    from types import SimpleNamespace

    problem = problems[5]
    real = tiny_moe.lora_hooks(problem)
    extra = SimpleNamespace(after_gate_up=real.after_gate_up, after_down=real.after_down, lora_ids=[0, 1])
    sglang_plugins()
    assert torch.equal(tiny_moe.run_sequence(problem, use_tma=True, hooks=extra), references[5])


# --- turning the guard off when other code wraps it ------------------------------------------------


def wrap_with_a_closure(module):
    """The usual monkeypatch: a functools.wraps closure set on the module above the guard."""
    import functools

    inner = getattr(module, TARGET_NAME)

    @functools.wraps(inner)
    def traced(*args, **kwargs):
        return inner(*args, **kwargs)

    setattr(module, TARGET_NAME, traced)


def wrap_with_sglangs_registry(module):
    """Another plugin's AROUND hook, applied by SGLang's own HookRegistry."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{module.__name__}.{TARGET_NAME}", lambda original, *a, **k: original(*a, **k),
                          HookType.AROUND)
    HookRegistry.apply_hooks()


@pytest.fixture
def restore_target(fm):
    from sglang.srt.plugins.hook_registry import HookRegistry

    original = getattr(fm, TARGET_NAME)
    yield
    target = f"{fm.__name__}.{TARGET_NAME}"
    HookRegistry._hooks.pop(target, None)
    HookRegistry._patched.discard(target)
    setattr(fm, TARGET_NAME, original)
    guard.deactivate()  # the guard's wrapper is gone with the outer one: it forgets it


@pytest.mark.parametrize("outer", [wrap_with_a_closure, wrap_with_sglangs_registry], ids=["closure", "hook-registry"])
def test_under_another_wrapper_deactivate_leaves_the_guard_inert_and_activate_revives_it(
        fm, sglang_plugins, launches, restore_target, problems, references, outer):
    problem, hooks = problems[5], tiny_moe.lora_hooks(problems[5])
    assert sglang_plugins().installed
    outer(fm)
    state = guard.deactivate()  # never raises
    assert (state.active, state.installed, state.inert) == (False, True, True)
    unguarded = tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks)
    assert launches == tiny_moe.FULL_TMA_LAUNCHES  # passed through untouched, as without the guard
    assert tiny_moe.compare(unguarded, references[5]).rows_wrong == 5
    launches.clear()
    state = guard.activate(weight_tma=False)  # never raises; keeps what it can keep
    assert (state.active, state.installed, state.inert, state.strategy) == (True, True, False, "weight_tma")
    guarded = tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks)
    assert launches == [tiny_moe.WEIGHT_TMA_LAUNCH] * 2
    assert torch.equal(guarded, references[5])


def test_deactivate_logs_once_why_the_guard_stays_in_the_chain(fm, sglang_plugins, restore_target, caplog):
    import logging

    sglang_plugins()
    wrap_with_a_closure(fm)
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        guard.deactivate()
    [line] = caplog.messages
    assert "wrapped by other code above the guard" in line and "inert" in line
