"""The gate-up LoRA expand inside the activation, for batches on the fast path.

A hooked MoE call otherwise adds the gate-up delta into the gate-up GEMM's output ``(tokens, topk, 2I)`` (the
hook reads it and writes it back), and SGLang's activation then reads it again to write ``silu(gate) * up``.
Here one kernel (:func:`~sglang_lora_tma_guard.lora_moe.expand_silu_and_mul`) reads the rows once, adds the
delta in float32 and writes the activation: the read-modify-write of the largest buffer of the call's first
half is gone, and one launch with it.

The seams. SGLang's ``_fused_moe_kernel_sequence`` (0.5.11-0.5.23) calls ``hooks.after_gate_up`` on the
gate-up rows, then its activation, then ``invoke_fused_moe_kernel`` for the down GEMM. The fast path's
``after_gate_up`` *offers* the gate-up work instead of adding the delta (:func:`offer`: thread-local, one shot)
only where the guard's wrapper around the sequence has read from the call's own arguments that its activation
is ``silu(gate) * up`` with nothing else (:func:`plain_silu_reader`: ``activation="silu"``, gated, no alpha,
limit or clamp, no SwiGLU fused into the GEMM). Then, in every branch SGLang may take, the activation's output
is that function of the rows, and the offer is kept whichever runs:

- SGLang's ``silu_and_mul`` (looked up in its module at call time; CUDA) takes it when it is called on the very
  rows offered, into an output of their shape, with no other argument: the one kernel runs instead;
- called on anything else, it first adds the delta into the rows as the hook would have, then runs as it is;
- any other activation (SGLang's portable ones off CUDA) ran on the rows without the delta: the down GEMM's
  launch, the next launch in the sequence, takes the offer first (:func:`finish`) and writes the activation
  again, delta included, into its input, before anything reads it.

Placed at every batch where :func:`activate` is called: by ``=fast`` (:data:`BY_FAST`), by the benchmarks and
tests; elsewhere the hook's expand runs. Not under ``torch.compile``. Right:
``tests/test_fast_lora.py``; measured: ``docs/lora_moe_floor.md``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .log import info_once, logger
from .patching import Engaged, Patch

MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
NAME = "silu_and_mul"
BY_FAST = True
"""Does ``=fast`` place it? Yes, at every batch: the whole hooked call with it was faster than with the hook's
expand at every batch measured, 1 to 8192 tokens, and its output as close to the float32 reference. An H100,
SGLang's runner, GLM-5.1 TP8 and Qwen3-30B-A3B tp1 with block-fp8 experts, ranks 8-64 and all 16
(``bash benchmarks/run_lora_moe_h200.sh place-act``, ``benchmarks/results/lora_moe/place-act/``):

- 256 to 8192 tokens: 0.7-1.7% faster on GLM-5.1, 2.3-5.6% on Qwen3 tp1 (mixed ranks at 256 tokens 0.394 / 0.416
  ms, rank 16 at 8192 tokens 1.659 / 1.758); its error at or below the hooks' in 11 of 12 batches, a tenth of a
  bf16 step above in one, below SGLang's default path's in all 12;
- 1 to 128 tokens: 0.2-5.7% faster (Qwen3 mixed ranks at 128 tokens 0.365 / 0.387 ms; one token 0.080 / 0.081 on
  GLM-5.1, 0.036 / 0.038 on Qwen3 at rank 16), one launch fewer; with the fused down GEMM in the same call, its
  error at or below the fast path's in 20 of 24 batches, under half a bf16 step above in the others;

the one kernel 0.46-0.82 of the expand + SGLang's ``silu_and_mul``. Off: the hook's expand at every batch."""
TILE = {"BLOCK_N": 64, "N_TILES": 1, "num_warps": 4, "num_stages": 2}
"""The one kernel's tile: one column tile of 64 a program, every rank in one tile. Of ``benchmarks/act_tiles.py``'s
30 (column tiles of 32 to 128, 1 to 12 a program, 4 or 8 warps, ranks in one tile or in tiles of 16, both program
orders) the fastest, or within 10% of it, at every batch of 256 to 8192 tokens measured (once its programs go block
by block from :data:`BLOCK_MAJOR_FROM_ROUTES`) but one: all rank 16 at 256 tokens on Qwen3-30B-A3B tp 1, 0.019 ms
against 0.017 with 6 tiles of 128 a program (``benchmarks/results/lora_moe/act/order/``, one H100)."""
BLOCK_MAJOR_FROM_ROUTES = 32768
"""From this many routes (tokens x top-k) the one kernel's programs go block by block (``BLOCK_MAJOR``: the column
groups of one block of routes run together, so its ranks of ``t`` come from DRAM once and from L2 after); the
output is the same to the bit in either order. Block by block against group by group, :data:`TILE`, one H100
(``benchmarks/results/lora_moe/act/order/``), ms:

