"""The fast LoRA MoE path against SGLang's default LoRA MoE path, on a Hopper GPU.

    python -m benchmarks.lora_moe_h200 [--shapes ...] [--tokens 1 8 64 256 1024 4096 8192] [--out results] [--base fp8|bf16]
        [--rank-sets mixed r16]

Per shape (``_bench.SHAPES``), rank set (4 adapters of ranks 8/16/32/64 padded to 64; all 16 on the
GLM-5.1 shape) and batch size, the ``benchmarks/lora_h200.py`` setup: SGLang's ``LoRAInfo`` with its
CUDA-graph LoRA buffers, hooks built inside the captured graph in SGLang's capture mode, the call by
SGLang's ``TritonRunnerCore.run`` with the guard's weight TMA. Graphs, CUDA-graph replay, best of
5 x 50, interleaved:

- whole hooked call (MoE + LoRA): ``default`` (SGLang's ``build_lora_hooks``: ``fused_moe_lora``),
  ``fast`` (``sglang_lora_tma_guard.lora_path.build_hooks``, the down expand a hook), ``fused`` (the fast
  hooks with the down expand in the down GEMM's epilogue where ``sglang_lora_tma_guard.fused_lora`` takes the
  batch: what ``SGLANG_LORA_TMA_GUARD=fast`` serves), and the call without hooks;
- the LoRA hooks alone (build + both hooks on fixed buffers): default, fast, and SGLang's own
  virtual-experts path (``--lora-use-virtual-experts``; wrong on gated MoE, timed for reference);
- the floor: the LoRA weights the batch touches read once at 4.3 TB/s (an H100's floors: at its 3.35,
  ``_lora_setup.HBM_BYTES_PER_S_OF``), at the true ranks.

Checks per row (eager), on up to 32 tokens spread over the batch: every whole call's output against the
float32 PyTorch reference MoE (``harness/reference.py``: the same weights, with a block-fp8 base the same
per-group fp8 activation quantization, no bf16 rounding anywhere, each adapter's delta in float32; the
call without hooks against the reference without adapters, as the floor of this metric), and the default
and fast paths' LoRA deltas alone against the float32 reference deltas (rounded into the bf16 buffers:
blind to where paths round).
Writes ``lora_moe_h200.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import torch

import sglang_lora_tma_guard as guard
from benchmarks._bench import benchmark_parser, capture, replay_times
from benchmarks._lora_setup import (
    BASE_NAMES,
    HBM_BYTES_PER_S,
    add_base_option,
    add_rank_sets_option,
    floor_bytes,
    fused_down,
    hbm_bytes_per_s,
    lora_batch,
    run_batches,
)
from harness import real_lora, tables, tiny_moe
from harness.reference import ReferenceLoRAHooks, reference_moe
from sglang_lora_tma_guard import lora_path

TOKENS = [1, 8, 64, 256, 1024, 4096, 8192]
SAMPLE = 32
WHOLE = ("default", "fast", "fused", "nohook")


def sample_tokens(tokens: int) -> torch.Tensor:
    """Up to SAMPLE tokens spread over the batch (so over every adapter's segment and the base model's)."""
    return torch.linspace(0, tokens - 1, min(SAMPLE, tokens), device="cuda").round().long().unique()


def reference_deltas(info, hidden, act, ids, weights, shape1, shape3, idx):
    """float32 reference deltas of both hooks on the tokens ``idx``."""
    n, topk = idx.numel(), ids.shape[1]
    ref = ReferenceLoRAHooks(dataclasses.replace(info, token_lora_mapping=info.token_lora_mapping[idx]))
    c1 = torch.zeros(n, topk, shape1, dtype=torch.float32, device=hidden.device)
    c3 = torch.zeros(n, topk, shape3, dtype=torch.float32, device=hidden.device)
    ref.after_gate_up(hidden[idx], c1, weights[idx], ids[idx])
    ref.after_down(act.view(-1, topk, act.shape[1])[idx].reshape(n * topk, -1), c3, weights[idx], ids[idx])
    return c1, c3


def reference_output(problem, info, idx, lora: bool):
    """The float32 reference MoE's output for the tokens ``idx`` (with every adapter, or none)."""
    sub = dataclasses.replace(info, token_lora_mapping=info.token_lora_mapping[idx])
    hooks = ReferenceLoRAHooks(sub) if lora else SimpleNamespace(after_gate_up=None, after_down=None)
    args = tiny_moe.call_arguments(problem, hooks)
    args.update(hidden_states=problem.hidden_states[idx].float(), topk_ids=problem.topk_ids[idx],
                topk_weights=problem.topk_weights[idx])
    return reference_moe(args)


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def measure(capture_mode, name, shape, ranks_name, tokens, weights) -> dict:
    from sglang.srt.lora import lora_moe_runners as runners

    original = runners.build_lora_hooks
    batch = lora_batch(shape, ranks_name, tokens, weights)
    problem, info, use_tma, act, c1, c3 = (batch.problem, batch.info, batch.use_tma, batch.act, batch.cache1,
                                           batch.cache3)
    ve_info = dataclasses.replace(info, lora_use_virtual_experts=True)
    builders = {  # from the hidden states they are then given, as SGLang's MoeRunner.run builds them
        "default": lambda h: original(h, info, problem.topk_ids),
        "fast": lambda h: lora_path.build_hooks(original, h, info, problem.topk_ids),
        "ve": lambda h: original(h, ve_info, problem.topk_ids),
        "nohook": lambda h: None,
    }
    hidden, ids, w = problem.hidden_states, problem.topk_ids, problem.topk_weights
    width1, width3 = c1.shape[2], c3.shape[2]

    def whole(kind):
        with fused_down(kind == "fused"):
            return real_lora.run_runner(problem, None, use_tma=use_tma,
                                        build=builders["fast" if kind == "fused" else kind])

    def lora_only(kind):
        hooks = builders[kind](hidden)
        hooks.after_gate_up(hidden, c1, w, ids)
        hooks.after_down(act, c3, w, ids)
        return c3

    row = {"shape": name, "ranks": ranks_name, "tokens": tokens}
    guard.activate(weight_tma=True)
    with capture_mode():  # hooks built as in a server's captured batch
        out = {kind: whole(kind) for kind in WHOLE}
        row["whole_rel_err_fast_vs_default"] = rel(out["fast"], out["default"])
        row["whole_rel_err_fused_vs_fast"] = rel(out["fused"], out["fast"])  # 0: the batch was not taken
        row["lora_rel_of_output"] = rel(out["default"], out["nohook"])
        idx = sample_tokens(tokens)
        with_lora, without = (reference_output(problem, info, idx, lora) for lora in (True, False))
        for kind in WHOLE:
            row[f"err_whole_{kind}"] = rel(out[kind][idx], without if kind == "nohook" else with_lora)
        ref1, ref3 = reference_deltas(info, hidden, act, ids, w, width1, width3, idx)
        for kind in ("default", "fast"):
            c1.zero_()
            c3.zero_()
            lora_only(kind)
            row[f"err_{kind}"] = max(rel(c1[idx], ref1), rel(c3[idx], ref3))
        graphs = {f"whole_{kind}": capture(lambda k=kind: whole(k))[0] for kind in WHOLE}
        for kind in ("default", "fast"):
            graphs[f"lora_{kind}"] = capture(lambda k=kind: lora_only(k))[0]
        try:  # SGLang's virtual-experts path: tried eagerly first, so that a failure cannot break a capture
            lora_only("ve")
            torch.cuda.synchronize()
        except Exception as error:
            row["lora_ve_error"] = repr(error)[:200]
        else:
            graphs["lora_ve"] = capture(lambda: lora_only("ve"))[0]
    times = replay_times(graphs)
    row.update({f"ms_{key}": value for key, value in times.items()})
    true_bytes, padded_bytes = floor_bytes(info, ids)
    bandwidth = hbm_bytes_per_s()
    row["floor_ms"] = true_bytes / bandwidth * 1e3
    row["floor_padded_ms"] = padded_bytes / bandwidth * 1e3
    row["speedup_whole"] = row["ms_whole_default"] / row["ms_whole_fast"]
    row["speedup_whole_fused"] = row["ms_whole_default"] / row["ms_whole_fused"]
    row["speedup_lora"] = row["ms_lora_default"] / row["ms_lora_fast"]
    row["lora_over_floor"] = row["ms_lora_fast"] / row["floor_ms"]
    del graphs
    return row


