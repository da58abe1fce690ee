"""The global-memory accesses of the fast path's kernels as Triton compiles them for an H100/H200
(sm_90), here, without a GPU: Triton's own compiler to PTX, the kernels' arguments specialized as a
launch on the H200 specializes them (pointers and the sizes and strides that are multiples of 16
marked so, unit strides constant).

Run it as a script, without ``TRITON_INTERPRET`` (under the interpreter a ``@triton.jit`` function is
not compiled at all): ``python -m harness.ptx`` prints, as one JSON object, each configuration's count
of each PTX global access (``ld.global.b16``: one 16-bit element; ``ld.global.v4.b32``: 16 bytes;
``cp.async.cg.shared.global``: a 16-byte asynchronous copy of a software-pipelined load).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

ACCESS = re.compile(r"\b(?:ld|st)\.global[\w.]*|\bcp\.async\.c[ag]\.shared\.global[\w.]*")

_INT32 = ("sorted_ptr", "block_key_ptr", "rows_used_ptr", "ranks_ptr")
_NOT_ALIGNED = ("num_pairs", "rows_used_ptr")  # a batch's pairs; one int32 inside the routing's buffer


def accesses(kernel, *, types: dict[str, str], constexprs: dict, unit: tuple[str, ...] = (),
             num_warps: int = 4, num_stages: int = 2) -> dict[str, int]:
    """Counts of each global access in ``kernel``'s PTX for sm_90. ``types``: Triton types of the
    pointer arguments other than bf16 ones; every other argument not in ``constexprs`` or ``unit`` (the
    strides of 1) is an int32 size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, values = {}, {}
    for name in kernel.arg_names:
        if name in constexprs or name in unit:
            signature[name], values[name] = "constexpr", constexprs.get(name, 1)
        else:
            signature[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name] != "constexpr" and name not in _NOT_ALIGNED}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return dict(Counter(ACCESS.findall(compiled.asm["ptx"])))


def expand(**meta) -> dict[str, int]:
    """The expand kernel in a gate-up configuration of the shipped H200 tiles (Qwen3-30B-A3B tp 1, 512
    pairs) unless ``meta`` says otherwise."""
    from sglang_lora_tma_guard import lora_moe

    constexprs = dict(TOPK=8, MUL_ROUTED_WEIGHT=False, BLOCK_M=16, BLOCK_N=128, BLOCK_R=64, N_TILES=4,
                      ONE_R_TILE=True, RANK_GRANULE=8)
    warps = meta.pop("num_warps", 8)
    constexprs.update(meta)
    return accesses(lora_moe._expand_kernel, types={"t_ptr": "*fp32", "weights_ptr": "*fp32",
                                                    **dict.fromkeys(_INT32, "*i32")},
                    constexprs=constexprs, unit=("stride_br", "stride_on"), num_warps=warps)


def shrink(**meta) -> dict[str, int]:
    """The gated gate-up shrink in a configuration of the shipped H200 tiles."""
    from sglang_lora_tma_guard import lora_moe

    constexprs = dict(PAIRS_PER_X=8, GATED=True, SPLIT_K=1, BLOCK_M=16, BLOCK_R=32, BLOCK_K=128)
    constexprs.update(meta)
    return accesses(lora_moe._shrink_kernel, types={"t_ptr": "*fp32", **dict.fromkeys(_INT32, "*i32")},
                    constexprs=constexprs, unit=("stride_xk", "stride_ak"), num_stages=3)


CONFIGURATIONS = {
    "expand, one rank tile": lambda: expand(),
    "expand, rank tiles of 16": lambda: expand(BLOCK_R=16, ONE_R_TILE=False, N_TILES=1, num_warps=4),
    "expand, one rank tile, exact rank masks": lambda: expand(RANK_GRANULE=1),
    "expand, rank tiles of 16, exact rank masks": lambda: expand(BLOCK_R=16, ONE_R_TILE=False, N_TILES=1,
                                                                 RANK_GRANULE=1, num_warps=4),
    "shrink": lambda: shrink(),
}


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(CONFIGURATIONS)
    print(json.dumps({name: CONFIGURATIONS[name]() for name in names}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
