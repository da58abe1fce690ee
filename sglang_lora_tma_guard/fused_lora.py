"""The down LoRA expand inside the down GEMM, for batches on the fast path.

A hooked MoE call otherwise writes the down GEMM's output ``(tokens, topk, hidden)``, and the down
hook reads it and writes it back with the delta added: the largest traffic only hooks have (0.8 GB
at 8192 tokens on GLM-5.1 TP8), and a separate expand kernel of small programs. Here the down GEMM
of such a call is this package's (:func:`~sglang_lora_tma_guard.moe_gemm.moe_gemm`), the delta added
in its epilogue: the output is written once, and the expand's B tiles are read beside the weights.

The seam. SGLang's ``_fused_moe_kernel_sequence`` (0.5.11-0.5.23) calls ``invoke_fused_moe_kernel``,
looked up in its module's globals at call time, for the gate-up GEMM and then the down GEMM, with
``hooks.after_gate_up`` between them and ``hooks.after_down`` after. The fast path's
``after_gate_up`` *offers* the call's down work (:func:`offer`: thread-local, one shot); the launcher
placed here takes an offer only at the very next launch, and only when that launch is the batch's
down GEMM in a form it covers (:meth:`DownWork.refusal`); it then runs the down shrink and the fused
GEMM, and ``after_down`` finds its buffer done (:meth:`DownWork.took`). Any other launch goes to
SGLang's launcher untouched, and ``after_down`` then adds the delta itself: an offer that is not
taken costs nothing and loses nothing. Not under ``torch.compile`` (the hooks' custom ops run there).

Where it runs: ``=fast`` places it for the batches it is measured faster on (:data:`FASTER_FROM_ROUTES`:
by the down GEMM's K, max rank and batch size; block-fp8 experts; a GPU's own rows in
:data:`FASTER_FROM_ROUTES_ON`), or split by rank where only that is
(:data:`SPLIT_FROM_ROUTES`, a GPU's own rows in :data:`SPLIT_FROM_ROUTES_ON`: the epilogue adds the adapters up to
a rank, the hook's expand the others' deltas after it); every other batch keeps the hook's expand.
:func:`activate` with ``everywhere`` takes every batch it covers (tests, benchmarks). Right:
``tests/test_fast_lora.py``, ``tests/test_fused_lora.py``; measured: ``docs/lora_moe_floor.md``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import fused_act
from .log import info_once, logger
from .patching import Engaged, Patch

MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
NAME = "invoke_fused_moe_kernel"
MAX_RANK = 64
"""Above this rank the epilogue's tiles would not fit in registers: the hooks' expand runs instead."""
WIDE_TILES = ((32, 16, {"num_stages": 2}), (MAX_RANK, 16, {"BLOCK_N": 64, "num_stages": 2, "LORA_AHEAD": 3}))
"""The wide down GEMM's tile by the adapters' max rank: (up to that rank, column tiles a program, changes to
SGLang's tile), the fastest variants on the GLM-5.1 TP8 down GEMM (``benchmarks/down_gemm.py``,
``benchmarks/results/lora_moe/late-b/``): with each adapter's B tile loaded just before its GEMM, SGLang's
128-wide columns up to rank 32; past it the epilogue's tiles crowd the accumulator's registers, 64-wide columns,
whose two B tiles are copied a column tile ahead (``LORA_AHEAD=3``, ``moe_gemm._lora_add_always``). Over SGLang's
list ordered by adapter, one H100 (``benchmarks/results/lora_moe/b-ahead/down/``), ms: ranks 8/16/32/64 0.844
against 0.983 at 4096 tokens, 0.686 / 0.787 at 2048; every adapter of rank 64 0.894 / 1.017, 0.728 / 0.830. At rank
32 the copies take the 128-wide tile to one program an SM (139,264 bytes of shared memory): 0.837 against 0.676
at 4096 tokens, 0.731 at 64 wide, so not there. At K 512 and 640 (``e513-n512``, ``e80-n640``; ``.../b-ahead/k4-k5-*``)
the whole call within 1% or 6-12% faster; at three K tiles slower (:data:`WIDE_TILES_BY_K_TILES`).
Other K tile counts measured to want other tiles: :data:`WIDE_TILES_BY_K_TILES`. Where two pipeline stages of
every K tile would not fit the GPU's shared memory, the K steps as the pipelined loop (:func:`wide_tile`)."""
WIDE_TILES_BY_K_TILES = {3: ((16, 16, {"K_LOOP": 1}), (MAX_RANK, 16, {"BLOCK_N": 64, "num_stages": 2})),
                         6: ((MAX_RANK, 0, {}),)}
