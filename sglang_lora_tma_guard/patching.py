"""One change to SGLang's code, and its whole life: wanted, placed, inert, removed.

Usage::

    from sglang_lora_tma_guard.patching import Patch

    def make(original, engaged):
        @functools.wraps(original)
        def init_lora_modules(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if engaged.on:
                check(self)
            return result
        return init_lora_modules

    CHECK = Patch("fused-shared-expert check", "sglang.srt.lora.lora_manager",
                  "LoRAManager.init_lora_modules", make)
    CHECK.activate()    # now, or as soon as SGLang imports the module; never raises
    CHECK.status()      # PatchStatus(wanted=True, installed=True, inert=False, ...)
    CHECK.deactivate()  # SGLang's own function is back (under other code's wrapper: ours inert)

Every fix of this package changes SGLang the same way: a plain ``functools.wraps`` function (which
TorchDynamo traces like any other; a wrapt ``FunctionWrapper`` it skips without a word) put in place
of one attribute, a module's function or a class's method, with wrapt's ``wrap_object``, when the
module that holds it is imported (wrapt's post-import hook, registered once) or at once when it is
imported already; ``unwrap_object`` takes it out again.

``make(original, engaged)`` builds the replacement, or returns None where this SGLang needs none
(the patch is then wanted and not installed, with the reason in its status); ``original`` is None
where the attribute does not exist in this SGLang. The replacement must
pass every call straight to ``original`` while ``engaged.on`` is False: where other code has wrapped
our function since, ``deactivate()`` cannot take it out of the call chain and switches it off
instead (*inert*), and ``activate()`` switches it on again. Our own function is recognised by
identity (``find_wrapper`` with the handle ``wrap_object`` returned), never by a marker.

All patches share one lock: they are placed from import hooks (in whatever thread imports SGLang),
from the plugin and from tests. Nothing here raises: a failure is logged, with the patch's name,
and SGLang's own code is left in place.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import wrapt

from .log import logger

LOCK = threading.RLock()


class Engaged:
    """A replacement's on/off switch, read on every call."""

    __slots__ = ("on",)

    def __init__(self, on: bool = True):
        self.on = on


@dataclass(frozen=True)
class PatchStatus:
    name: str
    target: str
    wanted: bool
    """``activate()`` was called and not undone."""
    imported: bool
    """SGLang's module holding the target is imported (and done importing)."""
    installed: bool
    """Our replacement is in the call chain of the target now (outermost or not)."""
    inert: bool
    """Installed but switched off: it passes every call through untouched."""
    note: str | None = None
    """Why a wanted patch is not installed: this SGLang needs none, or placing it failed."""

    @property
    def working(self) -> bool:
        return self.wanted and self.installed and not self.inert


# One Patch per name in a process, kept across importlib.reload of a module that makes its patches
# at import time: a reloaded module still knows the function it placed.
_PATCHES: dict[str, Patch] = globals().get("_PATCHES") or {}


