"""The fast hooks' second stream made to lose its race, on a GPU: is the gate-up hook's wait what keeps
the hooked call right?

    python -m benchmarks.overlap_race [--shapes qwen3-30b-tp1 glm51-fp8-tp8] [--tokens 8 64 1024] [--base fp8|bf16]

The routing and gate-up shrink of a fast batch run on a second stream, launched when the hooks are built
(``sglang_lora_tma_guard.lora_path``); the gate-up hook makes the call's stream wait for them. Here every
shrink first spins the GPU for ``--delay-ms`` (``torch.cuda._sleep``, on the stream it is launched on), so
the second stream finishes long after the gate-up GEMM. Per batch, the whole hooked call through SGLang's
runner (weight TMA, the guard on), against the same call with everything on one stream (``OVERLAP`` off):

- ``eager``: the delayed call, its output compared bit for bit;
- ``graph``: the delayed call captured in a CUDA graph and replayed, compared bit for bit;
- ``unjoined``: the delayed call with the waits taken out (``lora_path.Join`` a no-op): the control, which
  must differ (the expand reads the shrink's output before it is written).

Bit identity is what is promised: the same kernels on the same inputs. Writes ``overlap_race.json`` / ``.md``.
"""

from __future__ import annotations

import contextlib
import sys

import torch

import sglang_lora_tma_guard as guard
from benchmarks._bench import benchmark_parser, capture
from benchmarks._lora_setup import add_base_option, fast_call, lora_batch, one_stream, run_batches
from harness import tables
from sglang_lora_tma_guard import lora_moe, lora_path

CYCLES_PER_MS = 1.98e6  # the H200's boost clock; the measured delay is in the table


@contextlib.contextmanager
def delayed_shrinks(cycles: int):
    shrink = lora_moe.shrink

    def slow(*args, **kwargs):
        torch.cuda._sleep(cycles)
        return shrink(*args, **kwargs)

    lora_moe.shrink = slow
    try:
        yield
    finally:
        lora_moe.shrink = shrink


@contextlib.contextmanager
def unjoined():
    join = lora_path.Join.__call__
    lora_path.Join.__call__ = lambda self: None
    try:
        yield
    finally:
        lora_path.Join.__call__ = join
        torch.cuda.synchronize()  # the second stream's work, left running, ends before anything else


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.float() - b.float()).abs()
    return float("inf") if not torch.isfinite(d).all() else float(d.max())


def measure(capture_mode, name, shape, ranks_name, tokens, weights, delay_ms: float) -> dict:
    call = fast_call(lora_batch(shape, ranks_name, tokens, weights))
    guard.activate(weight_tma=True)
    reference = one_stream(call).clone()
    cycles = int(delay_ms * CYCLES_PER_MS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with delayed_shrinks(cycles):
        torch.cuda.synchronize()
        start.record()
        eager = call()
        end.record()
        torch.cuda.synchronize()
        with capture_mode():
            graph, graphed = capture(call)
        graphed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        with unjoined():
            control = call()
    return {"shape": name, "ranks": ranks_name, "tokens": tokens, "delayed_call_ms": start.elapsed_time(end),
            "eager_equal": torch.equal(eager, reference), "graph_equal": torch.equal(graphed, reference),
            "unjoined_equal": torch.equal(control, reference), "unjoined_max_diff": max_diff(control, reference),
            "output_max": float(reference.float().abs().max())}


def markdown(rows, meta) -> str:
    return "\n".join([
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}. Every LoRA shrink "
        "delayed on its stream; outputs against the same call on one stream, bit for bit.", "",
        tables.markdown(["shape", "ranks", "tokens", "delayed call, ms", "eager", "CUDA graph", "no waits (control)",
                         "control's max |diff| (output max)"],
                        ([r["shape"], r["ranks"], r["tokens"], f"{r['delayed_call_ms']:.2f}",
                          "equal" if r["eager_equal"] else "**DIFFERS**", "equal" if r["graph_equal"] else "**DIFFERS**",
                          "equal (**the race was not lost**)" if r["unjoined_equal"] else "differs",
                          f"{r['unjoined_max_diff']:.3g} ({r['output_max']:.3g})"] for r in rows)),
    ]) + "\n"


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, [8, 64, 1024])
    add_base_option(parser)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.set_defaults(shapes=["qwen3-30b-tp1", "glm51-fp8-tp8"])
    args = parser.parse_args(argv)
    args.rank_sets = ["mixed"]
    return run_batches(args, "overlap_race", lambda *a: measure(*a, delay_ms=args.delay_ms), markdown)


if __name__ == "__main__":
    sys.exit(main())
