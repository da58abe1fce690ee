"""The fast path's direct launches against Triton's own, on a GPU: the same hooked call, bit for bit?

    python -m benchmarks.launch_check [--shapes qwen3-30b-tp1 glm51-fp8-tp8] [--tokens 1 8 64 1024 8192]

:mod:`sglang_lora_tma_guard.launching` launches each kernel variant through Triton's own path once and then
through the compiled kernel's launcher, under a key of its own. Per batch, the whole hooked call through
SGLang's runner (weight TMA, the guard on, the fast hooks): every launch through Triton's path (``DIRECT``
off) is the reference; then, after one call that fills the keys, the same call with direct launches, eager
and captured in a CUDA graph and replayed, compared bit for bit (the same kernels on the same inputs: bit
identity is what is promised), both for the fast hooks and with the fused down GEMM and the gate-up delta in the
activation (``fused``). ``direct launches`` counts the launches of the eager call that went the
direct way (none would mean the check compared Triton's path with itself). Writes ``launch_check.json`` /
``.md``.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

import sglang_lora_tma_guard as guard
from benchmarks._bench import benchmark_parser, capture
from benchmarks._lora_setup import add_base_option, direct_launches, fast_call, fused_down, lora_batch, run_batches
from harness import tables
from sglang_lora_tma_guard import launching


class _Counted:
    """A compiled kernel whose direct launches are counted."""

    def __init__(self, kernel, counter: list):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args):
            launch(*args)  # a refused launch raises before it is counted
            self.counter[0] += 1

        return counted


@contextlib.contextmanager
def counted_direct_launches():
    """The number of direct launches since entry, as ``counter[0]``: every kept variant wrapped."""
    counter, saved = [0], []
    for cached in _launchers():
        for key, (kernel, rest) in list(cached.kernels.items()):
            saved.append((cached, key, kernel, rest))
            cached.kernels[key] = _Counted(kernel, counter), rest
    try:
        yield counter
    finally:
        for cached, key, kernel, rest in saved:
            cached.kernels[key] = kernel, rest


def _launchers():
    from sglang_lora_tma_guard import lora_moe, moe_gemm

    return [launching.launcher(getattr(module, name)) for module in (lora_moe, moe_gemm) for name in dir(module)
            if name.endswith("_kernel")]


def _path(name: str):
    """``fast``: the fast hooks; ``fused``: with the fused down GEMM and the gate-up delta in the activation, at
    every batch they cover."""
    return contextlib.nullcontext() if name == "fast" else fused_down(True, how="everywhere")


def _eager_ms(call, calls: int = 50) -> float:
    """ms a call, ``calls`` eager calls launched back to back (the host's time where it paces the GPU)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def measure(capture_mode, name, shape, ranks_name, tokens, weights) -> dict:
    call = fast_call(lora_batch(shape, ranks_name, tokens, weights))
    guard.activate(weight_tma=True)
    rows = []
    for path in ("fast", "fused"):
        with _path(path):
            with direct_launches(False):
                reference = call().clone()
            with direct_launches(True):
                call()  # each variant once through Triton's path: its key kept
                with counted_direct_launches() as counter:
                    eager = call().clone()
                launches = counter[0]
                with capture_mode():
                    graph, graphed = capture(call)
                graphed.zero_()
                graph.replay()
                torch.cuda.synchronize()
            host = {}
            for direct in (False, True, False, True):  # interleaved; the best of each
                with direct_launches(direct):
                    host[direct] = min(host.get(direct, float("inf")), _eager_ms(call))
        rows.append({"path": path, "direct_launches": launches, "eager_equal": torch.equal(eager, reference),
                     "graph_equal": torch.equal(graphed, reference), "eager_ms_triton": host[False],
                     "eager_ms_direct": host[True]})
    return {"shape": name, "ranks": ranks_name, "tokens": tokens, "paths": rows}


def markdown(rows, meta) -> str:
    return "\n".join([
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}. The fast hooked call "
        "with direct launches against the same call through Triton's own launch path, bit for bit.", "",
        tables.markdown(["shape", "ranks", "tokens", "path", "direct launches", "eager", "CUDA graph",
                         "eager ms a call: Triton's launches / direct"],
                        ([r["shape"], r["ranks"], r["tokens"], p["path"], p["direct_launches"],
                          "equal" if p["eager_equal"] else "**DIFFERS**",
                          "equal" if p["graph_equal"] else "**DIFFERS**",
                          f"{p['eager_ms_triton']:.3f} / {p['eager_ms_direct']:.3f}"] for r in rows for p in r["paths"])),
        "",
        "path: fast, the fast hooks; fused, with the fused down GEMM and the gate-up delta in the activation at every "
        "batch they cover (FUSED_DOWN=everywhere). eager ms a call: 50 eager calls back to back, best of two, "
        "interleaved; where the host paces the GPU (small batches) the difference is the launches' host time.",
    ]) + "\n"


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, [1, 8, 64, 1024, 8192])
    add_base_option(parser)
    parser.set_defaults(shapes=["qwen3-30b-tp1", "glm51-fp8-tp8"])
    args = parser.parse_args(argv)
    args.rank_sets = ["mixed"]
    return run_batches(args, "launch_check", measure, markdown)


if __name__ == "__main__":
    sys.exit(main())
