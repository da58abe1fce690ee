"""The moments of a server's life that every defect of the catalogue shares.

- **The launcher resolves the server arguments** (``ServerArgs.__post_init__`` up to 0.5.18,
  ``ServerArgs.resolve_once`` from 0.5.19; from 0.5.20 ``ServerArgs`` is a msgspec struct that
  calls the ``__post_init__`` it was built with, so only ``resolve_once`` can be patched there).
  Before that, for a LoRA server, every defect SGLang has may set fields on the raw record
  (:meth:`~sglang_lora_tma_guard.catalogue.Defect.server_args_changes`), and the record goes to each
  scheduler by pickle with them; then a deployment that would still meet a defect the guard refuses
  is stopped there, before any model is loaded. ``ServerArgs.check_server_args`` (the launcher calls
  it before starting the schedulers) does the same for a record resolved before the plugin loaded
  (``sglang.Engine(server_args=...)``), through SGLang's audited late write where there is one.
- **Each adapter SGLang loads** (``LoRAManager.load_lora_weights``, and ``..._from_tensors``): once its
  weights are read and normalised, before any pool slot is filled, every defect may fix it in place or
  say why it must not be served; the load then fails with the reasons, which SGLang turns into the
  answer to ``/load_lora_adapter`` (the server keeps serving the others) or, for ``--lora-paths``, into
  a scheduler that does not start.
- **Each scheduler wraps its layers for LoRA** (``LoRAManager.init_lora_modules``): just before, a
  defect may change what SGLang will wrap; just after (before CUDA graphs are captured), every defect
  may fix the LoRA-wrapped MoE layers or say why this scheduler must not serve, and it refuses to
  start with every reason at once (:class:`~sglang_lora_tma_guard.catalogue.RefusedDeployment`). A
  launcher without the plugin, or a model the launcher could not read, is caught here.

Each moment is a :class:`~sglang_lora_tma_guard.patching.Patch`; a server without LoRA passes them
untouched.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from . import defects
from .catalogue import Deployment, RefusedDeployment
from .log import logger
from .patching import LOCK, Patch

SERVER_ARGS_MODULE = "sglang.srt.server_args"
LORA_MANAGER_MODULE = "sglang.srt.lora.lora_manager"
SOURCE = "sglang-lora-tma-guard"
"""The name SGLang's audited late writes (``override``, ``_late_resolution``) record as the source."""


class _Switch:
    on = False
    """The guard is on in this process (``activate`` was called and not undone)."""


_switch = globals().get("_switch") or _Switch()


def active_defects() -> tuple:
    return defects.DEFECTS if _switch.on else ()


# --- the launcher ----------------------------------------------------------------------------------


def resolved(server_args) -> bool:
    """A record that went through resolution (a child's pickled copy among them) is final."""
    return bool(getattr(server_args, "_resolution_finished", False)
                or getattr(server_args, "_declarations_materialized", False))


def model_config_of(server_args) -> dict | None:
    """The model's ``config.json`` where ``model_path`` is a local folder (None: not known here)."""
    path = getattr(server_args, "model_path", None)
    if not isinstance(path, str):
        return None
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def prepare_launch(server_args, late: bool = False) -> None:
    """Set what the defects set for a LoRA server, then refuse what the guard refuses."""
    deployment = Deployment(args=server_args, model=model_config_of(server_args))
    if not deployment.lora:
        return
    present = [d for d in active_defects() if d.present().present is not False]
    changes = [change for defect in present for change in defect.server_args_changes(deployment)]
    changes = [c for c in changes if getattr(server_args, c.field, None) != c.value]
    if changes:
        _write(server_args, changes, late)
    reasons = [reason for defect in present if (reason := defect.refuses(deployment))]
    if reasons:
        raise RefusedDeployment(refusal_text(reasons))


def _write(server_args, changes, late: bool) -> None:
    if late and resolved(server_args):
        # SGLang's audited writes after resolution: _late_resolution (0.5.18) and override (0.5.16,
        # 0.5.17). From 0.5.19 a resolved record is read-only and nothing re-projects it: the
        # schedulers' check refuses what it must then.
        writer = getattr(server_args, "_late_resolution", None) or getattr(server_args, "override", None)
        if writer is None:
            logger.warning(
                "LoRA is enabled but these server arguments were resolved before the "
                "plugin loaded, and this SGLang cannot change them now; the schedulers will refuse to start "
                "where that matters. Pass %s yourself.", ", ".join(_flag(c) for c in changes))
            return
        writer(SOURCE, **{c.field: c.value for c in changes})
    else:
        for change in changes:
            setattr(server_args, change.field, change.value)
    for change in changes:
        logger.warning(change.message)


