"""This package's route-major expert GEMM, and the per-group fp8 quantization of its input.

One expert GEMM over SGLang's own expert-sorted route list (``sorted_token_ids`` / ``expert_ids``,
blocks of ``BLOCK_M`` routes of one expert), each result row stored at its route index: the layout
SGLang's LoRA hooks index. Used by the fallback sequence (:mod:`~sglang_lora_tma_guard.fallback`)
and by the fused LoRA launch (:mod:`~sglang_lora_tma_guard.fused_lora`), which adds each route's
LoRA expand in the epilogue::

    C[route, n] = routed weight * (sum_k A[route's row, k] * W[expert, n, k]
                                   + sum_r t[route, r] * B[adapter, expert, n, r])

where ``t`` holds the route's LoRA ranks (the shrink, computed before the launch), ``adapter`` is the
route's token's slot and ``r`` runs to that adapter's true rank. Rows of one block may belong to
several adapters: the epilogue adds one small GEMM per adapter present in the block, its rows
selected, the others zero (no delta for the base model's tokens, disabled slots, slots of rank 0,
or experts the LoRA buffers do not hold, such as a fused shared expert).

With block-wise fp8 weights the GEMM input is quantized per row and 128-wide K group, as SGLang
quantizes it (scale = max(|x|) / 448), and one K tile is one quantization group. Expert id -1
(filtered out under expert parallelism) gives zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launching import launcher

FP8_MAX = 448.0
QUANT_EPS = 1e-10
QUANTIZE_ROWS = 16
"""Rows of one K group each program of :func:`quantize_per_group` quantizes."""
WIDE_K_TILES = 8
"""The most K tiles :func:`_moe_gemm_wide_kernel` unrolls."""

# The fp8 quantization of GEMM inputs, as SGLang does it: scale = max(|x|, QUANT_EPS) / FP8_MAX.
_FP8_MAX = tl.constexpr(FP8_MAX)
_QUANT_EPS = tl.constexpr(QUANT_EPS)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` on the host: Triton 3.8's is a ``ConstexprFunction``, 3 us a call from Python here;
    the launchers of this module, ``fallback`` and ``lora_moe`` run it several times a MoE call."""
    return -(-a // b)


@triton.jit
def _moe_gemm_kernel(
    # Pointers. A (rows, K): the GEMM's input, one row per token (gate-up) or per route (down);
    # A_SCALE (rows, K / BLOCK_K) fp32 with FP8; B (E, N, K): the experts' weights; C (R, N): the
    # route-major output, R = tokens * topk; BIAS (E, N); B_SCALE (E, N / SCALE_BLOCK_N, K / BLOCK_K)
    # fp32 with FP8; TOPK_WEIGHTS (R,); SGLang's route list: SORTED_IDS (S,) route ids padded with R,
    # EXPERT_IDS (S / BLOCK_M,) one expert (or -1) per block, NUM_POST_PADDED (1,) the blocks used.
    a_ptr, a_scale_ptr, b_ptr, c_ptr, bias_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    # With B_TMA: a tensor descriptor of B, tiles [1, BLOCK_N, BLOCK_K] (else unused).
    b_desc,
    # With LORA: T (R, halves * max_rank) float32 ranks; LORA_B (slots, experts or 1, N, max_rank);
    # TOKEN_LORA (tokens,) each token's slot, -1: none; ENABLED, RANKS (slots,) int32.
    # With SHRINK (not with LORA): T is written, the routes' ranks; LORA_A (slots, experts or 1, W, K), W the
    # ranks of both halves (halves * max_rank).
    t_ptr, lora_b_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, lora_a_ptr,
    # Sizes: N, K of the weights; R routes; S entries of the padded route list; with LORA the slots,
    # the experts the LoRA buffers hold, the columns of one half (N, or N / 2 for a gated gate-up) and
    # the rank stride between halves in T; with SHRINK the slots, those experts, W and the rank stride.
    N, K, num_routes, num_sorted, num_slots, lora_experts, half_width, max_rank, shrink_width,
    # Strides, in elements.
    stride_am, stride_ak, stride_asm, stride_ask, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_bias_e, stride_bias_n, stride_se, stride_sn, stride_sk,
    stride_tm, stride_ll, stride_le, stride_ln, stride_lr, stride_al, stride_ae, stride_ar, stride_ak_lora,
    # Meta-parameters: routes that share one A row (topk for gate-up, 1 for down); routes per token
    # (topk); the fp8 scale block along N; the tile (BLOCK_M = the route list's block size; with FP8,
    # BLOCK_K = one K quantization group; BLOCK_R >= max_rank); GROUP_M, the L2 swizzle of output tiles.
    ROUTES_PER_A_ROW: tl.constexpr, TOPK: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, LORA: tl.constexpr,
    B_TMA: tl.constexpr,
    RANK_GRANULE: tl.constexpr,  # with LORA: ranks loaded in aligned runs of this many (see _granule)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: the K loop's loads need no K mask
    SHRINK: tl.constexpr,  # a 16-bit GEMM's A rows also shrunk by the LoRA A of each row's adapter, into T
    SHRINK_R: tl.constexpr,  # with SHRINK: the ranks (of W) column tile pid_n computes, from pid_n * SHRINK_R
):
    """C[route, n] = sum_k A[route // ROUTES_PER_A_ROW, k] * B[expert(route), n, k], route-major,
    plus the route's LoRA expand with LORA (before the bias and the routed weight).

    With FP8, A holds fp8 values quantized per row and K group, their scales in A_SCALE. With SHRINK (16-bit A) the
    programs of the first column tiles also write T[route, j] = sum_k A[route's row, k] * LORA_A[adapter, expert, j, k]
    for their SHRINK_R columns j of W, each route's own ranks only (j % max_rank below its adapter's rank): the A
    tiles the K loop loads for the GEMM are the ones the shrink reads.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_sorted, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: neighbouring programs share an expert's weight columns in L2.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_rows)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows
    # The grid covers the largest possible route list; this batch may use fewer blocks.
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    routes = tl.load(sorted_ids_ptr + offs_m, mask=offs_m < num_sorted, other=num_routes).to(tl.int64)
    route_ok = routes < num_routes
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        tl.store(c_ptr + routes[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=route_ok[:, None] & n_ok[None, :])
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_rows = routes // ROUTES_PER_A_ROW
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    # Columns past N read a valid column's weights (their results are never stored): no N mask on B.
    b_cols = offs_n % N
    b_ptrs = b_ptr + expert * stride_be + b_cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    if FP8:
        s_ptrs = _scale_ptrs(b_scale_ptr, expert, pid_n, b_cols, stride_se, stride_sn, SCALE_BLOCK_N, BLOCK_N)
        as_ptrs = a_scale_ptr + a_rows * stride_asm
    else:
        s_ptrs, as_ptrs = b_ptrs, a_ptrs  # unread
    if LORA:
        # Rows of any adapters. Every load of the epilogue is issued here, so that the K loop hides its chain
        # of round trips (slot, rank, then ranks and B tiles); the B tiles of the block's lowest and highest
        # adapter among its rows: all of them where each expert's rows come ordered by adapter, two at most
        # then (:func:`_lora_rest` adds any others after the loop).
        slot, wanted, ranks_t, first, first_rank, last, last_rank = _lora_rows(
            routes, route_ok, expert, pid_n * BLOCK_N, t_ptr, token_lora_ptr, enabled_ptr, ranks_ptr, num_slots,
            lora_experts, half_width, max_rank, stride_tm, TOPK, BLOCK_R, RANK_GRANULE, lora_b_ptr.dtype.element_ty)
        first_b, last_b = _lora_end_tiles(lora_b_ptr, first, first_rank, last, last_rank, expert, offs_n, n_ok,
                                          stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R, RANK_GRANULE)
    if SHRINK:
        # This program's share of the ranks (none past W; a program past it shrinks nothing: its adapters none),
        # each row's adapter, the block's lowest and highest, and LORA_A at the expert.
        offs_j = pid_n * SHRINK_R + tl.arange(0, SHRINK_R)
        s_slot, s_wanted, s_rank, s_first, s_first_rank, s_last, s_last_rank = _lora_slots(
            routes, route_ok & (pid_n * SHRINK_R < shrink_width), expert, token_lora_ptr, enabled_ptr, ranks_ptr,
            num_slots, lora_experts, TOPK)
        # LORA_A at the expert (a scalar base per adapter) and one tile of offsets: pointer tiles held across the K
        # loop would take the registers the GEMM's tiles need.
        la_expert = lora_a_ptr + expert * stride_ae
        la_offs = offs_j[None, :] * stride_ar + offs_k[:, None] * stride_ak_lora
        first_la = la_expert + tl.cast(tl.where(s_first < num_slots, s_first, 0), tl.int64) * stride_al
        last_la = la_expert + tl.cast(tl.where(s_last >= 0, s_last, 0), tl.int64) * stride_al
        first_j = _rank_columns(offs_j, shrink_width, max_rank, s_first_rank)
        last_j = _rank_columns(offs_j, shrink_width, max_rank, s_last_rank)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SHRINK:
        # Every row against the block's lowest and highest adapter's tiles (the A tile as the GEMM's dot has it, no
        # copy of it masked by rows); each row keeps its own adapter's after the loop. One K loop for each case, the
        # program's own taken: a dot on zeros would still cost the tensor cores its time.
        t_first = tl.zeros((BLOCK_M, SHRINK_R), dtype=tl.float32)
        t_last = tl.zeros((BLOCK_M, SHRINK_R), dtype=tl.float32)
        if s_last_rank > 0:
            acc, t_first, t_last = _k_loop(acc, t_first, t_last, a_ptrs, b_ptrs, b_desc, as_ptrs, s_ptrs, route_ok,
                                           offs_k, expert, pid_n * BLOCK_N, K, stride_ak, stride_bk, stride_ask,
                                           stride_sk, first_la, last_la, la_offs, first_j, last_j, stride_ak_lora,
                                           BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K, SCALE_BLOCK_N % BLOCK_N == 0, 2)
        elif s_first_rank > 0:
            acc, t_first, t_last = _k_loop(acc, t_first, t_last, a_ptrs, b_ptrs, b_desc, as_ptrs, s_ptrs, route_ok,
                                           offs_k, expert, pid_n * BLOCK_N, K, stride_ak, stride_bk, stride_ask,
                                           stride_sk, first_la, last_la, la_offs, first_j, last_j, stride_ak_lora,
                                           BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K, SCALE_BLOCK_N % BLOCK_N == 0, 1)
        else:
            acc, t_first, t_last = _k_loop(acc, t_first, t_last, a_ptrs, b_ptrs, b_desc, as_ptrs, s_ptrs, route_ok,
                                           offs_k, expert, pid_n * BLOCK_N, K, stride_ak, stride_bk, stride_ask,
                                           stride_sk, first_la, last_la, la_offs, first_j, last_j, stride_ak_lora,
                                           BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K, SCALE_BLOCK_N % BLOCK_N == 0, 0)
    else:
        for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
            acc = _k_step(acc, a_ptrs, b_ptrs, b_desc, as_ptrs + k_tile * stride_ask, s_ptrs + k_tile * stride_sk,
                          route_ok, offs_k, expert, pid_n * BLOCK_N, k_tile * BLOCK_K, K, BLOCK_N, BLOCK_K, FP8, B_TMA,
                          EVEN_K, SCALE_BLOCK_N % BLOCK_N == 0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    if LORA:
        acc = _lora_add(acc, slot, wanted, ranks_t, first, first_b, last, last_b, expert, offs_n, n_ok, lora_b_ptr,
                        ranks_ptr, num_slots, stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R, RANK_GRANULE)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n * stride_bias_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + routes, mask=route_ok, other=0.0)
        acc *= weight.to(tl.float32)[:, None]
    # The output's addresses only now: held across the K loop they would take registers the tiles need.
    tl.store(c_ptr + routes[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=route_ok[:, None] & n_ok[None, :])
    if SHRINK:  # after the GEMM's store: its accumulator no longer holds registers
        t_rest = tl.zeros((BLOCK_M, SHRINK_R), dtype=tl.float32)
        if s_last > s_first + 1:  # adapters between (rows not ordered by adapter): their own K loop
            t_rest = _shrink_rest(t_rest, a_ptrs, la_expert + la_offs, offs_k, K, offs_j, shrink_width, max_rank,
                                  s_slot, s_wanted, s_first, s_last, ranks_ptr, stride_ak, stride_al, stride_ak_lora,
                                  BLOCK_K)
        acc_t = tl.where((s_slot == s_first)[:, None], t_first, tl.where((s_slot == s_last)[:, None], t_last, t_rest))
        tl.store(t_ptr + routes[:, None] * stride_tm + offs_j[None, :], acc_t,
                 mask=s_wanted[:, None] & ((offs_j % max_rank)[None, :] < s_rank[:, None])
                 & (offs_j < shrink_width)[None, :])


@triton.jit
def _moe_gemm_wide_kernel(
    # As _moe_gemm_kernel's, less the bias; one A row per route.
    a_ptr, a_scale_ptr, b_ptr, c_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    b_desc,
    t_ptr, lora_b_ptr, token_lora_ptr, enabled_ptr, ranks_ptr,
    N, K, num_routes, num_sorted, num_slots, lora_experts, max_rank,
    stride_am, stride_ak, stride_asm, stride_ask, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_se, stride_sn, stride_sk,
    stride_tm, stride_ll, stride_le, stride_ln, stride_lr,
    TOPK: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    K_TILES: tl.constexpr,  # cdiv(K, BLOCK_K): the K loop unrolled, so that the column loop is the pipelined one
    N_TILES: tl.constexpr,  # column tiles a program computes, the block's rows, scales and ranks read once for all
    FP8: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, LORA: tl.constexpr, B_TMA: tl.constexpr,
    RANK_GRANULE: tl.constexpr, EVEN_K: tl.constexpr,
    K_LOOP: tl.constexpr = 0,  # 1: the K steps a loop, the one pipelined, a stage one K tile (for a long K)
    LORA_AHEAD: tl.constexpr = 0,  # 1: a column tile's B tiles loaded before its K steps; 3: and their GEMMs
    # unconditional, so that Triton pipelines them with the column loop
    A_ONCE: tl.constexpr = 0,  # 1 (two K tiles, unrolled): the block's A tiles read once for all its column tiles
    RANKS_IN_GRANULES: tl.constexpr = 0,  # 1: every adapter's rank a multiple of RANK_GRANULE (_lora_b_tile)
):
    """``_moe_gemm_kernel``'s GEMM for a short K (a down GEMM: K is one shard's intermediate width), one block
    of routes against ``N_TILES`` column tiles; grid (blocks, column-tile groups). With K of a few tiles a
    program of one output tile is mostly its prologue (the block's routes, expert, scales, and with LORA the
    rows' adapters and ranks) and its store; here the prologue is paid once for ``N_TILES`` tiles, and the
    next tile's weights are in flight while one is stored."""
    pid_m, pid_g = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    routes = tl.load(sorted_ids_ptr + offs_m, mask=offs_m < num_sorted, other=num_routes).to(tl.int64)
    route_ok = routes < num_routes
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    first_tile = pid_g * N_TILES
    if expert == -1:
        for j in range(N_TILES):
            offs_n = (first_tile + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(c_ptr + routes[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty),
                     mask=route_ok[:, None] & (offs_n < N)[None, :])
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + routes[:, None] * stride_am + offs_k[None, :] * stride_ak
    if FP8:
        as_ptrs = a_scale_ptr + routes * stride_asm
    if MUL_ROUTED_WEIGHT:
        routed = tl.load(topk_weights_ptr + routes, mask=route_ok, other=0.0).to(tl.float32)
    if LORA:
        slot, wanted, rank, first, first_rank, last, last_rank = _lora_slots(
            routes, route_ok, expert, token_lora_ptr, enabled_ptr, ranks_ptr, num_slots, lora_experts, TOPK)
        # The block's ranks once for all its column tiles (read again per tile they would be a gather of
        # scattered rows each time); the B tiles per column tile.
        ranks_t = _lora_ranks(t_ptr, routes, wanted, rank, 0, stride_tm, BLOCK_R, RANK_GRANULE,
                              lora_b_ptr.dtype.element_ty)
    if not FP8:
        as_ptrs = a_ptrs
    if not MUL_ROUTED_WEIGHT:
        routed = route_ok
    if not LORA:
        slot, wanted, ranks_t, first, first_rank, last, last_rank = route_ok, route_ok, route_ok, 0, 0, 0, 0
    if A_ONCE:  # else each column tile's K steps copy them again (from L2), a pipeline stage each
        tl.static_assert(K_TILES == 2 and not K_LOOP, "A_ONCE holds two unrolled K tiles")
        a0 = _a_tile(a_ptrs, route_ok, offs_k, 0, K, EVEN_K)
        a1 = _a_tile(a_ptrs + BLOCK_K * stride_ak, route_ok, offs_k, BLOCK_K, K, EVEN_K)
        if FP8:
            s0 = tl.load(as_ptrs, mask=route_ok, other=0.0)
            s1 = tl.load(as_ptrs + stride_ask, mask=route_ok, other=0.0)
        else:
            s0, s1 = route_ok, route_ok  # unread
    else:
        a0, s0, a1, s1 = route_ok, route_ok, route_ok, route_ok  # unread
    # One column loop, the LoRA epilogue inside it (its B tiles per column tile; a block whose rows hold
    # adapters between its lowest and highest loops over them too). Measured on an H200 at rank 16 this
    # beats a loop split in two by that case and an epilogue in chunks of ranks.
    for j in range(N_TILES):
        _wide_tile(first_tile + j, routes, route_ok, expert, a_ptrs, as_ptrs, a0, s0, a1, s1, routed, offs_k, b_ptr,
                   b_desc, c_ptr, b_scale_ptr, lora_b_ptr, ranks_ptr, slot, wanted, ranks_t, first, first_rank, last,
                   last_rank, num_slots, N, K, stride_ak, stride_ask, stride_be, stride_bn, stride_bk, stride_cm,
                   stride_cn, stride_se, stride_sn, stride_sk, stride_ll, stride_le, stride_ln, stride_lr,
                   SCALE_BLOCK_N, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, K_TILES, FP8, MUL_ROUTED_WEIGHT, LORA, B_TMA,
                   RANK_GRANULE, EVEN_K, K_LOOP, LORA_AHEAD, A_ONCE, RANKS_IN_GRANULES)


@triton.jit
def _wide_tile(tile, routes, route_ok, expert, a_ptrs, as_ptrs, a0, s0, a1, s1, routed, offs_k, b_ptr, b_desc, c_ptr,
               b_scale_ptr, lora_b_ptr, ranks_ptr, slot, wanted, ranks_t, first, first_rank, last, last_rank, num_slots,
               N, K, stride_ak, stride_ask, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_se, stride_sn,
               stride_sk, stride_ll, stride_le, stride_ln, stride_lr,
               SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_R: tl.constexpr, K_TILES: tl.constexpr, FP8: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
               LORA: tl.constexpr, B_TMA: tl.constexpr, RANK_GRANULE: tl.constexpr, EVEN_K: tl.constexpr,
               K_LOOP: tl.constexpr, LORA_AHEAD: tl.constexpr, A_ONCE: tl.constexpr, RANKS_IN_GRANULES: tl.constexpr):
    """Output tile ``tile`` of :func:`_moe_gemm_wide_kernel`'s block, computed and stored. The same K steps in
    the same order either way: unrolled (``K_LOOP`` 0; the column loop is then the one Triton pipelines, each stage
    holding every K tile) or a loop (the one pipelined, a stage one K tile). With ``LORA_AHEAD`` the epilogue's B tiles
    are loaded before the K steps, in flight while the K steps' copies are waited for, and added after them in the
    same order (:func:`_lora_add`; 3: :func:`_lora_add_always`, whose B tiles Triton copies a column tile ahead);
    else each just before its GEMM (:func:`_lora_add_late`)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_cols = offs_n % N  # columns past N read a valid column's weights, never stored
    b_ptrs = b_ptr + expert * stride_be + b_cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    if FP8:
        s_ptrs = _scale_ptrs(b_scale_ptr, expert, tile, b_cols, stride_se, stride_sn, SCALE_BLOCK_N, BLOCK_N)
    else:
        s_ptrs = b_ptrs  # unread
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if LORA and LORA_AHEAD:
        first_b, last_b = _lora_end_tiles(lora_b_ptr, first, first_rank, last, last_rank, expert, offs_n, n_ok,
                                          stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R, RANK_GRANULE,
                                          RANKS_IN_GRANULES)
    if K_LOOP:
        for kt in range(K_TILES):
            acc = _k_step(acc, a_ptrs + kt * BLOCK_K * stride_ak, b_ptrs + kt * BLOCK_K * stride_bk, b_desc,
                          as_ptrs + kt * stride_ask, s_ptrs + kt * stride_sk, route_ok, offs_k, expert,
                          tile * BLOCK_N, kt * BLOCK_K, K, BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K,
                          SCALE_BLOCK_N % BLOCK_N == 0)
    elif A_ONCE:  # the block's two A tiles and their row scales as the kernel read them
        acc = _k_step_given_a(acc, a0, s0, b_ptrs, b_desc, s_ptrs, offs_k, expert, tile * BLOCK_N, 0, K, BLOCK_N,
                              BLOCK_K, FP8, B_TMA, EVEN_K, SCALE_BLOCK_N % BLOCK_N == 0)
        acc = _k_step_given_a(acc, a1, s1, b_ptrs + BLOCK_K * stride_bk, b_desc, s_ptrs + stride_sk, offs_k, expert,
                              tile * BLOCK_N, BLOCK_K, K, BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K,
                              SCALE_BLOCK_N % BLOCK_N == 0)
    else:
        for kt in tl.static_range(K_TILES):
            acc = _k_step(acc, a_ptrs + kt * BLOCK_K * stride_ak, b_ptrs + kt * BLOCK_K * stride_bk, b_desc,
                          as_ptrs + kt * stride_ask, s_ptrs + kt * stride_sk, route_ok, offs_k, expert,
                          tile * BLOCK_N, kt * BLOCK_K, K, BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K,
                          SCALE_BLOCK_N % BLOCK_N == 0)
    if LORA and LORA_AHEAD == 3:
        acc = _lora_add_always(acc, slot, wanted, ranks_t, first, first_b, last, last_b, expert, offs_n, n_ok,
                               lora_b_ptr, ranks_ptr, stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R, RANK_GRANULE)
    elif LORA and LORA_AHEAD:
        acc = _lora_add(acc, slot, wanted, ranks_t, first, first_b, last, last_b, expert, offs_n, n_ok, lora_b_ptr,
                        ranks_ptr, num_slots, stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R, RANK_GRANULE)
    elif LORA:
        acc = _lora_add_late(acc, slot, wanted, ranks_t, first, first_rank, last, last_rank, expert, offs_n, n_ok,
                             lora_b_ptr, ranks_ptr, num_slots, stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R,
                             RANK_GRANULE, RANKS_IN_GRANULES)
    if MUL_ROUTED_WEIGHT:
        acc *= routed[:, None]
    tl.store(c_ptr + routes[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=route_ok[:, None] & n_ok[None, :])


@triton.jit
def _granule(limit, GRANULE: tl.constexpr):
    """``limit`` (a rank, or a block's ranks) rounded up to a multiple of ``GRANULE``, and said to be one:
    under ``offs_r < _granule(rank, G)`` Triton knows the mask constant over aligned runs of ``G`` ranks, so
    a load along a contiguous rank axis is a vector load. Under ``offs_r < rank``, a rank read from memory,
    it is one load per element (32 16-bit loads a thread for a 64 x 128 tile of LoRA B). The caller zeroes
    what it loads from the true rank on with ``tl.where``: a buffer's columns past an adapter's rank hold
    whatever they hold. The rounded rank never passes the row: the host passes a ``GRANULE`` that divides
    ``max_rank`` (:func:`rank_granule`)."""
    return tl.multiple_of((limit + GRANULE - 1) // GRANULE * GRANULE, GRANULE)


def rank_granule(max_rank: int) -> int:
    """The run of ranks :func:`_granule` rounds to: 16 bytes of bf16 where every adapter's row of
    ``max_rank`` ranks allows it, else 1 (exact masks, element loads)."""
    return 8 if max_rank % 8 == 0 else 1


@triton.jit
def _lora_b_base(lora_b_ptr, adapter, expert, stride_ll, stride_le):
    return lora_b_ptr + tl.cast(adapter, tl.int64) * stride_ll + expert * stride_le


@triton.jit
def _k_step(acc, a_ptrs, b_ptrs, b_desc, as_ptrs, s_ptrs, route_ok, offs_k, expert, first_n, k0, K,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, B_TMA: tl.constexpr,
            EVEN_K: tl.constexpr, ONE_SCALE: tl.constexpr):
    """``acc`` plus the K tile from ``k0`` (one quantization group of A and of B with FP8): the block's A rows,
    the weight tile (through ``b_desc`` with B_TMA, which fills what lies past N or K with zeros; else from
    ``b_ptrs``, whose columns past N read a valid column), the pointers all at that tile."""
    acc, _ = _k_step_a(acc, a_ptrs, b_ptrs, b_desc, as_ptrs, s_ptrs, route_ok, offs_k, expert, first_n, k0, K,
                       BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K, ONE_SCALE)
    return acc


@triton.jit
def _k_step_a(acc, a_ptrs, b_ptrs, b_desc, as_ptrs, s_ptrs, route_ok, offs_k, expert, first_n, k0, K,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, B_TMA: tl.constexpr,
              EVEN_K: tl.constexpr, ONE_SCALE: tl.constexpr):
    """:func:`_k_step`, and the A tile it loaded (zero past K and in rows of no route)."""
    a = _a_tile(a_ptrs, route_ok, offs_k, k0, K, EVEN_K)
    b = _b_tile(b_ptrs, b_desc, offs_k, expert, first_n, k0, K, BLOCK_N, BLOCK_K, B_TMA, EVEN_K)
    if FP8:
        acc = _scaled_dot(acc, a, b, tl.load(as_ptrs, mask=route_ok, other=0.0), s_ptrs, ONE_SCALE)
    else:
        acc = tl.dot(a, b, acc=acc)
    return acc, a


@triton.jit
def _a_tile(a_ptrs, route_ok, offs_k, k0, K, EVEN_K: tl.constexpr):
    """The block's A tile from ``k0``: zero past K and in rows of no route."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=route_ok[:, None], other=0.0)
    else:
        a = tl.load(a_ptrs, mask=route_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
    return a


@triton.jit
def _k_step_given_a(acc, a, a_scale, b_ptrs, b_desc, s_ptrs, offs_k, expert, first_n, k0, K, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, FP8: tl.constexpr, B_TMA: tl.constexpr, EVEN_K: tl.constexpr,
                    ONE_SCALE: tl.constexpr):
    """:func:`_k_step` with the A tile (:func:`_a_tile`) and its row scales already read."""
    b = _b_tile(b_ptrs, b_desc, offs_k, expert, first_n, k0, K, BLOCK_N, BLOCK_K, B_TMA, EVEN_K)
    if FP8:
        acc = _scaled_dot(acc, a, b, a_scale, s_ptrs, ONE_SCALE)
    else:
        acc = tl.dot(a, b, acc=acc)
    return acc


@triton.jit
def _b_tile(b_ptrs, b_desc, offs_k, expert, first_n, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            B_TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight tile from ``k0`` (through ``b_desc`` with B_TMA, which fills what lies past N or K with zeros;
    else from ``b_ptrs``, zero past K)."""
    if B_TMA:
        b = b_desc.load([expert.to(tl.int32), first_n, k0]).reshape(BLOCK_N, BLOCK_K).T
    elif EVEN_K:
        b = tl.load(b_ptrs)
    else:
        b = tl.load(b_ptrs, mask=(offs_k < K - k0)[:, None], other=0.0)
    return b


@triton.jit
def _k_loop(acc, t_first, t_last, a_ptrs, b_ptrs, b_desc, as_ptrs, s_ptrs, route_ok, offs_k, expert, first_n, K,
            stride_ak, stride_bk, stride_ask, stride_sk, first_la, last_la, la_offs, first_j, last_j, stride_ak_lora,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, B_TMA: tl.constexpr, EVEN_K: tl.constexpr,
            ONE_SCALE: tl.constexpr, SHRINK_DOTS: tl.constexpr):
    """:func:`_moe_gemm_kernel`'s K loop; with ``SHRINK_DOTS`` 1 or 2, each A tile also against the block's lowest
    (and highest) adapter's LORA_A tile, into ``t_first`` (``t_last``)."""
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = k_tile * BLOCK_K
        acc, x = _k_step_a(acc, a_ptrs, b_ptrs, b_desc, as_ptrs + k_tile * stride_ask, s_ptrs + k_tile * stride_sk,
                           route_ok, offs_k, expert, first_n, k0, K, BLOCK_N, BLOCK_K, FP8, B_TMA, EVEN_K, ONE_SCALE)
        if SHRINK_DOTS >= 1:
            k_ok = offs_k < K - k0
            t_first = _shrink_dot(t_first, x, first_la + k0 * stride_ak_lora + la_offs, k_ok, first_j, EVEN_K)
            if SHRINK_DOTS == 2:
                t_last = _shrink_dot(t_last, x, last_la + k0 * stride_ak_lora + la_offs, k_ok, last_j, EVEN_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, t_first, t_last


@triton.jit
def _rank_columns(offs_j, shrink_width, max_rank, rank):
    """Which of the shrink's columns ``offs_j`` (of W: the gate ranks, then the up ranks) an adapter of ``rank``
    has."""
    return (offs_j < shrink_width) & (offs_j % max_rank < rank)


@triton.jit
def _shrink_dot(acc_t, x, la_ptrs, k_ok, columns, EVEN_K: tl.constexpr):
    """``acc_t`` plus the A tile ``x`` against one adapter's LORA_A tile (its ``columns`` only)."""
    if EVEN_K:
        la = tl.load(la_ptrs, mask=columns[None, :], other=0.0)
    else:
        la = tl.load(la_ptrs, mask=k_ok[:, None] & columns[None, :], other=0.0)
    return tl.dot(x, la, acc=acc_t)


@triton.jit
def _shrink_rest(acc_t, a_ptrs, la_ptrs, offs_k, K, offs_j, shrink_width, max_rank, slot, wanted, first, last,
                 ranks_ptr, stride_ak, stride_al, stride_ak_lora, BLOCK_K: tl.constexpr):
    """``acc_t`` plus the shrink of the rows of the adapters strictly between the block's lowest and highest, each
    present one over the whole K (the A rows read again): a block whose rows do not come ordered by adapter."""
    for s in range(first + 1, last):
        mine = wanted & (slot == s)
        if tl.max(mine.to(tl.int32), 0) > 0:  # this adapter has rows in the block
            columns = _rank_columns(offs_j, shrink_width, max_rank, tl.load(ranks_ptr + s))
            for k0 in range(0, K, BLOCK_K):
                k_ok = offs_k < K - k0
                x = tl.load(a_ptrs + k0 * stride_ak, mask=mine[:, None] & k_ok[None, :], other=0.0)
                la = tl.load(la_ptrs + tl.cast(s, tl.int64) * stride_al + k0 * stride_ak_lora,
                             mask=k_ok[:, None] & columns[None, :], other=0.0)
                acc_t = tl.dot(x, la, acc=acc_t)
    return acc_t


@triton.jit
def _scale_ptrs(b_scale_ptr, expert, tile, b_cols, stride_se, stride_sn, SCALE_BLOCK_N: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The weight scales of column tile ``tile`` in K group 0: one scale where the tile lies in one scale
    block, else one per column."""
    if SCALE_BLOCK_N % BLOCK_N == 0:  # one return for both: Triton types every return it compiles
        ptrs = b_scale_ptr + expert * stride_se + (tile * BLOCK_N // SCALE_BLOCK_N) * stride_sn
    else:
        ptrs = b_scale_ptr + expert * stride_se + (b_cols // SCALE_BLOCK_N) * stride_sn
    return ptrs


@triton.jit
def _scaled_dot(acc, a, b, a_scale, s_ptrs, ONE_SCALE: tl.constexpr):
    """``acc`` plus one K group's fp8 ``a @ b``, scaled by A's row scales and B's scales (:func:`_scale_ptrs`)."""
    if ONE_SCALE:
        acc += tl.dot(a, b) * (a_scale * tl.load(s_ptrs))[:, None]
    else:
        acc += tl.dot(a, b) * a_scale[:, None] * tl.load(s_ptrs)[None, :]
    return acc


@triton.jit
def _lora_b_tile(lora_b_ptr, adapter, rank, expert, offs_n, n_ok, stride_ll, stride_le, stride_ln, stride_lr,
                 BLOCK_R: tl.constexpr, RANK_GRANULE: tl.constexpr, IN_GRANULES: tl.constexpr = 0):
    """Adapter ``adapter``'s B tile (its ranks x the tile's columns), zero from its ``rank`` on; ranks all past
    ``rank`` read nothing. ``IN_GRANULES``: the caller knows ``rank`` a multiple of ``RANK_GRANULE``, so the load's
    mask is already the rank's and the tile is the load as it lands (in shared memory, where a GEMM takes it; the
    ``tl.where`` would take it through registers and back)."""
    offs_r = tl.arange(0, BLOCK_R)
    b = tl.load(_lora_b_base(lora_b_ptr, adapter, expert, stride_ll, stride_le) + offs_n[None, :] * stride_ln
                + offs_r[:, None] * stride_lr,
                mask=(offs_r[:, None] < _granule(rank, RANK_GRANULE)) & n_ok[None, :], other=0.0)
    if IN_GRANULES:
        return b
    return tl.where(offs_r[:, None] < rank, b, 0.0)


@triton.jit
def _lora_end_tiles(lora_b_ptr, first, first_rank, last, last_rank, expert, offs_n, n_ok, stride_ll, stride_le,
                    stride_ln, stride_lr, BLOCK_R: tl.constexpr, RANK_GRANULE: tl.constexpr,
                    IN_GRANULES: tl.constexpr = 0):
    """The B tiles of a block's lowest and highest adapter (:func:`_lora_slots`); one of rank 0 reads nothing."""
    first_b = _lora_b_tile(lora_b_ptr, tl.where(first_rank > 0, first, 0), first_rank, expert, offs_n, n_ok,
                           stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R, RANK_GRANULE, IN_GRANULES)
    last_b = _lora_b_tile(lora_b_ptr, tl.where(last_rank > 0, last, 0), last_rank, expert, offs_n, n_ok,
                          stride_ll, stride_le, stride_ln, stride_lr, BLOCK_R, RANK_GRANULE, IN_GRANULES)
    return first_b, last_b


@triton.jit
def _lora_rows(routes, route_ok, expert, first_n, t_ptr, token_lora_ptr, enabled_ptr, ranks_ptr,
               num_slots, lora_experts, half_width, max_rank, stride_tm,
               TOPK: tl.constexpr, BLOCK_R: tl.constexpr, RANK_GRANULE: tl.constexpr, B_DTYPE: tl.constexpr):
    """What the epilogue over SGLang's blocks reads of a block's rows: each row's slot, whether it has a delta
    here and its ranks (the half of column ``first_n``); the lowest and the highest slot among those rows
    (``num_slots`` and -1 if none) and their ranks (the highest's 0 unless it is another adapter)."""
    slot, wanted, rank, first, first_rank, last, last_rank = _lora_slots(
        routes, route_ok, expert, token_lora_ptr, enabled_ptr, ranks_ptr, num_slots, lora_experts, TOPK)
    t = _lora_ranks(t_ptr, routes, wanted, rank, first_n // half_width * max_rank, stride_tm, BLOCK_R, RANK_GRANULE,
                    B_DTYPE)
    return slot, wanted, t, first, first_rank, last, last_rank


@triton.jit
def _lora_slots(routes, route_ok, expert, token_lora_ptr, enabled_ptr, ranks_ptr, num_slots, lora_experts,
                TOPK: tl.constexpr):
    """Each row's slot, whether it has a delta here and its adapter's rank; the lowest and the highest slot
    among the rows with a delta (``num_slots`` and -1 if none) and their ranks (the highest's 0 unless it is
    another adapter)."""
    slot = tl.load(token_lora_ptr + routes // TOPK, mask=route_ok, other=-1)
    known = route_ok & (slot >= 0) & (slot < num_slots) & (expert < lora_experts)
    slot = tl.where(known, slot, 0)
    rank = tl.load(ranks_ptr + slot, mask=known, other=0)
    wanted = known & (tl.load(enabled_ptr + slot, mask=known, other=0) != 0) & (rank > 0)
    first = tl.min(tl.where(wanted, slot, num_slots), 0)
    last = tl.max(tl.where(wanted, slot, -1), 0)
    first_rank = tl.max(tl.where(wanted & (slot == first), rank, 0), 0)
    last_rank = tl.max(tl.where(wanted & (slot == last) & (last > first), rank, 0), 0)
    return slot, wanted, rank, first, first_rank, last, last_rank


@triton.jit
def _lora_ranks(t_ptr, routes, wanted, rank, first_column, stride_tm, BLOCK_R: tl.constexpr,
                RANK_GRANULE: tl.constexpr, DTYPE: tl.constexpr):
    """The rows' ranks of ``t`` (from column ``first_column``: a half's), each row's own ranks only, in
    ``DTYPE``: the shrink writes no others (and the buffer is not cleared)."""
    offs_r = tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + routes[:, None] * stride_tm + (first_column + offs_r)[None, :],
                mask=wanted[:, None] & (offs_r[None, :] < _granule(rank, RANK_GRANULE)[:, None]), other=0.0)
    return tl.where(offs_r[None, :] < rank[:, None], t, 0.0).to(DTYPE)


@triton.jit
def _lora_add(acc, slot, wanted, t, first, first_b, last, last_b, expert, offs_n, n_ok, b_ptr, ranks_ptr,
              num_slots, stride_bl, stride_be, stride_bn, stride_br, BLOCK_R: tl.constexpr,
              RANK_GRANULE: tl.constexpr):
    """``acc[row] += t[row] @ B[row's adapter, expert, tile columns].T``: the lowest adapter's rows from
    ``first_b``, the highest's from ``last_b``, any between from their own B tiles (:func:`_lora_rest`)."""
    if first < num_slots:  # a row with a delta
        acc += tl.dot(tl.where((wanted & (slot == first))[:, None], t, tl.zeros_like(t)), first_b)
    if last > first:
        acc += tl.dot(tl.where((wanted & (slot == last))[:, None], t, tl.zeros_like(t)), last_b)
        if last > first + 1:
            acc = _lora_rest(acc, slot, wanted, t, first, last, expert, offs_n, n_ok, b_ptr, ranks_ptr,
                             stride_bl, stride_be, stride_bn, stride_br, BLOCK_R, RANK_GRANULE)
    return acc


@triton.jit
def _lora_add_always(acc, slot, wanted, t, first, first_b, last, last_b, expert, offs_n, n_ok, b_ptr, ranks_ptr,
                     stride_bl, stride_be, stride_bn, stride_br, BLOCK_R: tl.constexpr, RANK_GRANULE: tl.constexpr):
    """:func:`_lora_add` with the lowest and the highest adapter's GEMMs unconditional: where a block has no such
    adapter its rows of ``t`` are zero and its B tile (rank 0, :func:`_lora_end_tiles`) is zero, read from nowhere.
    A load that feeds a GEMM under no branch is one Triton software-pipelines: in the wide kernel the two B tiles
    become copies into shared memory a column tile ahead (``cp.async`` in the sm_90 PTX), where under
    :func:`_lora_add`'s branches they are loads waited for in the epilogue. The same GEMMs in the same order, the
    added ones of zero products into a float32 accumulator: the output bit for bit."""
    acc += tl.dot(tl.where((wanted & (slot == first))[:, None], t, tl.zeros_like(t)), first_b)
    acc += tl.dot(tl.where((wanted & (slot == last) & (last > first))[:, None], t, tl.zeros_like(t)), last_b)
    if last > first + 1:
        acc = _lora_rest(acc, slot, wanted, t, first, last, expert, offs_n, n_ok, b_ptr, ranks_ptr,
                         stride_bl, stride_be, stride_bn, stride_br, BLOCK_R, RANK_GRANULE)
    return acc


@triton.jit
def _lora_add_late(acc, slot, wanted, t, first, first_rank, last, last_rank, expert, offs_n, n_ok, b_ptr, ranks_ptr,
                   num_slots, stride_bl, stride_be, stride_bn, stride_br, BLOCK_R: tl.constexpr,
                   RANK_GRANULE: tl.constexpr, IN_GRANULES: tl.constexpr = 0):
    """:func:`_lora_add` with each B tile loaded just before its GEMM (the wide kernel's epilogue): the same GEMMs
    in the same order, but the highest adapter's tile is not live across the lowest adapter's GEMM. With both
    live the wide kernel sat at 250-255 registers a thread on sm_90 and spilled past rank 16; loaded late, rank
    32 takes 215 with 64-wide columns and 128-wide columns fit it (measured 17-20% faster on an H100's GLM-5.1
    TP8 down GEMM, ``benchmarks/results/lora_moe/late-b/``). :func:`_moe_gemm_kernel` keeps its tiles early:
    its K loop is long enough to hide their loads."""
    if first < num_slots:  # a row with a delta
        b = _lora_b_tile(b_ptr, first, first_rank, expert, offs_n, n_ok, stride_bl, stride_be, stride_bn, stride_br,
                         BLOCK_R, RANK_GRANULE, IN_GRANULES)
        acc += tl.dot(tl.where((wanted & (slot == first))[:, None], t, tl.zeros_like(t)), b)
    if last > first:
        b = _lora_b_tile(b_ptr, last, last_rank, expert, offs_n, n_ok, stride_bl, stride_be, stride_bn, stride_br,
                         BLOCK_R, RANK_GRANULE, IN_GRANULES)
        acc += tl.dot(tl.where((wanted & (slot == last))[:, None], t, tl.zeros_like(t)), b)
        if last > first + 1:
            acc = _lora_rest(acc, slot, wanted, t, first, last, expert, offs_n, n_ok, b_ptr, ranks_ptr,
                             stride_bl, stride_be, stride_bn, stride_br, BLOCK_R, RANK_GRANULE)
    return acc


@triton.jit
def _lora_rest(acc, slot, wanted, t, first, last, expert, offs_n, n_ok, b_ptr, ranks_ptr,
               stride_bl, stride_be, stride_bn, stride_br, BLOCK_R: tl.constexpr, RANK_GRANULE: tl.constexpr):
    """``acc[row] += t[row] @ B[adapter, expert, tile columns].T`` for the rows of the adapters strictly between
    the block's lowest and highest (a block whose rows do not come ordered by adapter): one GEMM each present."""
    for s in range(first + 1, last):
        mine = wanted & (slot == s)
        if tl.max(mine.to(tl.int32), 0) > 0:  # this adapter has rows in the block
            b = _lora_b_tile(b_ptr, s, tl.load(ranks_ptr + s), expert, offs_n, n_ok, stride_bl, stride_be,
                             stride_bn, stride_br, BLOCK_R, RANK_GRANULE)
            acc += tl.dot(tl.where(mine[:, None], t, tl.zeros_like(t)), b)
    return acc


@triton.jit
def _quantize_group(x, q_ptrs, s_ptr, ok):
    """Store ``x`` (one row's K group, float32) as fp8 with scale max|x| / FP8_MAX, as SGLang does."""
    scale = tl.maximum(tl.max(tl.abs(tl.where(ok, x, 0.0))), _QUANT_EPS) / _FP8_MAX
    tl.store(q_ptrs, tl.clamp(x * (1.0 / scale), -_FP8_MAX, _FP8_MAX).to(q_ptrs.dtype.element_ty), mask=ok)
    tl.store(s_ptr, scale)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, rows, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
                     ROWS: tl.constexpr):
    """Per-row, per-K-group fp8 quantization of a GEMM's input: ``ROWS`` rows of one group a program
    (a program of one row's group, 128 values, would be a launch's worth of overhead for 256 bytes)."""
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = (offs_m < rows)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), _QUANT_EPS) / _FP8_MAX  # masked values load as 0
    q = tl.clamp(x * (1.0 / scale)[:, None], -_FP8_MAX, _FP8_MAX)
    tl.store(q_ptr + offs_m[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + offs_m * stride_s + tl.program_id(1), scale, mask=offs_m < rows)


@triton.jit
def _adapter_keys(ids, token_lora_ptr, num_routes, num_slots, TOPK: tl.constexpr):
    """Each route's sort key: its token's slot, ``num_slots`` for padding and tokens of no slot."""
    ok = ids < num_routes
    slot = tl.load(token_lora_ptr + ids // TOPK, mask=ok, other=-1)
    return tl.where(ok & (slot >= 0) & (slot < num_slots), slot, num_slots)


@triton.jit
def _order_by_adapter_kernel(sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, token_lora_ptr, out_ptr,
                             num_routes, num_slots, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                             KEYS: tl.constexpr):
    """``out``: SGLang's route list with each expert's routes (its run of blocks) ordered by adapter slot, a
    counting sort by the program of the run's first block (the others return). Blocks and experts stay."""
    b = tl.program_id(0)
    blocks = tl.load(num_post_padded_ptr) // BLOCK_M
    if b >= blocks:
        return
    expert = tl.load(expert_ids_ptr + b)
    if b > 0:
        if tl.load(expert_ids_ptr + b - 1) == expert:
            return
    end = b + 1
    more = end < blocks
    while more:
        more = tl.load(expert_ids_ptr + end) == expert
        end = tl.where(more, end + 1, end)
        more = more & (end < blocks)
    offs, keys = tl.arange(0, BLOCK_M), tl.arange(0, KEYS)
    counts = tl.zeros((KEYS,), dtype=tl.int32)
    for blk in range(b, end):
        key = _adapter_keys(tl.load(sorted_ids_ptr + blk * BLOCK_M + offs), token_lora_ptr, num_routes, num_slots,
                            TOPK)
        counts += tl.sum((key[:, None] == keys[None, :]).to(tl.int32), 0)
    starts = b * BLOCK_M + tl.cumsum(counts, 0) - counts  # each key's first place in the run
    for blk in range(b, end):
        ids = tl.load(sorted_ids_ptr + blk * BLOCK_M + offs)
        hot = (_adapter_keys(ids, token_lora_ptr, num_routes, num_slots, TOPK)[:, None] == keys[None, :]).to(tl.int32)
        place = starts[None, :] + tl.cumsum(hot, 0) - hot  # after the key's routes of earlier rows and blocks
        tl.store(out_ptr + tl.sum(hot * place, 1), ids)
        starts += tl.sum(hot, 0)


def order_by_adapter(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_padded: torch.Tensor,
                     token_lora: torch.Tensor, topk: int, block_m: int, num_slots: int) -> torch.Tensor:
    """SGLang's route list (``moe_align_block_size``'s ``sorted_token_ids``, blocks of ``block_m``) with each
    expert's routes ordered by their token's adapter slot (``token_lora``), padding and tokens of no slot last;
    the blocks, their experts and the blocks used stay as they are. Only the used blocks are written."""
    out = torch.empty_like(sorted_ids)
    num_routes = token_lora.numel() * topk
    launcher(_order_by_adapter_kernel)[(cdiv(sorted_ids.numel(), block_m),)](
        sorted_ids, expert_ids, num_post_padded, token_lora, out, num_routes, num_slots, TOPK=topk, BLOCK_M=block_m,
        KEYS=triton.next_power_of_2(num_slots + 1))
    return out


def tile(config: dict, block_m: int, fp8_group_k: int | None) -> dict:
    """Tile sizes from SGLang's tuned config; BLOCK_M must be the route list's block size, and an
    fp8 K tile must be one quantization group."""
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": config["BLOCK_SIZE_N"],
        "BLOCK_K": fp8_group_k or config["BLOCK_SIZE_K"],
        "GROUP_M": config.get("GROUP_SIZE_M", 1),
        "num_warps": config.get("num_warps", 4),
        "num_stages": config.get("num_stages", 3),
    }


@dataclass(frozen=True)
class LoRAEpilogue:
    """What the epilogue adds: ``t`` (routes, halves * max_rank) float32 ranks from the shrink;
    ``lora_b`` (slots, ``experts`` or 1, N, max_rank), ``experts`` the experts the LoRA buffers hold;
    ``token_lora`` (tokens,), ``enabled`` and ``ranks`` (slots,) int32; ``halves``: 2 for a gated
    gate-up (gate columns from the gate ranks, up from the up ranks), else 1. ``rank_limit``: the highest
    rank among the adapters ``enabled`` leaves on, where it is below ``max_rank``: the epilogue's rank tile
    holds that many (a slot of a higher rank left on would lose its ranks past it)."""

    t: torch.Tensor
    lora_b: torch.Tensor
    token_lora: torch.Tensor
    enabled: torch.Tensor
    ranks: torch.Tensor
    experts: int
    max_rank: int
    halves: int = 1
    rank_limit: int | None = None

    def block_r(self) -> int:
        return rank_tile(self.rank_limit or self.max_rank)


@dataclass(frozen=True)
class LoRAShrink:
    """What a 16-bit gate-up GEMM shrinks beside it: each route's ranks into ``t`` (routes, halves * max_rank)
    float32, written only for the routes with a delta and only at their adapter's true ranks (the rest is left as
    it is); ``lora_a`` (slots, ``experts`` or 1, halves * max_rank, K), the gate ranks then the up ranks;
    ``token_lora``, ``enabled``, ``ranks`` as :class:`LoRAEpilogue`'s. The ranks are what the fast hooks' shrink
    (``lora_moe.shrink``) writes, summed in another order."""

    t: torch.Tensor
    lora_a: torch.Tensor
    token_lora: torch.Tensor
    enabled: torch.Tensor
    ranks: torch.Tensor
    experts: int
    max_rank: int
    halves: int = 2

    def block_r(self, column_tiles: int) -> int:
        """The ranks each of the first column tiles computes: all of them shared among the tiles, 16 at least."""
        return max(16, triton.next_power_of_2(cdiv(self.halves * self.max_rank, column_tiles)))


def rank_tile(max_rank: int) -> int:
    """The epilogue's rank tile (``BLOCK_R``) for adapters up to ``max_rank``: a power of two, 16 at least (a dot)."""
    return max(16, triton.next_power_of_2(max_rank))


def moe_gemm(a, w, out, *, a_scale, w_scale, bias, topk_weights, sorted_ids, expert_ids,
             num_post_padded, routes_per_a_row: int, mul_routed_weight: bool, tile: dict,
             scale_block_n: int = 1, topk: int | None = None, lora: LoRAEpilogue | None = None,
             weights_by_tma: bool = False, n_tiles: int = 0, shrink: LoRAShrink | None = None) -> None:
    """One expert GEMM over SGLang's sorted route list, written route-major into ``out`` (R, N).

    ``a`` is fp8 with per-row, per-K-group ``a_scale`` when ``w_scale`` is given (block fp8); then
    ``scale_block_n`` is the weights' fp8 scale block along N (``GROUP_M`` in ``tile`` is the L2
    swizzle of output tiles, unrelated). ``lora``: each route's LoRA expand added in the epilogue
    (``topk``: routes per token, to find a route's adapter; with two halves ``tile["BLOCK_N"]`` must
    divide a half). ``weights_by_tma``: the weight tiles loaded through a tensor descriptor (Hopper).
    ``n_tiles``: each program computes
    that many column tiles (:func:`_moe_gemm_wide_kernel`: one A row per route, no bias, SGLang's route list,
    K of at most ``WIDE_K_TILES`` tiles); ``tile["GROUP_M"]`` is then unused, and ``tile["K_LOOP"]`` (0 unless
    given) makes each column tile's K steps a pipelined loop instead of unrolled. ``shrink``: the gate-up LoRA's
    shrink computed in the K loop from the A tiles the GEMM loads (16-bit A, one A row per token, one column tile a
    program, not with ``lora``).
    """
    experts, n, k = w.shape
    fp8 = w_scale is not None
    block_m, block_k = tile["BLOCK_M"], tile["BLOCK_K"]
    assert a.dim() == 2 and a.shape[1] == k, f"A is {tuple(a.shape)}, the weights take K={k}"
    assert out.dim() == 2 and out.shape[1] == n, f"C is {tuple(out.shape)}, the weights give N={n}"
    assert out.shape[0] == a.shape[0] * routes_per_a_row, "one output row per route"
    assert expert_ids.shape[0] >= cdiv(sorted_ids.shape[0], block_m), "one expert id per route block"
    if bias is not None:
        assert bias.shape == (experts, n), f"bias is {tuple(bias.shape)}, expected {(experts, n)}"
    if fp8:
        assert a.dtype == torch.float8_e4m3fn and a_scale is not None, "block fp8 takes fp8 A with its scales"
        groups = cdiv(k, block_k)
        assert a_scale.shape == (a.shape[0], groups), f"A's scales are {tuple(a_scale.shape)}, expected {(a.shape[0], groups)}"
        expected = (experts, cdiv(n, scale_block_n), groups)
        assert w_scale.shape == expected, f"the weights' scales are {tuple(w_scale.shape)}, expected {expected}"
    else:
        assert a.dtype == w.dtype, f"A in {a.dtype}, weights in {w.dtype}"
    if lora is not None:
        half_width = n // lora.halves
        assert topk and out.shape[0] == lora.token_lora.shape[0] * topk, "one adapter slot per token"
        assert lora.t.shape == (out.shape[0], lora.halves * lora.max_rank) and lora.t.stride(1) == 1, lora.t.shape
        assert lora.lora_b.shape[2:] == (n, lora.max_rank) and lora.lora_b.dtype == out.dtype, lora.lora_b.shape
        assert lora.lora_b.shape[1] in (1, lora.experts), (lora.lora_b.shape, lora.experts)
        assert n % lora.halves == 0, (n, lora.halves)
        assert lora.halves == 1 or half_width % tile["BLOCK_N"] == 0, "a column tile must lie in one half"
        lb, lora_args = lora.lora_b, (lora.t, lora.lora_b, lora.token_lora, lora.enabled, lora.ranks)
        lora_sizes = (lora.ranks.numel(), lora.experts, half_width, lora.max_rank)
        lora_strides = (lora.t.stride(0), lb.stride(0), 0 if lb.shape[1] == 1 else lb.stride(1), lb.stride(2),
                        lb.stride(3))
    elif shrink is not None:
        la = shrink.lora_a
        width = shrink.halves * shrink.max_rank
        assert not fp8 and not n_tiles, "the shrink reads the GEMM's 16-bit A tiles, one column tile a program"
        assert topk and routes_per_a_row == topk and out.shape[0] == shrink.token_lora.shape[0] * topk, \
            "a gate-up GEMM: one A row and one adapter slot per token"
        assert shrink.t.shape == (out.shape[0], width) and shrink.t.stride(1) == 1, shrink.t.shape
        assert shrink.t.dtype == torch.float32, shrink.t.dtype
        assert la.shape[2:] == (width, k) and la.dtype == a.dtype, (tuple(la.shape), la.dtype)
        assert la.shape[1] in (1, shrink.experts), (la.shape, shrink.experts)
        lora_args = (shrink.t, w, shrink.token_lora, shrink.enabled, shrink.ranks)
        lora_sizes, lora_strides = (shrink.ranks.numel(), shrink.experts, n, shrink.max_rank), (shrink.t.stride(0), 0, 0, 0, 0)
    else:
        lora_args, lora_sizes, lora_strides = (w,) * 5, (0, 0, n, 0), (0,) * 5
    b_desc = None
    if weights_by_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        b_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, tile["BLOCK_N"], block_k])
    if n_tiles:
        assert routes_per_a_row == 1 and bias is None and (lora is None or lora.halves == 1), \
            "the wide GEMM takes SGLang's down GEMMs"
        k_tiles = cdiv(k, block_k)
        assert k_tiles <= WIDE_K_TILES, f"K={k} is {k_tiles} tiles of {block_k}, the wide GEMM unrolls {WIDE_K_TILES}"
        wide = {name: value for name, value in tile.items() if name != "GROUP_M"}  # with K_LOOP where it is set
        grid = (cdiv(sorted_ids.shape[0], block_m), cdiv(cdiv(n, tile["BLOCK_N"]), n_tiles))
        launcher(_moe_gemm_wide_kernel)[grid](
            a, a_scale if fp8 else a, w, out, w_scale if fp8 else w, topk_weights, sorted_ids, expert_ids,
            num_post_padded, b_desc, *lora_args,
            n, k, out.shape[0], sorted_ids.shape[0], lora_sizes[0], lora_sizes[1], lora_sizes[3],
            a.stride(0), a.stride(1), a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
            w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0, w_scale.stride(2) if fp8 else 0,
            *lora_strides,
            TOPK=topk or 1, SCALE_BLOCK_N=scale_block_n, BLOCK_R=lora.block_r() if lora is not None else 16,
            K_TILES=k_tiles, N_TILES=n_tiles, FP8=fp8, MUL_ROUTED_WEIGHT=mul_routed_weight, LORA=lora is not None,
            B_TMA=b_desc is not None, RANK_GRANULE=rank_granule(lora.max_rank) if lora is not None else 1,
            EVEN_K=k % block_k == 0, **wide,
        )
        return
    grid = (cdiv(sorted_ids.shape[0], block_m) * cdiv(n, tile["BLOCK_N"]),)
    launcher(_moe_gemm_kernel)[grid](
        a, a_scale if fp8 else a, w, out, bias if bias is not None else w, w_scale if fp8 else w,
        topk_weights, sorted_ids, expert_ids, num_post_padded, b_desc, *lora_args,
        shrink.lora_a if shrink is not None else w,
        n, k, out.shape[0], sorted_ids.shape[0], *lora_sizes, shrink.halves * shrink.max_rank if shrink is not None else 0,
        a.stride(0), a.stride(1), a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0, w_scale.stride(2) if fp8 else 0,
        *lora_strides, *_lora_a_strides(shrink),
        ROUTES_PER_A_ROW=routes_per_a_row, TOPK=topk or 1, SCALE_BLOCK_N=scale_block_n,
        BLOCK_R=lora.block_r() if lora is not None else 16,
        FP8=fp8, HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=mul_routed_weight, LORA=lora is not None,
        B_TMA=b_desc is not None,
        RANK_GRANULE=rank_granule(lora.max_rank) if lora is not None else 1, EVEN_K=k % block_k == 0,
        SHRINK=shrink is not None,
        SHRINK_R=shrink.block_r(cdiv(n, tile["BLOCK_N"])) if shrink is not None else 16,
        **{name: value for name, value in tile.items() if name != "K_LOOP"},
    )


def _lora_a_strides(shrink: LoRAShrink | None) -> tuple[int, int, int, int]:
    """The shrink's LoRA A strides (slot, expert: 0 for one matrix shared by every expert, rank, K)."""
    if shrink is None:
        return 0, 0, 0, 0
    la = shrink.lora_a
    return la.stride(0), 0 if la.shape[1] == 1 else la.stride(1), la.stride(2), la.stride(3)


def wide_shared_bytes(tile: dict, k_tiles: int, max_rank: int, weight_bytes: int) -> int:
    """At least the shared memory :func:`_moe_gemm_wide_kernel` takes with ``tile`` (held to Triton's own sm_90
    allocation in tests/test_kernel_codegen.py): each pipeline stage holds every K tile of the block's A rows and of
    the weights (one with ``K_LOOP``), and the LoRA epilogue's 16-bit dot operands take at most twice theirs; with
    ``LORA_AHEAD=3`` each stage also holds the two B tiles copied a column tile ahead."""
    m, n, k, r = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"], rank_tile(max_rank)
    held = 1 if tile.get("K_LOOP") else k_tiles
    ahead = tile["num_stages"] * 2 * n * r * 2 if tile.get("LORA_AHEAD") == 3 else 0
    return tile["num_stages"] * held * (m + n) * k * weight_bytes + 2 * 2 * (m + n) * r + ahead


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, K) as fp8 with one float32 scale per row and ``group`` columns."""
    assert x.stride(-1) == 1, "the quantize kernel reads each row as one contiguous run"
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, cdiv(k, group)), dtype=torch.float32, device=x.device)
    launcher(_quantize_kernel)[(cdiv(rows, QUANTIZE_ROWS), scale.shape[1])](
        x, q, scale, rows, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=group, ROWS=QUANTIZE_ROWS)
    return q, scale
