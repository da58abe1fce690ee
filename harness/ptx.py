"""The global-memory accesses of the fast path's kernels as Triton compiles them for an H100/H200
(sm_90), here, without a GPU: Triton's own compiler to PTX, the kernels' arguments specialized as a
launch on the H200 specializes them (pointers and the sizes and strides that are multiples of 16
marked so, unit strides constant).

Run it as a script, without ``TRITON_INTERPRET`` (under the interpreter a ``@triton.jit`` function is
not compiled at all): ``python -m harness.ptx`` prints, as one JSON object, each configuration's count
of each PTX global access (``ld.global.b16``: one 16-bit element; ``ld.global.v4.b32``: 16 bytes;
``cp.async.cg.shared.global``: a 16-byte asynchronous copy of a software-pipelined load), and the
registers a thread (Triton's own ptxas) and shared memory a program, which bound the programs an SM
holds at once (65,536 registers and 228 KB on an H100/H200).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

ACCESS = re.compile(r"\b(?:ld|st)\.global[\w.]*|\bcp\.async\.c[ag]\.shared\.global[\w.]*")

WAIT = re.compile(r"ttg\.async_wait\b[^\n]*\{num = (\d+)")
"""A wait for a software pipeline's copies (Triton's TTGIR), ``num``: the copy groups it leaves in flight."""

_INT32 = ("sorted_ptr", "block_key_ptr", "rows_used_ptr")
_NOT_ALIGNED = ("num_pairs",)  # a batch's pairs (the routing's views each start on 16 bytes: lora_moe._Scratch)


def compiled(kernel, *, types: dict[str, str], constexprs: dict, unit: tuple[str, ...] = (),
             num_warps: int = 4, num_stages: int = 2) -> dict:
    """``kernel`` compiled for sm_90: ``accesses`` (the count of each global access in its PTX),
    ``registers`` a thread and ``shared_bytes`` a program, ``copies_left_in_flight`` (each wait for pipelined copies,
    in program order: the copy groups it leaves in flight; 0 waits for every one). ``types``: Triton types of the pointer
    arguments other than bf16 ones; every other argument not in ``constexprs`` or ``unit`` (the strides
    of 1) is an int32 size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, values = {}, {}
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    for name in kernel.arg_names:
        if name in constexprs or name in unit:
            signature[name], values[name] = "constexpr", constexprs.get(name, 1)
        elif name in defaults:  # a switch left at its default is a constexpr as launched, not an int argument
            signature[name], values[name] = "constexpr", defaults[name]
        else:
            signature[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name] != "constexpr" and name not in _NOT_ALIGNED}
    done = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = done.asm["ptx"]
    return {"accesses": dict(Counter(ACCESS.findall(ptx))), "registers": _registers(ptx),
            "shared_bytes": done.metadata.shared, "copies_left_in_flight": [int(n) for n in WAIT.findall(done.asm["ttgir"])]}


