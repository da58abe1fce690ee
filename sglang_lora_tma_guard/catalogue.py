"""Every known way SGLang 0.5.11-0.5.23 serves LoRA on Mixture-of-Experts models wrong, and what the guard does.

Usage::

    from sglang_lora_tma_guard.catalogue import Deployment
    from sglang_lora_tma_guard.defects import DEFECTS, assess

    for defect in DEFECTS:
        found = defect.present()       # read from the installed SGLang's code, not its version
        print(defect.id, found.present, found.evidence, defect.does)
    assess(Deployment(args=server_args, model=config))   # one Assessment each

Each defect is one module of :mod:`sglang_lora_tma_guard.defects` with one :class:`Defect`: what it
is (``title``, the ``releases`` that have it by their source, who is ``exposed``), how the guard
answers it (``remedy``: it fixes it, or refuses to start a server that would meet it, with ``does``
saying how), and the few functions the plugin, ``check`` and the README table all read:

- :meth:`Defect.present`: does the installed SGLang have the defect, read from its files;
- :meth:`Defect.affects`: does a deployment (server arguments, the model's ``config.json``) meet it;
- :meth:`Defect.server_args_changes`: the server arguments the launcher sets for a LoRA server;
- :meth:`Defect.refusal`: why a deployment must not start (the launcher and every scheduler ask);
- :meth:`Defect.on_lora_modules`: each scheduler, once SGLang has wrapped its layers for LoRA;
- :meth:`Defect.activate` / :meth:`Defect.deactivate`: the defect's own patches, if any.

The seams they share (the resolution of the server arguments, and ``LoRAManager.init_lora_modules``)
are patched once, in :mod:`sglang_lora_tma_guard.serving`, and call every active defect.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass


class Remedy(str, enum.Enum):
    FIX = "fix"
    """The guard makes SGLang serve it right."""
    REFUSE = "refuse"
    """The guard stops a server that would meet it before it serves, naming what to change."""


@dataclass(frozen=True)
class Presence:
    present: bool | None
    """The installed SGLang has the defect (None: its code could not be read; treated as present)."""
    evidence: str
    """What in the installed code says so, in a few words."""


class RefusedDeployment(RuntimeError):
    """This server would serve LoRA on MoE wrong: it does not start. The message says what to change."""


@dataclass(frozen=True)
class Change:
    """One server argument the launcher sets for a LoRA server, and the line it logs."""

    field: str
    value: object
    message: str


@dataclass(frozen=True)
class Deployment:
    """What is known of one server: its arguments (raw or resolved), its model's ``config.json``, and
    whether SGLang wrapped an MoE layer for LoRA (known in a scheduler)."""

    args: object | None = None
    model: dict | None = None
    moe_lora_layers: bool | None = None

    @property
    def lora(self) -> bool | None:
        """Does this server serve LoRA? ``--enable-lora``, or ``--lora-paths`` unless ``--enable-lora`` is False."""
        if self.args is None:
            return None
        enable = getattr(self.args, "enable_lora", None)
        return enable is True or (enable is None and bool(getattr(self.args, "lora_paths", None)))

    @property
    def moe(self) -> bool | None:
        """Does the model have routed experts (None: not known)?"""
        if self.moe_lora_layers is not None:
            return self.moe_lora_layers
        if self.model is None:
            return None
        return (routed_experts(self.model) or 0) >= 2

    def arg(self, name: str, default=None):
        return getattr(self.args, name, default) if self.args is not None else default

    def lora_moe_of(self, architectures) -> bool | None:
        """A LoRA server of a MoE model whose architecture is one of ``architectures`` (None: not known)?"""
        if self.lora is False or self.moe is False:
            return False
        if self.model is None:
            return None
        return architecture(self.model) in architectures


EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def model_settings(config: dict) -> dict:
    """A model's settings, its ``text_config`` (multimodal models) merged under the top level."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return {**text, **{k: v for k, v in config.items() if v is not None}}


def routed_experts(config: dict) -> int | None:
    merged = model_settings(config)
    return next((merged[k] for k in EXPERT_COUNT_KEYS if isinstance(merged.get(k), int)), None)


def architecture(config: dict | None) -> str | None:
    return ((config or {}).get("architectures") or [None])[0]


@dataclass(frozen=True)
class Assessment:
    """One defect, judged for the installed SGLang and one deployment."""

    id: str
    title: str
    releases: str
    remedy: Remedy
    does: str
    present: bool | None
    evidence: str
    affects: bool | None
    """The deployment meets the defect (None: not known without more of the deployment)."""
    refusal: str | None = None
    """With the guard on, this deployment does not start: the reason and what to change."""