""":data:`WIDE_TILES` for a down GEMM of that many K tiles (block fp8's K tiles of 128), the GEMM with its epilogue
alone on an H100; no column tiles a program: the narrow GEMM (one column tile a program) at SGLang's tile.

- Three (Qwen3-30B-A3B at tp 2, K 384): up to rank 16 the K steps a loop (``K_LOOP``, SGLang's stages, 128-wide
  columns), past it 64-wide columns unrolled. Rank 16, the K loop against 64-wide columns, 0.33 ms against 0.40 at
  8192 tokens, 0.22 against 0.25 at 4096 (``benchmarks/results/lora_moe/k-loop/short-k/``; rank 8 runs the same
  compiled kernel, its rank tile 16 too; rank 32 not measured with the loop). 64-wide columns against 128-wide
  unrolled, ranks 8–32 (``.../fused-qwen3-tp2/``): 0.37–0.40 against 0.41–0.52 at 8192 tokens, 0.24–0.25 against
  0.26–0.33 at 4096, 0.18–0.19 against 0.20–0.23 at 2048; with ranks up to 64, 0.42 against 0.47 for the loop at
  8192. The B tiles copied a column tile ahead (``LORA_AHEAD=3``, as in :data:`WIDE_TILES`) slower past rank 16:
  the whole call 0.803 against 0.688 ms at 4096 tokens with ranks 8/16/32/64, 0.862 / 0.750 all 64
  (``.../b-ahead/qwen3-tp2-*``).
- Six (tp 1, K 768): narrow. Six K steps a column tile pay for a program's prologue (the block's routes, scales,
  adapters and ranks), and the narrow grid has 16 times the wide one's programs: at 2048 tokens the wide one's few
  hundred leave SMs idle. Over SGLang's list ordered by adapter, the down side (quantize + shrink + GEMM), narrow
  against the wide kernel's K loop at its best tile, in one H100 run (``benchmarks/results/lora_moe/narrow/``): rank
  16 0.15 / 0.21 ms at 1024 tokens, 0.20 / 0.28 at 2048, 0.34 / 0.38 at 4096, 0.61 / 0.60 at 8192; rank 32 0.16 /
  0.23, 0.23 / 0.32, 0.36 / 0.43, 0.64 / 0.66; ranks up to 64 0.18 / 0.30, 0.25 / 0.35, 0.40 / 0.48, 0.71 / 0.75
  (rank 8 as rank 16). Without LoRA the narrow GEMM and its input's fp8 quantization are a little faster than SGLang's
  GEMM with its own, which runs SGLang's default tile here (no tuned file for this shape): 0.49 against 0.52 ms at
  8192 tokens, 0.16 against 0.17 at 2048 (``.../k-loop/kernels/``)."""
