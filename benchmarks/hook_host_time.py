"""The host's time per MoE layer in this package's fast LoRA hooks, their kernel launches left out.

    python -m benchmarks.hook_host_time [--repeats 7] [--layers 2000]

Outside a CUDA-graph replay (every prefill batch, and decode batches above the graphs' sizes) each MoE
layer of a LoRA batch runs this Python: SGLang builds the hooks (``build_lora_hooks``, here this
package's ``build_hooks``: the batch's checks, its tiles, its routing) and calls both (each a shrink and
an expand). Where the host is what paces the GPU (a 16-layer prefill step on the H200 took 50 ms of host
time for 41 ms of GPU work, docs/benchmarks.md), this time is on the step's critical path. Here every
Triton launch of :mod:`~sglang_lora_tma_guard.lora_moe` is replaced by a no-op, so what is timed is the
package's own Python and the tensors it allocates, on the CPU (SGLang's real ``LoRAInfo``; a decode-size
batch, whose routing is one launch, and a prefill-size one, whose routing is three); Triton's own launch
path (five to seven launches a layer) comes on top and is not timed here. Best of ``--repeats``; compare
rows of one run.

    python -m benchmarks.hook_host_time --cuda

On a GPU: the same layers with CUDA tensors, with the launches left out, then through Triton's own launch path
(``launching.DIRECT`` off), then as the package launches them (each variant's compiled launcher called
directly, :mod:`~sglang_lora_tma_guard.launching`): the differences are what the launches cost the host (the
widths are small enough that the GPU keeps up: the host's time is what is timed; the GPU is synchronized
after each timed run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import timeit

import torch

from benchmarks._lora_setup import direct_launches
from harness import real_lora, tables
from harness.tiny_moe import make_problem
from sglang_lora_tma_guard import lora_moe, lora_path


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def launches_left_out():
    kernels = {name: getattr(lora_moe, name) for name in dir(lora_moe) if name.endswith("_kernel")}
    try:
        for name in kernels:
            setattr(lora_moe, name, _NoLaunch())
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(lora_moe, name, kernel)


def layer(tokens: int, device: str = "cpu"):
    """One MoE layer of a LoRA batch (Qwen3-30B-A3B's routing: 128 experts, top-8; small widths, which
    the host's work does not depend on): a function that builds and calls both hooks."""
    from sglang.srt.lora import lora_moe_runners

    problem = make_problem(num_tokens=tokens, num_experts=128, topk=8, hidden=64, intermediate=32, seed=0,
                           device=device)
    info = real_lora.make_lora_info(problem, real_lora.Adapters(ranks=(8, 16, 32, 64), enabled=(True,) * 4))
    like = dict(dtype=problem.hidden_states.dtype, device=device)
    cache1 = torch.zeros(tokens, 8, info.gate_up_lora_b_weights.shape[2], **like)
    activation = torch.zeros(tokens * 8, 32, **like)
    cache3 = torch.zeros(tokens, 8, 64, **like)
    parts = {}

    def build():
        parts["hooks"] = lora_path.build_hooks(lora_moe_runners.build_lora_hooks, problem.hidden_states, info,
                                               problem.topk_ids)

    def gate_up():
        parts["hooks"].after_gate_up(problem.hidden_states, cache1, problem.topk_weights, problem.topk_ids)

    def down():
        parts["hooks"].after_down(activation, cache3, problem.topk_weights, problem.topk_ids)

    return {"build_hooks": build, "after_gate_up": gate_up, "after_down": down}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="host time per MoE layer of the fast LoRA hooks")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=2000, help="layers timed per repeat")
    parser.add_argument("--cuda", action="store_true",
                        help="CUDA tensors; the launches left out, through Triton's path, then direct")
    args = parser.parse_args(argv)
    if not args.cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # the hooks take CPU tensors only under Triton's interpreter
    device = "cuda" if args.cuda else "cpu"
    where = f"{torch.cuda.get_device_name()} host" if args.cuda else "CPU"
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, {where}; us per layer, best of "
          f"{args.repeats} x {args.layers}")
    table = tables.Table(["batch", "routing launches", "Triton launches", "build_hooks", "after_gate_up",
                          "after_down", "layer"])
    modes = {"left out": launches_left_out}
    if args.cuda:
        modes.update({"Triton's path": functools.partial(direct_launches, False),
                      "direct": functools.partial(direct_launches, True)})
    for mode, context in modes.items():
        with context():
            for tokens in (64, 1024):  # 512 pairs: one routing program; 8192: count, offsets, scatter
                best = time_layer(layer(tokens, device), args.repeats, args.layers, args.cuda)
                routing = 1 if tokens * 8 <= lora_moe.ONE_PROGRAM_PAIRS else 3
                table.add(f"{tokens} tokens x top-8", routing, mode, *(f"{us:.1f}" for us in best.values()),
                          f"{sum(best.values()):.1f}")
    return 0


def time_layer(steps: dict, repeats: int, layers: int, cuda: bool) -> dict:
    """Each step's best host time in us (interleaved: a noisy neighbour slows every column alike)."""
    for step in steps.values():
        step()  # the first call of each builds (and compiles) what later calls reuse
    best = {}
    for _ in range(repeats):
        for name, step in steps.items():
            if cuda:
                torch.cuda.synchronize()
            us = timeit.timeit(step, number=layers) / layers * 1e6
            best[name] = min(best.get(name, us), us)
    if cuda:
        torch.cuda.synchronize()
    return best


if __name__ == "__main__":
    sys.exit(main())