def _registers(ptx: str) -> int:
    """Registers a thread, as the ptxas that Triton bundles allocates them (the compiled kernel says so
    only once loaded on a GPU)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=True)
    return int(re.search(r"Used (\d+) registers", done.stderr).group(1))


def expand(**meta) -> dict:
    """The expand kernel in a gate-up configuration of the shipped H200 tiles (Qwen3-30B-A3B tp 1, 512
    pairs) unless ``meta`` says otherwise."""
    from sglang_lora_tma_guard import lora_moe

    constexprs = dict(TOPK=8, MUL_ROUTED_WEIGHT=False, BLOCK_M=16, BLOCK_N=128, BLOCK_R=64, N_TILES=4,
                      ONE_R_TILE=True, RANK_GRANULE=8)
    warps = meta.pop("num_warps", 8)
    constexprs.update(meta)
    return compiled(lora_moe._expand_kernel, types={"t_ptr": "*fp32", "weights_ptr": "*fp32",
                                                    **dict.fromkeys(_INT32, "*i32")},
                    constexprs=constexprs, unit=("stride_br", "stride_on"), num_warps=warps)


def shrink(**meta) -> dict:
    """The gated gate-up shrink in a configuration of the shipped H200 tiles."""
    from sglang_lora_tma_guard import lora_moe

    constexprs = dict(PAIRS_PER_X=8, GATED=True, SPLIT_K=1, BLOCK_M=16, BLOCK_R=32, BLOCK_K=128)
    constexprs.update(meta)
    return compiled(lora_moe._shrink_kernel, types={"t_ptr": "*fp32", **dict.fromkeys(_INT32, "*i32")},
                    constexprs=constexprs, unit=("stride_xk", "stride_ak"), num_stages=3)


def hook(**meta) -> dict:
    """Both GEMMs of the gate-up hook in one kernel (``StageConfig.one_kernel``), a decode tile of
    Qwen3-30B-A3B tp 1 (a half's 768 columns in 6 tiles of 128 a program)."""
    from sglang_lora_tma_guard import lora_moe

    constexprs = dict(PAIRS_PER_X=8, TOPK=8, MUL_ROUTED_WEIGHT=False, BLOCK_M=16, BLOCK_R=64, BLOCK_K=128,
                      BLOCK_N=128, N_TILES=6, RANK_GRANULE=8)
    constexprs.update(meta)
    return compiled(lora_moe._hook_kernel, types={"weights_ptr": "*fp32", **dict.fromkeys(_INT32, "*i32")},
                    constexprs=constexprs, unit=("stride_xk", "stride_ak", "stride_br", "stride_on"), num_stages=3)


def act(num_warps: int = 4, num_stages: int = 2, **meta) -> dict:
    """The gate-up expand and the activation in one kernel (``fused_act.TILE``) at a prefill batch of Qwen3-30B-A3B
    tp 1 (the routing's blocks of 64 pairs), ranks up to 64 in one tile, unless ``meta`` says otherwise."""
    from sglang_lora_tma_guard import lora_moe

    constexprs = dict(TOPK=8, BLOCK_M=64, BLOCK_N=64, BLOCK_R=64, N_TILES=1, RANK_GRANULE=8, ONE_R_TILE=True,
                      BLOCK_MAJOR=False, PREFETCH=False, ROWS_ONLY=False)
    constexprs.update(meta)
    return compiled(lora_moe._act_kernel, types={"t_ptr": "*fp32", **dict.fromkeys(_INT32, "*i32"),
                                                 **dict.fromkeys(("topk_ids_ptr", "token_lora_ptr", "enabled_ptr",
                                                                  "ranks_ptr"), "*i32")},
                    constexprs=constexprs, unit=("stride_br",), num_warps=num_warps, num_stages=num_stages)


def fused_down(num_warps: int = 4, num_stages: int = 3, **meta) -> dict:
    """This package's down GEMM with the LoRA expand in its epilogue over SGLang's route list, one column tile
    a program (``moe_gemm`` without ``n_tiles``), bf16 weights by plain loads unless ``meta`` says otherwise
    (block-fp8 ones with ``FP8=True``)."""
    from sglang_lora_tma_guard import moe_gemm

    constexprs = dict(ROUTES_PER_A_ROW=1, TOPK=8, SCALE_BLOCK_N=128, BLOCK_M=16, BLOCK_N=128, BLOCK_K=64,
                      BLOCK_R=64, GROUP_M=1, FP8=False, HAS_BIAS=False, MUL_ROUTED_WEIGHT=True, LORA=True,
                      B_TMA=False, RANK_GRANULE=8, EVEN_K=True, b_desc=None, SHRINK=False, SHRINK_R=16)
    constexprs.update(meta)
    weights = "*fp8e4nv" if constexprs["FP8"] else "*bf16"
    int32 = ("sorted_ids_ptr", "expert_ids_ptr", "num_post_padded_ptr", "token_lora_ptr", "enabled_ptr", "ranks_ptr")
    return compiled(moe_gemm._moe_gemm_kernel,
                    types={"a_ptr": weights, "b_ptr": weights, "t_ptr": "*fp32", "topk_weights_ptr": "*fp32",
                           "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", **dict.fromkeys(int32, "*i32")},
                    constexprs=constexprs, unit=("stride_ak", "stride_bk", "stride_cn", "stride_lr", "stride_ak_lora"),
                    num_warps=num_warps, num_stages=num_stages)


def gate_up(shrink: bool, num_warps: int = 4, num_stages: int = 3, **meta) -> dict:
    """This package's 16-bit gate-up GEMM (one A row per token, top-8) with or without the LoRA shrink in its
    K loop (``moe_gemm``'s ``LoRAShrink``), a prefill tile of Qwen3-30B-A3B tp 1 in bf16 (12 column tiles of 128,
    ranks up to 64 in both halves: 16 ranks for each of the first 8)."""
    return fused_down(num_warps, num_stages, **{
        "ROUTES_PER_A_ROW": 8, "BLOCK_M": 64, "MUL_ROUTED_WEIGHT": False, "LORA": False, "SHRINK": shrink,
        "SHRINK_R": 16, **meta})


def wide_down(num_warps: int = 4, num_stages: int = 2, **meta) -> dict:
    """The wide down GEMM with the LoRA epilogue as ``=fast`` launches it (``fused_lora.WIDE_TILES``):
    block-fp8 weights (bf16 with ``FP8=False``) by plain loads, SGLang's route list, the GLM-5.1 TP8 down GEMM
    (K 256: two tiles), rank 16 unless ``meta`` says otherwise."""
    from sglang_lora_tma_guard import moe_gemm

    constexprs = dict(TOPK=8, SCALE_BLOCK_N=128, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, BLOCK_R=16, K_TILES=2,
                      N_TILES=16, FP8=True, MUL_ROUTED_WEIGHT=True, LORA=True, B_TMA=False, RANK_GRANULE=8,
                      EVEN_K=True, b_desc=None)
    constexprs.update(meta)
    weights = "*fp8e4nv" if constexprs["FP8"] else "*bf16"
    int32 = ("sorted_ids_ptr", "expert_ids_ptr", "num_post_padded_ptr", "token_lora_ptr", "enabled_ptr", "ranks_ptr")
    return compiled(moe_gemm._moe_gemm_wide_kernel,
                    types={"a_ptr": weights, "b_ptr": weights, "t_ptr": "*fp32", "topk_weights_ptr": "*fp32",
                           "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", **dict.fromkeys(int32, "*i32")},
                    constexprs=constexprs, unit=("stride_ak", "stride_bk", "stride_cn", "stride_lr"),
                    num_warps=num_warps, num_stages=num_stages)


HOPPER_SHARED_BYTES = 232448
"""Shared memory a program may use on an H100 or H200 (``shared_memory_per_block_optin``)."""


def down_as_placed(k: int, max_rank: int, block_m: int = 64, fp8: bool = True, block_n: int = 128,
                   num_stages: int = 3, num_warps: int = 4) -> dict:
    """The fused down GEMM at the tile ``fused_lora.wide_tile`` picks on an H100/H200 from a tuned config of
    SGLang's (``BLOCK_SIZE_M`` ``block_m``, ``BLOCK_SIZE_N`` ``block_n``, its stages and warps; K tiles of 128, one
    fp8 group, or of 64 with bf16 experts) for a down GEMM of K ``k`` (a shard's intermediate width) and adapters up
    to ``max_rank``: the compiled kernel (the wide one, or the narrow one where the tile has no column tiles a
    program), with ``estimate`` (``moe_gemm.wide_shared_bytes``, the narrow kernel's as a K loop's: a stage one K
    tile), the ``tile`` and ``n_tiles``."""
    from sglang_lora_tma_guard import fused_lora, moe_gemm

    block_k, weight_bytes = (128, 1) if fp8 else (64, 2)
    config = {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": block_n, "BLOCK_SIZE_K": block_k, "GROUP_SIZE_M": 1,
              "num_warps": num_warps, "num_stages": num_stages}
    tile, n_tiles = fused_lora.wide_tile(config, 128 if fp8 else None, k, max_rank, weight_bytes, HOPPER_SHARED_BYTES)
    k_tiles = moe_gemm.cdiv(k, block_k)
    shape = dict(BLOCK_M=tile["BLOCK_M"], BLOCK_N=tile["BLOCK_N"], BLOCK_K=block_k, BLOCK_R=moe_gemm.rank_tile(max_rank),
                 FP8=fp8, EVEN_K=k % block_k == 0, num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    if n_tiles:
        switches = {name: tile[name] for name in ("K_LOOP", "LORA_AHEAD") if name in tile}  # as launched
        built = wide_down(K_TILES=k_tiles, N_TILES=n_tiles, **switches, **shape)
        estimate = moe_gemm.wide_shared_bytes(tile, k_tiles, max_rank, weight_bytes)
    else:
        built = fused_down(GROUP_M=tile["GROUP_M"], **shape)
        estimate = moe_gemm.wide_shared_bytes({**tile, "K_LOOP": 1}, k_tiles, max_rank, weight_bytes)
    return {**built, "estimate": estimate, "tile": tile, "n_tiles": n_tiles}


CONFIGURATIONS = {
    "expand, one rank tile": lambda: expand(),
    "expand, rank tiles of 16": lambda: expand(BLOCK_R=16, ONE_R_TILE=False, N_TILES=1, num_warps=4),
    "expand, one rank tile, exact rank masks": lambda: expand(RANK_GRANULE=1),
    "expand, rank tiles of 16, exact rank masks": lambda: expand(BLOCK_R=16, ONE_R_TILE=False, N_TILES=1,
                                                                 RANK_GRANULE=1, num_warps=4),
    "shrink": lambda: shrink(),
    "one kernel a hook": lambda: hook(),
    "fused down GEMM": lambda: fused_down(),
    "fused down GEMM, exact rank masks": lambda: fused_down(RANK_GRANULE=1),
    "wide fused down GEMM, rank 16": lambda: wide_down(),
    "wide fused down GEMM, rank 64": lambda: wide_down(BLOCK_N=64, N_TILES=16, BLOCK_R=64, LORA_AHEAD=3),  # as placed
    # Each column tile's B tiles loaded before its K steps (LORA_AHEAD=1: benchmarks/down_gemm.py's sweep, not placed).
    "wide fused down GEMM, rank 32, B tiles ahead": lambda: wide_down(BLOCK_R=32, LORA_AHEAD=1),
    "wide fused down GEMM, rank 64, B tiles ahead": lambda: wide_down(BLOCK_N=64, N_TILES=16, BLOCK_R=64, LORA_AHEAD=1),
    # and their GEMMs unconditional (LORA_AHEAD=3): the B tiles pipelined with the column loop.
    "wide fused down GEMM, rank 32, B tiles pipelined": lambda: wide_down(BLOCK_R=32, LORA_AHEAD=3),
    # The block's two A tiles read once for all its column tiles (A_ONCE; benchmarks/down_gemm.py's sweep, not placed).
    "wide fused down GEMM, rank 64, A once": lambda: wide_down(BLOCK_N=64, N_TILES=16, BLOCK_R=64, LORA_AHEAD=3, A_ONCE=1),
    # and three stages, 32-wide columns (benchmarks/down_gemm.py's ONCE rows): copies in flight while a tile computes.
    "wide fused down GEMM, rank 64, A once, three stages": lambda: wide_down(
        BLOCK_N=32, N_TILES=32, BLOCK_R=64, LORA_AHEAD=3, A_ONCE=1, num_stages=3),
    # and its B tiles as loaded (RANKS_IN_GRANULES: every rank a multiple of the granule; not placed).
    "wide fused down GEMM, rank 64, A once, B tiles as loaded": lambda: wide_down(
        BLOCK_N=64, N_TILES=16, BLOCK_R=64, LORA_AHEAD=3, A_ONCE=1, RANKS_IN_GRANULES=1),
    "wide fused down GEMM, K loop": lambda: wide_down(K_TILES=6, K_LOOP=1, num_stages=3),  # Qwen3-30B-A3B tp1's K
    "wide fused down GEMM, K unrolled in one stage": lambda: wide_down(K_TILES=6, num_stages=1),  # as placed before
    # As placed on an H100/H200 for SGLang's block-fp8 down GEMMs: GLM-5.1 TP8 (K 256), Qwen3-30B-A3B at tp 1, 2, 4
    # (K 768, 384, 192), at ranks 16, 32 and 64, with SGLang's BLOCK_SIZE_M of 64 (128 for the longest K too).
    **{f"fused down GEMM placed, K {k}, rank {r}, BLOCK_M {m}": (lambda k=k, r=r, m=m: down_as_placed(k, r, m))
       for k, r, m in ((256, 16, 64), (256, 32, 64), (256, 64, 64), (768, 16, 64), (768, 32, 128), (768, 64, 64),
                       (384, 16, 64), (384, 64, 128), (192, 32, 64))},
    # bf16 experts, where the fused launch runs only when placed for every batch (fused_lora.activate(everywhere=True)).
    **{f"fused down GEMM placed, bf16, K {k}, rank {r}, BLOCK_M {m}": (
        lambda k=k, r=r, m=m: down_as_placed(k, r, m, fp8=False))
       for k, r, m in ((256, 16, 64), (256, 64, 128), (384, 32, 64), (192, 16, 64))},
    # SGLang's bf16 tile of Qwen3-30B-A3B tp 1 (E=128,N=768; 128 x 256 x 64, 4 stages, 8 warps, from 1536 tokens on
    # an H100, 1024 on an H200): 262,144 bytes with a rank-64 epilogue as SGLang gives it (fused_lora.narrow_tile).
    **{f"fused down GEMM placed, bf16, K 768, rank {r}, BLOCK_M {m}, SGLang's large tile": (
        lambda r=r, m=m: down_as_placed(768, r, m, fp8=False, block_n=256, num_stages=4, num_warps=8))
       for r, m in ((16, 64), (32, 128), (64, 128))},
    # The other tuned decode tiles of Qwen3-30B-A3B tp 1 (512 pairs; "rank tiles of 16" is the gate-up expand's).
    # The gate-up expand and the activation in one kernel (fused_act): as placed (one column tile of 64 a program),
    # with the switches act_tiles sweeps.
    "expand and activation": lambda: act(),
    "expand and activation, block by block, rows a tile ahead": lambda: act(BLOCK_N=32, N_TILES=8, BLOCK_MAJOR=True,
                                                                              PREFETCH=True),
    "decode expand down": lambda: expand(BLOCK_R=16, ONE_R_TILE=False, N_TILES=1, MUL_ROUTED_WEIGHT=True,
                                         num_warps=4),
    "decode shrink gate-up": lambda: shrink(BLOCK_R=64),
    "gate-up GEMM, bf16": lambda: gate_up(False),
    "gate-up GEMM with its shrink, bf16": lambda: gate_up(True),
}


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(CONFIGURATIONS)
    print(json.dumps({name: CONFIGURATIONS[name]() for name in names}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
