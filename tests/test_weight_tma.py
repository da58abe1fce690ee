"""Hooked calls keep TMA for the weights: the variant, when it is built, and how it behaves.

The real-kernel tests run SGLang 0.5.16's own sequence and kernels (Triton's CPU interpreter);
the shape tests run the transform on small functions written like SGLang's.
"""

from __future__ import annotations

import threading

import pytest
import torch

import sglang_lora_tma_guard as guard
from harness import tiny_moe
from sglang_lora_tma_guard import weight_tma
from sglang_lora_tma_guard.inspection import TARGET_NAME, Strategy, inspect_target

WEIGHT_TMA = tiny_moe.WEIGHT_TMA_LAUNCH

LAUNCHER = '''
def invoke_fused_moe_kernel(A, B, C, *, a_use_tma=False, b_use_tma=False, c_sorted=False):
    LAUNCHES.append(dict(a_use_tma=a_use_tma, b_use_tma=b_use_tma, c_sorted=c_sorted))
'''
SEQUENCE = '''
def _fused_moe_kernel_sequence(x, down_moe_use_tma, *, hooks=None, use_fp8_w8a8=False, block_shape=None):
    invoke_fused_moe_kernel(x, 1, 2, c_sorted=down_moe_use_tma{gate_up_extra})
    invoke_fused_moe_kernel(x, 3, 4, a_use_tma=down_moe_use_tma, b_use_tma=down_moe_use_tma)
    return x
'''


def load(tmp_path, sequence: str, launcher: str = LAUNCHER, name="seq_module"):
    """Write ``launcher`` + ``sequence`` as a module file and import it (so it has source)."""
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text("LAUNCHES = []\n" + launcher + sequence)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gate_up_extra", ["", ", b_use_tma=up_moe_use_tma"], ids=["0.5.16", "0.5.23"])
def test_the_copy_launches_both_gemms_with_tma_weights(tmp_path, gate_up_extra):
    sequence = SEQUENCE.format(gate_up_extra=gate_up_extra)
    if gate_up_extra:
        sequence = sequence.replace("down_moe_use_tma, *", "down_moe_use_tma, up_moe_use_tma=False, *")
    module = load(tmp_path, sequence)
    variant = weight_tma.build(module._fused_moe_kernel_sequence)
    assert variant("x", False) == "x"
    assert module.LAUNCHES == [WEIGHT_TMA, WEIGHT_TMA]
    assert variant.__globals__ is module.__dict__  # later changes to the module reach it
    assert variant is not module._fused_moe_kernel_sequence and variant.__qualname__ == "_fused_moe_kernel_sequence"
    assert "b_use_tma" not in module._fused_moe_kernel_sequence.__code__.co_names  # original untouched


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda s, l: (s.replace("    invoke_fused_moe_kernel(x, 3, 4", "    invoke_fused_moe_kernel(x, 5, 6, "
                                 "a_use_tma=down_moe_use_tma, b_use_tma=down_moe_use_tma)\n"
                                 "    invoke_fused_moe_kernel(x, 3, 4"), l), "expected 2 calls"),
        (lambda s, l: (s.replace("c_sorted=down_moe_use_tma", "c_sorted=False"), l),
         "gate-up launch does not pass c_sorted=down_moe_use_tma"),
        (lambda s, l: (s.replace("a_use_tma=down_moe_use_tma", "a_use_tma=True"), l),
         "down launch does not pass a_use_tma=down_moe_use_tma"),
        (lambda s, l: (s.replace("(x, 3, 4,", "(*x, 3, 4,"), l), "unpacking"),
        (lambda s, l: ("def mark(f):\n    return f\n@mark\n" + s.lstrip(), l), "decorated"),
        (lambda s, l: (s, l.replace("b_use_tma=False, ", "")), "takes no b_use_tma"),
        (lambda s, l: (s, ""), "has no invoke_fused_moe_kernel"),
    ],
    ids=["three-launches", "gate-up-not-sorted-by-flag", "down-a-not-flag", "unpacking", "decorated",
         "launcher-without-b-tma", "no-launcher"],
)
def test_a_sequence_that_was_not_verified_gets_no_variant(tmp_path, change, reason):
    sequence, launcher = change(SEQUENCE.format(gate_up_extra=""), LAUNCHER)
    module = load(tmp_path, sequence, launcher)
    assert reason in weight_tma.unavailable_reason(module._fused_moe_kernel_sequence)
    inspection = inspect_target(module._fused_moe_kernel_sequence)
    assert inspection.strategy is Strategy.FLAG and reason in inspection.weight_tma_unavailable


def test_no_source_and_wrapped_functions_get_no_variant(tmp_path):
    import functools

    module = load(tmp_path, SEQUENCE.format(gate_up_extra=""))
    namespace = dict(module.__dict__)
    exec(compile(SEQUENCE.format(gate_up_extra=""), "<compiled only>", "exec"), namespace)
    assert "no source" in weight_tma.unavailable_reason(namespace[TARGET_NAME])

    @functools.wraps(module._fused_moe_kernel_sequence)
    def traced(*args, **kwargs):
        return module._fused_moe_kernel_sequence(*args, **kwargs)

    assert "wrapped by other code" in weight_tma.unavailable_reason(traced)


