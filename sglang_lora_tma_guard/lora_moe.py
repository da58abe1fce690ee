"""Multi-LoRA MoE deltas as virtual experts: one grouped shrink and one grouped expand per hook.

Each (token, route) pair of a batch belongs to one *virtual expert*: its adapter slot times the
experts in the LoRA buffers, plus its expert. Pairs are grouped by virtual expert into blocks of
``BLOCK_M`` rows (:func:`route`: one Triton program for small batches, three small kernels for larger
ones, no host sync), and each hook's delta is two
grouped GEMMs over those blocks (:func:`add_delta`):

- shrink: ``t[pair, :r] = x[pair] @ A[adapter, expert][:r].T`` (``x``: the token's hidden state for
  gate-up, the pair's activation for down);
- expand: ``out[pair] += (t[pair, :r] @ B[adapter, expert][:, :r].T) * routed weight (down only)``.

What makes it right where SGLang 0.5.11-0.5.22's ``merged_experts_fused_moe_lora_add`` is not: for a
gated MoE the gate-up A holds ``2 * max_rank`` rows (gate, then up) and B ``2 * I`` rows; the shrink
writes both halves' ranks and the expand's *gate* half reads the gate ranks and its *up* half the up
ranks (SGLang's path expands both halves from the gate ranks). What makes it fast: only an adapter's
true rank is computed (``lora_ranks``), blocks are grouped by virtual expert so each block reads one
adapter's weights for one expert once, and grids are sized from the batch (idle blocks exit at once).

No delta for: tokens of the base model (adapter ``-1``), disabled slots or slots of rank 0, routes
filtered out (expert ``-1``) and routes to experts the LoRA buffers do not hold (a fused shared
expert's id). Shared-outer adapters (``experts_shared_outer_loras``: one gate-up A and one down B per
adapter) read their one matrix for every expert (expert stride 0).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from .launching import launcher
from .moe_gemm import _granule, cdiv, rank_granule

ROUTE_BLOCK = 1024
"""Pairs (or keys, or rows) one routing program handles per step."""

KEY_BITS = 20
"""A block's entry holds its virtual expert in the low ``KEY_BITS`` bits and its adapter's rank above
them: the grouped GEMMs read both in one load, with no dependent load of the rank behind the key."""
MAX_KEYS = 1 << KEY_BITS
MAX_RANK = (1 << (31 - KEY_BITS)) - 1
_KEY_BITS = tl.constexpr(KEY_BITS)
_KEY_MASK = tl.constexpr(MAX_KEYS - 1)

# --------------------------------------------------------------------------------------------------
# Routing: pairs grouped by virtual expert (adapter * experts + expert), blocks of BLOCK_M rows.


@triton.jit
def _count_kernel(
    # Pointers. In: topk_ids (pairs,), token_lora (tokens,), enabled (slots,), ranks (slots,).
    topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr,
    # Out: counts (keys,) pairs per key; keys (pairs,) each pair's key with its rank above (KEY_BITS), -1: no
    # delta; slots (pairs,) its place among its key's pairs.
    counts_ptr, keys_ptr, slots_ptr,
    # Sizes.
    num_pairs, num_loras, num_experts,
    # Meta-parameters.
    TOPK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Each pair's virtual expert and its place among that expert's pairs (an atomic count)."""
    _count_step(tl.program_id(0) * BLOCK, topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, counts_ptr, keys_ptr,
                slots_ptr, num_pairs, num_loras, num_experts, TOPK, BLOCK)