- from 4096 tokens faster in all 8 batches: ranks 8-64 at 8192 tokens 0.226 / 0.275 (Qwen3-30B-A3B tp 1), 0.119 /
  0.140 (tp 2), 0.087 / 0.099 (GLM-5.1 TP8); at 4096 0.123 / 0.134, 0.065 / 0.069, 0.063 / 0.066; all rank 16
  2-8% faster (0.187 / 0.203 at 8192 tokens on Qwen3 tp 1);
- below, up to 13% slower: all rank 16 at 2048 tokens 0.053 / 0.047 (Qwen3 tp 1), 0.024 / 0.023 (GLM-5.1)."""


def tile(num_pairs: int) -> dict:
    """The one kernel's tile for a batch of ``num_pairs`` routes."""
    return {**TILE, "BLOCK_MAJOR": num_pairs >= BLOCK_MAJOR_FROM_ROUTES}

if TYPE_CHECKING:
    import torch

_local = threading.local()
_placed = False


def plain_silu_reader(original):
    """A reader of ``original``'s (SGLang's sequence's) arguments: ``reader(args, kwargs)`` is True where that
    call's activation is ``silu(gate) * up`` and nothing else; None where its signature lacks what it reads."""
    try:
        params = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params]
    required = ("activation", "is_gated", "gemm1_alpha", "gemm1_limit")
    if any(name not in names for name in required):
        return None
    # name -> (position, default, the value the plain activation needs or None for "is None")
    wanted = {"activation": "silu", "is_gated": True, "gemm1_alpha": None, "gemm1_limit": None,
              "swiglu_limit": None, "fuse_swiglu_interleaved": False}
    checks = [(names.index(n), n, params[names.index(n)].default, v) for n, v in wanted.items() if n in names]

    def reader(args, kwargs) -> bool:
        for at, name, default, value in checks:
            given = args[at] if at < len(args) else kwargs.get(name, default)
            if given is inspect.Parameter.empty or (given is not value if value is None or isinstance(value, bool)
                                                    else given != value):
                return False
        return True

    return reader


@contextlib.contextmanager
def sequence(plain_silu: bool):
    """The guard's wrapper runs SGLang's sequence inside this: what its activation is, for :func:`ready`."""
    before = getattr(_local, "plain_silu", False)
    _local.plain_silu = plain_silu
    try:
        yield
    finally:
        _local.plain_silu = before
        stale = getattr(_local, "work", None)
        if stale is not None:  # offered and never taken: the sequence ended without a down launch
            _local.work = None
            logger.error("a gate-up LoRA delta offered to the activation was never added; the fast hooks add it "
                         "themselves from now on")
            _disable("an offer was left")


