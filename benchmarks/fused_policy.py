"""Where the fused down launch pays, read from ``benchmarks/down_gemm.py``'s tables: the table
``sglang_lora_tma_guard.fused_lora.FASTER_FROM_ROUTES`` is set from.

    python -m benchmarks.fused_policy DOWN_GEMM.json [DOWN_GEMM.json ...] [--margin 0.05]

Per row of those tables (a shape, a rank set, a batch; block-fp8 experts, tables run with ``--parts "SGLang's list
ordered"`` or all parts): the fused down side as ``=fast`` launches it, the fp8 quantization + the down shrink + the
ordering by adapter (where the table timed it: the tables up to ``benchmarks/results/lora_moe/narrow/`` did not; on
an H100 it takes 0.006-0.011 ms at 2048-8192 tokens, ``.../route-order/``) + the GEMM with the LoRA epilogue over
SGLang's route list ordered by adapter at the tile ``fused_lora.wide_tile`` places on a Hopper GPU (one of the
table's "SGLang's list ordered" rows, or of its "B tiles ahead sweep" ones), against SGLang's down GEMM + the hook
(``fast``).
``benchmarks/lora_moe_kernels.py``'s tables (``lora_moe_kernels.json``) count too where the placed tile is the narrow
GEMM at SGLang's tile: their ``own down + LoRA`` is that launch (over the benchmark's route list ordered by adapter),
their ``SGLang down`` + ``shrink down`` + ``expand down`` the unfused side. Then, by the down
GEMM's K and each rank set's max rank, the fewest routes (tokens x top-k) from which the fused side is at least
``--margin`` faster at that batch and at every larger batch measured: what ``FASTER_FROM_ROUTES`` would hold. A
batch measured in several tables pays only if it pays in each. Only tables of the kernels as the package now has
them say where the package's launch pays (``benchmarks/results/lora_moe/README.md`` says which kernels each ran).

With ``--whole``, the whole hooked call instead, from ``lora_moe_kernels.py`` tables run with
``FUSED_DOWN=everywhere``: the fused launch at the batch (``fused``) against the call as ``=fast`` runs a batch it
places no launch for (``fast, act``), the comparison a row of ``FASTER_FROM_ROUTES`` decides.

    python -m benchmarks.fused_policy --whole LORA_MOE_KERNELS.json [...]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from benchmarks._bench import SHAPES
from benchmarks._lora_setup import pool_rank
from harness import tables
from harness.ptx import HOPPER_SHARED_BYTES
from sglang_lora_tma_guard import fused_lora, moe_gemm

ORDERED = "ms SGLang's list ordered: wide + LoRA, "
SWEEP = "ms B tiles ahead sweep, ordered: wide + LoRA, "
"""``down_gemm.py``'s ``AHEAD`` rows: the same launches over the same list as the ordered rows, under their own name."""


def variant(label: str) -> tuple[int, dict] | None:
    """``N_TILES=16, BLOCK_N=64, num_stages=2`` as (16, {"BLOCK_N": 64, "num_stages": 2}); None for a variant of
    a kernel switch the package no longer has (``LATE_B=True``)."""
    fields = dict(field.split("=") for field in label.split(", "))
    if not all(value.isdigit() for value in fields.values()):
        return None
    return int(fields.pop("N_TILES")), {name: int(value) for name, value in fields.items()}


def kernels_row(row: dict) -> bool:
    """A ``lora_moe_kernels.py`` row (not a ``down_gemm.py`` one)."""
    return "ms_down_own_lora" in row