def _flag(change) -> str:
    name = "--" + change.field.replace("_", "-")
    return name if change.value is True else f"{name} {change.value}"


def refusal_text(reasons: list[str]) -> str:
    head = "sglang-lora-tma-guard: refusing to serve LoRA adapters on this MoE model, which SGLang would serve wrong"
    if len(reasons) == 1:
        return f"{head}: {reasons[0]}"
    return head + ":\n" + "\n".join(f"  - {reason}" for reason in reasons)


def _make_resolution(original, engaged):
    @functools.wraps(original)
    def resolve(self, *args, **kwargs):
        if engaged.on and _switch.on and not resolved(self):
            prepare_launch(self)
        return original(self, *args, **kwargs)

    return resolve


def _make_post_init(original, engaged):
    """Up to 0.5.18 the dataclass resolves in ``__post_init__``; from 0.5.19 ``resolve_once`` does."""
    if original is None or resolution_method(_server_args_class()) != "__post_init__":
        return None
    return _make_resolution(original, engaged)


def _make_resolve_once(original, engaged):
    return None if original is None else _make_resolution(original, engaged)


def _make_check_server_args(original, engaged):
    if original is None:
        return None

    @functools.wraps(original)
    def check_server_args(self, *args, **kwargs):
        if engaged.on and _switch.on:
            prepare_launch(self, late=True)
        return original(self, *args, **kwargs)

    return check_server_args


def resolution_method(server_args_class) -> str:
    """The method that starts resolution: ``resolve_once`` (0.5.19+) or ``__post_init__`` (up to 0.5.18)."""
    return "resolve_once" if hasattr(server_args_class, "resolve_once") else "__post_init__"


def _server_args_class():
    import sys

    return getattr(sys.modules.get(SERVER_ARGS_MODULE), "ServerArgs", None)


POST_INIT = Patch("server-argument fixes (__post_init__)", SERVER_ARGS_MODULE, "ServerArgs.__post_init__",
                  _make_post_init)
RESOLVE_ONCE = Patch("server-argument fixes (resolve_once)", SERVER_ARGS_MODULE, "ServerArgs.resolve_once",
                     _make_resolve_once)
CHECK_SERVER_ARGS = Patch("server-argument fixes (check_server_args)", SERVER_ARGS_MODULE,
                          "ServerArgs.check_server_args", _make_check_server_args)


# --- each scheduler ----------------------------------------------------------------------------------


def server_args_here():
    """The server arguments this process runs with, or None where they cannot be read."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:
        pass
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:
        return None


def moe_lora_layers(lora_manager) -> list:
    """``(layer_id, name, module)`` of every MoE layer SGLang wrapped for LoRA."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return [
        (layer_id, name, module)
        for layer_id, modules in enumerate(getattr(lora_manager, "lora_modules", None) or ())
        for name, module in (modules or {}).items()
        if isinstance(getattr(module, "base_layer", None), FusedMoE)
    ]


def after_lora_modules(lora_manager) -> None:
    """Every defect fixes the scheduler's LoRA-wrapped MoE layers, or says why it must not serve."""
    layers = moe_lora_layers(lora_manager)
    if not layers:
        return
    deployment = Deployment(args=server_args_here(), moe_lora_layers=True)
    reasons = [reason for defect in active_defects() if defect.present().present is not False
               and (reason := _scheduler_step(defect, layers, deployment))]
    if reasons:
        raise RefusedDeployment(refusal_text(reasons))


def _scheduler_step(defect, layers, deployment) -> str | None:
    """One defect's step; a step that fails leaves its defect unanswered, so the scheduler refuses."""
    try:
        return defect.on_lora_modules(layers, deployment)
    except Exception as exc:
        logger.exception("its check of %s failed in this scheduler", defect.id)
        return (f"the guard could not check {defect.id} on this scheduler's LoRA MoE layers ({type(exc).__name__}: "
                f"{exc}); please report this with the output of `python -m sglang_lora_tma_guard.check`")