@dataclass
class ActWork:
    """One batch's gate-up LoRA, offered to the activation: the rows it belongs in, the gate-up shrink's ranks,
    the gate-up B buffer, the batch's routing and adapters, the expand's tiles (for :meth:`add_in_place`)."""

    rows: torch.Tensor
    """The gate-up rows as the hook was given them, (tokens, topk, 2I)."""
    t: torch.Tensor
    lora_b: torch.Tensor
    routing: object
    topk_ids: torch.Tensor
    token_lora: torch.Tensor
    enabled: torch.Tensor
    ranks: torch.Tensor
    max_rank: int
    expand_tiles: object

    def fits(self, rows: torch.Tensor, out: torch.Tensor) -> bool:
        """Are ``rows`` this batch's gate-up rows (the same memory, one row a route) and ``out`` their activation's
        place?"""
        pairs, width = self.routing.num_pairs, self.rows.shape[2]
        return (rows.dim() == 2 and tuple(rows.shape) == (pairs, width) and rows.data_ptr() == self.rows.data_ptr()
                and rows.stride(1) == 1 and self.holds_activation(out))

    def holds_activation(self, out) -> bool:
        """Can ``out`` take the rows' activation: a row each (at least), half their width, their dtype?"""
        import torch

        return (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] >= self.routing.num_pairs
                and out.shape[1] * 2 == self.rows.shape[2] and out.stride(1) == 1 and out.dtype == self.rows.dtype)

    def activation(self, out: torch.Tensor) -> None:
        """``out[:pairs] = silu(gate) * up`` of the rows with the delta added (the one kernel)."""
        from . import lora_moe

        pairs = self.routing.num_pairs
        lora_moe.expand_silu_and_mul(out[:pairs], self.rows.view(pairs, -1), self.t, self.lora_b, self.routing,
                                     topk_ids=self.topk_ids, token_lora=self.token_lora, enabled=self.enabled,
                                     ranks=self.ranks, max_rank=self.max_rank, tile=tile(pairs))

    def add_in_place(self) -> None:
        """The hook's own work: the delta added into the rows."""
        from . import lora_moe

        lora_moe.expand(self.rows, self.t, self.lora_b, self.routing, max_rank=self.max_rank, halves=2,
                        topk_weights=None, config=self.expand_tiles)


def placed() -> bool:
    return _placed


def ready() -> bool:
    """Would the gate-up work of a batch be offered to the activation now? (Placed, inside a sequence whose
    activation is plain SiLU, the down launch's seam working, not compiling.)"""
    if not (_placed and getattr(_local, "plain_silu", False)):
        return False
    import torch

    from . import fused_lora

    return not torch.compiler.is_compiling() and fused_lora.PATCH.status().working


def offer(work: ActWork) -> None:
    _local.work = work


def pending() -> bool:
    return getattr(_local, "work", None) is not None


def _take() -> ActWork | None:
    work = getattr(_local, "work", None)
    _local.work = None
    return work


def finish(a) -> None:
    """At the down launch (``a``: its input, the activation's output): an offer no activation took is
    finished here, the activation written again with the delta."""
    work = _take()
    if work is None:
        return
    if work.holds_activation(a):
        try:
            work.activation(a)
        except Exception:  # the activation again, by the hook's own path: the delta into the rows, then SiLU
            logger.exception("the gate-up LoRA kernel failed at the down launch; the fast hooks add the delta "
                             "themselves from now on")
            _disable("its kernel failed")
            import torch

            work.add_in_place()
            pairs, half = work.routing.num_pairs, a.shape[1]
            rows = work.rows.view(pairs, 2 * half)
            a[:pairs] = torch.nn.functional.silu(rows[:, :half].float()).mul_(rows[:, half:].float()).to(a.dtype)
            return
        info_once("the gate-up LoRA delta of fast batches is added in the activation (at the down launch)")
        return
    logger.error("the down launch after a gate-up offer has an input of another shape (%s); the fast hooks add "
                 "the gate-up delta themselves from now on", tuple(getattr(a, "shape", ())))
    _disable("a down input of another shape")


def _disable(why: str) -> None:
    global _placed
    _placed = False
    logger.warning("the gate-up LoRA delta in the activation is off in this process: %s", why)


def _make(original, engaged: Engaged):
    if not callable(original):
        return None  # off CUDA SGLang's sequence has no silu_and_mul: the down launch finishes every offer

    @functools.wraps(original)
    def silu_and_mul(*args, **kwargs):
        work = _take()
        if work is None:
            return original(*args, **kwargs)
        if engaged.on and len(args) == 2 and not kwargs and work.fits(*args):
            try:
                work.activation(args[1])
                info_once("the gate-up LoRA delta of fast batches is added in the activation")
                return None
            except Exception:  # nothing of the output is served from it: SGLang's activation overwrites it below
                logger.exception("the gate-up LoRA kernel failed; the fast hooks add the delta themselves from now on")
                _disable("its kernel failed")
        work.add_in_place()  # another call than the one offered for: the hook's own work, then SGLang's
        return original(*args, **kwargs)

    return silu_and_mul


PATCH = Patch("gate-up LoRA in the activation", MODULE, NAME, _make)


def activate() -> None:
    """Offer the gate-up work of fast batches to the activation."""
    global _placed
    _placed = True
    PATCH.activate()


def deactivate() -> None:
    global _placed
    _placed = False
    PATCH.deactivate()