FASTER_FROM_ROUTES = {256: ((8, 32768), (16, 16384), (32, 32768)), 384: ((32, 65536),), 768: ((32, 16384), (64, 65536))}
"""Where ``=fast`` takes the fused down launch, by the down GEMM's K (a shard's expert intermediate width): (up
to that max rank, from that many routes, tokens x top-k), block-fp8 experts; none past the last rank named, none at
a K not named. Measured with ``benchmarks/down_gemm.py`` or ``benchmarks/lora_moe_kernels.py``
(``benchmarks/fused_policy.py`` reads such a table's thresholds at the placed tile), the down side of a hooked call
fused against unfused (SGLang's down GEMM + the fast down hook), ms:

- K 256, GLM-5.1 and DeepSeek-V3 at TP8, on an H200 (``benchmarks/results/lora_moe/down-gemm/``): rank 16
  0.29 / 0.27 at 1024 tokens, 0.37 / 0.40 at 2048, 0.49 / 0.62 at 4096, 0.73 / 1.07 at 8192; rank 8 0.42 / 0.39
  at 2048, 0.56 / 0.64 at 4096; rank 32 0.79 / 0.72 at 4096, 1.08 / 1.27 at 8192; ranks up to 64 slower at every
  size (1.34 / 1.23 at 8192). A later H200 on today's kernels (``.../h200-k256/``, ``run_lora_moe_h200.sh
  thresholds``): rank 32 0.64 / 0.72 at 4096, and the whole hooked call 1.420-1.422 ms whole against 1.501-1.504 with
  the hooks (two tables; about 1.484 as placed before, the gate-up expand in the activation saving 0.017-0.018 ms
  beside the whole launch), so rank 32 from 4096 tokens; at 2048 slower (1.054 / 1.004). There the down side at
  rank 16 was 0.43 / 0.41 at 2048 (the whole call not timed): its row stands on the first H200's table.
- K 384, Qwen3-30B-A3B at tp 2, on an H100 only (``benchmarks/results/lora_moe/fused-qwen3-tp2/``, 64-wide
  columns): ranks 8, 16 and 32 0.42 / 0.61, 0.45 / 0.63, 0.44 / 0.64 at 8192 tokens; 0.26 / 0.32, 0.27 / 0.33,
  0.27 / 0.34 at 4096; ranks 16 and 32 0.20 / 0.20 and 0.20 / 0.21 at 2048. Taken from 8192 tokens only, a
  margin an H200 is unlikely to close: its unfused side is relatively faster (at K 256 the H100 pays earlier,
  rank 32 from 2048 tokens against the H200's 8192).
- K 768, Qwen3-30B-A3B at tp 1, on an H100 only, the narrow GEMM (``benchmarks/results/lora_moe/narrow/``): ranks
  16 and 32 0.15 / 0.17 and 0.16 / 0.18 at 1024 tokens, 0.20 / 0.26 and 0.23 / 0.28 at 2048, 0.34 / 0.42 and 0.36 /
  0.43 at 4096, 0.61 / 0.77 and 0.64 / 0.78 at 8192 (0.79–0.83 from 2048 tokens); rank 8 0.85–0.87 from 2048; ranks
  up to 64 0.84–0.87 from 1024 tokens. Two more runs (``.../narrow/repro/``; ``.../k-loop/kernels/``,
  ``lora_moe_kernels.py``'s parts) the same within 3%. Taken from 2048 tokens up to rank 32, where the margin
  (13–21%) is more than an H200's faster hook is likely to take back, from 8192 past it (a 13–16% margin at ranks
  up to 64, not placed on an H100 figure alone below the largest batch, as at K 384).

Other widths are not measured.
"""
FASTER_FROM_ROUTES_ON: dict[str, dict[int, tuple[tuple[int, int], ...]]] = {
    "NVIDIA H100 80GB HBM3": {256: ((8, 32768), (16, 16384), (32, 8192), (64, 32768)), 384: ((64, 32768),)}}