def placed_ms(row: dict) -> float | None:
    """The row's fused down side at the tile ``fused_lora.wide_tile`` places, ms; None where it was not timed."""
    if kernels_row(row):  # only SGLang's own tile, narrow, was timed fused there
        config = {"BLOCK_SIZE_M": row["block_m"], "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                  "num_warps": 4, "num_stages": 3}  # all but BLOCK_SIZE_M stand-ins: only the change is compared
        tile, n_tiles = fused_lora.wide_tile(config, 128, SHAPES[row["shape"]]["N"], pool_rank(row["ranks"]), 1,
                                             HOPPER_SHARED_BYTES)
        narrow_at_sglangs_tile = not n_tiles and tile == moe_gemm.tile(config, row["block_m"], 128)
        return row["ms_quant_own"] + row["ms_shrink_dn"] + row["ms_down_own_lora"] if narrow_at_sglangs_tile else None
    base = row["tile"]  # moe_gemm.tile of SGLang's config: the config back from it
    config = {"BLOCK_SIZE_M": base["BLOCK_M"], "BLOCK_SIZE_N": base["BLOCK_N"], "BLOCK_SIZE_K": base["BLOCK_K"],
              "GROUP_SIZE_M": base["GROUP_M"], "num_warps": base["num_warps"], "num_stages": base["num_stages"]}
    tile, n_tiles = fused_lora.wide_tile(config, base["BLOCK_K"], SHAPES[row["shape"]]["N"], pool_rank(row["ranks"]),
                                         1, HOPPER_SHARED_BYTES)
    ordering = row.get("ms order by adapter", 0.0)  # not in the tables up to narrow/ (see above)
    for key, ms in row.items():
        prefix = next((p for p in (ORDERED, SWEEP) if key.startswith(p)), None)
        got = variant(key.removeprefix(prefix)) if prefix else None
        if got and got[0] == n_tiles and {**base, **got[1]} == tile:
            return row["ms quantize"] + row["ms shrink"] + ordering + ms
    return None


def fast_ms(row: dict) -> float:
    """The row's down side unfused, ms: SGLang's down GEMM + the fast down hook (its shrink and expand)."""
    return row["ms_down_sglang"] + row["ms_shrink_dn"] + row["ms_expand_dn"] if kernels_row(row) else row["ms fast"]


def whole_ms(row: dict) -> tuple[float, float] | None:
    """The row's whole hooked call with the fused launch and as ``=fast`` runs it with none (``fast, act``), ms: a
    ``lora_moe_kernels.py`` row of a run with ``FUSED_DOWN=everywhere``; None for any other row."""
    if row.get("fused_down") != "everywhere" or "ms_fast_act" not in row:
        return None
    return row["ms_fused"], row["ms_fast_act"]


def down_ms(row: dict) -> tuple[float, float] | None:
    """The row's down side fused (placed) and unfused, ms; None where the placed tile was not timed."""
    fused = placed_ms(row)
    return None if fused is None else (fused, fast_ms(row))


def policy(rows: list[dict], margin: float, whole: bool = False
           ) -> tuple[dict[int, tuple[tuple[int, int], ...]], list[list]]:
    """``FASTER_FROM_ROUTES`` as ``rows`` support it (their down side, or with ``whole`` their whole call), and a line
    per row: shape, ranks, tokens, fused and unfused ms, their ratio."""
    ratios: dict[tuple[int, int], dict[int, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    lines = []
    for row in rows:
        if row.get("base", "fp8") != "fp8":
            continue  # =fast takes the fused launch over block-fp8 experts only
        sides = whole_ms(row) if whole else down_ms(row)
        if sides is None:
            continue
        (fused, fast), shape = sides, SHAPES[row["shape"]]
        ratio = fused / fast
        ratios[shape["N"], pool_rank(row["ranks"])][row["tokens"] * shape["topk"]].append(ratio)
        lines.append([row["shape"], row["ranks"], row["tokens"], f"{fused:.4f}", f"{fast:.4f}", f"{ratio:.3f}"])
    table: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for (k, rank), by_routes in sorted(ratios.items()):
        start = None
        for routes in sorted(by_routes, reverse=True):  # from the largest batch down, while each pays
            if max(by_routes[routes]) > 1 - margin:
                break
            start = routes
        if start is not None:
            table[k].append((rank, start))
    return {k: tuple(entries) for k, entries in sorted(table.items())}, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", metavar="DOWN_GEMM.json", help="or LORA_MOE_KERNELS.json")
    parser.add_argument("--margin", type=float, default=0.05, help="how much faster the fused side must be (0.05: 5%%)")
    parser.add_argument("--whole", action="store_true", help="the whole hooked call of lora_moe_kernels tables run "
                        "with FUSED_DOWN=everywhere (fused against fast, act), not the down side")
    args = parser.parse_args(argv)
    rows = []
    for path in args.tables:
        with open(path) as f:
            rows += json.load(f)["rows"]
    table, lines = policy(rows, args.margin, args.whole)
    sides = ["whole call, fused (ms)", "fast, act (ms)"] if args.whole else ["fused, as placed (ms)", "fast (ms)"]
    print(tables.markdown(["shape", "ranks", "tokens", *sides, "fused / fast"], lines))
    print(f"\nFASTER_FROM_ROUTES = {table!r}  # at least {args.margin:.0%} faster from these routes up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
