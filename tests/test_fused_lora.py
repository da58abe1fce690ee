"""The down GEMM with the LoRA expand in its epilogue (``moe_gemm``'s ``LoRAEpilogue``), on its own.

Through Triton's CPU interpreter, against a float32 PyTorch reference computed route by route from
the same inputs (the fp8 input's own quantized values and scales: the quantizer is the fallback's,
tested there). Widths no tile divides; in one route list: tokens of the base model, of a disabled
slot, of a slot of rank 0, of slots of different ranks in one block (three with deltas, out of slot order),
routes filtered out (-1) and routes to an expert the LoRA buffers do not hold. Every rank column past a slot's own rank holds NaN,
in the ranks ``t`` and in B: a single one read would show in the output.

Tolerance: the output is fp16, of size about 1 here; one fp16 rounding of the result is 2**-11 of
it, the fp16 rounding of ``t`` before the epilogue's GEMM (as the hooks' expand rounds it) a few
more steps: 2e-3 of the largest output (measured: about 5e-4).
"""

from __future__ import annotations

import pytest
import torch

from harness.tiny_moe import assert_ordered_by_adapter, shuffle_runs
from sglang_lora_tma_guard import moe_gemm
from sglang_lora_tma_guard.tiny_moe import align_block_size, quantize_block_fp8

pytestmark = pytest.mark.real

TOLERANCE = 2e-3
TOKENS, TOPK, EXPERTS, LORA_EXPERTS = 13, 3, 6, 5  # expert 5: a fused shared expert, no LoRA
# Slot 1 rank 0, slot 3 disabled; ranks 5 and 20 are no multiple of the runs of 8 ranks the epilogue loads
# (the NaN past them in those runs must not reach the output).
RANKS, ENABLED, MAX_RANK = (5, 0, 20, 16, 32), (1, 1, 1, 0, 1), 32


