"""The route-major fallback kernels against a plain PyTorch reference and against SGLang itself.

On the CPU, through Triton's interpreter. The interpreter rounds float32 -> fp8 differently from
GPUs and from PyTorch, so the reference is handed the interpreter's own cast (fp8 cases only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import tiny_moe
from harness.reference import interpreter_fp8, reference_moe
from sglang_lora_tma_guard import fallback

pytestmark = pytest.mark.real


rel_err = tiny_moe.rel_err
call_args = tiny_moe.call_arguments


def with_dtype(problem, dtype):
    """The same layer with dequantized bf16/fp16 weights instead of block-fp8 ones."""
    def dequantize(w, scale):
        full = scale.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        return (w.float() * full).to(dtype)

    problem.w1, problem.w2 = dequantize(problem.w1, problem.w1_scale), dequantize(problem.w2, problem.w2_scale)
    problem.hidden_states = problem.hidden_states.to(dtype)
    problem.lora = {k: v.to(dtype) for k, v in problem.lora.items()}
    return {"use_fp8_w8a8": False, "w1_scale": None, "w2_scale": None, "block_shape": None}


def route(problem, experts_used=None, filtered=0.0, seed=0):
    """Re-route the problem: only the first ``experts_used`` experts get routes; some become -1."""
    gen = torch.Generator().manual_seed(seed)
    tokens, topk = problem.topk_ids.shape
    scores = torch.randn(tokens, problem.num_experts, generator=gen)
    if experts_used is not None:
        scores[:, experts_used:] -= 1e3
    weights, ids = torch.topk(scores.softmax(-1), topk, dim=-1)
    if filtered:
        ids[torch.rand(ids.shape, generator=gen) < filtered] = -1
    tiny_moe.reroute(problem, topk_ids=ids.to(torch.int32), topk_weights=weights.float())


CASES = {
    "1-token": dict(make=dict(num_tokens=1, num_experts=4, topk=2)),
    "ragged-empty-experts": dict(make=dict(num_tokens=13, num_experts=8, topk=3), experts_used=3),
    "topk-9": dict(make=dict(num_tokens=5, num_experts=16, topk=9)),
    "257-experts": dict(make=dict(num_tokens=6, num_experts=257, topk=8)),
    "filtered-experts": dict(make=dict(num_tokens=10, num_experts=6, topk=2), filtered=0.3,
                             over=dict(filter_expert=True)),
    "not-inplace": dict(make=dict(num_tokens=7, num_experts=4, topk=2), over=dict(inplace=False)),
    "no-combine": dict(make=dict(num_tokens=7, num_experts=4, topk=2), over=dict(inplace=False, no_combine=True)),
    "router-weight-first": dict(make=dict(num_tokens=9, num_experts=4, topk=1),
                                over=dict(apply_router_weight_on_input=True)),
    "scaling-factor": dict(make=dict(num_tokens=9, num_experts=4, topk=3), over=dict(routed_scaling_factor=2.5)),
    "gelu": dict(make=dict(num_tokens=9, num_experts=4, topk=2), over=dict(activation="gelu")),
    "block-m-32": dict(make=dict(num_tokens=40, num_experts=4, topk=2, config=tiny_moe.small_config(32))),
    "fp16-weights": dict(make=dict(num_tokens=11, num_experts=6, topk=2), dtype=torch.float16),
    "fp16-bias": dict(make=dict(num_tokens=11, num_experts=6, topk=2), dtype=torch.float16, bias=True),
    "fp8-bias": dict(make=dict(num_tokens=11, num_experts=6, topk=2), bias=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fallback_matches_the_pytorch_reference(fm, name):
    case = CASES[name]
    problem = tiny_moe.make_problem(hidden=128, intermediate=128, seed=len(name), **case["make"])
    if "experts_used" in case or "filtered" in case:
        route(problem, case.get("experts_used"), case.get("filtered", 0.0), seed=len(name))
    over = dict(case.get("over", {}))
    if "dtype" in case:
        over.update(with_dtype(problem, case["dtype"]))
    if case.get("bias"):
        gen = torch.Generator().manual_seed(1)
        dtype = problem.hidden_states.dtype
        over["b1"] = (torch.randn(problem.num_experts, problem.w1.shape[1], generator=gen) * 0.1).to(dtype)
        over["b2"] = (torch.randn(problem.num_experts, problem.w2.shape[1], generator=gen) * 0.1).to(dtype)
    hooks = tiny_moe.lora_hooks(problem)
    ours = fallback.fused_moe_hooked(call_args(problem, hooks, **over))
    reference = reference_moe(call_args(problem, hooks, **over), to_fp8=interpreter_fp8)
    assert ours.shape == reference.shape
    assert torch.isfinite(ours).all()
    assert rel_err(ours, reference) < 2e-3, rel_err(ours, reference)


def test_inplace_writes_into_hidden_states_and_no_combine_keeps_routes(fm):
    problem = tiny_moe.make_problem(num_tokens=5, hidden=128, intermediate=128, seed=3)
    hooks = tiny_moe.lora_hooks(problem)
    args = call_args(problem, hooks)
    out = fallback.fused_moe_hooked(args)
    assert out is args["hidden_states"]
    routes = fallback.fused_moe_hooked(call_args(problem, hooks, inplace=False, no_combine=True))
    assert routes.shape == (5, 2, 128)


@pytest.mark.parametrize("tokens", [1, 5, 24])
def test_fallback_agrees_with_sglangs_non_tma_path_within_2_percent(fm, tokens):
    problem = tiny_moe.make_problem(num_tokens=tokens, seed=tokens)
    hooks = tiny_moe.lora_hooks(problem)
    reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks)  # SGLang 0.5.16 itself
    ours = fallback.fused_moe_hooked(call_args(problem, hooks))
    assert rel_err(ours, reference) < 0.02


@pytest.mark.parametrize("overrides, phrase", [
    (dict(use_int8_w8a16=True), "use_int8_w8a16=True"),
    (dict(block_shape=None), "fp8 weights without a block shape"),
    (dict(activation="swish"), "activation 'swish' (gated)"),
    (dict(gemm1_alpha=1.7, gemm1_limit=7.0), "gemm1_alpha is set"),
    (dict(a1_scale=torch.ones(1)), "a1_scale is set"),
])
def test_uncovered_calls_are_refused_loudly(fm, overrides, phrase):
    problem = tiny_moe.make_problem(num_tokens=3, hidden=128, intermediate=128)
    with pytest.raises(fallback.FallbackUnsupported) as caught:
        fallback.fused_moe_hooked(call_args(problem, tiny_moe.lora_hooks(problem), **overrides))
    message = str(caught.value)
    assert phrase in message and "Covered:" in message and "0.5.17" in message


def test_float32_activations_are_refused(fm):
    problem = tiny_moe.make_problem(num_tokens=3, hidden=128, intermediate=128)
    problem.hidden_states = problem.hidden_states.float()
    with pytest.raises(fallback.FallbackUnsupported, match="activations in torch.float32"):
        fallback.fused_moe_hooked(call_args(problem, tiny_moe.lora_hooks(problem)))


# Through the plugin, on a copy of SGLang 0.5.16 whose flag was renamed, as a fork might.

RENAMED_RUN = """
import os, sys, torch
import sglang.srt.plugins as plugins
from harness import tiny_moe
from sglang_lora_tma_guard import status
from sglang_lora_tma_guard.inspection import sglang_version
if os.environ.get("LOAD_PLUGINS") == "1":
    plugins.load_plugins()