"""A GPU's own rows of :data:`FASTER_FROM_ROUTES` at a K (by its name, as ``tuning`` knows it), where its unfused
side pays earlier. The H100 SXM at K 256 (GLM-5.1 TP8), one machine (``benchmarks/results/lora_moe/h100-k256/``):
rank 32 from 1024 tokens, the down side fused against unfused 0.44 / 0.48 ms at 1024 tokens, 0.57 / 0.60 at 2048
(three tables), 0.70 / 0.95 at 4096, and the whole hooked call 1.07 against 1.12 ms at 1024 tokens (two tables),
1.31 / 1.35 at 2048 (three), 1.69 / 1.95 at 4096 (one); rank 16 from 2048 tokens as on the H200 (0.49 / 0.52 ms
there, the whole call 1.10 / 1.13; at 1024 a tie, 0.883 / 0.885); rank 8 from 4096 as on the H200 (at 2048 0.51 /
0.51). Past rank 32 the whole launch from 4096 tokens, below it the split (:data:`SPLIT_FROM_ROUTES_ON`), since the
64-wide tile's B tiles are copied a column tile ahead (:data:`WIDE_TILES`' ``LORA_AHEAD=3``; one more H100,
``benchmarks/results/lora_moe/b-ahead/``, ``shipped/`` and ``kernels-ahead3/``), the whole call whole / split / the
hooks, ms: ranks 8/16/32/64 1.884-1.885 / 1.935-1.937 / 1.987-2.000 at 4096 tokens (two tables), 2.776 / 2.699 /
3.113 at 8192, 1.468-1.469 / 1.410-1.413 / 1.450-1.451 at 2048; every adapter of rank 64 2.257-2.258 /
2.394-2.395 / 2.476-2.478 at 4096, 3.127 / 3.415 / 3.519 at 8192, 1.796-1.797 / 1.831 / 1.876-1.878 at 2048. The
pool's max rank does not tell the two batches apart: each side taken where its worse batch is nearer its floor
(whole from 4096: 1.23 and 1.17 of the fused floor at 4096, 1.16 and 1.12 at 8192; split at 2048: 1.28 and 1.22).
Before it the split beat the whole launch at every size with ranks 8/16/32/64 (``.../h100-k256/``).

The H100 SXM at K 384 (Qwen3-30B-A3B tp 2), every rank from 4096 tokens (the shared row: up to rank 32 from 8192).
The whole hooked call, the whole launch against the hooks, two tables of one machine
(``benchmarks/results/lora_moe/h100-qwen3/tp2-*``), ms: mixed ranks 0.690-0.691 / 0.714-0.719 at 4096 tokens, all
64 0.756-0.758 / 0.788-0.789, all 16 0.593 / 0.683-0.684; at 8192 1.165-1.167 / 1.310, 1.248-1.249 / 1.397-1.399,
1.032-1.033 / 1.285-1.287. As placed before, the gate-up expand ran in the activation, which beside the whole launch
saves 0.010-0.011 ms at 4096 tokens (mixed, all 64) and 0.021 (all 16): the launch is about 2-3% faster than that at
4096 (10% at all 16), 9% at 8192 (inferred so, not timed side by side). At 2048 tokens within 5% at all 16 and
slower at mixed ranks (0.494-0.498 / 0.473-0.476), at 1024 slower at every rank set. The split is slower than the
whole launch there at every batch (all 64 at 8192 tokens 1.40 against 1.25)."""
SPLIT_FROM_ROUTES: dict[int, tuple[int, int]] = {256: (32, 65536)}
"""Where :data:`FASTER_FROM_ROUTES` takes no batch of a max rank at a K: (a rank R, from that many routes) there the
fused down launch takes the adapters up to rank R in its epilogue (the tile of rank R), and the hook's expand then
adds only the others' deltas, over their routes (a read-modify-write of their rows alone). The whole hooked call,
split at 32 against the hooks (and the gate-up work in the activation), one H100
(``benchmarks/results/lora_moe/split/``, ``lora_moe_kernels.py --split-rank 32``):

- K 256 (GLM-5.1 TP8), ranks 8/16/32/64: 2.73 against 3.27 ms at 8192 tokens, 1.94 / 2.09 at 4096, 1.36 / 1.40 at
  2048; all four of rank 64 (nothing in the epilogue: this package's GEMM, then the expand) 3.56 / 3.70 at 8192,
  2.37 / 2.45 at 4096. Taken from 8192 tokens, as the whole launch's H100 figures are.
- K 384 (Qwen3-30B-A3B tp 2): mixed 1.20 / 1.33 at 8192 tokens, 0.70 / 0.73 at 4096; all of rank 64 slower
  (1.47 / 1.43 at 8192): not taken.
- K 768 (tp 1): the whole launch faster at 8192 tokens (1.80 against 1.81 split), split 3% faster at 4096: not
  taken. At 16, split at 16 instead of 32: slower at 8192 tokens on every shape, within 2% elsewhere."""
