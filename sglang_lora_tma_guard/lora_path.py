"""SGLang's LoRA MoE hooks, built by :mod:`~sglang_lora_tma_guard.lora_moe` where that is right or fast.

SGLang's MoE runner builds a batch's LoRA hooks with ``sglang.srt.lora.lora_moe_runners.build_lora_hooks``,
looked up at call time (0.5.11-0.5.23), so that module attribute is the seam: a plain
``functools.wraps`` closure (traced by TorchDynamo like any function) placed with wrapt's
``wrap_object`` and taken away with ``unwrap_object``. What it builds, by mode:

- ``fast`` (``SGLANG_LORA_TMA_GUARD=fast``): every batch it covers gets the virtual-experts hooks of
  :mod:`~sglang_lora_tma_guard.lora_moe` (each adapter's true rank, gate and up halves from their
  own A and B); what it does not cover goes to SGLang's hooks, with one log line per reason. For large
  batches the down delta goes into the down GEMM (:mod:`~sglang_lora_tma_guard.fused_lora`), and, where
  placed, the gate-up delta into the activation (:mod:`~sglang_lora_tma_guard.fused_act`).
- ``correct`` (the guard's other values): only where SGLang's own virtual-experts path is wrong
  (``--lora-use-virtual-experts`` on a gated MoE, SGLang 0.5.11-0.5.22: the up half of the gate-up
  delta computed from the gate half's A) are the hooks replaced; everything else is SGLang's own.

Beside the gate-up GEMM. The fast hooks are built before SGLang's sequence launches its gate-up GEMM, and
a batch's routing and gate-up shrink read only what the builder is given (the routes, the hidden states),
so the builder launches them there, on a second CUDA stream forked from the current one: they run beside
the base GEMM instead of after it. ``after_gate_up`` makes the current stream wait for them (the join)
before anything reads their output (and only then lets go of the builder's tensors they read, so that none is
reused while they run); ``after_down`` joins too, so no path leaves the fork open. The shrink's
output is used only if the gate-up hook is given the very tensor the builder was (SGLang's sequence passes
it on, and writes it, for an in-place call, only after the down GEMM); otherwise the hook computes the
shrink from what it is given. Under ``torch.compile``, on the CPU and where :data:`OVERLAP` is off, nothing
runs on a second stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from enum import Enum

from . import fused_act, fused_lora
from .log import logger
from .patching import LOCK, Engaged, Patch

MODULE = "sglang.srt.lora.lora_moe_runners"
NAME = "build_lora_hooks"
TARGET = f"{MODULE}.{NAME}"


class Mode(str, Enum):
    FAST = "fast"
    """Every covered batch on the virtual-experts hooks of this package."""
    CORRECT = "correct"
    """SGLang's hooks, except its virtual-experts path where that is wrong (replaced by this package's)."""


# --------------------------------------------------------------------------------------------------
# What the package's hooks cover, and the hooks.


def _capturing(module) -> bool:
    probe = getattr(module, "get_is_capture_mode", None)
    return bool(probe()) if callable(probe) else False


def is_gated(lora_info) -> bool:
    """SGLang's own test: a gated gate-up A holds gate and up ranks, ``2 * max_lora_rank`` rows."""
    return lora_info.gate_up_lora_a_weights.shape[2] > lora_info.max_lora_rank