outs = {}
for tokens in map(int, sys.argv[1].split(",")):
    problem = tiny_moe.make_problem(num_tokens=tokens, seed=tokens)
    outs[tokens] = tiny_moe.run_sequence(problem, use_tma=True, hooks=tiny_moe.lora_hooks(problem))
torch.save({"outs": outs, "status": status().as_dict(), "version": sglang_version()}, sys.argv[2])
"""
RENAMED_TOKENS = [3, 17]


@pytest.fixture(scope="module")
def renamed_sglang(tmp_path_factory):
    """A copy of the installed SGLang (links, one file rewritten) with ``down_use_tma`` for the flag."""
    import sglang

    root = tmp_path_factory.mktemp("renamed")
    source = Path(sglang.__file__).parent
    shutil.copytree(source, root / "sglang", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    module = root / "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py"
    text = module.resolve().read_text()
    assert text.count("down_moe_use_tma") > 5
    module.unlink()
    module.write_text(text.replace("down_moe_use_tma", "down_use_tma"))
    dist = next(source.parent.glob("sglang-*.dist-info"))
    (root / "sglang-0.5.16.dev0+renamed.dist-info").mkdir()
    (root / "sglang-0.5.16.dev0+renamed.dist-info/METADATA").write_text(
        (dist / "METADATA").read_text().replace("Version: 0.5.16", "Version: 0.5.16.dev0+renamed", 1))
    return root


def run_renamed(root, load_plugins, tmp_path) -> dict:
    """RENAMED_RUN in a fresh interpreter on the renamed copy: every batch size of RENAMED_TOKENS."""
    out = tmp_path / f"out-{load_plugins}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS",)}
    env.update(PYTHONPATH=str(root), TRITON_INTERPRET="1", SGLANG_LORA_TMA_GUARD="1",
               LOAD_PLUGINS="1" if load_plugins else "0")
    proc = subprocess.run([sys.executable, "-c", RENAMED_RUN, ",".join(map(str, RENAMED_TOKENS)), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def renamed_runs(renamed_sglang, tmp_path_factory):
    """The renamed copy run with the plugin loaded by ``load_plugins()`` and without: one interpreter each."""
    tmp = tmp_path_factory.mktemp("renamed-runs")
    return {guarded: run_renamed(renamed_sglang, guarded, tmp) for guarded in (True, False)}


@pytest.mark.slow
@pytest.mark.parametrize("tokens", RENAMED_TOKENS)
def test_renamed_flag_is_guarded_by_the_fallback_through_load_plugins(fm, renamed_runs, tokens):
    problem = tiny_moe.make_problem(num_tokens=tokens, seed=tokens)
    reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=tiny_moe.lora_hooks(problem))  # unmodified
    guarded, unguarded = renamed_runs[True], renamed_runs[False]
    assert guarded["version"] == "0.5.16.dev0+renamed"
    assert guarded["status"]["strategy"] == "fallback" and guarded["status"]["installed"]
    assert rel_err(guarded["outs"][tokens], reference) < 0.02
    assert not unguarded["status"]["installed"]
    assert tiny_moe.compare(unguarded["outs"][tokens], reference).rows_wrong == tokens


def dense_problem(dtype, hidden=128, intermediate=128, gated=True, **make):
    """A bf16/fp16 layer of any width: a block-fp8 problem dequantized, then cut to ``hidden`` and
    ``intermediate`` (un-gated: the gate half only), its LoRA-style factors cut to match."""
    problem = tiny_moe.make_problem(hidden=256, intermediate=128, **make)
    over = with_dtype(problem, dtype)
    full = problem.w2.shape[2]
    rows = list(range(intermediate)) + ([full + i for i in range(intermediate)] if gated else [])
    problem.w1 = problem.w1[:, rows, :hidden].contiguous()
    problem.w2 = problem.w2[:, :hidden, :intermediate].contiguous()
    problem.hidden_states = problem.hidden_states[:, :hidden].contiguous()
    lora = problem.lora
    lora["A1"], lora["B1"] = lora["A1"][:hidden], lora["B1"][:, rows]
    lora["A2"], lora["B2"] = lora["A2"][:intermediate], lora["B2"][:, :hidden]
    return problem, {**over, "is_gated": gated}


# fp16: Triton's CPU interpreter computes these bf16 GEMMs wrongly (relative errors of 1e11 and inf
# here; SGLang's own kernels gave wrong bf16 numbers on it as well), so bf16 is left to the GPU.
@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
@pytest.mark.parametrize("hidden, intermediate, gated, activation", [
    (200, 72, True, "silu"),      # neither width a multiple of the 128-wide tiles: the tail masks run
    (128, 128, False, "silu"),    # un-gated activations, applied by PyTorch between the two GEMMs
    (128, 128, False, "gelu"),
    (200, 72, False, "relu2"),
])
def test_fallback_matches_the_reference_at_odd_widths_and_ungated(fm, dtype, hidden, intermediate, gated, activation):
    problem, over = dense_problem(dtype, hidden, intermediate, gated, num_tokens=9, num_experts=5, topk=2, seed=7)
    hooks = tiny_moe.lora_hooks(problem)
    args = call_args(problem, hooks, activation=activation, **over)
    ours = fallback.fused_moe_hooked(args)
    reference = reference_moe(call_args(problem, hooks, activation=activation, **over))
    assert ours.shape == (9, hidden) and torch.isfinite(ours).all()
    # The same bound as the other fp16 cases: fp16 intermediate buffers round at ~5e-4 relative.
    assert rel_err(ours, reference) < 2e-3, rel_err(ours, reference)