SPLIT_FROM_ROUTES_ON: dict[str, dict[int, tuple[int, int]]] = {"NVIDIA H100 80GB HBM3": {256: (32, 16384)}}
"""A GPU's own rows of :data:`SPLIT_FROM_ROUTES` (by its name, as ``tuning`` knows it), where it is measured faster
split from other batches. The H100 SXM at K 256 from 2048 tokens: GLM-5.1 TP8 at ranks 8/16/32/64, the whole hooked
call at 4096 tokens 1.956-1.968 ms split against 2.025-2.026 as ``=fast`` placed it before (the gate-up expand in the
activation, the down expand a hook), four tables of one machine (``benchmarks/results/lora_moe/h100-tune/``, the
``fused, split`` and ``fused`` columns); 1.94 against 2.00 with the H200's tiles and 1.93-1.94 against 2.09 with the
rule of thumb's in three more, of two other leases (``.../tiles-on-h100/``, ``.../split/``); every adapter of rank 64
2.37 against 2.45 (``.../split/``). At 2048 tokens 1.405-1.408 against 1.449-1.452 in three tables of one more machine
(``.../h100-k256/kernels/k1``, ``k2``, ``k6``; 1.36 / 1.40 in ``.../split/``), every adapter of rank 64 1.823-1.826
against 1.876-1.877; at 1024 slower (1.152 against 1.123; rank 64 1.559 / 1.511): not taken there. The H200's K 256
thresholds, with its relatively faster hooks, start at 8192 tokens; below it is not measured."""
_everywhere = False
_split_rank: int | None = None
_failed: dict[tuple, str] = {}
"""Down GEMMs (:meth:`DownWork.key`) whose fused launch raised in this process, and why: refused from then on
(logged once), not tried again at every call."""

# Launcher parameters the fused down GEMM reads, and the ones that may hold any value because they
# change nothing it computes: b_use_tma (the weights by TMA here too), filter_expert (expert -1
# always gives zero rows here), router_topk (only read with fuse_sum_all_reduce, which must be off).
USED = ("A", "B", "bias", "C", "A_scale", "B_scale", "B_zp", "topk_weights", "topk_ids", "sorted_token_ids",
        "expert_ids", "num_tokens_post_padded", "mul_routed_weight", "top_k", "config", "compute_type",
        "use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16", "per_channel_quant", "block_shape")
ANY_VALUE = ("b_use_tma", "filter_expert", "router_topk")

if TYPE_CHECKING:
    import torch

_offers = threading.local()