def not_covered(lora_info, hidden_states, topk_ids) -> str | None:
    """Why this batch goes to SGLang's hooks, or None: the package's hooks compute it."""
    r = int(lora_info.max_lora_rank)
    ga, gb = lora_info.gate_up_lora_a_weights, lora_info.gate_up_lora_b_weights
    da, db = lora_info.down_lora_a_weights, lora_info.down_lora_b_weights
    if getattr(lora_info, "fully_sharded", False) and getattr(lora_info, "tp_size", 1) > 1:
        return "fully sharded LoRA weights at tp > 1 (LoRAInfo.fully_sharded)"
    import torch

    device = hidden_states.device.type
    if device != "cuda" and not (device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"tensors on {device}, not a CUDA device"
    if hidden_states.dtype not in (torch.bfloat16, torch.float16):
        return f"activations in {hidden_states.dtype}"
    if any(w is None or w.dim() != 4 or w.dtype != hidden_states.dtype for w in (ga, gb, da, db)):
        return "LoRA weights of another shape or dtype than the activations"
    experts = gb.shape[1]
    halves = ga.shape[2] // r if r else 0
    if (halves not in (1, 2) or ga.shape[2] != halves * r or gb.shape[3] != r or da.shape[2] != r
            or db.shape[3] != r or da.shape[1] != experts or ga.shape[1] not in (1, experts)
            or db.shape[1] not in (1, experts) or ga.shape[3] != hidden_states.shape[-1]
            or gb.shape[2] % halves):
        return (f"LoRA buffers of an unexpected layout (gate-up A {tuple(ga.shape)}, B {tuple(gb.shape)}, "
                f"down A {tuple(da.shape)}, B {tuple(db.shape)}, rank {r})")
    slots = lora_info.lora_ranks.numel()
    if slots > ga.shape[0] or lora_info.adapter_enabled.numel() < slots:
        return (f"{slots} adapter slots for LoRA buffers of {ga.shape[0]} "
                f"and {lora_info.adapter_enabled.numel()} enabled flags")
    from .lora_moe import MAX_KEYS, MAX_RANK  # a block's routing entry holds its key and rank in 31 bits

    if r > MAX_RANK or slots * experts > MAX_KEYS:
        return f"rank {r} or {slots} slots x {experts} experts past the routing's {MAX_RANK} / {MAX_KEYS}"
    if topk_ids is None or topk_ids.dim() != 2 or hidden_states.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        return "routing of an unexpected shape"
    mapping = getattr(lora_info, "token_lora_mapping", None)
    if mapping is not None and mapping.shape[0] != topk_ids.shape[0]:
        return f"a token-to-adapter map of {mapping.shape[0]} tokens for {topk_ids.shape[0]}"
    return None


def token_adapters(lora_info, tokens: int):
    """Each token's adapter slot (-1: none). SGLang 0.5.13+ gives it; 0.5.11-0.5.12 from the segments."""
    import torch

    mapping = getattr(lora_info, "token_lora_mapping", None)
    if mapping is not None:
        return mapping.to(torch.int32)
    seg_indptr, owners = lora_info.seg_indptr, lora_info.req_to_lora
    positions = torch.arange(tokens, device=seg_indptr.device, dtype=seg_indptr.dtype)
    segment = torch.searchsorted(seg_indptr, positions, right=True) - 1
    inside = (segment >= 0) & (segment < owners.numel())
    adapter = owners.to(torch.int32)[segment.clamp(0, max(owners.numel() - 1, 0))]
    return torch.where(inside, adapter, torch.full_like(adapter, -1))


def build_hooks(original, hidden_states, lora_info, topk_ids):
    """This package's hooks for the batch, or SGLang's (``original``) where it is not covered."""
    import torch

    from . import lora_moe, tuning  # torch and Triton: imported when SGLang builds its first LoRA batch

    module = sys.modules.get(MODULE)
    if lora_info is None or lora_info.max_lora_rank == 0:
        return original(hidden_states, lora_info, topk_ids)
    if not _capturing(module) and not getattr(lora_info, "has_active_lora", True):
        return original(hidden_states, lora_info, topk_ids)  # no adapter in the batch: SGLang skips it
    reason = not_covered(lora_info, hidden_states, topk_ids)
    if reason is not None:
        _say_once(reason)
        return sglang_hooks_for(original, hidden_states, lora_info, topk_ids)

    tokens, topk = topk_ids.shape
    experts = lora_info.gate_up_lora_b_weights.shape[1]
    ranks, enabled = lora_info.lora_ranks.to(torch.int32), lora_info.adapter_enabled.to(torch.int32)
    r, halves = int(lora_info.max_lora_rank), 2 if is_gated(lora_info) else 1
    tiles = tuning.plan(tokens * topk, hidden_states.shape[1], lora_info.down_lora_a_weights.shape[3], experts,
                        ranks.numel(), r)
    token_lora = token_adapters(lora_info, tokens)
    early = OVERLAP and not torch.compiler.is_compiling()
    side = side_stream(hidden_states.device) if early else None
    def gate_up_ranks(x):  # the gate-up shrink of hidden states x
        return lora_moe.shrink(x, lora_info.gate_up_lora_a_weights, routing, topk=topk, max_rank=r, halves=halves,
                               config=tiles.gate_up)

    with beside(side):  # before the gate-up GEMM, which needs neither
        routing = lora_moe.route(topk_ids, token_lora, enabled, ranks, experts, tiles.block_m)
        t_gate_up = gate_up_ranks(hidden_states) if early and not tiles.gate_up.one_kernel else None
    join = Join(side, topk_ids, token_lora, enabled, ranks)  # what the second stream reads lives until the join
    shape = tuple(topk_ids.shape)
    theirs = []
    down_work = None
    epilogue_rank = fused_lora.epilogue_rank(tokens * topk, r, lora_info.down_lora_a_weights.shape[3])
    if epilogue_rank is not None:
        down_work = fused_lora.DownWork(topk_ids, lora_info.down_lora_a_weights, lora_info.down_lora_b_weights,
                                        routing, token_lora, enabled, ranks, r, tiles.down, epilogue_rank)

    def sglang_hooks():  # built only if a call comes with buffers this batch's routing does not fit
        if not theirs:
            theirs.append(sglang_hooks_for(original, hidden_states, lora_info, topk_ids))
        return theirs[0]

    def fits(x, cache, x_rows, x_width) -> bool:
        return (tuple(cache.shape[:2]) == shape and cache.dim() == 3 and x.dim() == 2 and x.shape == (x_rows, x_width)
                and x.dtype == cache.dtype == hidden_states.dtype)

    def after_gate_up(hidden, cache1, topk_weights, topk_ids_now):
        held = join.inputs  # the routing's inputs, which a gate-up offer reads too (the join lets go of them)
        join()
        if (tuple(topk_ids_now.shape) != shape or cache1.shape[2] != lora_info.gate_up_lora_b_weights.shape[2]
                or not fits(hidden, cache1, tokens, hidden_states.shape[1])):
            _say_once("a gate-up call whose buffers differ from its batch's")
            return sglang_hooks().after_gate_up(hidden, cache1, topk_weights, topk_ids_now)
        if halves == 2 and len(held) == 4 and cache1.is_contiguous() and fused_act.ready():
            t = t_gate_up if t_gate_up is not None and hidden is hidden_states else gate_up_ranks(hidden)
            fused_act.offer(fused_act.ActWork(cache1, t, lora_info.gate_up_lora_b_weights, routing, *held, r,
                                              tiles.gate_up))  # the activation that follows adds the delta
        elif t_gate_up is not None and hidden is hidden_states:
            lora_moe.expand(cache1, t_gate_up, lora_info.gate_up_lora_b_weights, routing, max_rank=r, halves=halves,
                            topk_weights=None, config=tiles.gate_up)
        else:
            lora_moe.add_delta(cache1, hidden, lora_info.gate_up_lora_a_weights, lora_info.gate_up_lora_b_weights,
                               routing, max_rank=r, halves=halves, config=tiles.gate_up)
        if down_work is not None:
            fused_lora.offer(down_work)  # the down launch that follows may add the down delta itself

    def after_down(activation, cache3, topk_weights, topk_ids_now):
        join()
        if down_work is not None and down_work.took(cache3):
            return  # the down GEMM added it in its epilogue
        if (tuple(topk_ids_now.shape) != shape or cache3.shape[2] != lora_info.down_lora_b_weights.shape[2]
                or not fits(activation, cache3, tokens * topk, lora_info.down_lora_a_weights.shape[3])):
            _say_once("a down call whose buffers differ from its batch's")
            return sglang_hooks().after_down(activation, cache3, topk_weights, topk_ids_now)
        lora_moe.add_delta(cache3, activation, lora_info.down_lora_a_weights, lora_info.down_lora_b_weights,
                           routing, max_rank=r, halves=1, topk_weights=topk_weights, config=tiles.down)

    return module.LoRAHooks(after_gate_up=after_gate_up, after_down=after_down)


OVERLAP = True
"""Launch a fast batch's routing and gate-up shrink when its hooks are built, beside the gate-up GEMM (see the
module docstring). Off (benchmarks' A/B), they run in the gate-up hook, after the GEMM, on its stream."""

_side_streams: dict = {}


def side_stream(device):
    """The second stream of ``device`` (one a device, made on first use), or None: not a CUDA device, or a
    graph being captured before the stream exists (SGLang runs each batch size once before its capture)."""
    import torch

    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None and not torch.cuda.is_current_stream_capturing():
        stream = _side_streams[index] = torch.cuda.Stream(index)
    return stream


@contextlib.contextmanager
def beside(side):
    """Run the block's launches on ``side`` after what the current stream holds so far (None: on the current
    stream). Their tensors are allocated on ``side``: freed, the caching allocator gives them only to later
    work on ``side``, which the next fork orders after everything the current stream holds then."""
    if side is None:
        yield
        return
    import torch

    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


class Join:
    """Calling it makes the current stream wait for the work launched on ``side`` (once; None: nothing to wait
    for), then lets go of ``inputs``, the current stream's tensors that work reads. Until then none of them is
    freed: the caching allocator would hand a freed block at once to the current stream's next allocation (the
    gate-up GEMM's output), which the current stream may write while the second one still reads the block."""

    def __init__(self, side, *inputs):
        self.side, self.inputs = side, inputs

    def __call__(self) -> None:
        side, self.side = self.side, None
        if side is not None:
            import torch

            torch.cuda.current_stream(side.device).wait_stream(side)
        self.inputs = ()


def sglang_hooks_for(original, hidden_states, lora_info, topk_ids):
    """SGLang's own hooks for a batch the fast path does not take: its default path where it would
    take its virtual-experts path on a gated MoE in a release where that path is wrong."""
    if (getattr(lora_info, "lora_use_virtual_experts", False) and is_gated(lora_info)
            and not _state.ve_fixed):
        lora_info = dataclasses.replace(lora_info, lora_use_virtual_experts=False)
    return original(hidden_states, lora_info, topk_ids)


_said: set[str] = set()


def _say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        logger.warning("this LoRA MoE batch goes to SGLang's own LoRA hooks: %s "
                       "(logged once)", reason)


# --------------------------------------------------------------------------------------------------
# SGLang's virtual-experts path: wrong on gated MoE up to 0.5.22.


def virtual_experts_fixed_upstream(module=None) -> bool:
    """SGLang 0.5.23 gives each half of a gated gate-up its own A (``a_output_slices``). Read from
    the installed code (the file of ``module``, SGLang's LoRA MoE runners by default), not the
    version; source that cannot be read counts as not fixed (this package's hooks are right either
    way)."""
    from .catalogue import source_of

    return "a_output_slices" in (source_of(getattr(module, "__name__", MODULE)) or "")


def replaces(mode: Mode, lora_info, ve_fixed: bool) -> bool:
    """Does this batch get the package's hooks in ``mode``?"""
    if lora_info is None:
        return False
    if mode is Mode.FAST:
        return True
    return (bool(getattr(lora_info, "lora_use_virtual_experts", False)) and not ve_fixed
            and lora_info.max_lora_rank > 0 and is_gated(lora_info))


# --------------------------------------------------------------------------------------------------
# Install and removal.


@dataclass
class _State:
    mode: Mode | None = None
    """Wanted mode; None: not wanted."""
    ve_fixed: bool = False
    """SGLang's virtual-experts path is right here (read once, when the builder is placed)."""


_state: _State = globals().get("_state") or _State()


def make_build(original, state: _State, engaged: Engaged):
    @functools.wraps(original)
    def build_lora_hooks(hidden_states, lora_info, topk_ids):
        mode = state.mode
        if engaged.on and mode is not None and replaces(mode, lora_info, state.ve_fixed):
            return build_hooks(original, hidden_states, lora_info, topk_ids)
        return original(hidden_states, lora_info, topk_ids)

    return build_lora_hooks


def _make(original, engaged: Engaged):
    module = sys.modules.get(MODULE)
    if not callable(original) or not hasattr(module, "LoRAHooks"):
        logger.warning("%s not found; SGLang's LoRA MoE hooks are left as they are", TARGET)
        return None
    _state.ve_fixed = virtual_experts_fixed_upstream()
    if _state.mode is Mode.FAST:
        logger.info("LoRA MoE deltas on the fast virtual-experts path (%s)", TARGET)
    elif not _state.ve_fixed:
        logger.info("--lora-use-virtual-experts on a gated MoE is corrected "
                    "(SGLang's path computes the up half from the gate half's A)")
    return make_build(original, _state, engaged)


PATCH = Patch("LoRA MoE hook builder", MODULE, NAME, _make)


def activate(mode: Mode) -> None:
    """Build LoRA MoE hooks in ``mode`` from now on (on import of SGLang's module, or at once). Never raises."""
    try:
        with LOCK:
            _state.mode = Mode(mode)
    except ValueError:
        logger.exception("unknown LoRA MoE mode %r; SGLang's hooks are used", mode)
        return
    PATCH.activate()
    if _state.mode is Mode.FAST:
        fused_lora.activate()  # the down delta in the down GEMM, for the batches it is measured faster on
        if fused_act.BY_FAST:
            fused_act.activate()  # the gate-up delta in the activation, likewise
    else:
        fused_lora.deactivate()
        fused_act.deactivate()


def deactivate() -> None:
    """SGLang's own hook builder again; under other code's wrapper, ours stays and passes through. Never raises."""
    with LOCK:
        _state.mode = None
    PATCH.deactivate()
    fused_lora.deactivate()
    fused_act.deactivate()


def bypassed_by(server_args) -> str | None:
    """Why this server's MoE LoRA never reaches ``build_lora_hooks``, or None.

    SGLang 0.5.23's ``--lora-backend triton_v2`` with a ``--moe-runner-backend lora_*`` engine runs the
    LoRA-wrapped MoE layer itself (``FusedMoEWithLoRA`` replaces its MoE core), so no hook builder is called:
    neither SGLang's hooks nor this package's are used there.
    """
    runner = str(getattr(server_args, "moe_runner_backend", "") or "")
    if getattr(server_args, "lora_backend", None) == "triton_v2" and runner.startswith("lora"):
        return f"--lora-backend triton_v2 with --moe-runner-backend {runner}: SGLang's own LoRA MoE engine, no hooks"
    return None


@dataclass(frozen=True)
class PathStatus:
    mode: str | None
    installed: bool
    virtual_experts_fixed_upstream: bool | None
    bypassed: str | None = None
    """This server's MoE LoRA does not go through any hook builder (:func:`bypassed_by`)."""

    def describe(self) -> str:
        if self.bypassed:
            return f"no LoRA MoE hooks are built here ({self.bypassed})"
        if self.mode is None:
            return "SGLang's own LoRA MoE hooks"
        if self.mode == Mode.FAST:
            from . import tuning  # torch: only where the fast path is on

            widths_by_rank: dict[int, list[str]] = {}
            for k, entries in sorted(fused_lora.faster_from_routes(tuning._gpu()).items()):
                widths_by_rank.setdefault(max(rank for rank, _ in entries), []).append(str(k))
            where = ", ".join(f"up to rank {rank} at a down GEMM K of {_either(widths)}"
                              for rank, widths in sorted(widths_by_rank.items()))
            act = "the gate-up expand in the SiLU activation; " if fused_act.BY_FAST else ""
            return ("fast virtual-experts LoRA MoE path (SGLang's hooks where it does not cover a batch; "
                    f"{act}the down expand in the down GEMM for large block-fp8 batches {where})")
        if self.virtual_experts_fixed_upstream:
            return "SGLang's own LoRA MoE hooks (its virtual-experts path is right in this release)"
        return "SGLang's own LoRA MoE hooks; --lora-use-virtual-experts on gated MoE corrected"


def _either(words: list[str]) -> str:
    """``["256", "384"]`` as ``256 or 384``."""
    *most, last = words
    return f"{', '.join(most)} or {last}" if most else last


def status() -> PathStatus:
    from .serving import server_args_here

    bypassed = bypassed_by(server_args_here())
    with LOCK:
        patch = PATCH.status()
        mode = _state.mode.value if _state.mode is not None else None
        return PathStatus(mode=mode, installed=patch.working and not bypassed, bypassed=bypassed,
                          virtual_experts_fixed_upstream=virtual_experts_fixed_upstream() if patch.imported else None)
