"""The wrapper around SGLang's ``_fused_moe_kernel_sequence`` and its install and removal.

Why it exists: when a tuned down-projection config says ``USE_TMA``, SGLang 0.5.11-0.5.16 lay the
intermediate MoE buffers out expert-sorted and block-padded, while the LoRA hooks
(``hooks.after_gate_up``, ``hooks.after_down``) read and write them as route-major
``(num_tokens, topk, N)``. The hooks then touch the wrong rows. ``down_moe_use_tma`` decides that
layout at the top of the function, so calling it with the flag False fixes it, as SGLang 0.5.17
does inside the function (strategy FLAG, ``SGLANG_LORA_TMA_GUARD=plain``). The default, strategy
WEIGHT_TMA, keeps the route-major buffers and gives both GEMMs their weights by TMA
(:mod:`sglang_lora_tma_guard.weight_tma`): bit-identical, and faster, on 0.5.11-0.5.23.

What it does not do: calls without hooks keep TMA, and nothing else about a call changes. (It does read, for
the fast path, whether a hooked call's activation is plain SiLU: :func:`sglang_lora_tma_guard.fused_act.sequence`.)

Where the installed function has no positional ``down_moe_use_tma`` to set (strategy FALLBACK),
hooked calls run on :mod:`sglang_lora_tma_guard.fallback` instead, and hook-less ones on SGLang.

The replacement is a plain ``functools.wraps`` closure, installed and removed with wrapt's
``wrap_object`` / ``unwrap_object``: TorchDynamo traces a plain function like any other, whereas a
wrapt ``FunctionWrapper`` in the same place is skipped by it without a word, and a guard that a
compiled caller does not run guards nothing.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, dataclass

from . import fused_act, weight_tma
from .inspection import (
    TARGET,
    TARGET_MODULE,
    TARGET_NAME,
    Inspection,
    Strategy,
    inspect_target,
    sglang_version,
    version_note,
)
from .log import logger
from .patching import LOCK, Engaged, Patch


@dataclass
class _State:
    """What the guard decided in this process; read and written under the patches' lock."""

    weight_tma: bool = True
    """False: the plain fix only (``SGLANG_LORA_TMA_GUARD=plain``)."""
    inspection: Inspection | None = None
    """The strategy read from the installed function when the patch was last built."""


# Kept across importlib.reload of this module, as the patch itself is (see patching.Patch).
_state: _State = globals().get("_state") or _State()


@dataclass(frozen=True)
class GuardStatus:
    active: bool
    """``activate()`` was called and not undone, and the guard does its work (or has none to do)."""
    installed: bool
    """The guard's wrapper is in the call chain of the module attribute now (outermost or not)."""
    inert: bool
    """Installed but switched off: it passes every call through untouched (``deactivate()`` under
    other code's wrapper)."""
    target_imported: bool
    strategy: Strategy | None
    reason: str | None
    sglang_version: str | None
    target: str = TARGET

    def as_dict(self) -> dict:
        """Plain values only (the strategy as its string), for JSON and for pickles read by others."""
        return {**asdict(self), "strategy": self.strategy.value if self.strategy else None}


def hooks_touch_buffers(hooks) -> bool:
    """Upstream's test: a hooks object with ``after_gate_up`` or ``after_down`` set.

    A hooks object of another shape is never an error here: the call then goes through as it
    came, and SGLang meets the object, and raises about it, exactly as it would without us.
    """
    try:
        return bool(hooks) and (
            getattr(hooks, "after_gate_up", None) is not None
            or getattr(hooks, "after_down", None) is not None
        )
    except Exception:
        return False


def _hooks_of(args, kwargs, hooks_at):
    if hooks_at is not None and len(args) > hooks_at:
        return args[hooks_at]
    return kwargs.get("hooks")


def make_guarded(original, inspection: Inspection, variant=None, engaged: Engaged | None = None):
    """Build the replacement for ``original`` from its inspection (WEIGHT_TMA, FLAG or FALLBACK).

    ``variant``: the weight-TMA copy of ``original`` (built here when the strategy asks for it and
    none is given); ``engaged``: the wrapper's on/off switch (always on when not given).
    """
    engaged = engaged or Engaged()
    if inspection.strategy is Strategy.FALLBACK:
        return _make_fallback_guarded(original, inspection, engaged)
    flag_at = inspection.flag_index
    hooks_at = inspection.hooks_index
    # A copy of SGLang's own function whose two GEMM launches take the weights by TMA; it is given
    # only hooked calls that asked for TMA on block-fp8 weights (the path the variant was verified
    # on), and always with down_moe_use_tma=False.
    if variant is None and inspection.strategy is Strategy.WEIGHT_TMA:
        variant = weight_tma.build(original)
    plain_silu = fused_act.plain_silu_reader(original)

    @functools.wraps(original)
    def _fused_moe_kernel_sequence(*args, **kwargs):
        if not engaged.on:
            return original(*args, **kwargs)
        hooks = _hooks_of(args, kwargs, hooks_at)
        if hooks is None or not hooks_touch_buffers(hooks):
            return original(*args, **kwargs)
        # The hooks index the buffers as (num_tokens, topk, N); only the non-TMA path stores
        # them that way.
        if len(args) > flag_at:
            requested = args[flag_at]
            args = (*args[:flag_at], False, *args[flag_at + 1 :])
        else:
            requested = kwargs.get("down_moe_use_tma", False)
            if "down_moe_use_tma" in kwargs:
                kwargs["down_moe_use_tma"] = False
        run = variant if variant is not None and requested and kwargs.get("use_fp8_w8a8") and kwargs.get(
            "block_shape") else original
        if plain_silu is None or not fused_act.placed() or torch_compiling():
            return run(*args, **kwargs)
        with fused_act.sequence(plain_silu(args, kwargs)):  # what its activation is, for the fast hooks
            return run(*args, **kwargs)

    return _fused_moe_kernel_sequence


