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

Status: right (``tests/test_fast_lora.py``, ``tests/test_fused_lora.py``) but not placed by ``=fast``: on
an H200 the hooked call is slower with it than with the hooks' expand (1.02-1.42x in 40 of 42 rows, equal in two)
(``docs/lora_moe_floor.md``: the epilogue over blocks of one adapter costs less than the separate
expand, but this package's base GEMM over those blocks costs more than SGLang's over its own).
:func:`activate` places it (benchmarks, tests).
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .log import logger
from .patching import Engaged, Patch

MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
NAME = "invoke_fused_moe_kernel"
MAX_RANK = 64
"""Above this rank the epilogue's tiles would not fit in registers: the hooks' expand runs instead."""

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
    shrink_tiles: object
    done: torch.Tensor | None = None
    """The down buffer a fused launch wrote, delta included."""

    def took(self, cache3: torch.Tensor) -> bool:
        """Did a fused launch already add the delta into ``cache3``? (Once: the record is cleared.)"""
        done, self.done = self.done, None
        return done is not None and done is cache3

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
        if self.max_rank > MAX_RANK:
            return f"LoRA rank {self.max_rank} (the fused epilogue takes up to {MAX_RANK})"
        from .lora_moe import MAX_KEYS

        if B.shape[0] * (self.ranks.numel() + 1) + 1 > MAX_KEYS:  # route_all's (expert, adapter) keys
            return f"{B.shape[0]} experts x {self.ranks.numel() + 1} adapter groups past the routing's {MAX_KEYS} keys"
        return None

    def run(self, a: dict) -> None:
        """The down shrink, then the down GEMM with the expand in its epilogue, into ``C``.

        The GEMM walks its own route list (:func:`~sglang_lora_tma_guard.lora_moe.route_all`: blocks of
        one expert and one adapter, the routing's block size), not SGLang's, whose blocks mix adapters:
        each block then adds one delta, its B tile loaded before the K loop."""
        from . import lora_moe
        from .moe_gemm import LoRAEpilogue, moe_gemm, quantize_per_group, tile

        A, B, C = a["A"], a["B"], a["C"]
        tokens, topk = self.topk_ids.shape
        t = lora_moe.shrink(A, self.lora_a, self.routing, topk=topk, max_rank=self.max_rank, halves=1,
                            config=self.shrink_tiles)
        block_m = self.routing.block_m
        blocks = lora_moe.route_all(self.topk_ids, self.token_lora, self.enabled, self.ranks, B.shape[0],
                                    self.routing.num_experts, block_m)
        fp8 = bool(a["use_fp8_w8a8"])
        group_n, group_k = a["block_shape"] if fp8 else (1, None)
        x, x_scale = quantize_per_group(A, group_k) if fp8 else (A, None)
        moe_gemm(x, B, C.view(tokens * topk, C.shape[2]), a_scale=x_scale, w_scale=a["B_scale"] if fp8 else None,
                 bias=None, topk_weights=a["topk_weights"].view(-1), sorted_ids=blocks.sorted_ids,
                 expert_ids=blocks.block_key, num_post_padded=blocks.rows_used, routes_per_a_row=1,
                 mul_routed_weight=True, tile=tile(a["config"], block_m, group_k), scale_block_n=group_n,
                 topk=topk, lora=LoRAEpilogue(t, self.lora_b, self.token_lora, self.enabled, self.ranks,
                                              self.routing.num_experts, self.max_rank),
                 weights_by_tma=bool(a.get("b_use_tma")),  # where SGLang would take them by TMA itself
                 key_groups=self.ranks.numel() + 1)
        self.done = C


def offer(work: DownWork) -> None:
    """Offer ``work`` to the next launch in this thread (and only to it)."""
    _offers.work = work


def _take_offer() -> DownWork | None:
    work = getattr(_offers, "work", None)
    _offers.work = None
    return work


def ready() -> bool:
    """Would a fused down launch be taken here now? (The launcher placed and on, no compilation.) Asked
    for every fast batch: one flag read while nothing placed it, as in every server."""
    if not PATCH.wanted:
        return False
    import torch

    return not torch.compiler.is_compiling() and PATCH.status().working  # Dynamo never reads the lock


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.info("%s (logged once)", message)


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
                _say_once("the down LoRA delta of fast batches is added in the down GEMM's epilogue")
                return None
            except Exception:  # nothing of C is served from a failed launch: SGLang's GEMM overwrites it
                logger.exception("the fused LoRA down GEMM failed; SGLang's GEMM and the hook run instead")
                work.done = None
                reason = "the fused launch failed"
        _say_once(f"a LoRA down GEMM runs unfused (the hook adds its delta): {reason}")
        return original(*args, **kwargs)

    return invoke_fused_moe_kernel


def _is_default(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


PATCH = Patch("fused LoRA down GEMM", MODULE, NAME, _make)


def activate() -> None:
    PATCH.activate()


def deactivate() -> None:
    PATCH.deactivate()
