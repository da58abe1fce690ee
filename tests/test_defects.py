"""The defects of the catalogue on SGLang 0.5.16's own layers, in one scheduler-like process.

Each test builds SGLang's own ``FusedMoE`` with its own constructor, lets SGLang's own
``LoRAManager.init_lora_modules`` wrap it (its ``FusedMoEWithLoRA``, its LoRA runner), and runs the
wrapped layer's own forward on a CPU (its dispatcher, Triton kernels through the interpreter, LoRA
hooks, combine) against a float32 PyTorch reference of the layer with the adapters as written
(``harness.sglang_cpu.reference``): without the guard, then with it (``serving.arm()``: the
scheduler step every defect shares).

Tolerances: activations, weights and the intermediate buffers are fp16 and the reference float32 from
the same fp16 weights, so a right layer is off by a few fp16 roundings of its buffers (2^-11 relative
each): right means a relative error below 5e-3; the defects give errors of 0.5 to 1.4.
"""

from __future__ import annotations

import pytest
import torch

from sglang_lora_tma_guard import serving
from sglang_lora_tma_guard.catalogue import RefusedDeployment

pytestmark = pytest.mark.real

RIGHT, WRONG = 5e-3, 0.1
OWNERS = [0, 0, 0, 1, 1, -1, -1]  # two adapters, then the base model


@pytest.fixture
def cpu(fm):
    from harness import sglang_cpu

    sglang_cpu.scheduler()
    yield sglang_cpu
    serving.disarm()


def wrap(cpu, guarded: bool, experts=4, topk=2, **options):
    """SGLang's FusedMoE, wrapped for LoRA by SGLang's own init_lora_modules, with or without the guard."""
    (serving.arm if guarded else serving.disarm)()
    layer = cpu.moe_layer(experts, topk=topk, **options)
    manager = cpu.lora_manager([layer])
    manager.init_lora_modules()
    [module] = cpu.wrapped(manager)
    return layer, module


def batch(cpu, experts=4, topk=2, ranks=(8, 4)):
    adapters = [cpu.ExpertAdapter.random(experts, 64, 32, rank, seed=10 + i) for i, rank in enumerate(ranks)]
    x = (torch.randn(len(OWNERS), 64, generator=torch.Generator().manual_seed(3)) * 0.5).half()
    return adapters, x, cpu.routing(len(OWNERS), experts, topk, seed=4)


def run(cpu, layer, module, adapters, x, topk):
    """The wrapped layer's forward on a copy of ``x``: (output, input after the call, reference)."""
    given = x.clone()
    out = cpu.forward(module, given, topk, cpu.lora_info_for(module, adapters, OWNERS))
    return out, given, cpu.reference(layer, x, topk, adapters, OWNERS)


# --- the in-place MoE output (0.5.11-0.5.16) -------------------------------------------------------------


def test_unguarded_the_lora_moe_layer_writes_its_output_into_its_input(cpu):
    layer, module = wrap(cpu, guarded=False)
    adapters, x, topk = batch(cpu)
    out, given, ref = run(cpu, layer, module, adapters, x, topk)
    assert module.moe_runner_config.inplace is True
    assert out.data_ptr() == given.data_ptr() and not torch.equal(given, x)  # the shared expert's input is gone
    assert cpu.relative_error(out, ref) < RIGHT  # right, but only if nobody else reads hidden_states


def test_guarded_every_lora_wrapped_moe_layer_runs_out_of_place(cpu):
    layer, module = wrap(cpu, guarded=True)
    adapters, x, topk = batch(cpu)
    out, given, ref = run(cpu, layer, module, adapters, x, topk)
    assert module.moe_runner_config.inplace is False and layer.moe_runner_config.inplace is False
    assert out.data_ptr() != given.data_ptr() and torch.equal(given, x)
    assert cpu.relative_error(out, ref) < RIGHT


def test_the_fallback_honours_out_of_place_calls(fm):
    """The package's own route-major kernels (strategy FALLBACK) leave the input alone when asked to."""
    from harness import tiny_moe
    from sglang_lora_tma_guard import fallback

    problem = tiny_moe.make_problem(num_tokens=5, hidden=128, intermediate=128, seed=3)
    arguments = tiny_moe.call_arguments(problem, tiny_moe.lora_hooks(problem), inplace=False)
    before = arguments["hidden_states"].clone()
    out = fallback.fused_moe_hooked(arguments)
    assert out.data_ptr() != arguments["hidden_states"].data_ptr()
    assert torch.equal(arguments["hidden_states"], before)


# --- MiniMax-M3 / Kimi-K3: a non-interleaved gate-up with an alpha-SwiGLU (0.5.16-0.5.23) -----------------

MINIMAX = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0, gate_up_interleaved=False)


@pytest.fixture
def eager():
    """SGLang compiles its alpha-SwiGLU with torch.compile; on a CPU that costs a C++ build per test."""
    with torch.compiler.set_stance("force_eager"):
        yield


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_a_minimax_m3_layer_is_right_only_with_the_guard(cpu, eager, guarded):
    layer, module = wrap(cpu, guarded, **MINIMAX)
    adapters, x, topk = batch(cpu)
    out, _, ref = run(cpu, layer, module, adapters, x, topk)
    adapter_rows, base_rows = slice(0, 5), slice(5, None)
    if guarded:
        assert module._uses_interleaved_gate_up is False
        assert cpu.relative_error(out, ref) < RIGHT
    else:
        assert module._uses_interleaved_gate_up is True
        assert cpu.relative_error(out[adapter_rows], ref[adapter_rows]) > WRONG
        assert cpu.relative_error(out[base_rows], ref[base_rows]) > WRONG  # base-model requests too