@dataclass
class DownWork:
    """One batch's down LoRA, offered to the down launch: the down LoRA buffers, the batch's routing
    (:func:`~sglang_lora_tma_guard.lora_moe.route`) and adapter slots, the shrink's tiles."""

    topk_ids: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    routing: object
    token_lora: torch.Tensor
    enabled: torch.Tensor
    ranks: torch.Tensor
    max_rank: int
    tiles: object
    """The down hook's tiles (``tuning.plan``'s ``down``): the shrink's, and the expand's where it adds a part."""
    epilogue_rank: int
    """The highest rank the epilogue adds (:func:`epilogue_rank`); the adapters past it, the hook's expand."""
    done: torch.Tensor | None = None
    """The down buffer a fused launch wrote, delta included."""

    def took(self, cache3: torch.Tensor) -> bool:
        """Did a fused launch already add the delta into ``cache3``? (Once: the record is cleared.)"""
        done, self.done = self.done, None
        return done is not None and done is cache3

    def key(self, a: dict) -> tuple:
        """What a fused launch compiles for: the weights' shape and dtypes, SGLang's tile, the max rank."""
        return (tuple(a["B"].shape), a["B"].dtype, a["A"].dtype, tuple(sorted(a["config"].items())), self.max_rank,
                self.epilogue_rank)

    def refusal(self, a: dict) -> str | None:
        """Why this launch is not this batch's down GEMM in a covered form, or None."""
        import torch

        A, B, C = a["A"], a["B"], a["C"]
        tokens, topk = self.topk_ids.shape
        if a["topk_ids"] is not self.topk_ids or a["top_k"] != 1 or C.dim() != 3 or tuple(C.shape[:2]) != (tokens, topk):
            return "not this batch's down launch"
        if not a["mul_routed_weight"]:
            return "routed weights not applied in the down GEMM (apply_router_weight_on_input or no_combine)"
        if (A.dim() != 2 or A.shape != (tokens * topk, self.lora_a.shape[3]) or B.dim() != 3
                or B.shape[1:] != (C.shape[2], A.shape[1]) or self.lora_b.shape[2] != C.shape[2]):
            return f"down GEMM of an unexpected shape (A {tuple(A.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)})"
        if not (C.is_contiguous() and A.stride(1) == 1 and a["topk_weights"].is_contiguous()):
            return "non-contiguous down buffers"
        if a["bias"] is not None or a["B_zp"] is not None or a["A_scale"] is not None:
            return "a bias, zero points or static activation scales"
        if a["use_int8_w8a8"] or a["use_int8_w8a16"] or a["use_int4_w4a16"] or a["per_channel_quant"]:
            return "int8/int4 or per-channel quantized weights"
        if a["use_fp8_w8a8"]:
            block = a["block_shape"]
            if not block or len(block) != 2 or not all(block) or B.dtype != torch.float8_e4m3fn:
                return "fp8 weights without a block shape"
        elif B.dtype != A.dtype or a["B_scale"] is not None:
            return f"weights in {B.dtype} with activations in {A.dtype}"
        if A.dtype != C.dtype or self.lora_b.dtype != C.dtype:
            return "LoRA weights in another dtype than the activations"
        if self.epilogue_rank > MAX_RANK:
            return f"LoRA rank {self.epilogue_rank} (the fused epilogue takes up to {MAX_RANK})"
        if not _everywhere and not a["use_fp8_w8a8"]:
            return ("16-bit experts (over them the fused down GEMM measured 1-3% faster at most, up to rank 32 from "
                    "2048 tokens, and slower with ranks up to 64: one H100)")
        failed = _failed.get(self.key(a)) if _failed else None  # no key built on every launch while none failed
        return f"its fused launch failed here before ({failed})" if failed else None

    def run(self, a: dict) -> None:
        """The down shrink, then the down GEMM with the expand in its epilogue, into ``C``.

        The GEMM walks SGLang's route list, each expert's routes ordered by adapter first
        (:func:`~sglang_lora_tma_guard.moe_gemm.order_by_adapter`; a block may still hold several adapters:
        the epilogue adds each row's own delta), one block against several column tiles a program
        (:data:`WIDE_TILES`) where K is short enough (:func:`~sglang_lora_tma_guard.moe_gemm.moe_gemm`'s
        ``n_tiles``: the block's rows, scales and ranks read once for all its tiles). Adapters past
        ``epilogue_rank`` are off in the epilogue; the hook's expand adds theirs after it."""
        from . import lora_moe
        from .moe_gemm import LoRAEpilogue, moe_gemm, order_by_adapter, quantize_per_group

        A, B, C = a["A"], a["B"], a["C"]
        tokens, topk = self.topk_ids.shape
        t = lora_moe.shrink(A, self.lora_a, self.routing, topk=topk, max_rank=self.max_rank, halves=1,
                            config=self.tiles)
        split = self.epilogue_rank < self.max_rank
        enabled = self.enabled * (self.ranks <= self.epilogue_rank) if split else self.enabled
        fp8 = bool(a["use_fp8_w8a8"])
        group_n, group_k = a["block_shape"] if fp8 else (1, None)
        x, x_scale = quantize_per_group(A, group_k) if fp8 else (A, None)
        gemm_tile, n_tiles = wide_tile(a["config"], group_k, A.shape[1], self.epilogue_rank, B.element_size(),
                                       shared_bytes_of(C.device))
        # SGLang's list holds each expert's routes in the order its atomics took them: about every adapter in
        # every block, each adding a GEMM to the block's epilogue. Ordered, a block holds one or two.
        sorted_ids = order_by_adapter(a["sorted_token_ids"], a["expert_ids"], a["num_tokens_post_padded"],
                                      self.token_lora, topk, gemm_tile["BLOCK_M"], self.ranks.numel())
        moe_gemm(x, B, C.view(tokens * topk, C.shape[2]), a_scale=x_scale, w_scale=a["B_scale"] if fp8 else None,
                 bias=None, topk_weights=a["topk_weights"].view(-1), sorted_ids=sorted_ids,
                 expert_ids=a["expert_ids"], num_post_padded=a["num_tokens_post_padded"], routes_per_a_row=1,
                 mul_routed_weight=True, tile=gemm_tile, scale_block_n=group_n, topk=topk,
                 lora=LoRAEpilogue(t, self.lora_b, self.token_lora, enabled, self.ranks, self.routing.num_experts,
                                   self.max_rank, rank_limit=self.epilogue_rank if split else None),
                 weights_by_tma=bool(a.get("b_use_tma")),  # where SGLang would take them by TMA itself
                 n_tiles=n_tiles)
        if split:
            lora_moe.expand(C, t, self.lora_b, self.routing, max_rank=self.max_rank, halves=1,
                            topk_weights=a["topk_weights"], config=self.tiles, rank_above=self.epilogue_rank)
        self.done = C