def torch_compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def _make_fallback_guarded(original, inspection: Inspection, engaged: Engaged):
    """Hooked calls go to the route-major fallback, their arguments bound by name; others to SGLang."""
    from . import fallback  # Triton is imported only where this strategy applies

    signature = inspect.signature(original)
    hooks_at = inspection.hooks_index

    @functools.wraps(original)
    def _fused_moe_kernel_sequence(*args, **kwargs):
        hooks = _hooks_of(args, kwargs, hooks_at)
        if not engaged.on or hooks is None or not hooks_touch_buffers(hooks):
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # SGLang raises its own error about the arguments
        bound.apply_defaults()
        # TMA switches, whatever their name, do not matter here: the fallback never uses TMA.
        unknown = sorted(
            name for name, value in bound.arguments.items()
            if name not in fallback.KNOWN and "tma" not in name
            and value is not signature.parameters[name].default
        )
        if unknown:
            raise fallback.FallbackUnsupported(
                f"sglang-lora-tma-guard: the fallback does not know the arguments {unknown} of this "
                f"SGLang's {TARGET_NAME}; refusing rather than risking garbled output"
            )
        return fallback.fused_moe_hooked(bound.arguments)

    return _fused_moe_kernel_sequence


def _make(original, engaged: Engaged):
    """The patch's builder: inspect the installed function, build the weight-TMA copy where asked."""
    inspection = inspect_target(original, weight_tma=_state.weight_tma)
    version = sglang_version()
    note = version_note(version)
    if note:
        logger.info("%s", note)
    variant = None
    if inspection.strategy is Strategy.WEIGHT_TMA:
        try:
            variant = weight_tma.build(original)
        except Exception as exc:  # the copy did not build: the plain fix is always possible
            logger.warning(
                "the weight-TMA variant of %s did not build (%s: %s); "
                "using the plain fix", TARGET, type(exc).__name__, exc,
            )
            inspection = inspect_target(original, weight_tma=False)
    _state.inspection = inspection
    if inspection.strategy.installs_wrapper:
        logger.info(
            "SGLang %s, strategy %s: %s in %s",
            version, inspection.strategy.name, inspection.reason, TARGET,
        )
        if inspection.strategy is Strategy.FLAG and inspection.weight_tma_unavailable and _state.weight_tma:
            logger.info("no weight TMA for hooked calls: %s",
                        inspection.weight_tma_unavailable)
        return make_guarded(original, inspection, variant, engaged)
    if inspection.strategy is Strategy.UNSUPPORTED:
        logger.warning(
            "SGLang %s, strategy %s: %s. Not patched: LoRA adapters on MoE "
            "models may still produce garbled output where a tuned config turns TMA on.",
            version, inspection.strategy.name, inspection.reason,
        )
    else:
        logger.info(
            "SGLang %s, strategy %s: %s; nothing to patch",
            version, inspection.strategy.name, inspection.reason,
        )
    return None


PATCH = Patch("TMA guard", TARGET_MODULE, TARGET_NAME, _make)


def activate(weight_tma: bool = True) -> GuardStatus:
    """Guard ``_fused_moe_kernel_sequence`` now, or as soon as its module is imported. Never raises.

    ``weight_tma=False`` keeps the plain fix (hooked calls run with ``down_moe_use_tma=False``)
    even where the weight-TMA variant could be built. Idempotent: a second call with the same
    choice (a second ``load_plugins()``, another thread) installs nothing twice; another choice
    rebuilds the installed wrapper where it is outermost (else the current one stays, with a
    warning). A wrapper left inert by ``deactivate()`` under other code's wrapper is turned back on.
    """
    with LOCK:
        changed = _state.weight_tma != weight_tma
        _state.weight_tma = weight_tma
        was_installed = PATCH.status().installed
    PATCH.activate()
    if changed and was_installed:
        PATCH.replace()
    return status()


def deactivate() -> GuardStatus:
    """Put the original function object back and stop guarding later imports. Never raises.

    Where other code has wrapped the guard's wrapper since (a ``functools.wraps`` closure set on
    the module, an ``AROUND`` hook of SGLang's registry), the wrapper cannot leave the call chain:
    it stays there inert, passing every call through untouched, until ``activate()``.
    """
    with LOCK:
        PATCH.deactivate()
        if not PATCH.status().installed:
            _state.inspection = None
        return status()


def status() -> GuardStatus:
    """What the guard does in this process now, read from the module and the wrapper themselves."""
    with LOCK:
        patch = PATCH.status()
        inspection = _state.inspection if (patch.installed or patch.wanted) else None
        return GuardStatus(
            active=patch.wanted and (patch.working or inspection is None or not inspection.strategy.installs_wrapper),
            installed=patch.installed,
            inert=patch.inert,
            target_imported=patch.imported,
            strategy=inspection.strategy if inspection else None,
            reason=inspection.reason if inspection else None,
            sglang_version=sglang_version(),
        )
