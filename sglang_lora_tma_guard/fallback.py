"""Route-major fused MoE for LoRA-hooked calls, for SGLang builds the flag cannot reach.

When the installed ``_fused_moe_kernel_sequence`` takes ``hooks`` but has no ``down_moe_use_tma``
to turn off (a fork, a renamed parameter, a source build between releases), hooked calls run here
instead. Every intermediate buffer is route-major: row ``t * topk + j`` holds route ``(t, j)``, the
layout the hooks index. Nothing here uses TMA.

The sequence, with SGLang's contract:

1. gate-up GEMM into ``(num_tokens, topk, N)``;
2. ``hooks.after_gate_up(hidden_states, that buffer, topk_weights, topk_ids)``;
3. gated activation (silu or gelu) into ``(num_tokens * topk, N // 2)``;
4. down GEMM into ``(num_tokens, topk, hidden)``, router weights applied as SGLang applies them;
5. ``hooks.after_down(activation buffer, down buffer, topk_weights, topk_ids)``;
6. sum over top-k times ``routed_scaling_factor``, honouring ``inplace`` and ``no_combine``.

Both GEMMs walk SGLang's own expert-sorted route list (``sorted_token_ids`` / ``expert_ids``) a
block of one expert's routes at a time, and store each result row at its route index. With
block-wise fp8 weights the GEMM inputs are quantized per token and 128-wide group, as SGLang
quantizes them (scale = max(|x|) / 448): the hidden states by a small kernel of their own, the
activation inside the activation kernel, which writes both the bf16 buffer the hook sees and the
fp8 copy the down GEMM reads. Expert id -1 (filtered
out under expert parallelism) gives zero rows.

Covered: bf16 or fp16 activations with weights of the same dtype, or block-wise fp8 w8a8 weights
(the only precision SGLang's TMA path serves); silu or gelu, gated, or silu, gelu and relu2
un-gated; biases; ``apply_router_weight_on_input``; filtered experts. Anything else raises
:class:`FallbackUnsupported`: this path exists because the installed SGLang cannot be told to keep
hooked calls off TMA, so handing an uncovered call back to it could return garbled output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8_MAX = 448.0
QUANT_EPS = 1e-10

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu2": lambda x: torch.square(F.relu(x))}
"""Elementwise activations by SGLang's name (the gated ones apply to the gate half)."""

COVERED = (
    "activations bf16/fp16 with weights of the same dtype, or block-wise fp8 w8a8 weights "
    "(dynamic activation scales); activation silu/gelu gated, or silu/gelu/relu2 un-gated; "
    "biases; apply_router_weight_on_input; filtered experts (-1); inplace, no_combine"
)

# Parameters of _fused_moe_kernel_sequence whose meaning the fallback knows. Any other parameter
# must hold its default for the fallback to take the call.
KNOWN = {
    "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "sorted_token_ids", "expert_ids",
    "num_tokens_post_padded", "config", "down_config", "b1", "b2", "use_fp8_w8a8", "use_int8_w8a8",
    "use_int8_w8a16", "use_int4_w4a16", "per_channel_quant", "w1_scale", "w2_scale", "w1_zp",
    "w2_zp", "a1_scale", "a2_scale", "block_shape", "activation", "is_gated", "no_combine", "inplace",
    "apply_router_weight_on_input", "routed_scaling_factor", "gemm1_alpha", "gemm1_limit",
    "filter_expert", "hooks", "swiglu_limit", "gate_up_interleaved",
}


class FallbackUnsupported(ValueError):
    """A hooked call the fallback does not cover; the message says which part and what is covered."""


# The fp8 quantization of GEMM inputs, as SGLang does it: scale = max(|x|, QUANT_EPS) / FP8_MAX.
_FP8_MAX = tl.constexpr(FP8_MAX)
_QUANT_EPS = tl.constexpr(QUANT_EPS)