def markdown(rows, meta) -> str:
    lines = [
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}; base experts "
        f"{BASE_NAMES[meta.get('base', 'fp8')]}. ms per call, "
        "CUDA-graph replay, best of 5 x 50 (interleaved); hooks built inside the graph in SGLang's capture mode; "
        "weight TMA on. default = SGLang's LoRA MoE hooks (fused_moe_lora); fast = this package's hooks; "
        "fused = the fast hooks, the down expand in the down GEMM where fused_lora takes the batch (SGLANG_LORA_TMA_GUARD=fast); "
        "VE = SGLang's --lora-use-virtual-experts path (wrong on gated MoE, timed for reference). Floor: the LoRA "
        f"weights the batch touches read once at {meta.get('hbm_bytes_per_s', HBM_BYTES_PER_S) / 1e12:.2f} TB/s (true ranks "
        "/ padded to the max). "
        "Errors: max |delta - reference| / max |reference|, float32 PyTorch reference, 32 tokens spread over the batch.",
        "",
        tables.markdown(
            ["shape", "ranks", "tokens", "whole: default", "whole: fast", "speed-up", "whole: fused", "speed-up",
             "no hooks", "LoRA: default",
             "LoRA: fast", "LoRA: VE", "LoRA speed-up", "floor (true / padded)", "fast / floor", "err default / fast",
             "fast vs default / fused vs fast (output)", "output err no hooks / default / fast / fused"],
            ([r["shape"], r["ranks"], r["tokens"], f"{r['ms_whole_default']:.3f}", f"{r['ms_whole_fast']:.3f}",
              f"**{r['speedup_whole']:.2f}x**", f"{r['ms_whole_fused']:.3f}", f"**{r['speedup_whole_fused']:.2f}x**",
              f"{r['ms_whole_nohook']:.3f}", f"{r['ms_lora_default']:.3f}",
              f"{r['ms_lora_fast']:.3f}", f"{r['ms_lora_ve']:.3f}" if "ms_lora_ve" in r else "n/a",
              f"{r['speedup_lora']:.2f}x", f"{r['floor_ms']:.3f} / {r['floor_padded_ms']:.3f}",
              f"{r['lora_over_floor']:.2f}", f"{r['err_default']:.1e} / {r['err_fast']:.1e}",
              f"{r['whole_rel_err_fast_vs_default']:.1e} / {r.get('whole_rel_err_fused_vs_fast', float('nan')):.1e}",
              " / ".join(f"{r[f'err_whole_{k}']:.1e}" for k in ("nohook", "default", "fast", "fused"))] for r in rows)),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, TOKENS)
    add_base_option(parser)
    add_rank_sets_option(parser, by_shape=True)
    return run_batches(parser.parse_args(argv), "lora_moe_h200", measure, markdown, hbm_bytes_per_s=hbm_bytes_per_s())


if __name__ == "__main__":
    sys.exit(main())