@triton.jit
def _pairs(offs, in_range, topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, num_loras, lora_experts,
           TOPK: tl.constexpr):
    """The pairs ``offs``: their expert, adapter (0 where unknown), its rank and whether they get a delta."""
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    adapter = tl.load(token_lora_ptr + offs // TOPK, mask=in_range, other=-1).to(tl.int32)
    known = in_range & (adapter >= 0) & (adapter < num_loras)
    adapter = tl.where(known, adapter, 0)
    enabled = tl.load(enabled_ptr + adapter, mask=known, other=0) != 0  # adapter clamped to 0 where unknown
    rank = tl.load(ranks_ptr + adapter, mask=known, other=0)
    return expert, adapter, rank, known & enabled & (rank > 0) & (expert >= 0) & (expert < lora_experts)


@triton.jit
def _count_step(start, topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, counts_ptr, keys_ptr, slots_ptr,
                num_pairs, num_loras, num_experts, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    expert, adapter, rank, wanted = _pairs(offs, in_range, topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr,
                                           num_loras, num_experts, TOPK)
    key = tl.where(wanted, adapter * num_experts + expert, 0)
    slot = tl.atomic_add(counts_ptr + key, 1, mask=wanted)
    tl.store(keys_ptr + offs, tl.where(wanted, key | (rank << _KEY_BITS), -1), mask=in_range)
    tl.store(slots_ptr + offs, slot, mask=in_range)


@triton.jit
def _offsets_kernel(
    # Pointers. In: counts (keys,). Out: offsets (keys,) each key's first row; total (1,) rows in use;
    # sorted (rows,) every row marked empty.
    counts_ptr, offsets_ptr, total_ptr, sorted_ptr,
    # Sizes.
    num_keys, num_rows, num_pairs,
    # Meta-parameters.
    BLOCK_M: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_FILL: tl.constexpr,
):
    """One program: each key's first row (counts padded to BLOCK_M), the rows in use, and every row
    marked empty (``num_pairs``) before the pairs are scattered into them."""
    _offsets_steps(counts_ptr, offsets_ptr, total_ptr, sorted_ptr, num_keys, num_rows, num_pairs,
                   BLOCK_M, BLOCK_KEYS, BLOCK_FILL)


@triton.jit
def _offsets_steps(counts_ptr, offsets_ptr, total_ptr, sorted_ptr, num_keys, num_rows, num_pairs,
                   BLOCK_M: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_FILL: tl.constexpr):
    running = tl.full((), 0, tl.int32)
    for start in range(0, num_keys, BLOCK_KEYS):
        idx = start + tl.arange(0, BLOCK_KEYS)
        count = tl.load(counts_ptr + idx, mask=idx < num_keys, other=0)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(offsets_ptr + idx, running + tl.cumsum(padded, 0) - padded, mask=idx < num_keys)
        running += tl.sum(padded, 0)
    tl.store(total_ptr, running)
    for start in range(0, num_rows, BLOCK_FILL):
        idx = start + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ptr + idx, num_pairs, mask=idx < num_rows)


@triton.jit
def _scatter_kernel(
    # Pointers. In: keys, slots (pairs,), offsets (keys,). Out: sorted (rows,) the pair of each row;
    # block_key (rows / BLOCK_M,) the key of each block (with the rank bits the count stored).
    keys_ptr, slots_ptr, offsets_ptr,
    sorted_ptr, block_key_ptr,
    # Sizes.
    num_pairs,
    # Meta-parameters.
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):
    """Each pair into its row (its key's first row plus its place); each block's key."""
    _scatter_step(tl.program_id(0) * BLOCK, keys_ptr, slots_ptr, offsets_ptr, sorted_ptr, block_key_ptr, num_pairs,
                  BLOCK_M, BLOCK)


@triton.jit
def _scatter_step(start, keys_ptr, slots_ptr, offsets_ptr, sorted_ptr, block_key_ptr, num_pairs,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    entry = tl.load(keys_ptr + offs, mask=offs < num_pairs, other=-1)
    wanted = entry >= 0
    key = tl.where(wanted, entry & _KEY_MASK, 0)
    row = tl.load(offsets_ptr + key, mask=wanted, other=0) + tl.load(slots_ptr + offs, mask=wanted, other=0)
    tl.store(sorted_ptr + row, offs, mask=wanted)
    tl.store(block_key_ptr + row // BLOCK_M, entry, mask=wanted)  # the rank bits travel with the key


@triton.jit
def _route_one_program_kernel(
    # Pointers: the inputs of _count_kernel, then every buffer of the three steps.
    topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr,
    counts_ptr, keys_ptr, slots_ptr, offsets_ptr, total_ptr, sorted_ptr, block_key_ptr,
    # Sizes.
    num_pairs, num_loras, num_experts, num_keys, num_rows,
    # Meta-parameters.
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):
    """The three routing steps in one program, for small batches (one launch instead of four); the
    barriers make each step's global writes visible to the next within the program."""
    for start in range(0, num_keys, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        tl.store(counts_ptr + idx, tl.zeros((BLOCK,), tl.int32), mask=idx < num_keys)
    tl.debug_barrier()
    for start in range(0, num_pairs, BLOCK):
        _count_step(start, topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, counts_ptr, keys_ptr, slots_ptr,
                    num_pairs, num_loras, num_experts, TOPK, BLOCK)
    tl.debug_barrier()
    _offsets_steps(counts_ptr, offsets_ptr, total_ptr, sorted_ptr, num_keys, num_rows, num_pairs, BLOCK_M, BLOCK, BLOCK)
    tl.debug_barrier()
    for start in range(0, num_pairs, BLOCK):
        _scatter_step(start, keys_ptr, slots_ptr, offsets_ptr, sorted_ptr, block_key_ptr, num_pairs, BLOCK_M, BLOCK)


@triton.jit
def _route_in_registers_kernel(
    # Pointers: the inputs of _count_kernel; out: total (1,) rows in use, sorted (rows,), block_key.
    topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, total_ptr, sorted_ptr, block_key_ptr,
    # Sizes.
    num_pairs, num_loras, num_experts, num_rows,
    # Meta-parameters. PAIRS: a power of two, at least num_pairs.
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BLOCK_FILL: tl.constexpr,
):
    """The routing of a decode-sized batch in one program, with no count in memory: every pair's key is
    compared with every other's (PAIRS x PAIRS in registers), which gives its key's count, its place
    among that key's pairs (pair order) and its key's first row; then the rows are written once. The
    layout is the other routings': keys ascending, each key's rows padded to BLOCK_M."""
    offs = tl.arange(0, PAIRS)
    expert, adapter, rank, wanted = _pairs(offs, offs < num_pairs, topk_ids_ptr, token_lora_ptr, enabled_ptr,
                                           ranks_ptr, num_loras, num_experts, TOPK)
    key = tl.where(wanted, adapter * num_experts + expert, -1)  # -1: equal to no wanted pair's key
    same = (key[:, None] == key[None, :]) & wanted[:, None]     # [i, j]: j has i's key (i wanted)
    count = tl.sum(same.to(tl.int32), axis=1)
    place = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
    padded = tl.where(wanted & (place == 0), (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)  # once a key
    first_row = tl.sum(tl.where(key[None, :] < key[:, None], padded[None, :], 0), axis=1)
    tl.store(total_ptr, tl.sum(padded, 0))
    for start in range(0, num_rows, BLOCK_FILL):
        idx = start + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ptr + idx, num_pairs, mask=idx < num_rows)
    tl.debug_barrier()  # the fill visible before the pairs overwrite it
    row = first_row + place
    tl.store(sorted_ptr + row, offs, mask=wanted)
    tl.store(block_key_ptr + row // BLOCK_M, key | (rank << _KEY_BITS), mask=wanted)


@dataclass(frozen=True)
class Routing:
    """A batch's pairs grouped by virtual expert: ``sorted_ids[row]`` is a pair (``num_pairs``:
    empty row), ``block_key[block]`` its virtual expert (the low ``KEY_BITS``; above them, for
    :func:`route`'s blocks, its adapter's rank), ``rows_used`` (one int32 on the device) how many rows
    hold pairs; blocks at or past it exit at once."""

    sorted_ids: torch.Tensor
    block_key: torch.Tensor
    rows_used: torch.Tensor
    block_m: int
    num_pairs: int
    num_experts: int

    @property
    def max_blocks(self) -> int:
        return self.block_key.numel()


ONE_PROGRAM_PAIRS = 2048
"""Up to this many pairs (tokens x topk) the routing runs as one program (one launch instead of four)."""
REGISTER_PAIRS = 64
"""Up to this many pairs (8 tokens at top-8) that program keeps every count in registers, with no round trip
through memory: 2.3-4.4 µs less a hooked call at one token on the H200, the same at 8 tokens, 4 µs more at
16 (benchmarks/results/lora_moe/register-routing/)."""


def max_rows(num_pairs: int, num_keys: int, block_m: int) -> int:
    """Rows the grouping can need: each pair once, plus padding for each key in use (at most
    ``min(pairs, keys)`` of them), rounded to whole blocks."""
    rows = num_pairs + min(num_pairs, num_keys) * (block_m - 1)
    return cdiv(rows, block_m) * block_m


def route(topk_ids: torch.Tensor, token_lora: torch.Tensor, adapter_enabled: torch.Tensor,
          lora_ranks: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Group the batch's pairs by virtual expert (see the module docstring for who gets no delta).

    ``topk_ids``: (tokens, topk) int32 or int64; ``token_lora``: (tokens,) int32 slot of each token (-1:
    none); ``adapter_enabled``, ``lora_ranks``: (slots,) int32. All on one device.
    """
    tokens, topk = topk_ids.shape
    assert topk_ids.dim() == 2 and token_lora.shape == (tokens,), (topk_ids.shape, token_lora.shape)
    for name, t in (("token_lora", token_lora), ("adapter_enabled", adapter_enabled), ("lora_ranks", lora_ranks)):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.device == topk_ids.device, (name, t.dtype, t.device)
    assert lora_ranks.numel() * num_experts <= MAX_KEYS, (lora_ranks.numel(), num_experts)
    if torch.compiler.is_compiling():
        sorted_ids, block_key, rows_used = torch.ops.lora_tma_guard.route(topk_ids, token_lora, adapter_enabled,
                                                                           lora_ranks, num_experts, block_m)
        return Routing(sorted_ids, block_key, rows_used, block_m, tokens * topk, num_experts)
    return _route(topk_ids, token_lora, adapter_enabled, lora_ranks, num_experts, block_m)


@dataclass(frozen=True)
class _Scratch:
    """One routing's int32 buffers, views of one allocation."""

    counts: torch.Tensor
    keys: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor
    rows_used: torch.Tensor
    sorted_ids: torch.Tensor
    block_key: torch.Tensor

    @classmethod
    def of(cls, num_pairs: int, num_keys: int, block_m: int, device) -> _Scratch:
        rows = max_rows(num_pairs, num_keys, block_m)
        sizes = [num_keys, num_pairs, num_pairs, num_keys, 1, rows, rows // block_m]
        # Each view starts on 16 bytes whatever the batch: Triton specializes a kernel on its pointers'
        # alignment, so views at offsets that follow the pair count would make each change of it modulo 4
        # another variant of every kernel, compiled when first seen (in a server, while it serves).
        pieces = [m for n in sizes for m in (n, -n % 4)]  # each view, then the padding to 16 bytes
        flat = torch.empty(sum(pieces), dtype=torch.int32, device=device)
        return cls(*flat.split(pieces)[::2])

    def place(self, num_pairs: int, block_m: int) -> None:
        """After the count: each key's first row, then every pair into its row (two launches)."""
        num_keys, rows = self.counts.numel(), self.sorted_ids.numel()
        launcher(_offsets_kernel)[(1,)](
            self.counts, self.offsets, self.rows_used, self.sorted_ids, num_keys, rows, num_pairs,
            BLOCK_M=block_m, BLOCK_KEYS=ROUTE_BLOCK, BLOCK_FILL=ROUTE_BLOCK)
        launcher(_scatter_kernel)[(max(1, cdiv(num_pairs, ROUTE_BLOCK)),)](
            self.keys, self.slots, self.offsets, self.sorted_ids, self.block_key, num_pairs, BLOCK_M=block_m,
            BLOCK=ROUTE_BLOCK)

    def routing(self, block_m: int, num_pairs: int, num_experts: int) -> Routing:
        return Routing(self.sorted_ids, self.block_key, self.rows_used, block_m, num_pairs, num_experts)


def _route(topk_ids, token_lora, adapter_enabled, lora_ranks, num_experts: int, block_m: int) -> Routing:
    tokens, topk = topk_ids.shape
    num_pairs, num_loras = tokens * topk, lora_ranks.numel()
    num_keys = num_loras * num_experts
    b = _Scratch.of(num_pairs, num_keys, block_m, topk_ids.device)
    topk_ids = topk_ids.contiguous()
    if num_pairs <= REGISTER_PAIRS:
        launcher(_route_in_registers_kernel)[(1,)](
            topk_ids, token_lora, adapter_enabled, lora_ranks, b.rows_used, b.sorted_ids, b.block_key, num_pairs,
            num_loras, num_experts, b.sorted_ids.numel(),
            TOPK=topk, BLOCK_M=block_m, PAIRS=max(16, triton.next_power_of_2(num_pairs)), BLOCK_FILL=ROUTE_BLOCK)
        return b.routing(block_m, num_pairs, num_experts)
    if num_pairs <= ONE_PROGRAM_PAIRS:
        launcher(_route_one_program_kernel)[(1,)](
            topk_ids, token_lora, adapter_enabled, lora_ranks, b.counts, b.keys, b.slots, b.offsets, b.rows_used,
            b.sorted_ids, b.block_key, num_pairs, num_loras, num_experts, num_keys, b.sorted_ids.numel(),
            TOPK=topk, BLOCK_M=block_m, BLOCK=ROUTE_BLOCK)
        return b.routing(block_m, num_pairs, num_experts)
    b.counts.zero_()
    launcher(_count_kernel)[(max(1, cdiv(num_pairs, ROUTE_BLOCK)),)](
        topk_ids, token_lora, adapter_enabled, lora_ranks, b.counts, b.keys, b.slots, num_pairs, num_loras,
        num_experts, TOPK=topk, BLOCK=ROUTE_BLOCK)
    b.place(num_pairs, block_m)
    return b.routing(block_m, num_pairs, num_experts)


# --------------------------------------------------------------------------------------------------
# The two grouped GEMMs of one hook.


@triton.jit
def _block_entries(pid_m, block_key_ptr, sorted_ptr, rows_used_ptr, BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s key and pairs, and the rows in use, in one round trip to memory: the caller
    returns when the block is past the rows in use, and only then reads further (its key is then
    whatever the buffer holds). The grid is the routing's block count and the routing allocates whole
    blocks of rows, so every block has both entries (empty rows: ``num_pairs``)."""
    key = tl.load(block_key_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return key, pairs, tl.load(rows_used_ptr)


@triton.jit
def _unpack(entry, num_experts):
    """A block entry of :func:`route`: its adapter, expert and the adapter's rank."""
    key = entry & _KEY_MASK
    return key // num_experts, key % num_experts, entry >> _KEY_BITS


@triton.jit
def _shrink_kernel(
    # Pointers: x (rows of x, K); A (slots, experts or 1, halves * max_rank, K); t (pairs, halves * max_rank)
    # float32, out; the routing's sorted (rows,), block_key (blocks,), rows_used (1,).
    x_ptr, a_ptr, t_ptr,
    sorted_ptr, block_key_ptr, rows_used_ptr,
    # Sizes; rank_tiles: programs a block (max_rank / BLOCK_R, rounded up).
    num_pairs, K, num_experts, max_rank, rank_tiles,
    # Strides.
    stride_xm, stride_xk, stride_al, stride_ae, stride_ar, stride_ak, stride_tm,
    # Meta-parameters.
    PAIRS_PER_X: tl.constexpr,  # topk when x holds one row per token (gate-up), 1 for one per pair (down)
    GATED: tl.constexpr,  # both halves (gate ranks, up ranks) from one read of x
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``t[pair, half * max_rank + r] = sum_k x[pair's row, k] * A[adapter, expert, half * max_rank + r, k]``
    for the ranks r below the adapter's own; grid (blocks x rank tiles, split-K), a block's rank tiles side by side
    (its rows of x read from DRAM once for all of them, and its key's next block close behind)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    pid_m, pid_r = pid // rank_tiles, pid % rank_tiles
    key, pairs, used = _block_entries(pid_m, block_key_ptr, sorted_ptr, rows_used_ptr, BLOCK_M)
    if pid_m * BLOCK_M >= used:
        return
    adapter, expert, rank = _unpack(key, num_experts)
    r0 = pid_r * BLOCK_R
    if r0 >= rank:
        return  # past this adapter's true rank: nothing to compute

    pair_ok = pairs < num_pairs
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // PAIRS_PER_X)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = (a_ptr + adapter.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
              + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak)
    up_shift = max_rank * stride_ar  # the up half's ranks follow the gate half's

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        k_ok = offs_k < K - (k0 - pid_k * BLOCK_K)
        x = tl.load(x_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(x, a)
        if GATED:
            a_up = tl.load(a_ptrs + up_shift, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            acc_up += tl.dot(x, a_up)
        x_ptrs += SPLIT_K * BLOCK_K * stride_xk
        a_ptrs += SPLIT_K * BLOCK_K * stride_ak

    t_ptrs = t_ptr + pairs[:, None] * stride_tm + offs_r[None, :]
    t_mask = pair_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(t_ptrs, acc, mask=t_mask)
        if GATED:
            tl.store(t_ptrs + max_rank, acc_up, mask=t_mask)
    else:
        tl.atomic_add(t_ptrs, acc, mask=t_mask, sem="relaxed")
        if GATED:
            tl.atomic_add(t_ptrs + max_rank, acc_up, mask=t_mask, sem="relaxed")


@triton.jit
def _expand_kernel(
    # Pointers: t (pairs, halves * max_rank) float32; B (slots, experts or 1, halves * half_width, max_rank);
    # out (tokens, topk, halves * half_width), added into; weights (pairs,) routed weights (or unused);
    # the routing's sorted (rows,), block_key (blocks,), rows_used (1,).
    t_ptr, b_ptr, out_ptr, weights_ptr,
    sorted_ptr, block_key_ptr, rows_used_ptr,
    # Sizes; rank_above: blocks of adapters up to that rank add nothing (another kernel added theirs).
    num_pairs, half_width, num_experts, max_rank, rank_above,
    # Strides.
    stride_tm, stride_bl, stride_be, stride_bn, stride_br, stride_ot, stride_ok, stride_on,
    # Meta-parameters.
    TOPK: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    N_TILES: tl.constexpr,  # column tiles per program: the block's indices and ranks read once for all
    ONE_R_TILE: tl.constexpr,  # BLOCK_R >= max_rank: t read once, and the column loop is the pipelined one
    RANK_GRANULE: tl.constexpr,  # ranks loaded in aligned runs of this many (moe_gemm._granule)
):
    """``out[pair, half * half_width + n] += sum_r t[pair, half * max_rank + r] * B[adapter, expert, half *
    half_width + n, r]`` (times the routed weight where asked); grid (blocks, halves * column-tile groups)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    key, pairs, used = _block_entries(pid_m, block_key_ptr, sorted_ptr, rows_used_ptr, BLOCK_M)
    if pid_m * BLOCK_M >= used:
        return
    adapter, expert, rank = _unpack(key, num_experts)
    if rank <= rank_above:
        return
    tiles = tl.cdiv(half_width, BLOCK_N)
    groups = tl.cdiv(tiles, N_TILES)
    half = pid_n // groups  # gate (0) or up (1) half of a gated gate-up; always 0 otherwise

    pair_ok = pairs < num_pairs
    offs_r = tl.arange(0, BLOCK_R)
    if MUL_ROUTED_WEIGHT:
        routed = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    b_base = b_ptr + adapter.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    o_rows = out_ptr + (pairs // TOPK)[:, None] * stride_ot + (pairs % TOPK)[:, None] * stride_ok

    if ONE_R_TILE:
        # Every rank in one tile: this block's t once; the column loop below then has no inner loop, and
        # Triton software-pipelines it (the next tile's B and output in flight while this one is added).
        r_ok = offs_r < rank
        r_load = offs_r < _granule(rank, RANK_GRANULE)
        t = tl.load(t_ptr + pairs[:, None] * stride_tm + (half * max_rank + offs_r)[None, :],
                    mask=pair_ok[:, None] & r_load[None, :], other=0.0)
        t = tl.where(r_ok[None, :], t, 0.0).to(b_ptr.dtype.element_ty)
    for j in range(N_TILES):
        tile = (pid_n % groups) * N_TILES + j
        offs_n = half * half_width + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < (half + 1) * half_width) & (tile < tiles)  # the last group may hold fewer tiles
        o_ptrs = o_rows + offs_n[None, :] * stride_on
        o_mask = pair_ok[:, None] & n_ok[None, :]
        old = tl.load(o_ptrs, mask=o_mask, other=0.0)  # first: in flight while B arrives and is multiplied
        b_ptrs = b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br
        if ONE_R_TILE:
            b = tl.load(b_ptrs, mask=r_load[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(t, tl.where(r_ok[:, None], b, 0.0))
        else:
            t_ptrs = t_ptr + pairs[:, None] * stride_tm + (half * max_rank + offs_r)[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):  # this half's own ranks, up to the adapter's true rank
                r_ok = offs_r < rank - r0
                r_load = offs_r < _granule(rank - r0, RANK_GRANULE)
                t = tl.load(t_ptrs, mask=pair_ok[:, None] & r_load[None, :], other=0.0)  # again per tile: cached
                b = tl.load(b_ptrs, mask=r_load[:, None] & n_ok[None, :], other=0.0)
                acc += tl.dot(tl.where(r_ok[None, :], t, 0.0).to(b.dtype), tl.where(r_ok[:, None], b, 0.0))
                t_ptrs += BLOCK_R
                b_ptrs += BLOCK_R * stride_br
        if MUL_ROUTED_WEIGHT:
            acc *= routed[:, None]
        tl.store(o_ptrs, (old.to(tl.float32) + acc).to(old.dtype), mask=o_mask)


@triton.jit
def _hook_kernel(
    # Pointers: x (rows of x, K); A (slots, experts or 1, halves * max_rank, K); B (slots, experts or 1,
    # halves * half_width, max_rank); out (tokens, topk, halves * half_width), added into; weights (pairs,)
    # routed weights (or unused); the routing's sorted (rows,), block_key (blocks,), rows_used (1,).
    x_ptr, a_ptr, b_ptr, out_ptr, weights_ptr,
    sorted_ptr, block_key_ptr, rows_used_ptr,
    # Sizes.
    num_pairs, K, half_width, num_experts, max_rank,
    # Strides.
    stride_xm, stride_xk, stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br, stride_ot, stride_ok, stride_on,
    # Meta-parameters.
    PAIRS_PER_X: tl.constexpr, TOPK: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    N_TILES: tl.constexpr, RANK_GRANULE: tl.constexpr,
):
    """Both GEMMs of one hook in one program: the block's ranks of its half (``BLOCK_R >= max_rank``)
    over all of K, kept in registers, then added through ``N_TILES`` column tiles of that half; grid
    (blocks, halves * column-tile groups). One launch a hook instead of two, and no float32 round
    trip of the ranks; each column group computes its block's ranks again."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    key, pairs, used = _block_entries(pid_m, block_key_ptr, sorted_ptr, rows_used_ptr, BLOCK_M)
    if pid_m * BLOCK_M >= used:
        return
    adapter, expert, rank = _unpack(key, num_experts)
    tiles = tl.cdiv(half_width, BLOCK_N)
    groups = tl.cdiv(tiles, N_TILES)
    half = pid_n // groups

    pair_ok = pairs < num_pairs
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    r_load = offs_r < _granule(rank, RANK_GRANULE)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // PAIRS_PER_X)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = (a_ptr + adapter.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
              + (half * max_rank + offs_r)[None, :] * stride_ar + offs_k[:, None] * stride_ak)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        t += tl.dot(x, tl.load(a_ptrs, mask=k_ok[:, None] & r_load[None, :], other=0.0))
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    t = tl.where(r_ok[None, :], t, 0.0).to(b_ptr.dtype.element_ty)  # as the expand reads the shrink's ranks

    if MUL_ROUTED_WEIGHT:
        routed = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    b_base = b_ptr + adapter.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    o_rows = out_ptr + (pairs // TOPK)[:, None] * stride_ot + (pairs % TOPK)[:, None] * stride_ok
    for j in range(N_TILES):
        tile = (pid_n % groups) * N_TILES + j
        offs_n = half * half_width + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < (half + 1) * half_width) & (tile < tiles)
        o_ptrs = o_rows + offs_n[None, :] * stride_on
        o_mask = pair_ok[:, None] & n_ok[None, :]
        old = tl.load(o_ptrs, mask=o_mask, other=0.0)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                    mask=r_load[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(t, tl.where(r_ok[:, None], b, 0.0))
        if MUL_ROUTED_WEIGHT:
            acc *= routed[:, None]
        tl.store(o_ptrs, (old.to(tl.float32) + acc).to(old.dtype), mask=o_mask)


@triton.jit
def _rank_tiles(t_ptrs, pair_ok, offs_r, rank, max_rank, RANK_GRANULE: tl.constexpr, dtype: tl.constexpr):
    """A block's gate and up ranks of ``t`` (float32) from ``t_ptrs`` on, up to ``rank``, in ``dtype``."""
    r_ok = offs_r < rank
    mask = pair_ok[:, None] & (offs_r < _granule(rank, RANK_GRANULE))[None, :]
    t_gate = tl.where(r_ok[None, :], tl.load(t_ptrs, mask=mask, other=0.0), 0.0).to(dtype)
    t_up = tl.where(r_ok[None, :], tl.load(t_ptrs + max_rank, mask=mask, other=0.0), 0.0).to(dtype)
    return t_gate, t_up


@triton.jit
def _add_rank_tile(gate, up, t_gate, t_up, b_base, offs_n, n_ok, offs_r, rank, half_width, stride_bn,
                   RANK_GRANULE: tl.constexpr):
    """``gate`` and ``up`` (float32) plus the rank tile's deltas: B's gate rows ``offs_n``, its up rows
    ``half_width + offs_n``."""
    r_ok = offs_r < rank
    b_mask = (offs_r < _granule(rank, RANK_GRANULE))[:, None] & n_ok[None, :]
    b_gate = tl.load(b_base + offs_n[None, :] * stride_bn, mask=b_mask, other=0.0)
    b_up = tl.load(b_base + (half_width + offs_n)[None, :] * stride_bn, mask=b_mask, other=0.0)
    return (gate + tl.dot(t_gate, tl.where(r_ok[:, None], b_gate, 0.0)),
            up + tl.dot(t_up, tl.where(r_ok[:, None], b_up, 0.0)))


@triton.jit
def _delta_in(gate, up, t_rows, pair_ok, rank, max_rank, b_rows, stride_br, offs_n, n_ok, half_width, stride_bn,
              R: tl.constexpr, RANK_GRANULE: tl.constexpr):
    """``gate`` and ``up`` plus the deltas of the block's first ``rank`` ranks, at most ``R``, in one tile of ``R``
    (``t_rows``: each pair's row of ``t`` from the first; ``b_rows``: the block's B, row 0 at the first)."""
    offs_r = tl.arange(0, R)
    t_gate, t_up = _rank_tiles(t_rows[:, None] + offs_r[None, :], pair_ok, offs_r, rank, max_rank, RANK_GRANULE,
                               b_rows.dtype.element_ty)
    return _add_rank_tile(gate, up, t_gate, t_up, b_rows + offs_r[:, None] * stride_br, offs_n, n_ok, offs_r, rank,
                          half_width, stride_bn, RANK_GRANULE)


@triton.jit
def _halves(row_ptrs, row_ok, offs_n, n_ok, half_width):
    """The gate and up columns ``offs_n`` of the rows at ``row_ptrs`` (pointers to each row's first element), in
    float32 (zero off ``row_ok`` x ``n_ok``)."""
    mask = row_ok[:, None] & n_ok[None, :]
    ptrs = row_ptrs[:, None] + offs_n[None, :]
    return (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32),
            tl.load(ptrs + half_width, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _act_kernel(
    # Pointers: t (pairs, 2 * max_rank) float32 gate-up ranks; B (slots, experts or 1, 2 * half_width, max_rank);
    # gate_up (pairs, 2 * half_width) the gate-up GEMM's rows, read only; out (pairs, half_width); the routing's
    # sorted (rows,), block_key (blocks,), rows_used (1,); topk_ids (pairs,), token_lora (tokens,), enabled
    # (slots,), ranks (slots,): which pairs the routing holds.
    t_ptr, b_ptr, gate_up_ptr, out_ptr,
    sorted_ptr, block_key_ptr, rows_used_ptr,
    topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr,
    # Sizes.
    num_pairs, half_width, num_experts, num_loras, max_rank, lora_blocks, row_programs, groups,
    # Strides.
    stride_tm, stride_bl, stride_be, stride_bn, stride_br, stride_gm, stride_om,
    # Meta-parameters.
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    N_TILES: tl.constexpr, RANK_GRANULE: tl.constexpr,
    ONE_R_TILE: tl.constexpr,  # BLOCK_R >= max_rank; else each block's ranks in tiles of BLOCK_R, up to its own
    BLOCK_MAJOR: tl.constexpr,  # a block's column groups are neighbouring programs; else a group's blocks are
    PREFETCH: tl.constexpr,  # the first column tile's rows loaded before the ranks, each next one before the one
    # before it is computed and stored
    ROWS_ONLY: tl.constexpr = False,  # benchmarks only: no delta (the rows' traffic in the routing's order alone)
):
    """``out[pair, n] = silu(gate + dgate) * (up + dup)``, ``gate = gate_up[pair, n]``, ``up = gate_up[pair,
    half_width + n]``, each delta ``t[pair, half's ranks] @ B[adapter, expert, half's row n]`` (zero for a pair the
    routing does not hold). The gate-up expand and SGLang's ``silu_and_mul`` in one pass: the gate-up rows are
    read once and never written back, and the deltas are added in float32 before the activation. One axis of
    ``row_programs * groups`` programs: ``row_programs`` (the routing's ``lora_blocks`` blocks, then one for each
    ``BLOCK_M`` pairs without a delta) by ``groups`` column-tile groups of the half width; ``BLOCK_MAJOR`` orders
    it block by block (the programs that read one block's ranks of ``t`` run together, the later ones from L2),
    else group by group."""
    pid = tl.program_id(0)
    if BLOCK_MAJOR:
        pid_m, pid_n = pid // groups, pid % groups
    else:
        pid_m, pid_n = pid % row_programs, pid // row_programs
    first = pid_n * N_TILES * BLOCK_N
    if pid_m < lora_blocks:
        key, pairs, used = _block_entries(pid_m, block_key_ptr, sorted_ptr, rows_used_ptr, BLOCK_M)
        if pid_m * BLOCK_M >= used:
            return
        adapter, expert, rank = _unpack(key, num_experts)
        pair_ok = pairs < num_pairs
        offs_r = tl.arange(0, BLOCK_R)
        t_rows = t_ptr + pairs * stride_tm
        t_ptrs = t_rows[:, None] + offs_r[None, :]
        b_block = b_ptr + adapter.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
        b_base = b_block + offs_r[:, None] * stride_br
        row_ptrs = gate_up_ptr + pairs * stride_gm
        last = tl.minimum(half_width, first + N_TILES * BLOCK_N)
        if PREFETCH:  # the first tile's rows asked for before the ranks
            offs_n = first + tl.arange(0, BLOCK_N)
            gate_next, up_next = _halves(row_ptrs, pair_ok, offs_n, offs_n < last, half_width)
        if ONE_R_TILE and not ROWS_ONLY:  # every rank in one tile: the block's ranks read once
            t_gate, t_up = _rank_tiles(t_ptrs, pair_ok, offs_r, rank, max_rank, RANK_GRANULE, b_ptr.dtype.element_ty)
        for j in range(N_TILES):
            offs_n = first + j * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < half_width
            mask = pair_ok[:, None] & n_ok[None, :]
            if PREFETCH:
                gate, up = gate_next, up_next
                gate_next, up_next = _halves(row_ptrs, pair_ok, offs_n + BLOCK_N, offs_n + BLOCK_N < last, half_width)
            else:
                gate, up = _halves(row_ptrs, pair_ok, offs_n, n_ok, half_width)
            if ROWS_ONLY:
                pass
            elif ONE_R_TILE:
                gate, up = _add_rank_tile(gate, up, t_gate, t_up, b_base, offs_n, n_ok, offs_r, rank, half_width,
                                          stride_bn, RANK_GRANULE)
            else:  # the block's own ranks, a tile at a time: a rank-8 block in a buffer of 64 does one
                for r0 in range(0, rank, BLOCK_R):
                    gate, up = _delta_in(gate, up, t_rows + r0, pair_ok, rank - r0, max_rank, b_block + r0 * stride_br,
                                         stride_br, offs_n, n_ok, half_width, stride_bn, BLOCK_R, RANK_GRANULE)
            tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :],
                     (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        rows = (pid_m - lora_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = rows < num_pairs
        _, _, _, held = _pairs(rows, in_range, topk_ids_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, num_loras,
                               num_experts, TOPK)
        row_ok = in_range & ~held  # the routing's pairs are the blocks' programs'
        row_ptrs = gate_up_ptr + rows.to(tl.int64) * stride_gm
        last = tl.minimum(half_width, first + N_TILES * BLOCK_N)
        if PREFETCH:
            offs_n = first + tl.arange(0, BLOCK_N)
            gate_next, up_next = _halves(row_ptrs, row_ok, offs_n, offs_n < last, half_width)
        for j in range(N_TILES):
            offs_n = first + j * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (offs_n < half_width)[None, :]
            if PREFETCH:
                gate, up = gate_next, up_next
                gate_next, up_next = _halves(row_ptrs, row_ok, offs_n + BLOCK_N, offs_n + BLOCK_N < last, half_width)
            else:
                gate, up = _halves(row_ptrs, row_ok, offs_n, offs_n < half_width, half_width)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                     (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class StageConfig:
    """Tiles of one hook's two GEMMs (``BLOCK_M`` is the routing's)."""

    shrink_block_r: int = 16
    shrink_block_k: int = 128
    split_k: int = 1
    shrink_warps: int = 4
    shrink_stages: int = 3
    expand_block_n: int = 64
    expand_block_r: int = 16
    expand_warps: int = 4
    expand_stages: int = 2
    expand_n_tiles: int = 1
    """Column tiles each expand program adds (the block's routing read once for all of them)."""
    one_kernel: bool = False
    """Both GEMMs in one launch (:func:`_hook_kernel`: the shrink's ``shrink_block_k`` and
    ``shrink_stages``, the expand's column tiles and warps, every rank in one tile)."""


_STAGE_FIELDS = tuple(f.name for f in fields(StageConfig))


def _expert_stride(w: torch.Tensor) -> int:
    """Shared-outer weights hold one matrix per adapter for every expert: stride 0 reads it for each."""
    return 0 if w.shape[1] == 1 else w.stride(1)


def add_delta(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              routing: Routing, *, max_rank: int, halves: int,
              topk_weights: torch.Tensor | None = None, config: StageConfig | None = None) -> None:
    """``out[t, j] += delta`` for every pair the routing holds, in place.

    ``out``: (tokens, topk, halves * half_width), route-major; ``x``: (tokens, K) for gate-up (one row
    per token) or (tokens * topk, K) for down (one row per pair); ``lora_a``: (slots, experts or 1,
    halves * max_rank, K); ``lora_b``: (slots, experts or 1, halves * half_width, max_rank);
    ``topk_weights``: scale each pair's delta by its routed weight (the down hook).
    """
    tokens, topk, width = out.shape
    num_pairs = tokens * topk
    assert num_pairs == routing.num_pairs, (out.shape, routing.num_pairs)
    assert x.dim() == 2 and x.shape[0] in (tokens, num_pairs), (x.shape, out.shape)
    assert lora_a.shape[2] == halves * max_rank and lora_a.shape[3] == x.shape[1], (lora_a.shape, x.shape)
    assert lora_b.shape[2] == width and lora_b.shape[3] == max_rank and width % halves == 0, (lora_b.shape, out.shape)
    assert x.dtype == lora_a.dtype == lora_b.dtype == out.dtype, (x.dtype, lora_a.dtype, lora_b.dtype, out.dtype)
    if num_pairs == 0 or max_rank == 0:
        return
    assert max_rank <= MAX_RANK, max_rank  # ranks ride above the key bits of the routing's block entries
    config = config or StageConfig()
    if torch.compiler.is_compiling():
        torch.ops.lora_tma_guard.add_delta(out, x, lora_a, lora_b, routing.sorted_ids, routing.block_key,
                                           routing.rows_used, topk_weights, max_rank, halves,
                                           routing.block_m, routing.num_experts, [int(getattr(config, f)) for f in _STAGE_FIELDS])
        return
    if config.one_kernel:
        one_kernel(out, x, lora_a, lora_b, routing, max_rank=max_rank, halves=halves, topk_weights=topk_weights,
                   config=config)
        return
    t = shrink(x, lora_a, routing, topk=topk, max_rank=max_rank, halves=halves, config=config)
    expand(out, t, lora_b, routing, max_rank=max_rank, halves=halves, topk_weights=topk_weights,
           config=config)


def one_kernel(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, routing: Routing, *,
               max_rank: int, halves: int, topk_weights: torch.Tensor | None, config: StageConfig) -> None:
    """Both GEMMs of :func:`add_delta` in one launch (``config.one_kernel``)."""
    c, (_, topk, width) = config, out.shape
    half_width = width // halves
    weights = topk_weights.reshape(-1) if topk_weights is not None else x
    groups = cdiv(cdiv(half_width, c.expand_block_n), c.expand_n_tiles)
    launcher(_hook_kernel)[(routing.max_blocks, halves * groups)](
        x, lora_a, lora_b, out, weights, routing.sorted_ids, routing.block_key, routing.rows_used,
        routing.num_pairs, x.shape[1], half_width, routing.num_experts, max_rank,
        x.stride(0), x.stride(1), lora_a.stride(0), _expert_stride(lora_a), lora_a.stride(2), lora_a.stride(3),
        lora_b.stride(0), _expert_stride(lora_b), lora_b.stride(2), lora_b.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        PAIRS_PER_X=topk if x.shape[0] != routing.num_pairs else 1, TOPK=topk,
        MUL_ROUTED_WEIGHT=topk_weights is not None, BLOCK_M=routing.block_m,
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)), BLOCK_K=c.shrink_block_k, BLOCK_N=c.expand_block_n,
        N_TILES=c.expand_n_tiles, RANK_GRANULE=rank_granule(max_rank),
        num_warps=c.expand_warps, num_stages=c.shrink_stages,
    )


def shrink(x: torch.Tensor, lora_a: torch.Tensor, routing: Routing, *, topk: int,
           max_rank: int, halves: int, config: StageConfig) -> torch.Tensor:
    """The first GEMM: each pair's ranks (float32, ``(pairs, halves * max_rank)``; only each
    adapter's true ranks are written)."""
    c, num_pairs = config, routing.num_pairs
    pairs_per_x = topk if x.shape[0] != num_pairs else 1
    alloc = torch.zeros if c.split_k > 1 else torch.empty
    t = alloc(num_pairs, halves * max_rank, dtype=torch.float32, device=x.device)
    rank_tiles = cdiv(max_rank, c.shrink_block_r)
    launcher(_shrink_kernel)[(routing.max_blocks * rank_tiles, c.split_k)](
        x, lora_a, t, routing.sorted_ids, routing.block_key, routing.rows_used,
        num_pairs, x.shape[1], routing.num_experts, max_rank, rank_tiles,
        x.stride(0), x.stride(1), lora_a.stride(0), _expert_stride(lora_a), lora_a.stride(2), lora_a.stride(3),
        t.stride(0),
        PAIRS_PER_X=pairs_per_x, GATED=halves == 2, SPLIT_K=c.split_k,
        BLOCK_M=routing.block_m, BLOCK_R=c.shrink_block_r, BLOCK_K=c.shrink_block_k,
        num_warps=c.shrink_warps, num_stages=c.shrink_stages,
    )
    return t


def expand(out: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, routing: Routing, *,
           max_rank: int, halves: int, topk_weights: torch.Tensor | None, config: StageConfig,
           rank_above: int = 0) -> None:
    """The second GEMM, added into ``out`` (each half from its own ranks); with ``rank_above``, only for the
    adapters of a higher rank (the fused down launch's epilogue added the others')."""
    c = config
    half_width = out.shape[2] // halves
    weights = topk_weights.reshape(-1) if topk_weights is not None else t
    groups = cdiv(cdiv(half_width, c.expand_block_n), c.expand_n_tiles)
    launcher(_expand_kernel)[(routing.max_blocks, halves * groups)](
        t, lora_b, out, weights, routing.sorted_ids, routing.block_key, routing.rows_used,
        routing.num_pairs, half_width, routing.num_experts, max_rank, rank_above,
        t.stride(0), lora_b.stride(0), _expert_stride(lora_b), lora_b.stride(2), lora_b.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        TOPK=out.shape[1], MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=routing.block_m, BLOCK_N=c.expand_block_n, BLOCK_R=c.expand_block_r, N_TILES=c.expand_n_tiles,
        ONE_R_TILE=c.expand_block_r >= max_rank, RANK_GRANULE=rank_granule(max_rank),
        num_warps=c.expand_warps, num_stages=c.expand_stages,
    )


def expand_silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor,
                        routing: Routing, *, topk_ids: torch.Tensor, token_lora: torch.Tensor, enabled: torch.Tensor,
                        ranks: torch.Tensor, max_rank: int, tile: dict) -> None:
    """``out = silu(gate) * up`` of ``gate_up`` (pairs, 2 * half_width: the gate half, then the up half) with the
    gate-up delta added first (each half from its own ranks of ``t``, the gate-up shrink's), for every pair: the
    gate-up expand of a gated MoE and SGLang's ``silu_and_mul`` in one kernel. ``gate_up`` is only read. ``tile``:
    ``BLOCK_N``, ``N_TILES`` (column tiles a program), ``num_warps``, ``num_stages``, and ``BLOCK_R`` (ranks a
    tile; by default every rank in one), and switches, off unless given: ``BLOCK_MAJOR`` (a block's column groups as
    neighbouring programs, else a group's blocks), ``PREFETCH`` (each column tile's rows asked for a tile ahead, the
    first before the ranks), ``ROWS_ONLY`` (benchmarks: the delta left out)
    (:func:`~sglang_lora_tma_guard.fused_act.tile`)."""
    num_pairs = routing.num_pairs
    half_width = gate_up.shape[1] // 2
    assert gate_up.dim() == 2 and gate_up.shape[0] == num_pairs and gate_up.stride(1) == 1, gate_up.shape
    assert out.shape == (num_pairs, half_width) and out.stride(1) == 1, (out.shape, gate_up.shape)
    assert lora_b.shape[2] == 2 * half_width and lora_b.shape[3] == max_rank, (lora_b.shape, gate_up.shape)
    assert t.shape == (num_pairs, 2 * max_rank), (t.shape, max_rank)
    assert 0 < max_rank <= MAX_RANK, max_rank
    if num_pairs == 0:
        return
    topk = num_pairs // token_lora.shape[0]
    block_r = tile.get("BLOCK_R") or max(16, triton.next_power_of_2(max_rank))
    groups = cdiv(cdiv(half_width, tile["BLOCK_N"]), tile["N_TILES"])
    row_programs = routing.max_blocks + cdiv(num_pairs, routing.block_m)
    launcher(_act_kernel)[(row_programs * groups,)](
        t, lora_b, gate_up, out, routing.sorted_ids, routing.block_key, routing.rows_used,
        topk_ids, token_lora, enabled, ranks,
        num_pairs, half_width, routing.num_experts, ranks.numel(), max_rank, routing.max_blocks, row_programs, groups,
        t.stride(0), lora_b.stride(0), _expert_stride(lora_b), lora_b.stride(2), lora_b.stride(3),
        gate_up.stride(0), out.stride(0),
        TOPK=topk, BLOCK_M=routing.block_m, BLOCK_N=tile["BLOCK_N"], BLOCK_R=block_r, N_TILES=tile["N_TILES"],
        RANK_GRANULE=rank_granule(max_rank), ONE_R_TILE=block_r >= max_rank, BLOCK_MAJOR=bool(tile.get("BLOCK_MAJOR")),
        PREFETCH=bool(tile.get("PREFETCH")), ROWS_ONLY=bool(tile.get("ROWS_ONLY")), num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )


# --------------------------------------------------------------------------------------------------
# Under torch.compile both entry points are custom ops, opaque to Dynamo (which would otherwise trace
# into the Triton launches, and cannot through the CPU interpreter); eager callers skip the dispatch.


@torch.library.custom_op("lora_tma_guard::route", mutates_args=())
def _route_op(topk_ids: torch.Tensor, token_lora: torch.Tensor, adapter_enabled: torch.Tensor,
              lora_ranks: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    routing = _route(topk_ids, token_lora, adapter_enabled, lora_ranks, num_experts, block_m)
    # A custom op's outputs may not alias each other: the routing's three are views of one buffer.
    return routing.sorted_ids.clone(), routing.block_key.clone(), routing.rows_used.clone()


@_route_op.register_fake
def _(topk_ids, token_lora, adapter_enabled, lora_ranks, num_experts, block_m):
    rows = max_rows(topk_ids.numel(), lora_ranks.numel() * num_experts, block_m)
    return (topk_ids.new_empty(rows, dtype=torch.int32), topk_ids.new_empty(rows // block_m, dtype=torch.int32),
            topk_ids.new_empty(1, dtype=torch.int32))


@torch.library.custom_op("lora_tma_guard::add_delta", mutates_args=("out",))
def _add_delta_op(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  sorted_ids: torch.Tensor, block_key: torch.Tensor, rows_used: torch.Tensor,
                  topk_weights: torch.Tensor | None, max_rank: int, halves: int,
                  block_m: int, num_experts: int, config: list[int]) -> None:
    routing = Routing(sorted_ids, block_key, rows_used, block_m, out.shape[0] * out.shape[1], num_experts)
    add_delta(out, x, lora_a, lora_b, routing, max_rank=max_rank, halves=halves,
              topk_weights=topk_weights, config=StageConfig(*config))


@_add_delta_op.register_fake
def _(out, x, lora_a, lora_b, sorted_ids, block_key, rows_used, topk_weights, max_rank, halves,
      block_m, num_experts, config):
    return None