def test_on_a_minimax_m3_layer_each_half_of_the_fix_is_needed(cpu, eager):
    from sglang_lora_tma_guard.defects import gate_up_layout

    adapters, x, topk = batch(cpu)
    layer, module = wrap(cpu, True, **MINIMAX)
    module._uses_interleaved_gate_up = True  # the activation fixed, LoRA B left interleaved
    out, _, ref = run(cpu, layer, module, adapters, x, topk)
    assert cpu.relative_error(out[:5], ref[:5]) > WRONG and cpu.relative_error(out[5:], ref[5:]) < RIGHT
    module._uses_interleaved_gate_up = False
    gate_up_layout.RUNNER_PATCH.deactivate()  # LoRA B fixed, the runner's flag dropped again
    out, _, ref = run(cpu, layer, module, adapters, x, topk)
    assert cpu.relative_error(out[5:], ref[5:]) > WRONG


def test_the_layout_patches_exist_only_where_a_layer_needs_them(cpu):
    from sglang_lora_tma_guard.defects import gate_up_layout

    wrap(cpu, guarded=True)
    assert not gate_up_layout.RUNNER_PATCH.status().wanted
    serving.deactivate()
    assert not gate_up_layout.SEQUENCE_PATCH.status().installed


# --- the router weight on the input (Llama-4, 0.5.11-0.5.23) ----------------------------------------------


def test_unguarded_expert_lora_misses_the_router_weight_on_the_input(cpu):
    layer, module = wrap(cpu, False, topk=1, apply_router_weight_on_input=True)
    adapters, x, topk = batch(cpu, topk=1)
    out, _, ref = run(cpu, layer, module, adapters, x, topk)
    assert cpu.relative_error(out[:5], ref[:5]) > WRONG  # adapter requests
    assert cpu.relative_error(out[5:], ref[5:]) < RIGHT  # base-model requests are right


def test_guarded_a_scheduler_with_such_a_layer_refuses_to_start(cpu):
    serving.arm()
    manager = cpu.lora_manager([cpu.moe_layer(4, topk=1, apply_router_weight_on_input=True)])
    with pytest.raises(RefusedDeployment, match="apply the router weight to their input") as refused:
        manager.init_lora_modules()
    assert "--lora-target-modules" in str(refused.value)


# --- refusals decided from the scheduler's own server arguments ---------------------------------------------


@pytest.mark.parametrize("fields, phrase", [
    (dict(enable_dp_attention=True, dp_size=2), "Drop --enable-dp-attention, or upgrade to SGLang 0.5.21"),
    (dict(ep_size=2, enable_eplb=True), "Drop --enable-eplb"),
    (dict(ep_size=2, ep_num_redundant_experts=4), "Drop --ep-num-redundant-experts"),
    (dict(speculative_algorithm="NGRAM"), "Pass --disable-cuda-graph, drop NGRAM"),
    (dict(enable_fused_moe_sum_all_reduce=True), "Restart without --enable-fused-moe-sum-all-reduce"),
], ids=["dp-attention", "eplb", "redundant-experts", "ngram", "fused-sum-all-reduce"])
def test_a_scheduler_refuses_what_its_server_arguments_would_serve_wrong(cpu, fields, phrase):
    defaults = {name: getattr(cpu.scheduler(), name) for name in fields}
    cpu.scheduler(**fields)
    try:
        serving.arm()
        manager = cpu.lora_manager([cpu.moe_layer(4, topk=4)])
        with pytest.raises(RefusedDeployment, match=phrase):
            manager.init_lora_modules()
        serving.disarm()
        cpu.lora_manager([cpu.moe_layer(4, topk=4)]).init_lora_modules()  # SGLang alone starts
    finally:
        cpu.scheduler(**defaults)


def test_every_reason_is_given_at_once(cpu):
    cpu.scheduler(enable_dp_attention=True, dp_size=2, speculative_algorithm="NGRAM")
    try:
        serving.arm()
        with pytest.raises(RefusedDeployment) as refused:
            cpu.lora_manager([cpu.moe_layer(4, topk=1, apply_router_weight_on_input=True)]).init_lora_modules()
        text = str(refused.value)
        assert text.count("\n  - ") == 3
        assert all(phrase in text for phrase in ("router weight", "--enable-dp-attention", "NGRAM"))
    finally:
        cpu.scheduler(enable_dp_attention=False, dp_size=1, speculative_algorithm=None)


def test_a_dense_model_and_a_release_without_the_defect_are_left_alone(cpu):
    """csgmv is wrong on 0.5.11 only: on 0.5.16 its scheduler starts; a model without MoE layers too."""
    cpu.scheduler(lora_backend="csgmv", enable_dp_attention=True, dp_size=2)
    try:
        serving.arm()
        with pytest.raises(RefusedDeployment) as refused:
            cpu.lora_manager([cpu.moe_layer(4)]).init_lora_modules()
        assert "csgmv" not in str(refused.value)
        dense = cpu.lora_manager([])
        dense.init_lora_modules()
    finally:
        cpu.scheduler(lora_backend="csgmv", enable_dp_attention=False, dp_size=1)