def test_hooked_and_hookless_calls_on_many_threads_each_get_their_own_path(tmp_path):
    """The wrapper holds no per-call state: a hook-less call racing a hooked one keeps full TMA."""
    from types import SimpleNamespace

    from sglang_lora_tma_guard.guard import make_guarded

    launcher = LAUNCHER.replace("LAUNCHES.append(dict(", "LAUNCHES.append((threading.current_thread().name, dict(")
    launcher = "import threading\n" + launcher.replace("c_sorted=c_sorted))", "c_sorted=c_sorted)))")
    module = load(tmp_path, SEQUENCE.format(gate_up_extra=""), launcher)
    original = module._fused_moe_kernel_sequence
    wrapper = make_guarded(original, inspect_target(original))
    hooks = SimpleNamespace(after_gate_up=lambda *a: None, after_down=None)
    start = threading.Barrier(8)

    def work(hooked):
        start.wait()
        for _ in range(200):
            wrapper("x", True, hooks=hooks if hooked else None, use_fp8_w8a8=True, block_shape=[128, 128])

    threads = [threading.Thread(target=work, args=(i % 2 == 0,), name=f"{'hooked' if i % 2 == 0 else 'plain'}{i}")
               for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    full_tma = tiny_moe.FULL_TMA_LAUNCHES
    for name, launch in module.LAUNCHES:
        assert launch in ([WEIGHT_TMA] if name.startswith("hooked") else full_tma)
    assert len(module.LAUNCHES) == 8 * 200 * 2


def test_plain_asks_for_no_variant(tmp_path):
    module = load(tmp_path, SEQUENCE.format(gate_up_extra=""))
    assert inspect_target(module._fused_moe_kernel_sequence).strategy is Strategy.WEIGHT_TMA
    plain = inspect_target(module._fused_moe_kernel_sequence, weight_tma=False)
    assert plain.strategy is Strategy.FLAG


# On SGLang 0.5.16's own sequence and kernels.


@pytest.fixture
def guarded(fm):
    yield guard.activate()
    guard.deactivate()


@pytest.mark.real
@pytest.mark.parametrize(
    "tokens, experts, topk, filtered",
    [(1, 4, 1, False), (7, 8, 3, False), (20, 6, 2, True), (33, 16, 4, False)],
)
def test_weight_tma_is_bit_identical_to_the_non_tma_path(fm, launches, tokens, experts, topk, filtered):
    problem = tiny_moe.make_problem(num_tokens=tokens, num_experts=experts, topk=topk, seed=tokens)
    if filtered:
        ids = problem.topk_ids.clone()
        ids[::3, 0] = -1  # experts this rank does not own, under expert parallelism
        tiny_moe.reroute(problem, topk_ids=ids)
    hooks = tiny_moe.lora_hooks(problem)
    reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks, filter_expert=filtered)
    assert guard.activate().strategy == "weight_tma"
    try:
        launches.clear()
        output = tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks, filter_expert=filtered)
    finally:
        guard.deactivate()
    assert launches == [WEIGHT_TMA, WEIGHT_TMA]
    assert torch.equal(output, reference), tiny_moe.compare(output, reference)


@pytest.mark.real
def test_deactivate_leaves_nothing_behind(fm):
    names, original = set(vars(fm)), getattr(fm, TARGET_NAME)
    guard.activate()
    problem = tiny_moe.make_problem(num_tokens=3, seed=3)
    tiny_moe.run_sequence(problem, use_tma=True, hooks=tiny_moe.lora_hooks(problem))
    guard.deactivate()
    assert getattr(fm, TARGET_NAME) is original and set(vars(fm)) == names


@pytest.mark.real
def test_weight_tma_holds_in_a_caller_compiled_by_torch_compile(fm, monkeypatch, launches):
    # Dynamo cannot trace Triton's CPU interpreter, so the variant itself is made opaque to it; the
    # guard in front of it is traced as usual and must still route the hooked call there. (On an
    # H200 with the server kit Dynamo fails inside Triton's launcher on this path and on SGLang's
    # own non-TMA one: README, "Measured on an H200".)
    build = weight_tma.build
    monkeypatch.setattr(weight_tma, "build", lambda f: torch._dynamo.disable(build(f)))
    problem = tiny_moe.make_problem(num_tokens=5, seed=5)
    hooks = tiny_moe.lora_hooks(problem)
    reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks)
    assert guard.activate().strategy == "weight_tma"
    try:
        torch._dynamo.reset()
        compiled = torch.compile(lambda: tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks),
                                 backend="eager")
        launches.clear()
        output = compiled()
    finally:
        guard.deactivate()
        torch._dynamo.reset()
    assert launches == [WEIGHT_TMA, WEIGHT_TMA]
    assert torch.equal(output, reference)