def make(n: int, k: int, fp8: bool, shared_outer: bool, seed: int = 0, ranks=RANKS):
    gen = torch.Generator().manual_seed(seed)
    topk_ids = torch.randint(0, EXPERTS, (TOKENS, TOPK), generator=gen, dtype=torch.int32)
    topk_ids[::4, 1] = -1  # filtered out
    token_lora = torch.randint(-1, len(RANKS), (TOKENS,), generator=gen, dtype=torch.int32)
    # Every slot has a token, and expert 0 rows of three adapters with deltas out of slot order (over SGLang's
    # route list: a block whose lowest and highest adapters are not all it holds).
    token_lora[:len(RANKS)] = torch.tensor([2, 4, 0, 3, 1], dtype=torch.int32)
    topk_ids[:len(RANKS), 0] = 0
    a = torch.randn(TOKENS * TOPK, k, generator=gen).half()
    w = torch.randn(EXPERTS, n, k, generator=gen) / k**0.5
    t = torch.randn(TOKENS * TOPK, MAX_RANK, generator=gen)
    lora_b = torch.randn(len(RANKS), 1 if shared_outer else LORA_EXPERTS, n, MAX_RANK, generator=gen) / 4
    for route in range(TOKENS * TOPK):
        slot = int(token_lora[route // TOPK])
        t[route, ranks[slot] if slot >= 0 else 0:] = float("nan")
    for slot, rank in enumerate(ranks):
        lora_b[slot, :, :, rank:] = float("nan")
    weights = torch.rand(TOKENS, TOPK, generator=gen)
    if fp8:
        w_q, w_scale = quantize_block_fp8(w)
        a_q, a_scale = moe_gemm.quantize_per_group(a, 128)
        w_full = w_q.float() * w_scale.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
        a_full = a_q.float() * a_scale.repeat_interleave(128, 1)[:, :k]
    else:
        w_q, w_scale, a_q, a_scale = w.half(), None, a, None
        w_full, a_full = w.half().float(), a.float()
    lora = moe_gemm.LoRAEpilogue(t, lora_b.half(), token_lora, torch.tensor(ENABLED, dtype=torch.int32),
                                 torch.tensor(ranks, dtype=torch.int32), LORA_EXPERTS, MAX_RANK)
    inputs = dict(a=a_q, a_scale=a_scale, w=w_q, w_scale=w_scale, weights=weights, topk_ids=topk_ids, lora=lora)
    return inputs, reference(a_full, w_full, t, lora_b.half().float(), token_lora, topk_ids, weights, ranks)


def reference(a, w, t, lora_b, token_lora, topk_ids, weights, ranks=RANKS):
    out = torch.zeros(TOKENS * TOPK, w.shape[1])
    for route, expert in enumerate(topk_ids.reshape(-1).tolist()):
        if expert < 0:
            continue
        row = w[expert] @ a[route]
        slot = int(token_lora[route // TOPK])
        if slot >= 0 and ENABLED[slot] and ranks[slot] and expert < LORA_EXPERTS:
            b = lora_b[slot, min(expert, lora_b.shape[1] - 1), :, :ranks[slot]]
            row = row + b @ t[route, :ranks[slot]].half().float()
        out[route] = row * weights.reshape(-1)[route]
    return out


def run(inputs, n: int, block_m: int, block_n: int, block_k: int, fp8: bool, tma: bool = False, n_tiles: int = 0,
        order=None, k_loop: int = 0, lora_ahead: int = 0, a_once: int = 0, in_granules: int = 0):
    """The GEMM over SGLang's route list, one column tile a program or (the wide kernel) ``n_tiles``, its K steps
    unrolled or (``k_loop``) a loop, its B tiles loaded before them with ``lora_ahead``, its A tiles read once for all
    its column tiles with ``a_once``, its B tiles as loaded with ``in_granules``; ``order``: a change to the list
    first."""
    sorted_ids, expert_ids, post_padded = align_block_size(inputs["topk_ids"], block_m, EXPERTS)
    if order is not None:
        sorted_ids, expert_ids, post_padded = order((sorted_ids, expert_ids, post_padded), block_m)
    out = torch.full((TOKENS * TOPK, n), float("nan"), dtype=torch.float16)
    tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128 if fp8 else block_k, GROUP_M=2, num_warps=4,
                num_stages=2, **({"K_LOOP": k_loop, "LORA_AHEAD": lora_ahead, "A_ONCE": a_once,
                                  "RANKS_IN_GRANULES": in_granules} if n_tiles else {}))
    moe_gemm.moe_gemm(inputs["a"], inputs["w"], out, a_scale=inputs["a_scale"], w_scale=inputs["w_scale"], bias=None,
                      topk_weights=inputs["weights"].reshape(-1), sorted_ids=sorted_ids, expert_ids=expert_ids,
                      num_post_padded=post_padded, routes_per_a_row=1, mul_routed_weight=True, tile=tile,
                      scale_block_n=128 if fp8 else 1, topk=TOPK, lora=inputs["lora"], weights_by_tma=tma,
                      n_tiles=n_tiles)
    return out


@pytest.mark.parametrize("n_tiles, k_loop", [(0, 0), (3, 0), (3, 1)], ids=["one-tile-a-program", "wide", "wide-k-loop"])
@pytest.mark.parametrize("fp8, shared_outer, tma, n, k, block_m, block_n, block_k", [
    # Out of the default run (the interpreter's minutes); there the fused launch is proven through SGLang's
    # runner (tests/test_fast_lora.py::test_fast_takes_the_fused_down_launch_only_where_it_is_measured_faster).
    pytest.param(False, False, False, 200, 72, 16, 32, 32, marks=pytest.mark.slow),
    pytest.param(True, False, False, 72, 200, 16, 32, 128, marks=pytest.mark.slow),
    pytest.param(True, False, True, 72, 208, 16, 32, 128, marks=pytest.mark.slow),  # TMA: rows of 16-byte multiples
    pytest.param(False, True, False, 200, 72, 32, 64, 64, marks=pytest.mark.slow),
], ids=["fp16", "block-fp8", "block-fp8-weights-by-tma", "shared-outer-block-32"])
def test_the_epilogue_adds_each_routes_own_adapter_delta(fp8, shared_outer, tma, n, k, block_m, block_n, block_k,
                                                         n_tiles, k_loop):
    inputs, expected = make(n, k, fp8, shared_outer)
    out = run(inputs, n, block_m, block_n, block_k, fp8, tma, n_tiles, k_loop=k_loop).float()
    assert not out.isnan().any()
    err = float((out - expected).abs().max() / expected.abs().max())
    assert err < TOLERANCE, err
    # The deltas are not small beside the base rows: a dropped or doubled one would fail the bound.
    base_only = run({**inputs, "lora": None}, n, block_m, block_n, block_k, fp8, tma, n_tiles, k_loop=k_loop).float()
    assert float((base_only - expected).abs().max() / expected.abs().max()) > 50 * TOLERANCE


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp16", "block-fp8"])
def test_the_wide_gemms_k_loop_is_its_unrolled_k_steps_bit_for_bit(fp8):
    """A long K (Qwen3-30B-A3B tp 1's six K tiles) runs its K steps as a loop, each pipeline stage one K tile,
    instead of unrolled: the same steps in the same order, so the same output to the bit, with a K past its last
    full tile (odd widths) and the epilogue's mixed ranks."""
    n, k = (200, 72) if not fp8 else (72, 456)
    inputs, expected = make(n, k, fp8, False)
    unrolled = run(inputs, n, 16, 32, 32, fp8, n_tiles=3)
    looped = run(inputs, n, 16, 32, 32, fp8, n_tiles=3, k_loop=1)
    assert not looped.isnan().any()
    assert torch.equal(looped, unrolled)
    assert float((looped.float() - expected).abs().max() / expected.abs().max()) < TOLERANCE


@pytest.mark.parametrize("lora_ahead", [1, 3], ids=["ahead", "ahead-unconditional"])
@pytest.mark.parametrize("k_loop", [0, 1], ids=["unrolled", "k-loop"])
def test_the_wide_epilogues_b_tiles_loaded_ahead_give_its_output_bit_for_bit(k_loop, lora_ahead):
    """``LORA_AHEAD``: each column tile's B tiles of the block's lowest and highest adapter loaded before its K steps
    instead of after them (3: and their GEMMs run in every block, of zero rows where it has no such adapter): the
    same GEMMs in the same order, so the same output to the bit (mixed ranks, one of them odd, a disabled slot,
    blocks of three adapters, blocks of none, NaN in the buffers past each rank)."""
    n, k = 200, 72
    inputs, expected = make(n, k, False, False)
    behind = run(inputs, n, 16, 32, 32, False, n_tiles=3, k_loop=k_loop)
    ahead = run(inputs, n, 16, 32, 32, False, n_tiles=3, k_loop=k_loop, lora_ahead=lora_ahead)
    assert not ahead.isnan().any()
    assert torch.equal(ahead, behind)
    assert float((ahead.float() - expected).abs().max() / expected.abs().max()) < TOLERANCE


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp16", "block-fp8"])
def test_the_wide_gemm_reading_its_a_tiles_once_gives_its_output_bit_for_bit(fp8):
    """``A_ONCE``: a program's two K tiles of A (and with block fp8 their row scales) read once for all its column
    tiles instead of once a column tile: the same GEMMs of the same tiles in the same order, so the same output to
    the bit (a K past its last full tile, the epilogue's mixed ranks, with its B tiles behind and pipelined)."""
    n, k = (200, 56) if not fp8 else (72, 200)  # two K tiles: of 32 (fp16), of 128 (block fp8)
    inputs, expected = make(n, k, fp8, False)
    for lora_ahead in (0, 3):
        again = run(inputs, n, 16, 32, 32, fp8, n_tiles=3, lora_ahead=lora_ahead)
        once = run(inputs, n, 16, 32, 32, fp8, n_tiles=3, lora_ahead=lora_ahead, a_once=1)
        assert not once.isnan().any()
        assert torch.equal(once, again), lora_ahead
        assert float((once.float() - expected).abs().max() / expected.abs().max()) < TOLERANCE


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp16", "block-fp8"])
def test_b_tiles_as_loaded_are_the_masked_ones_bit_for_bit_where_every_rank_fills_its_granules(fp8):
    """``RANKS_IN_GRANULES``: where every adapter's rank is a multiple of the rank granule (8 here: max rank 32), the
    B tile's load mask is its rank mask, so the tile as loaded is the tile the ``tl.where`` past the rank gives, NaN
    past every rank in the buffers: the same output to the bit (B tiles behind, ahead, pipelined, the A tiles once).
    With ranks 5 and 20 the buffers' NaN past them, in the granule, reaches the output: the switch is the caller's
    promise, not a mask."""
    n, k = (200, 56) if not fp8 else (72, 200)
    inputs, expected = make(n, k, fp8, False, ranks=(8, 0, 24, 16, 32))
    for lora_ahead, a_once in ((0, 0), (1, 0), (3, 0), (3, 1)):
        masked = run(inputs, n, 16, 32, 32, fp8, n_tiles=3, lora_ahead=lora_ahead, a_once=a_once)
        loaded = run(inputs, n, 16, 32, 32, fp8, n_tiles=3, lora_ahead=lora_ahead, a_once=a_once, in_granules=1)
        assert not loaded.isnan().any()
        assert torch.equal(loaded, masked), (lora_ahead, a_once)
        assert float((loaded.float() - expected).abs().max() / expected.abs().max()) < TOLERANCE
    odd = make(n, k, fp8, False)[0]
    assert run(odd, n, 16, 32, 32, fp8, n_tiles=3, lora_ahead=3, in_granules=1).isnan().any()
    assert not run(odd, n, 16, 32, 32, fp8, n_tiles=3, lora_ahead=3).isnan().any()


def order_by_adapter(route_list, block_m: int, token_lora):
    sorted_ids, expert_ids, post_padded = route_list
    return (moe_gemm.order_by_adapter(sorted_ids, expert_ids, post_padded, token_lora, TOPK, block_m, len(RANKS)),
            expert_ids, post_padded)


def test_order_by_adapter_orders_each_experts_routes_by_slot_and_moves_none_out_of_its_run():
    """What the fused down launch walks: SGLang's list (here with each expert's routes shuffled, as its GPU
    kernel's atomics may leave them), each expert's run of blocks ordered by the routes' adapter slots (padding
    and tokens of no slot last), every route in its own expert's run, the blocks and their experts as given."""
    inputs = make(8, 8, False, False)[0]
    token_lora, block_m = inputs["lora"].token_lora, 4
    given = shuffle_runs(align_block_size(inputs["topk_ids"], block_m, EXPERTS), block_m)
    ordered = order_by_adapter(given, block_m, token_lora)[0]
    changed = assert_ordered_by_adapter(given, ordered, token_lora, TOPK, block_m, len(RANKS))
    assert changed > 0  # the shuffled list was not already in that order


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp16", "block-fp8"])
def test_the_wide_epilogue_is_right_over_a_shuffled_list_and_over_it_ordered_by_adapter(fp8):
    n, k = (200, 72) if not fp8 else (72, 200)
    inputs, expected = make(n, k, fp8, False)
    token_lora = inputs["lora"].token_lora
    for order in (shuffle_runs, lambda route_list, block_m: order_by_adapter(shuffle_runs(route_list, block_m),
                                                                             block_m, token_lora)):
        out = run(inputs, n, 16, 32, 32, fp8, n_tiles=3, order=order).float()
        assert not out.isnan().any()
        assert float((out - expected).abs().max() / expected.abs().max()) < TOLERANCE


def test_every_launch_of_the_fused_down_path_can_go_to_its_compiled_launcher(monkeypatch):
    """The fused down launch's kernels (the fp8 quantization, the adapter ordering, both GEMMs, with weights by TMA
    and without) go through ``launching``'s launcher: after a variant's first launch, the compiled kernel's own.
    That holds only where every argument is of a kind its key holds (a None, a TensorDescriptor among them), no
    constexpr is given by position and every argument after the positional ones is named. Recorded, not run (the
    interpreter has nothing to compile); bit for bit on a GPU: ``benchmarks/launch_check.py``'s fused rows."""
    import inspect

    from sglang_lora_tma_guard import launching

    launched = []
    monkeypatch.setattr(launching.Launcher, "launch",
                        lambda self, grid, *args, **kwargs: launched.append((self.fn, args, kwargs)))
    inputs = make(72, 208, True, False)[0]
    for n_tiles, tma in ((0, False), (0, True), (3, False), (3, True)):
        run(inputs, 72, 16, 32, 128, True, tma, n_tiles)
    order_by_adapter(align_block_size(inputs["topk_ids"], 16, EXPERTS), 16, inputs["lora"].token_lora)
    gate_up_run(*gate_up_case(72, 64, False), 16, 32, 32, shrink=True)  # the gate-up GEMM with its shrink
    names = {fn.fn.__name__ for fn, _, _ in launched}
    assert names == {"_quantize_kernel", "_moe_gemm_kernel", "_moe_gemm_wide_kernel", "_order_by_adapter_kernel"}
    assert any(type(a).__name__ == "TensorDescriptor" for _, args, _ in launched for a in args)
    assert any(a is None for _, args, _ in launched for a in args)
    for fn, args, kwargs in launched:
        launching.arguments_key(args)  # raises TypeError for a kind the key does not hold
        params = list(inspect.signature(fn.fn).parameters.values())
        assert not any("constexpr" in str(p.annotation) for p in params[:len(args)]), fn.fn.__name__
        assert set(fn.arg_names[len(args):]) <= set(kwargs), (fn.fn.__name__, set(fn.arg_names[len(args):]) - set(kwargs))


def gate_up_case(n: int, k: int, shared_outer: bool, seed: int = 1):
    """A gated gate-up GEMM's inputs (one A row per token, ``n`` columns: gate then up) and its LoRA A (the gate
    ranks, then the up ranks), NaN in every rank row past a slot's own rank."""
    inputs = make(8, 8, False, False, seed)[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, k, generator=gen).half()
    w = (torch.randn(EXPERTS, n, k, generator=gen) / k**0.5).half()
    lora_a = torch.randn(len(RANKS), 1 if shared_outer else LORA_EXPERTS, 2 * MAX_RANK, k, generator=gen) / k**0.5
    for slot, rank in enumerate(RANKS):
        lora_a[slot, :, rank:MAX_RANK] = float("nan")
        lora_a[slot, :, MAX_RANK + rank:] = float("nan")
    return x, w, lora_a.half(), inputs["topk_ids"], inputs["lora"].token_lora


def gate_up_run(x, w, lora_a, topk_ids, token_lora, block_m: int, block_n: int, block_k: int, shrink: bool,
                order=None):
    """The gate-up GEMM over SGLang's route list (``order``: a change to it first), with the shrink in its K loop
    or without; the output and the ranks (NaN where nothing was written)."""
    route_list = align_block_size(topk_ids, block_m, EXPERTS)
    sorted_ids, expert_ids, post_padded = order(route_list, block_m) if order else route_list
    out = torch.full((TOKENS * TOPK, w.shape[1]), float("nan"), dtype=torch.float16)
    t = torch.full((TOKENS * TOPK, 2 * MAX_RANK), float("nan"))
    lora = moe_gemm.LoRAShrink(t, lora_a, token_lora, torch.tensor(ENABLED, dtype=torch.int32),
                               torch.tensor(RANKS, dtype=torch.int32), LORA_EXPERTS, MAX_RANK) if shrink else None
    tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=2, num_warps=4, num_stages=2)
    moe_gemm.moe_gemm(x, w, out, a_scale=None, w_scale=None, bias=None, topk_weights=None, sorted_ids=sorted_ids,
                      expert_ids=expert_ids, num_post_padded=post_padded, routes_per_a_row=TOPK, mul_routed_weight=False,
                      tile=tile, topk=TOPK, shrink=lora)
    return out, t


@pytest.mark.parametrize("n, k, shared_outer, block_m, block_n, block_k, listed", [
    (200, 72, False, 16, 32, 32, "sglang"),  # 7 column tiles, 16 ranks each for the first 4; odd widths
    (200, 72, False, 16, 32, 32, "ordered"),
    pytest.param(128, 64, True, 32, 64, 32, "sglang", marks=pytest.mark.slow),  # 2 column tiles of 32 ranks
], ids=["odd-widths", "odd-widths-ordered-by-adapter", "shared-outer-block-32"])
def test_the_gate_up_gemm_shrinks_each_routes_own_adapter_in_its_k_loop(n, k, shared_outer, block_m, block_n,
                                                                        block_k, listed):
    """``moe_gemm``'s ``LoRAShrink``: the gate-up GEMM's programs shrink the A tiles they load for the GEMM. Each
    route's ranks, both halves, against a float32 reference from the same fp16 inputs: routes of the base model,
    of a disabled slot, of a slot of rank 0, filtered out, or to the expert the LoRA buffers do not hold get none
    written; no rank past a slot's own is written, and the NaN past it in LoRA A reaches nothing. Over SGLang's list
    one block holds three adapters with deltas (the lowest and highest in the K loop, the one between in its own).
    The GEMM's output is the plain GEMM's, bit for bit.

    Tolerance: float32 sums of ``k`` fp16 products (about 1 each) in another order, a few float32 steps of their
    size: 1e-5 of the largest rank (measured: about 5e-7)."""
    x, w, lora_a, topk_ids, token_lora = gate_up_case(n, k, shared_outer)
    order = (lambda route_list, bm: order_by_adapter(route_list, bm, token_lora)) if listed == "ordered" else None
    out, t = gate_up_run(x, w, lora_a, topk_ids, token_lora, block_m, block_n, block_k, True, order)
    plain, untouched = gate_up_run(x, w, lora_a, topk_ids, token_lora, block_m, block_n, block_k, False, order)
    assert torch.equal(out, plain) and untouched.isnan().all()

    expected = torch.full_like(t, float("nan"))
    for route, expert in enumerate(topk_ids.reshape(-1).tolist()):
        slot = int(token_lora[route // TOPK])
        if expert < 0 or slot < 0 or not ENABLED[slot] or not RANKS[slot] or expert >= LORA_EXPERTS:
            continue
        a = lora_a[slot, min(expert, lora_a.shape[1] - 1)].float()
        for half in (0, MAX_RANK):
            rows = slice(half, half + RANKS[slot])
            expected[route, rows] = a[rows] @ x[route // TOPK].float()
    assert torch.equal(t.isnan(), expected.isnan())  # written exactly where the hooks' expand reads
    assert (~t.isnan()).sum() > 0
    err = float((t - expected).nan_to_num().abs().max() / expected.nan_to_num().abs().max())
    assert err < 1e-5, err