def wide_tile(config: dict, group_k: int | None, k: int, max_rank: int, weight_bytes: int = 1,
              shared_bytes: int | None = None) -> tuple[dict, int]:
    """The down GEMM's tile from SGLang's ``config`` and its column tiles a program: :data:`WIDE_TILES`' (or
    :data:`WIDE_TILES_BY_K_TILES`') for ``max_rank`` where the wide kernel takes K (``k`` in at most
    ``WIDE_K_TILES`` tiles), else SGLang's and 0; 0 too where the table places the narrow GEMM.
    ``shared_bytes``: what a program may use on the GPU (weights of ``weight_bytes`` an element). Where two pipeline
    stages of every K tile would not fit, the K steps run as a loop at SGLang's stages, each one K tile
    (``K_LOOP``); where even that would not, unrolled in one stage. The narrow GEMM's tile as :func:`narrow_tile`
    fits it."""
    from .moe_gemm import WIDE_K_TILES, cdiv, tile, wide_shared_bytes

    gemm_tile = tile(config, config["BLOCK_SIZE_M"], group_k)
    k_tiles = cdiv(k, gemm_tile["BLOCK_K"])
    if k_tiles > WIDE_K_TILES:
        return narrow_tile(gemm_tile, max_rank, weight_bytes, shared_bytes), 0
    tiles = WIDE_TILES_BY_K_TILES.get(k_tiles, WIDE_TILES)
    n_tiles, change = next((n, change) for rank, n, change in tiles if max_rank <= rank)
    wide = {**gemm_tile, **change}
    if not n_tiles:  # measured faster one column tile a program: SGLang's pipeline, no K tile held whole
        return narrow_tile(wide, max_rank, weight_bytes, shared_bytes), 0
    if shared_bytes is not None and wide_shared_bytes(wide, k_tiles, max_rank, weight_bytes) > shared_bytes:
        looped = {**wide, "K_LOOP": 1, "num_stages": gemm_tile["num_stages"]}
        fits = wide_shared_bytes(looped, k_tiles, max_rank, weight_bytes) <= shared_bytes
        wide = looped if fits else {**wide, "num_stages": 1}
    return wide, n_tiles


def narrow_tile(gemm_tile: dict, max_rank: int, weight_bytes: int, shared_bytes: int | None) -> dict:
    """SGLang's tile for the narrow GEMM (one column tile a program), with fewer pipeline stages (down to two),
    then narrower columns, where the LoRA epilogue's operands on top of SGLang's pipeline would not fit
    ``shared_bytes``. SGLang tunes the tile for its GEMM alone: its bf16 down GEMM of Qwen3-30B-A3B tp 1
    (``E=128,N=768``; 128 x 256 x 64, four stages, from 1536 tokens on an H100, 1024 on an H200) takes 196,608
    bytes, and 262,144 with a rank-64 epilogue (Triton's OutOfResources at the launch, an H100)."""
    from .moe_gemm import wide_shared_bytes

    fitted = dict(gemm_tile)
    while shared_bytes is not None and wide_shared_bytes({**fitted, "K_LOOP": 1}, 1, max_rank, weight_bytes) > shared_bytes:
        if fitted["num_stages"] > 2:
            fitted["num_stages"] -= 1
        elif fitted["BLOCK_N"] > 32:
            fitted["BLOCK_N"] //= 2
        else:
            break  # nothing left to narrow: the launch says so, and the hook path takes the shape (``_failed``)
    return fitted


def shared_bytes_of(device) -> int | None:
    """Shared memory a program may use on ``device`` (227 KB on an H100/H200); None off the GPU."""
    return _gpu_shared_bytes(device.index) if device.type == "cuda" else None


@functools.cache
def _gpu_shared_bytes(index: int | None) -> int:
    import torch

    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def offer(work: DownWork) -> None:
    """Offer ``work`` to the next launch in this thread (and only to it)."""
    _offers.work = work


def _take_offer() -> DownWork | None:
    work = getattr(_offers, "work", None)
    _offers.work = None
    return work


