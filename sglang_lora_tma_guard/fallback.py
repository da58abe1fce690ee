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

Both GEMMs are :mod:`~sglang_lora_tma_guard.moe_gemm`'s: they walk SGLang's own expert-sorted route
list (``sorted_token_ids`` / ``expert_ids``) a block of one expert's routes at a time, and store each
result row at its route index. With
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

from .moe_gemm import _quantize_group, cdiv, moe_gemm, quantize_per_group, tile

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


def gated_activation(x: torch.Tensor, activation: str, group: int | None = None):
    """The gated activation; with ``group`` also its fp8 form and scales for the down GEMM."""
    assert x.stride(-1) == 1, "the activation kernel reads each row's gate and up halves as contiguous runs"
    rows, width = x.shape
    half = width // 2
    out = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    block = group or min(1024, triton.next_power_of_2(half))
    blocks = cdiv(half, block)
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
             tile=tile(config, block_m, group_k), **common)
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
             tile=tile(down_config, block_m, group_k), **common)
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
