"""LoRA on a fused shared expert: SGLang's shared-experts fusion is turned off for LoRA servers.

Why: on DeepSeek-V3/R1, GLM-5/5.1, every GLM-4.5/4.6/4.7 and a few others, SGLang (0.5.11-0.5.23,
NVIDIA sm >= 80, no expert parallelism) folds the shared expert into the routed ones as expert
number ``routed`` and routes every token to it. Its LoRA MoE path does not know: the per-expert LoRA
buffers hold the routed experts only, and the ``fused_moe_lora`` kernel indexes them with the shared
expert's id, which lands on the *next* adapter slot's expert 0 (or past the buffer). The adapter's own
shared-expert LoRA is dropped by the loader without a word. Every adapter request is then wrong,
most from its first token; base-model requests are right. With ``--disable-shared-experts-fusion``
the shared expert is a plain MLP with its own LoRA wrappers, and every request is right.

What this module does, with the guard on, through SGLang's own ``HookRegistry``:

- before SGLang resolves its server arguments (``ServerArgs.resolve_once`` from 0.5.19,
  ``ServerArgs.__post_init__`` up to 0.5.18) it sets ``disable_shared_experts_fusion`` when the
  server serves LoRA (``enable_lora``, or ``lora_paths`` with ``enable_lora`` not False), so every
  scheduler receives the flag with its pickled arguments; one warning in the launcher says so;
- before ``ServerArgs.check_server_args`` (called by the launcher before it starts the schedulers) it
  does the same for a record resolved before any plugin loaded (``sglang.Engine(server_args=...)``);
- after ``LoRAManager.init_lora_modules`` in every scheduler it refuses to start, with the flag to
  pass, if a LoRA-wrapped MoE layer still has a fused shared expert (fail closed).

What it does not do: a server without LoRA keeps SGLang's choice, and an explicit
``--enforce-shared-experts-fusion`` (or ``--enable-waterfill``, which forces it) is the user's word:
it is left as it is, with a loud warning in the launcher and in each scheduler.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

import wrapt

logger = logging.getLogger("sglang_lora_tma_guard")

FLAG = "disable_shared_experts_fusion"
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
LORA_MANAGER_MODULE = "sglang.srt.lora.lora_manager"
SOURCE = "sglang-lora-tma-guard"
"""The name SGLang's audited late writes (``override``, ``_late_resolution``) record as the source."""

DISABLED_MESSAGE = (
    "sglang-lora-tma-guard: LoRA is enabled, so shared-experts fusion is turned off "
    "(as --disable-shared-experts-fusion): SGLang's LoRA MoE kernels read another adapter's "
    "weights for a fused shared expert and drop the adapter's own shared-expert LoRA"
)
FORCED_MESSAGE = (
    "sglang-lora-tma-guard: LoRA is enabled with shared-experts fusion forced by {why}: left as asked. "
    "LoRA ADAPTERS WILL BE WRONG on models whose shared expert SGLang fuses (DeepSeek-V3/R1, GLM-4.5+, "
    "GLM-5): their requests read another adapter's weights for the shared expert. Remove {why} "
    "to serve them correctly."
)

_lock = threading.Lock()
_wanted = False
_registered = False
_import_hook_registered = False
_manager_patched = None  # the wrapper on LoRAManager.init_lora_modules, the handle for unwrap_object


class FusedSharedExpertWithLoRA(RuntimeError):
    """A LoRA-wrapped MoE layer has a fused shared expert: this scheduler refuses to serve."""


def lora_requested(server_args) -> bool:
    """Does this server serve LoRA? ``--enable-lora``, or ``--lora-paths`` unless ``--enable-lora`` is False."""
    enable = getattr(server_args, "enable_lora", None)
    return enable is True or (enable is None and bool(getattr(server_args, "lora_paths", None)))


def fusion_forced_by(server_args) -> str | None:
    """The flag by which the user forces fusion, or None."""
    if getattr(server_args, "enforce_shared_experts_fusion", False):
        return "--enforce-shared-experts-fusion"
    if getattr(server_args, "enable_waterfill", False):
        return "--enable-waterfill"
    return None


def _resolved(server_args) -> bool:
    return bool(getattr(server_args, "_resolution_finished", False)
                or getattr(server_args, "_declarations_materialized", False))


def before_resolution(server_args, *args, **kwargs):
    """BEFORE hook on the method that starts resolution: decide on the raw arguments."""
    if _wanted and not _resolved(server_args):  # a resolved record (a pickled child copy) is final
        _turn_fusion_off(server_args, late=False)
    return None


def before_check_server_args(server_args, *args, **kwargs):
    """BEFORE hook on ``check_server_args``: a record resolved before any plugin was loaded."""
    if _wanted:
        _turn_fusion_off(server_args, late=True)
    return None