def before_lora_modules(lora_manager) -> None:
    deployment = Deployment(args=server_args_here())
    for defect in active_defects():
        if defect.present().present is not False:
            defect.before_lora_modules(lora_manager, deployment)


def _make_init_lora_modules(original, engaged):
    if original is None:
        return None

    @functools.wraps(original)
    def init_lora_modules(self, *args, **kwargs):
        on = engaged.on and _switch.on
        if on:
            before_lora_modules(self)
        result = original(self, *args, **kwargs)
        if on:
            after_lora_modules(self)
        return result

    return init_lora_modules


INIT_LORA_MODULES = Patch("scheduler check (init_lora_modules)", LORA_MANAGER_MODULE,
                          "LoRAManager.init_lora_modules", _make_init_lora_modules)


# --- each adapter SGLang loads ---------------------------------------------------------------------------


def after_adapter_loaded(lora_manager, lora_ref) -> None:
    """Every defect fixes the adapter SGLang just read, or says why it must not be served: then the load
    fails with the reasons (SGLang answers ``/load_lora_adapter`` with them; at start-up it stops)."""
    adapter = getattr(lora_manager, "loras", {}).get(lora_ref.lora_id)
    if adapter is None:
        return
    deployment = Deployment(args=server_args_here())
    reasons = []
    for defect in active_defects():
        if defect.present().present is False:
            continue
        try:
            reason = defect.on_adapter(lora_manager, adapter, deployment)
        except Exception as exc:
            logger.exception("its check of %s failed on adapter %s", defect.id,
                             lora_ref.lora_name)
            reason = f"the guard could not check {defect.id} on it ({type(exc).__name__}: {exc})"
        if reason:
            reasons.append(reason)
    if reasons:
        lora_manager.loras.pop(lora_ref.lora_id, None)
        getattr(lora_manager, "configs", {}).pop(lora_ref.lora_id, None)
        head = f"sglang-lora-tma-guard: refusing LoRA adapter {lora_ref.lora_name!r}, which SGLang would serve wrong"
        raise ValueError(f"{head}: {reasons[0]}" if len(reasons) == 1
                         else head + ":\n" + "\n".join(f"  - {reason}" for reason in reasons))


def _make_load_lora_weights(original, engaged):
    if original is None:
        return None

    @functools.wraps(original)
    def load_lora_weights(self, lora_ref, *args, **kwargs):
        result = original(self, lora_ref, *args, **kwargs)
        if engaged.on and _switch.on:
            after_adapter_loaded(self, lora_ref)
        return result

    return load_lora_weights


LOAD_LORA_WEIGHTS = Patch("adapter check (load_lora_weights)", LORA_MANAGER_MODULE,
                          "LoRAManager.load_lora_weights", _make_load_lora_weights)
LOAD_LORA_WEIGHTS_FROM_TENSORS = Patch("adapter check (load_lora_weights_from_tensors)", LORA_MANAGER_MODULE,
                                       "LoRAManager.load_lora_weights_from_tensors", _make_load_lora_weights)

PATCHES = (POST_INIT, RESOLVE_ONCE, CHECK_SERVER_ARGS, INIT_LORA_MODULES, LOAD_LORA_WEIGHTS,
           LOAD_LORA_WEIGHTS_FROM_TENSORS)


# --- on and off --------------------------------------------------------------------------------------


def arm() -> None:
    """Arm both moments (the launcher's and each scheduler's) for every defect. Never raises."""
    with LOCK:
        _switch.on = True
    for patch in PATCHES:
        patch.activate()


def disarm() -> None:
    with LOCK:
        _switch.on = False
    for patch in PATCHES:
        patch.deactivate()


def activate(switch) -> None:
    """Arm both moments and every defect's own patches. Never raises."""
    arm()
    for defect in defects.DEFECTS:
        try:
            defect.activate(switch)
        except Exception:
            logger.exception("could not arm its fix for %s", defect.id)


def deactivate() -> None:
    """Take every patch off again, the last placed first (two defects may wrap one method: the outer one
    leaves first, so neither is left inert); inert where other code wrapped ours since. Never raises."""
    for defect in reversed(defects.DEFECTS):
        try:
            defect.deactivate()
        except Exception:
            logger.exception("could not take off its fix for %s", defect.id)
    disarm()


def active() -> bool:
    return _switch.on