class Patch:
    """A replacement for ``module.attribute`` (``attribute`` may be ``"Class.method"``)."""

    def __new__(cls, name: str, module: str, attribute: str, make):
        existing = _PATCHES.get(name)
        if existing is not None and (existing.module, existing.attribute) == (module, attribute):
            existing.make = make
            return existing
        patch = super().__new__(cls)
        patch._init(name, module, attribute, make)
        _PATCHES[name] = patch
        return patch

    def _init(self, name, module, attribute, make):
        self.name, self.module, self.attribute, self.make = name, module, attribute, make
        self.target = f"{module}.{attribute}"
        self._wanted = self._watching = False
        self._handle = self._engaged = None
        self._note: str | None = None

    def __repr__(self) -> str:
        return f"Patch({self.name!r}, {self.target!r})"

    # --- the lifecycle ---------------------------------------------------------------------------

    def activate(self) -> PatchStatus:
        """Place the replacement now, or when SGLang imports the module; turn an inert one back on."""
        try:
            with LOCK:
                self._wanted = True
                watch, self._watching = not self._watching, True
            if watch:
                # Outside the lock: wrapt runs the hook at once when the module is imported already,
                # and an import finishing in another thread runs it too; neither may wait on us.
                wrapt.register_post_import_hook(self._on_import, self.module)
            with LOCK:
                module = _imported(self.module)
                if module is not None and self._wanted:
                    self._place(module)
        except Exception:
            self._failed("could not be placed")
        return self.status()

    def deactivate(self) -> PatchStatus:
        """Put SGLang's own object back; under other code's wrapper, leave ours inert."""
        try:
            with LOCK:
                self._wanted = False
                module = sys.modules.get(self.module)
                if module is not None and self._handle is not None:
                    self._remove(module)
        except Exception:
            self._failed("could not be removed")
        return self.status()

    def replace(self) -> PatchStatus:
        """Build the replacement again (its inputs changed); where ours is not outermost, keep it."""
        try:
            with LOCK:
                module = _imported(self.module)
                if module is None or not self._wanted:
                    return self.status()
                if self._handle is not None:
                    if self._current(module) is not self._handle:
                        logger.warning("%s is wrapped by other code above the guard; "
                                       "its %s stays as it was built", self.target, self.name)
                        return self.status()
                    wrapt.unwrap_object(module, self.attribute, self._handle)
                    self._forget()
                self._place(module)
        except Exception:
            self._failed("could not be rebuilt")
        return self.status()

    @property
    def wanted(self) -> bool:
        """``activate()`` was called and not undone: one attribute read, no lock (for hot paths)."""
        return self._wanted

    def status(self) -> PatchStatus:
        with LOCK:
            module = sys.modules.get(self.module)
            current = self._current(module) if module is not None else None
            installed = self._in_chain(current)
            return PatchStatus(
                name=self.name, target=self.target, wanted=self._wanted,
                imported=_imported(self.module) is not None, installed=installed,
                inert=installed and not (self._engaged is not None and self._engaged.on),
                note=None if installed else self._note,
            )

    def original(self):
        """SGLang's own object under whatever wraps it now (None: the module is not imported)."""
        module = sys.modules.get(self.module)
        current = self._current(module) if module is not None else None
        return None if current is None else _unwrap(current)

    # --- placing and removing, under LOCK ---------------------------------------------------------

    def _on_import(self, module) -> None:
        # Runs inside SGLang's import of the module: an exception here would break that import, and
        # with it the server, so every failure is logged and the module left as it is.
        try:
            with LOCK:
                if self._wanted:
                    self._place(module)
        except Exception:
            self._failed("could not be placed")

    def _place(self, module) -> None:
        current = self._current(module)
        if self._handle is not None:
            if self._in_chain(current):
                self._engaged.on = True
                return
            self._forget()  # other code replaced the attribute wholesale: ours is gone
        engaged = Engaged()
        replacement = self.make(current, engaged)
        if replacement is None:
            self._note = (f"{self.target} does not exist in this SGLang" if current is None
                          else f"{self.target}: nothing to change in this SGLang")
            return
        self._handle = wrapt.wrap_object(module, self.attribute, lambda _original: replacement)
        self._engaged, self._note = engaged, None

    def _remove(self, module) -> None:
        try:
            removed = wrapt.unwrap_object(module, self.attribute, self._handle, missing_ok=True)
        except Exception:  # WrapperNotOutermostError and kin: a plain closure sits above ours
            removed = None
        if self._in_chain(self._current(module)):
            self._engaged.on = False
            logger.warning("%s is wrapped by other code above the guard, so its %s "
                           "cannot leave the call chain; it stays there inert, passing every call through "
                           "untouched", self.target, self.name)
            return
        if removed is None:
            logger.warning("%s was replaced by other code after the guard's %s was "
                           "placed; left as it is", self.target, self.name)
        self._forget()

    def _forget(self) -> None:
        # A wrapper that left our hands (replaced wholesale, or a class object someone still holds) must
        # not stay engaged: it passes calls through untouched from now on.
        if self._engaged is not None:
            self._engaged.on = False
        self._handle = self._engaged = None

    def _current(self, module):
        try:
            return wrapt.resolve_path(module, self.attribute)[2]
        except Exception:  # the attribute (or its class) is absent in this release
            return None

    def _in_chain(self, func) -> bool:
        if self._handle is None or func is None:
            return False
        try:
            return wrapt.find_wrapper(func, self._handle) is not None
        except Exception:  # a chain too deep to scan: say what is certain
            return func is self._handle

    def _failed(self, what: str) -> None:
        self._note = f"{self.name} {what} (see the log)"
        logger.exception("%s on %s %s; SGLang's own code is left in place. Please "
                         "report this with the output of `python -m sglang_lora_tma_guard.check`.",
                         self.name, self.target, what)


def _imported(name: str):
    """The module once its import has finished, else None (the import hook will come)."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _unwrap(func):
    seen = 0
    while hasattr(func, "__wrapped__") and seen < 64:
        func, seen = func.__wrapped__, seen + 1
    return func