def _turn_fusion_off(server_args, late: bool) -> None:
    if not lora_requested(server_args) or getattr(server_args, FLAG, False):
        return
    forced = fusion_forced_by(server_args)
    if forced:
        logger.warning(FORCED_MESSAGE.format(why=forced))
        return
    if late and _resolved(server_args):
        # SGLang's audited writes after resolution: _late_resolution (0.5.18) and override (0.5.16,
        # 0.5.17). From 0.5.19 a resolved record is read-only and nothing re-projects it: the
        # scheduler's check (after LoRAManager.init_lora_modules) refuses a fused LoRA layer there.
        writer = getattr(server_args, "_late_resolution", None) or getattr(server_args, "override", None)
        if writer is None:
            logger.warning(
                "sglang-lora-tma-guard: LoRA is enabled but these server arguments were resolved before "
                "the plugin loaded, and this SGLang cannot change them now; if the model's shared expert "
                "is fused, every scheduler will refuse to start. Pass --disable-shared-experts-fusion.")
            return
        writer(SOURCE, **{FLAG: True})
    else:
        setattr(server_args, FLAG, True)
    logger.warning(DISABLED_MESSAGE)


def refuse_fused_lora_layers(lora_manager) -> None:
    """Raise :class:`FusedSharedExpertWithLoRA` if a LoRA-wrapped MoE layer has a fused shared expert."""
    fused = [
        (layer_id, name, base.num_fused_shared_experts, getattr(base, "num_experts", "?"))
        for layer_id, modules in enumerate(getattr(lora_manager, "lora_modules", None) or ())
        for name, module in (modules or {}).items()
        for base in [getattr(module, "base_layer", None)]
        if (getattr(base, "num_fused_shared_experts", 0) or 0) > 0
    ]
    if not fused:
        return
    layer_id, name, shared, experts = fused[0]
    forced = fusion_forced_by(_server_args_here())
    if forced:
        logger.warning(FORCED_MESSAGE.format(why=forced))
        return
    raise FusedSharedExpertWithLoRA(
        f"sglang-lora-tma-guard: refusing to serve LoRA adapters: {len(fused)} LoRA-wrapped MoE layer(s) have "
        f"a fused shared expert (first: layer {layer_id} {name}, {experts} experts of which {shared} fused "
        "shared). SGLang's LoRA MoE kernels would read another adapter's weights there and every adapter "
        "request would be wrong. Restart with --disable-shared-experts-fusion (the guard sets it by itself "
        "when it is loaded in the launcher before the server arguments are resolved)."
    )


def _server_args_here():
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


def _make_checked_init_lora_modules(original):
    @functools.wraps(original)
    def init_lora_modules(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _wanted:
            refuse_fused_lora_layers(self)
        return result

    return init_lora_modules


def _on_lora_manager_import(module) -> None:
    # Runs inside the import of SGLang's LoRA manager: a failure here is logged, never raised.
    try:
        with _lock:
            if _wanted:
                _patch_lora_manager(module)
    except Exception:
        logger.exception("sglang-lora-tma-guard: could not add the fused-shared-expert check to %s",
                         LORA_MANAGER_MODULE)


def _patch_lora_manager(module) -> None:
    global _manager_patched
    manager = getattr(module, "LoRAManager", None)
    if _manager_patched is None and hasattr(manager, "init_lora_modules"):
        _manager_patched = wrapt.wrap_object(manager, "init_lora_modules", _make_checked_init_lora_modules)


def _unpatch_lora_manager(module) -> None:
    global _manager_patched
    manager = getattr(module, "LoRAManager", None)
    if _manager_patched is not None and manager is not None:
        wrapt.unwrap_object(manager, "init_lora_modules", _manager_patched, missing_ok=True)
    _manager_patched = None


def resolution_method(server_args_class) -> str:
    """The method that starts resolution: ``resolve_once`` (0.5.19+) or ``__post_init__`` (up to 0.5.18).

    From 0.5.20 ``ServerArgs`` is a msgspec struct, which calls the ``__post_init__`` it had when the
    class was made: a hook placed there later is never called.
    """
    return "resolve_once" if hasattr(server_args_class, "resolve_once") else "__post_init__"


def activate() -> bool:
    """Turn the fix on in this process. True when SGLang's hook registry took the server-argument hooks.

    The hooks are registered once per process; SGLang applies them when ``load_plugins()`` finishes
    (the plugin calls this from inside it). The scheduler check is put on ``LoRAManager`` now, or as
    soon as SGLang imports its LoRA manager.
    """
    global _wanted, _registered, _import_hook_registered
    with _lock:
        _wanted = True
        watch, _import_hook_registered = not _import_hook_registered, True
        module = sys.modules.get(LORA_MANAGER_MODULE)
        if module is not None:
            _patch_lora_manager(module)
        if _registered:
            return True
    if watch:  # outside the lock: wrapt runs the hook at once when the module is already imported
        wrapt.register_post_import_hook(_on_lora_manager_import, LORA_MANAGER_MODULE)
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return False  # no SGLang, or one without a hook registry (before 0.5.11): nothing to fix
    with _lock:
        if not _registered:
            HookRegistry.register(f"{SERVER_ARGS}.{resolution_method(ServerArgs)}", before_resolution,
                                  HookType.BEFORE)
            HookRegistry.register(f"{SERVER_ARGS}.check_server_args", before_check_server_args,
                                  HookType.BEFORE)
            _registered = True
    return True


def deactivate() -> None:
    """Make the server-argument hooks inert and take the scheduler check off ``LoRAManager``.

    SGLang's registry cannot take a hook back once it is applied: ours stay in place and pass every
    call through untouched until :func:`activate` is called again.
    """
    global _wanted
    with _lock:
        _wanted = False
        _unpatch_lora_manager(sys.modules.get(LORA_MANAGER_MODULE))


def active() -> bool:
    return _wanted
