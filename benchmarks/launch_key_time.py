"""The host's time for one direct launch's key (:mod:`sglang_lora_tma_guard.launching`), on any machine.

    python -m benchmarks.launch_key_time [--repeats 5] [--number 20000]

A direct launch computes, before anything else, the key of its positional arguments: here those of a
down expand of a 1024-token batch (seven tensors, twelve sizes and strides), through the per-argument
function (``argument_key``, as the first H200 runs of docs/benchmarks.md did) and the inline one the
launcher uses (``arguments_key``). Best of ``--repeats``, µs a launch.
"""

from __future__ import annotations

import argparse
import sys
import timeit

import torch

from sglang_lora_tma_guard import launching


def expand_arguments() -> tuple:
    """The positional arguments of ``_expand_kernel`` for the down hook of 1024 tokens x top-8 on Qwen3-30B-A3B
    (hidden 2048, 4 slots of rank 64): the kinds and counts of a real launch; the values do not matter."""
    t, out = torch.zeros(8192, 64), torch.zeros(1024, 8, 2048, dtype=torch.bfloat16)
    b = torch.zeros(4, 128, 2048, 64, dtype=torch.bfloat16)
    ints = (torch.zeros(8704, dtype=torch.int32), torch.zeros(136, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    return (t, b, out, torch.zeros(8192), *ints, 8192, 2048, 128, 64, 0, t.stride(0), *b.stride(), *out.stride())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args(argv)
    values = expand_arguments()
    assert launching.arguments_key(values) == tuple(map(launching.argument_key, values))
    ways = {"per argument": lambda: tuple(map(launching.argument_key, values)),
            "inline (the launcher's)": lambda: launching.arguments_key(values)}
    print(f"Python {sys.version.split()[0]}, {len(values)} positional arguments; us a launch, best of {args.repeats}")
    for name, way in ways.items():
        us = min(timeit.repeat(way, number=args.number, repeat=args.repeats)) / args.number * 1e6
        print(f"{name}: {us:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