class Defect:
    """One entry of the catalogue; each module of :mod:`~sglang_lora_tma_guard.defects` has one."""

    id: str
    title: str
    first: str
    last: str
    """The first and the last release that have it, by their source (the reviews in the README)."""
    exposed: str
    """Who meets it, in a few words."""
    remedy: Remedy
    does: str
    """What the guard does, one line (the README table, ``check``)."""
    upstream: str | None = None
    refused_at: str = "start"
    """Where a refusal happens: ``start`` (the launcher or a scheduler) or ``load`` (the adapter's load)."""

    @property
    def releases(self) -> str:
        return self.first if self.first == self.last else f"{self.first}–{self.last}"

    def in_range(self, version: str) -> bool:
        """Is ``version`` one of the releases that have it (by number: forks are read from their code)?"""
        from .inspection import release_tuple

        found = release_tuple(version)
        return found is not None and release_tuple(self.first) <= found <= release_tuple(self.last)

    def present(self) -> Presence:
        raise NotImplementedError

    def affects(self, deployment: Deployment) -> bool | None:
        """Does this deployment meet the defect where SGLang has it (None: not known)?"""
        return None

    def server_args_changes(self, deployment: Deployment) -> list[Change]:
        """What the launcher sets on a LoRA server's raw arguments (asked only where SGLang has the defect)."""
        return []

    def refusal(self, deployment: Deployment) -> str | None:
        """Why this deployment must not start with LoRA on MoE, and what to change; None: it may."""
        return None

    def before_lora_modules(self, manager, deployment: Deployment) -> None:
        """Each scheduler, before SGLang wraps its layers for LoRA (the targets are known, nothing wrapped)."""

    def on_adapter(self, manager, adapter, deployment: Deployment) -> str | None:
        """Each adapter SGLang loads (``--lora-paths`` at start, ``/load_lora_adapter`` later), once its
        weights are read and normalised, before any slot is filled: fix it in place, or say why it must not
        be served (the load then fails with that reason; the server keeps serving the others)."""
        return None

    def diagnose(self, adapter) -> str | None:
        """What SGLang, without the guard, does wrong with this adapter (``check --adapter``); None: nothing."""
        return None

    @property
    def judged_by_adapter(self) -> bool:
        """Met or not is read from an adapter's own files (:meth:`diagnose`), never from the server's arguments."""
        return type(self).diagnose is not Defect.diagnose

    def on_lora_modules(self, layers: list, deployment: Deployment) -> str | None:
        """Each scheduler, once SGLang wrapped its MoE layers for LoRA (``layers``: ``(layer_id, name,
        module)``): fix them, or say why it must not serve. By default: the refusal, if any."""
        return self.refuses(deployment)

    def refuses(self, deployment: Deployment) -> str | None:
        """The refusal where this deployment is known to meet the defect, else None."""
        return self.refusal(deployment) if self.affects(deployment) else None

    def activate(self, switch) -> None:
        """Arm the defect's own patches (``switch``: the parsed ``SGLANG_LORA_TMA_GUARD``)."""

    def deactivate(self) -> None:
        """Take the defect's own patches off again."""

    def assess(self, deployment: Deployment, guarded: bool = True) -> Assessment:
        found = self.present()
        affects = False if found.present is False else self.affects(deployment)
        refusal = self.refuses(deployment) if guarded and found.present is not False else None
        return Assessment(self.id, self.title, self.releases, self.remedy, self.does, found.present,
                          found.evidence, affects, refusal)


# --- reading the installed SGLang without importing it ---------------------------------------------


@functools.cache
def source_of(module: str) -> str | None:
    """The text of an installed SGLang module's file, or None (no such module, no source).

    Found from the top package's folder, not by importing: reading a file imports nothing (no
    parent package's ``__init__``), in the launcher and in ``check`` alike.
    """
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        top, *rest = module.split(".")
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return None
        roots = list(getattr(spec, "submodule_search_locations", None) or ()) if spec else []
        candidates = [os.path.join(root, *rest) for root in roots]
        path = next((c + suffix for c in candidates for suffix in (".py", os.sep + "__init__.py")
                     if os.path.isfile(c + suffix)), None)
    if not path or not path.endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


@functools.cache
def _parsed(module: str) -> tuple[str, list] | None:
    """``source_of(module)`` and its top-level statements, parsed once (SGLang's modules run to
    thousands of lines, and the catalogue reads several definitions of each)."""
    text = source_of(module)
    if text is None:
        return None
    try:
        return text, ast.parse(text).body
    except SyntaxError:
        return None


@functools.cache
def definition(module: str, qualname: str) -> str | None:
    """The source of one function or method (``"Class.method"``) of an installed module, or None."""
    parsed = _parsed(module)
    if parsed is None:
        return None
    text, body = parsed
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return ast.get_source_segment(text, node)


def parameters(source: str) -> list[str]:
    """The parameter names of the function whose definition ``source`` is."""
    import textwrap

    node = ast.parse(textwrap.dedent(source)).body[0]
    spec = node.args
    return [a.arg for a in (*spec.posonlyargs, *spec.args, *spec.kwonlyargs)]


def read(module: str, where: str | None = None) -> str | None:
    """A module's source, or one definition of it; a ``Presence`` of None follows where it is missing."""
    return source_of(module) if where is None else definition(module, where)


def unreadable(module: str, where: str | None = None) -> Presence:
    place = f"{module}.{where}" if where else module
    return Presence(None, f"cannot read {place} (treated as present)")


def by_marker(module: str, marker: str, *, fixed: str, present: str, where: str | None = None,
              marker_is_the_fix: bool = True) -> Presence:
    """Presence read from one marker in an installed module's source (or in one of its definitions): the
    upstream fix's own words (``marker_is_the_fix``), or the defective code's."""
    text = read(module, where)
    if text is None:
        return unreadable(module, where)
    there = (marker in text) is not marker_is_the_fix
    return Presence(there, present if there else fixed)