def epilogue_rank(routes: int, max_rank: int, k: int) -> int | None:
    """Would a fused down launch be taken here now for a batch of ``routes`` routes (tokens x top-k), adapters up
    to ``max_rank`` and a down GEMM of K ``k``, and for the adapters up to which rank: ``max_rank`` (all), a lower
    rank (:data:`SPLIT_FROM_ROUTES`: the hook's expand adds the rest), or None (not taken). The launcher placed and
    on, no compilation; placed by ``=fast``, only where it is measured faster. Asked for every fast batch: a few
    reads while nothing placed it, as in every server."""
    if not PATCH.wanted:
        return None
    rank = _placed(routes, max_rank, k) if not _everywhere else min(max_rank, _split_rank or max_rank)
    if rank is None:
        return None
    import torch

    return rank if not torch.compiler.is_compiling() and PATCH.status().working else None  # Dynamo never reads the lock


def faster_from_routes(gpu: str) -> dict[int, tuple[tuple[int, int], ...]]:
    """:data:`FASTER_FROM_ROUTES` on ``gpu`` (a name as ``tuning`` knows it): its own rows
    (:data:`FASTER_FROM_ROUTES_ON`) in place of the shared ones at their K."""
    return {**FASTER_FROM_ROUTES, **FASTER_FROM_ROUTES_ON.get(gpu, {})}


def _placed(routes: int, max_rank: int, k: int) -> int | None:
    from .tuning import _gpu

    gpu = _gpu()
    rows = faster_from_routes(gpu).get(k, ())
    from_routes = next((n for rank, n in rows if max_rank <= rank), None)
    if from_routes is not None and routes >= from_routes:
        return max_rank
    rank, from_routes = SPLIT_FROM_ROUTES_ON.get(gpu, {}).get(k) or SPLIT_FROM_ROUTES.get(k, (max_rank, None))
    return rank if rank < max_rank and from_routes is not None and routes >= from_routes else None


def _make(original, engaged: Engaged):
    if not callable(original):
        logger.info("%s.%s not found; the LoRA down expand stays a hook", MODULE, NAME)
        return None
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        logger.info("cannot read the signature of %s; the LoRA down expand stays a hook", NAME)
        return None
    missing = [name for name in USED if name not in params]
    if missing:
        logger.info("%s takes no %s; the LoRA down expand stays a hook", NAME, ", ".join(missing))
        return None
    signature = inspect.signature(original)

    @functools.wraps(original)
    def invoke_fused_moe_kernel(*args, **kwargs):
        if fused_act.pending():  # a gate-up offer no activation took: finished into this launch's input first
            fused_act.finish(args[0] if args else kwargs.get("A"))
        work = _take_offer()
        if work is None or not engaged.on:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # SGLang raises its own error about the arguments
        bound.apply_defaults()
        changed = sorted(name for name, value in bound.arguments.items()
                         if name not in USED and name not in ANY_VALUE
                         and not _is_default(value, signature.parameters[name].default))
        reason = f"launcher arguments {changed} set" if changed else work.refusal(bound.arguments)
        if reason is None:
            try:
                work.run(bound.arguments)
                info_once("the down LoRA delta of fast batches is added in the down GEMM's epilogue")
                return None
            except Exception as error:  # nothing of C is served from a failed launch: SGLang's GEMM overwrites it
                # Once a shape: refusal() turns its later launches away before any of their work.
                first_line = (str(error).splitlines() or [""])[0][:200]
                _failed[work.key(bound.arguments)] = f"{type(error).__name__}: {first_line}"
                logger.exception("the fused LoRA down GEMM failed; SGLang's GEMM and the hook run instead, "
                                 "for this down GEMM's shape from now on")
                work.done = None
                reason = "the fused launch failed"
        info_once(f"a LoRA down GEMM runs unfused (the hook adds its delta): {reason}")
        return original(*args, **kwargs)

    return invoke_fused_moe_kernel


def _is_default(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


PATCH = Patch("fused LoRA down GEMM", MODULE, NAME, _make)


def activate(everywhere: bool = False, split_rank: int | None = None) -> None:
    """Place the fused down launch: for the batches where it is measured faster (``=fast`` does so), or with
    ``everywhere`` for every batch it covers (tests, benchmarks), the epilogue taking the adapters up to
    ``split_rank`` where given (the hook's expand the rest)."""
    global _everywhere, _split_rank
    _everywhere, _split_rank = everywhere, split_rank
    PATCH.activate()


def deactivate() -> None:
    global _everywhere, _split_rank
    _everywhere, _split_rank = False, None
    _failed.clear()
    PATCH.deactivate()
