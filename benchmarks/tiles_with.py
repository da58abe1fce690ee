"""The shipped tiles with some fields changed, under this GPU's name: a file for ``SGLANG_LORA_TMA_GUARD_TILES``,
to time a tile field against the shipped tiles on one machine.

    python -m benchmarks.tiles_with OUT.json [--from-pairs N] HOOK.FIELD=VALUE ...

``HOOK``: ``gate_up`` or ``down``; every bucket of every shape from ``N`` pairs (tokens x topk) on gets the values.
The tiles: those ``tuning`` takes on this GPU (``tuning.tiles_of``: its own, or another GPU's).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys


def main(argv=None) -> int:
    from sglang_lora_tma_guard import tuning

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("changes", nargs="+", help="HOOK.FIELD=VALUE (an int)")
    parser.add_argument("--from-pairs", type=int, default=0)
    args = parser.parse_args(argv)
    gpu = tuning._gpu()
    shapes = copy.deepcopy(tuning.tiles_of(tuning._table(None), gpu))  # the shipped table is cached: changed here, not there
    if not shapes:
        raise SystemExit(f"no shipped tiles for this GPU ({gpu or 'none'}): it takes the rule of thumb")
    for change in args.changes:
        name, value = change.split("=")
        hook, field = name.split(".")
        for buckets in shapes.values():
            for entry in buckets:
                if entry["max_pairs"] >= args.from_pairs:
                    entry[hook][field] = int(value)
    with open(args.out, "w") as f:
        json.dump({"_about": f"the shipped tiles with {' '.join(args.changes)} from {args.from_pairs} pairs", gpu: shapes},
                  f, indent=1)
    print(f"{args.out}: {gpu}, {' '.join(args.changes)} from {args.from_pairs} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
