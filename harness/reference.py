"""Plain PyTorch references, route by route in float32, for the tests (and the fallback benchmark).

``reference_moe`` is the contract of SGLang's ``_fused_moe_kernel_sequence`` (the fallback keeps the
same one); ``ReferenceLoRAHooks`` is what SGLang's MoE LoRA hooks are meant to add, read from the
same ``LoRAInfo``: for each token of an enabled adapter and each of its routes, the adapter's
low-rank delta of that route's expert after gate-up, and after down scaled by the route's weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_lora_tma_guard import fallback, moe_gemm


@triton.jit
def _to_fp8_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def interpreter_fp8(t: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn rounded as Triton's CPU interpreter rounds it (unlike PyTorch's cast)."""
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
    _to_fp8_kernel[(triton.cdiv(t.numel(), 1024),)](t, out, t.numel(), BLOCK=1024)
    return out


def reference_moe(args: dict, to_fp8=None) -> torch.Tensor:
    """The same contract in plain PyTorch, route by route, for tests (slow; float32 math).

    ``to_fp8`` rounds float32 to float8_e4m3fn (default: PyTorch's cast). Triton's CPU interpreter
    rounds that cast differently from GPUs and from PyTorch, so tests on the interpreter pass its
    own cast here to compare like with like.
    """
    to_fp8 = to_fp8 or (lambda t: t.to(torch.float8_e4m3fn))
    hidden = args["hidden_states"]
    w1, w2 = args["w1"], args["w2"]
    topk_weights, topk_ids, hooks = args["topk_weights"], args["topk_ids"], args["hooks"]
    tokens, topk = topk_ids.shape
    fp8 = bool(args["use_fp8_w8a8"])

    def dequantize(w, scale):
        if not fp8:
            return w.float()
        gn, gk = args["block_shape"]
        full = scale.repeat_interleave(gn, dim=1)[:, : w.shape[1]].repeat_interleave(gk, dim=2)[:, :, : w.shape[2]]
        return w.float() * full

    def quantize_rows(x):
        if not fp8:
            return x.float()
        gk = args["block_shape"][1]
        padded = torch.nn.functional.pad(x.float(), (0, -x.shape[1] % gk))  # a last group may be partial
        groups = padded.view(x.shape[0], -1, gk)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=moe_gemm.QUANT_EPS) / moe_gemm.FP8_MAX
        q = to_fp8((groups * (1.0 / scale)).clamp(-moe_gemm.FP8_MAX, moe_gemm.FP8_MAX)).float()
        return (q * scale).view_as(padded)[:, : x.shape[1]]

    def expert_gemm(a_rows, w, bias, ids):
        out = torch.zeros(a_rows.shape[0], w.shape[1], device=a_rows.device)
        for i, e in enumerate(ids.tolist()):
            if e >= 0:
                out[i] = w[e] @ a_rows[i] + (bias[e].float() if bias is not None else 0.0)
        return out

    ids, weights = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
    router_first, no_combine = args["apply_router_weight_on_input"], args["no_combine"]
    a1 = quantize_rows(hidden).repeat_interleave(topk, dim=0)
    gate_up = expert_gemm(a1, dequantize(w1, args.get("w1_scale")), args.get("b1"), ids)
    if router_first:
        gate_up *= weights[:, None]
    gate_up = gate_up.to(hidden.dtype).view(tokens, topk, -1)
    if hooks.after_gate_up is not None:
        hooks.after_gate_up(hidden, gate_up, topk_weights, topk_ids)
    x = gate_up.view(tokens * topk, -1).float()
    fn = fallback.ACTIVATIONS[args["activation"]]
    act = (fn(x[:, : x.shape[1] // 2]) * x[:, x.shape[1] // 2:] if args["is_gated"] else fn(x)).to(hidden.dtype)
    down = expert_gemm(quantize_rows(act), dequantize(w2, args.get("w2_scale")), args.get("b2"), ids)
    if not router_first and not no_combine:
        down *= weights[:, None]
    down = down.to(hidden.dtype).view(tokens, topk, -1)
    if hooks.after_down is not None:
        hooks.after_down(act, down, topk_weights, topk_ids)
    if no_combine:
        return down
    out = down.float().sum(dim=1) * (args.get("routed_scaling_factor") or 1.0)
    return out.to(hidden.dtype)


class ReferenceLoRAHooks:
    """SGLang's ``LoRAHooks`` contract in plain PyTorch, from a ``LoRAInfo``.

    A route to an expert the LoRA buffers do not hold (a fused shared expert: the runner counts
    one more expert than the adapters have) or filtered out (-1) gets no delta; so do tokens of the
    base model (-1) and of a disabled slot. Gated (gate-up A of ``2 * r`` rows: the gate half from
    the gate ranks, the up half from the up ranks) or not; shared-outer adapters (one gate-up A and
    one down B for every expert) read that one matrix.
    """

    def __init__(self, info):
        self.info = info
        self.after_gate_up = self._after_gate_up
        self.after_down = self._after_down

    def _routes(self, topk_ids):
        """(token, route, adapter, expert, the adapter's rank) of every route with a delta."""
        info = self.info
        experts = info.gate_up_lora_b_weights.shape[1]
        enabled, ranks = info.adapter_enabled.tolist(), info.lora_ranks.tolist()
        for t, adapter in enumerate(info.token_lora_mapping.tolist()):
            if adapter < 0 or not enabled[adapter]:
                continue
            for j, e in enumerate(topk_ids[t].tolist()):
                if 0 <= e < experts:
                    yield t, j, adapter, e, ranks[adapter]

    @staticmethod
    def _of(weights, a, e):
        return weights[a, e if weights.shape[1] > 1 else 0].float()

    def _after_gate_up(self, hidden_states, cache1, topk_weights, topk_ids):
        info, r = self.info, self.info.max_lora_rank
        gated = info.gate_up_lora_a_weights.shape[2] > r
        half = cache1.shape[-1] // 2
        for t, j, a, e, rank in self._routes(topk_ids):  # each adapter's own rank: the buffer pads to r
            x = hidden_states[t].float()
            A, B = self._of(info.gate_up_lora_a_weights, a, e), self._of(info.gate_up_lora_b_weights, a, e)
            if gated:
                delta = torch.cat([B[:half, :rank] @ (A[:rank] @ x), B[half:, :rank] @ (A[r:r + rank] @ x)])
            else:
                delta = B[:, :rank] @ (A[:rank] @ x)
            cache1[t, j] += delta.to(cache1.dtype)

    def _after_down(self, activation, cache3, topk_weights, topk_ids):
        info, topk = self.info, cache3.shape[1]
        for t, j, a, e, rank in self._routes(topk_ids):
            x = activation[t * topk + j].float()
            A, B = self._of(info.down_lora_a_weights, a, e), self._of(info.down_lora_b_weights, a, e)
            cache3[t, j] += (topk_weights[t, j].float() * (B[:, :rank] @ (A[:rank] @ x))).to(cache3.dtype)
