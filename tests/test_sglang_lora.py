"""SGLang's own LoRA MoE hooks, run by SGLang's own Triton MoE runner, with and without the guard.

``build_lora_hooks`` with a ``LoRAInfo`` laid out as SGLang's LoRA manager lays it out (three adapters
of ranks 8, 16 and 4 padded to 16, the third disabled, the batch in segments for each adapter and the
base model), its ``fused_moe_lora`` Triton kernels, and ``TritonRunnerCore.run``, all from the
``sglang==0.5.16`` wheel, on Triton's CPU interpreter. The plugin is loaded by SGLang's
``load_plugins()``. The references are SGLang's non-TMA path and, for what SGLang's LoRA should
compute, the plain PyTorch reference in ``harness/reference.py``.
"""

from __future__ import annotations

import pytest
import torch

import sglang_lora_tma_guard as guard
from harness import real_lora, tiny_moe
from harness.reference import ReferenceLoRAHooks, interpreter_fp8, reference_moe

pytestmark = pytest.mark.real

WEIGHT_TMA, NO_TMA, FULL_TMA = tiny_moe.WEIGHT_TMA_LAUNCH, tiny_moe.NO_TMA_LAUNCH, tiny_moe.FULL_TMA_LAUNCHES


def small_problem(tokens=7, experts=8, topk=2, seed=0):
    return tiny_moe.make_problem(num_tokens=tokens, num_experts=experts, topk=topk, hidden=128,
                              intermediate=128, seed=seed)


@pytest.fixture(scope="module")
def lora_ops(fm):
    real_lora.enable_cpu_lora_ops()


@pytest.fixture(scope="module")
def case(lora_ops):
    """One batch: 7 tokens in segments for adapters 0, 1, 2 (disabled) and the base model."""
    problem = small_problem()
    info = real_lora.make_lora_info(problem, seed=1)
    reference = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=False)
    return problem, info, reference


def expected(problem, hooks):
    """The plain PyTorch reference MoE with ``hooks`` (None: no adapter at all)."""
    from types import SimpleNamespace

    args = tiny_moe.call_arguments(problem, hooks or SimpleNamespace(after_gate_up=None, after_down=None))
    return reference_moe(args, to_fp8=interpreter_fp8)


rel_err = tiny_moe.rel_err


@pytest.mark.parametrize("topk", [2, 1], ids=["top-2", "top-1"])
def test_sglangs_lora_hooks_add_the_adapters_deltas(lora_ops, topk):
    """On SGLang's non-TMA path its LoRA hooks compute what the adapters say, top-1 included."""
    problem = small_problem(topk=topk, seed=topk)
    info = real_lora.make_lora_info(problem, seed=topk)
    output = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=False)
    with_lora, without = expected(problem, ReferenceLoRAHooks(info)), expected(problem, None)
    assert rel_err(output, with_lora) < 1e-2, rel_err(output, with_lora)
    assert rel_err(output, without) > 0.1  # the adapters do change the output


def test_unguarded_sglang_lora_on_the_tma_path_is_wrong(case):
    problem, info, reference = case
    output = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    result = tiny_moe.compare(output, reference)
    # Rows of the enabled adapters' tokens (the first segments) are wrong at least.
    assert result.rows_wrong >= 4, result


@pytest.mark.parametrize("switch, strategy, each_launch", [("1", "weight_tma", WEIGHT_TMA),
                                                             ("plain", "flag", NO_TMA)])
def test_guarded_sglang_lora_is_bit_identical_to_the_non_tma_path(case, sglang_plugins, launches, switch,
                                                                 strategy, each_launch):
    problem, info, reference = case
    assert sglang_plugins(switch).strategy == strategy
    output = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    assert torch.equal(output, reference), tiny_moe.compare(output, reference)
    assert launches == [each_launch] * 2


def test_a_batch_without_an_active_adapter_keeps_full_tma(case, sglang_plugins, launches):
    """SGLang builds hooks with nothing set when no adapter is active: the guard lets TMA through."""
    from dataclasses import replace

    problem, info, _ = case
    sglang_plugins()
    idle = replace(info, has_active_lora=False)
    hooks = real_lora.lora_hooks(problem, idle)
    assert hooks.after_gate_up is None and hooks.after_down is None
    output = real_lora.run_runner(problem, hooks, use_tma=True)
    assert launches == FULL_TMA
    guard.deactivate()
    assert torch.equal(output, real_lora.run_runner(problem, hooks, use_tma=True))


def test_fused_shared_expert_routes_read_lora_weights_out_of_range_and_the_unfused_layout_is_right(lora_ops):
    """SGLang 0.5.16's own LoRA kernels, not the TMA bug. With a fused shared expert (DeepSeek/GLM
    style) the runner counts one more expert (E=9 here, like 257) than the LoRA buffers hold (8, like
    256). Every token routes to the shared expert, and SGLang's LoRA kernels index the buffers with
    its id: they read past that adapter's experts (into the next adapter's, or past the buffer for the
    last one) and add a delta nobody trained. With fusion off, which the guard makes every LoRA server
    use, the runner sees the routed experts only and SGLang's LoRA adds what the adapters say."""
    from dataclasses import replace

    experts = 8
    unfused = small_problem(experts=experts, topk=2, seed=5)  # what the guard makes SGLang build
    shared = small_problem(experts=1, topk=1, seed=6)  # the shared expert's weights, fused as expert 8
    tokens = unfused.topk_ids.shape[0]
    fused = replace(
        unfused, w1=torch.cat([unfused.w1, shared.w1]), w2=torch.cat([unfused.w2, shared.w2]),
        w1_scale=torch.cat([unfused.w1_scale, shared.w1_scale]), w2_scale=torch.cat([unfused.w2_scale, shared.w2_scale]),
        # SGLang's top-k writes the shared expert's id into one more column, with weight 1.
        topk_ids=torch.cat([unfused.topk_ids, torch.full((tokens, 1), experts, dtype=unfused.topk_ids.dtype)], 1),
        topk_weights=torch.cat([unfused.topk_weights, torch.ones(tokens, 1, dtype=unfused.topk_weights.dtype)], 1))
    # A third, disabled slot after the two adapters in use, as SGLang's pool has spare slots: the
    # reads past each adapter's experts then stay inside the buffer (past its end they read freed or
    # foreign memory: NaN on this CPU, an illegal address or garbage on a GPU).
    adapters = real_lora.Adapters(ranks=(8, 8, 8), enabled=(True, True, False), segments=(4, 3),
                                  segment_adapters=(0, 1), lora_experts=experts)
    info = real_lora.make_lora_info(fused, adapters, seed=5)
    output = real_lora.run_runner(fused, real_lora.lora_hooks(fused, info), use_tma=False)
    correct = expected(fused, ReferenceLoRAHooks(info))  # no adapter delta on the shared expert
    assert tiny_moe.compare(output, correct).rows_wrong == 7, tiny_moe.compare(output, correct)

    # Fusion off: the same tokens, routed experts and adapters; the shared expert is a separate MLP.
    info = replace(info, num_experts=experts)
    output = real_lora.run_runner(unfused, real_lora.lora_hooks(unfused, info), use_tma=False)
    with_lora, without = expected(unfused, ReferenceLoRAHooks(info)), expected(unfused, None)
    assert rel_err(output, with_lora) < 1e-2, rel_err(output, with_lora)
    assert rel_err(output, without) > 0.1