@triton.jit
def _moe_gemm_kernel(
    # Pointers. A (rows, K): the GEMM's input, one row per token (gate-up) or per route (down);
    # A_SCALE (rows, K / BLOCK_K) fp32 with FP8; B (E, N, K): the experts' weights; C (R, N): the
    # route-major output, R = tokens * topk; BIAS (E, N); B_SCALE (E, N / SCALE_BLOCK_N, K / BLOCK_K)
    # fp32 with FP8; TOPK_WEIGHTS (R,); SGLang's route list: SORTED_IDS (S,) route ids padded with R,
    # EXPERT_IDS (S / BLOCK_M,) one expert (or -1) per block, NUM_POST_PADDED (1,) the blocks used.
    a_ptr, a_scale_ptr, b_ptr, c_ptr, bias_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    # Sizes: N, K of the weights; R routes; S entries of the padded route list.
    N, K, num_routes, num_sorted,
    # Strides, in elements.
    stride_am, stride_ak, stride_asm, stride_ask, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_bias_e, stride_bias_n, stride_se, stride_sn, stride_sk,
    # Meta-parameters: routes that share one A row (topk for gate-up, 1 for down); the fp8 scale
    # block along N; the tile (BLOCK_M = the route list's block size; with FP8, BLOCK_K = one K
    # quantization group); GROUP_M, the L2 swizzle of output tiles.
    ROUTES_PER_A_ROW: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
):
    """C[route, n] = sum_k A[route // ROUTES_PER_A_ROW, k] * B[expert(route), n, k], route-major.

    With FP8, A holds fp8 values quantized per row and K group, their scales in A_SCALE.
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
    c_ptrs = c_ptr + routes[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = route_ok[:, None] & n_ok[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_rows = routes // ROUTES_PER_A_ROW
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    if FP8:
        s_ptrs = b_scale_ptr + expert * stride_se + (offs_n // SCALE_BLOCK_N) * stride_sn
        as_ptrs = a_scale_ptr + a_rows * stride_asm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k_tile * BLOCK_K
        a = tl.load(a_ptrs, mask=route_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            # One K tile is one quantization group of A and of B.
            a_scale = tl.load(as_ptrs + k_tile * stride_ask, mask=route_ok, other=0.0)
            b_scale = tl.load(s_ptrs + k_tile * stride_sk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        else:
            acc = tl.dot(a, b, acc=acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n * stride_bias_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + routes, mask=route_ok, other=0.0)
        acc *= weight.to(tl.float32)[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _quantize_group(x, q_ptrs, s_ptr, ok):
    """Store ``x`` (one row's K group, float32) as fp8 with scale max|x| / FP8_MAX, as SGLang does."""
    scale = tl.maximum(tl.max(tl.abs(tl.where(ok, x, 0.0))), _QUANT_EPS) / _FP8_MAX
    tl.store(q_ptrs, tl.clamp(x * (1.0 / scale), -_FP8_MAX, _FP8_MAX).to(q_ptrs.dtype.element_ty), mask=ok)
    tl.store(s_ptr, scale)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr):
    """Per-token, per-K-group fp8 quantization of the gate-up GEMM's input."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    _quantize_group(x, q_ptr + row * stride_q + cols, s_ptr + row * stride_s + tl.program_id(1), ok)


@triton.jit
def _gated_activation_kernel(x_ptr, out_ptr, q_ptr, s_ptr, half, stride_x, stride_out, stride_q,
                             stride_s, GELU: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, i] = act(x[r, i]) * x[r, half + i]; with QUANTIZE also its fp8 form, BLOCK = group."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < half
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + half + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    out = (act * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=ok)
    if QUANTIZE:
        # The down GEMM's input, quantized from the rounded values the hook will see.
        _quantize_group(out.to(tl.float32), q_ptr + row * stride_q + cols,
                        s_ptr + row * stride_s + tl.program_id(1), ok)


def _tile(config: dict, block_m: int, fp8_group_k: int | None) -> dict:
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


def moe_gemm(a, w, out, *, a_scale, w_scale, bias, topk_weights, sorted_ids, expert_ids,
             num_post_padded, routes_per_a_row: int, mul_routed_weight: bool, tile: dict,
             scale_block_n: int = 1) -> None:
    """One expert GEMM over SGLang's sorted route list, written route-major into ``out`` (R, N).

    ``a`` is fp8 with per-row, per-K-group ``a_scale`` when ``w_scale`` is given (block fp8); then
    ``scale_block_n`` is the weights' fp8 scale block along N (``GROUP_M`` in ``tile`` is the L2
    swizzle of output tiles, unrelated).
    """
    experts, n, k = w.shape
    fp8 = w_scale is not None
    block_m, block_k = tile["BLOCK_M"], tile["BLOCK_K"]
    assert a.dim() == 2 and a.shape[1] == k, f"A is {tuple(a.shape)}, the weights take K={k}"
    assert out.dim() == 2 and out.shape[1] == n, f"C is {tuple(out.shape)}, the weights give N={n}"
    assert out.shape[0] == a.shape[0] * routes_per_a_row, "one output row per route"
    assert expert_ids.shape[0] >= triton.cdiv(sorted_ids.shape[0], block_m), "one expert id per route block"
    if bias is not None:
        assert bias.shape == (experts, n), f"bias is {tuple(bias.shape)}, expected {(experts, n)}"
    if fp8:
        assert a.dtype == torch.float8_e4m3fn and a_scale is not None, "block fp8 takes fp8 A with its scales"
        groups = triton.cdiv(k, block_k)
        assert a_scale.shape == (a.shape[0], groups), f"A's scales are {tuple(a_scale.shape)}, expected {(a.shape[0], groups)}"
        expected = (experts, triton.cdiv(n, scale_block_n), groups)
        assert w_scale.shape == expected, f"the weights' scales are {tuple(w_scale.shape)}, expected {expected}"
    else:
        assert a.dtype == w.dtype, f"A in {a.dtype}, weights in {w.dtype}"
    grid = (triton.cdiv(sorted_ids.shape[0], block_m) * triton.cdiv(n, tile["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, a_scale if fp8 else a, w, out, bias if bias is not None else w, w_scale if fp8 else w,
        topk_weights, sorted_ids, expert_ids, num_post_padded,
        n, k, out.shape[0], sorted_ids.shape[0],
        a.stride(0), a.stride(1), a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0, w_scale.stride(2) if fp8 else 0,
        ROUTES_PER_A_ROW=routes_per_a_row, SCALE_BLOCK_N=scale_block_n,
        FP8=fp8, HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=mul_routed_weight,
        **tile,
    )


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.stride(-1) == 1, "the quantize kernel reads each row as one contiguous run"
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, triton.cdiv(k, group)), dtype=torch.float32, device=x.device)
    _quantize_kernel[(rows, scale.shape[1])](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
                                             GROUP=group)
    return q, scale


def gated_activation(x: torch.Tensor, activation: str, group: int | None = None):
    """The gated activation; with ``group`` also its fp8 form and scales for the down GEMM."""
    assert x.stride(-1) == 1, "the activation kernel reads each row's gate and up halves as contiguous runs"
    rows, width = x.shape
    half = width // 2
    out = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    block = group or min(1024, triton.next_power_of_2(half))
    blocks = triton.cdiv(half, block)
    if group:
        q = torch.empty((rows, half), dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty((rows, blocks), dtype=torch.float32, device=x.device)
    else:
        q, scale = out, out
    _gated_activation_kernel[(rows, blocks)](
        x, out, q, scale, half, x.stride(0), out.stride(0), q.stride(0), scale.stride(0),
        GELU=activation == "gelu", QUANTIZE=bool(group), BLOCK=block)
    return (out, q, scale) if group else (out, out, None)


def covered_or_raise(args: dict) -> None:
    """Raise :class:`FallbackUnsupported` for any part of the call the fallback does not cover."""
    hidden = args["hidden_states"]
    problems = []
    for name in ("use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16", "per_channel_quant"):
        if args.get(name):
            problems.append(f"{name}=True")
    for name in ("w1_zp", "w2_zp", "a1_scale", "a2_scale", "gemm1_alpha", "gemm1_limit", "swiglu_limit"):
        if args.get(name) is not None:
            problems.append(f"{name} is set")
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        problems.append(f"activations in {hidden.dtype}")
    if args["use_fp8_w8a8"]:
        block = args.get("block_shape")
        if not block or len(block) != 2 or not all(block):
            problems.append("fp8 weights without a block shape (per-tensor or per-channel scales)")
    elif args["w1"].dtype != hidden.dtype or args["w2"].dtype != hidden.dtype:
        problems.append(f"weights in {args['w1'].dtype} with activations in {hidden.dtype}")
    gated, activation = args["is_gated"], args["activation"]
    if activation not in (("silu", "gelu") if gated else ("silu", "gelu", "relu2")):
        problems.append(f"activation {activation!r} ({'gated' if gated else 'un-gated'})")
    if problems:
        raise FallbackUnsupported(
            "sglang-lora-tma-guard: this SGLang cannot be told to keep LoRA-hooked MoE calls off the "
            f"TMA path, and the guard's own kernels do not cover this call ({'; '.join(problems)}). "
            f"Covered: {COVERED}. Refusing rather than risking garbled output: upgrade SGLang to "
            "0.5.17 or later, or unset SGLANG_LORA_TMA_GUARD to accept that risk."
        )


def fused_moe_hooked(args: dict) -> torch.Tensor:
    """A hooked ``_fused_moe_kernel_sequence`` call, its arguments bound by name, route-major."""
    covered_or_raise(args)
    hidden = args["hidden_states"]
    w1, w2 = args["w1"], args["w2"]
    topk_weights, topk_ids = args["topk_weights"], args["topk_ids"]
    sorted_ids, expert_ids, num_post = (
        args["sorted_token_ids"], args["expert_ids"], args["num_tokens_post_padded"])
    hooks, config = args["hooks"], args["config"]
    down_config = args.get("down_config") or config
    no_combine, router_first = args["no_combine"], args["apply_router_weight_on_input"]
    tokens, topk, n = hidden.shape[0], topk_ids.shape[1], w1.shape[1]
    routes = tokens * topk
    fp8 = bool(args["use_fp8_w8a8"])
    group_n, group_k = (args["block_shape"] if fp8 else (1, None))
    block_m = config["BLOCK_SIZE_M"]  # the route list is padded to this block size
    weights = topk_weights.contiguous().view(-1)  # a view, unless SGLang passed a strided one
    common = dict(topk_weights=weights, sorted_ids=sorted_ids, expert_ids=expert_ids,
                  num_post_padded=num_post, scale_block_n=group_n)

    a1, a1_scale = quantize_per_group(hidden, group_k) if fp8 else (hidden, None)
    gate_up = torch.empty((tokens, topk, n), dtype=hidden.dtype, device=hidden.device)
    moe_gemm(a1, w1, gate_up.view(routes, n), a_scale=a1_scale, w_scale=args["w1_scale"] if fp8 else None,
             bias=args.get("b1"), routes_per_a_row=topk, mul_routed_weight=router_first,
             tile=_tile(config, block_m, group_k), **common)
    if hooks.after_gate_up is not None:
        hooks.after_gate_up(hidden, gate_up, topk_weights, topk_ids)

    flat = gate_up.view(routes, n)
    if args["is_gated"]:
        act, a2, a2_scale = gated_activation(flat, args["activation"], group_k if fp8 else None)
    else:
        act = ACTIVATIONS[args["activation"]](flat)
        a2, a2_scale = quantize_per_group(act, group_k) if fp8 else (act, None)

    down = torch.empty((tokens, topk, w2.shape[1]), dtype=hidden.dtype, device=hidden.device)
    moe_gemm(a2, w2, down.view(routes, w2.shape[1]), a_scale=a2_scale,
             w_scale=args["w2_scale"] if fp8 else None,
             bias=args.get("b2"), routes_per_a_row=1,
             mul_routed_weight=not router_first and not no_combine,
             tile=_tile(down_config, block_m, group_k), **common)
    if hooks.after_down is not None:
        # The hook may change act in place; the down GEMM has already read its fp8 copy, as
        # SGLang's GEMM reads its own quantized copy.
        hooks.after_down(act, down, topk_weights, topk_ids)

    if no_combine:
        return down
    out = hidden if args["inplace"] else torch.empty_like(hidden)
    torch.sum(down, dim=1, out=out)
    factor = args.get("routed_scaling_factor")
    if factor is not None and factor != 1.0:
        out.mul_(factor)
    return out
