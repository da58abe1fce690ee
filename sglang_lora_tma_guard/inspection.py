"""Reading the installed SGLang: where the fused-MoE sequence lives and how it must be guarded.

The strategy is decided from the function itself (its signature and its code), not from the
version string alone: source builds and forks carry versions such as ``0.5.16.dev12+g…`` and may
or may not carry the upstream fix.
"""

from __future__ import annotations

import ast
import enum
import inspect
import textwrap
from dataclasses import dataclass
from importlib import metadata

from . import weight_tma as weight_tma_module

TARGET_MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
TARGET_NAME = "_fused_moe_kernel_sequence"
TARGET = f"{TARGET_MODULE}.{TARGET_NAME}"
FLAG_PARAM = "down_moe_use_tma"
HOOKS_PARAM = "hooks"
HOOK_ATTRIBUTES = ("after_gate_up", "after_down")

# Releases read from PyPI (see README, "Who is affected"): the first with LoRA hooks in the
# fused-MoE sequence, and the first that turns TMA off by itself when hooks are set.
FIRST_WITH_HOOKS = (0, 5, 11)
FIRST_FIXED = (0, 5, 17)
SUPPORTED_SGLANG = ">=0.5.11,<0.5.24"
"""The SGLang releases this package is checked against, every one of them (``scripts/version_matrix.py``);
``setup.cfg``'s ``sglang`` extra says the same (a test keeps the two equal). A release outside it gets a
note, not a refusal: every fix is decided from the installed code."""


class Strategy(str, enum.Enum):
    """How the installed ``_fused_moe_kernel_sequence`` is guarded (a ``str``: it equals its value)."""

    WEIGHT_TMA = "weight_tma"
    """Hooked calls that asked for TMA run with route-major buffers and TMA for the weights
    (:mod:`sglang_lora_tma_guard.weight_tma`): the fix on 0.5.11-0.5.16, a speed-up of SGLang's
    own fix from 0.5.17 on."""

    FLAG = "flag"
    """Hooked calls are re-issued with ``down_moe_use_tma=False``, as SGLang 0.5.17 does itself."""

    NATIVE = "native"
    """SGLang provably turns TMA off for hooked calls itself: nothing to do."""

    ABSENT = "absent"
    """No fused-MoE sequence with LoRA hooks (SGLang before 0.5.11): nothing to guard."""

    FALLBACK = "fallback"
    """Hooks exist but no ``down_moe_use_tma`` can be turned off: hooked calls run on this
    package's own route-major kernels (:mod:`sglang_lora_tma_guard.fallback`)."""

    UNSUPPORTED = "unsupported"
    """The function cannot be read: left unpatched, with a warning."""

    @property
    def installs_wrapper(self) -> bool:
        return self in (Strategy.WEIGHT_TMA, Strategy.FLAG, Strategy.FALLBACK)


@dataclass(frozen=True)
class Inspection:
    strategy: Strategy
    reason: str
    flag_index: int | None = None
    """Positional index of ``down_moe_use_tma``; every SGLang caller passes it positionally."""
    hooks_index: int | None = None
    """Positional index of ``hooks``, or None where it is keyword-only (every release so far)."""
    native_guard: bool = False
    """The function's own code proves that it turns TMA off for hooked calls."""
    weight_tma_unavailable: str | None = None
    """Why the weight-TMA variant cannot be built here (None where it can, or was not asked for)."""


def inspect_target(func, weight_tma: bool = True) -> Inspection:
    """Decide the strategy for one ``_fused_moe_kernel_sequence`` object.

    ``weight_tma=False`` asks for the plain fix (``SGLANG_LORA_TMA_GUARD=plain``).
    """
    if func is None:
        return Inspection(
            Strategy.ABSENT,
            f"{TARGET} does not exist (SGLang before 0.5.11 has no LoRA hooks in fused MoE)",
        )
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError) as exc:
        return Inspection(Strategy.UNSUPPORTED, f"cannot read the signature of {TARGET}: {exc}")

    if HOOKS_PARAM not in params:
        return Inspection(Strategy.ABSENT, f"{TARGET} takes no '{HOOKS_PARAM}': no LoRA hooks to guard")
    native = has_native_guard(func)
    hooks_index = _positional_index(params, HOOKS_PARAM)
    flag_index = _positional_index(params, FLAG_PARAM)
    if flag_index is None:
        if native:  # a keyword-only flag that the function resets itself
            return Inspection(Strategy.NATIVE, NATIVE_REASON, hooks_index=hooks_index, native_guard=True)
        missing = "no" if FLAG_PARAM not in params else "no positional"
        return Inspection(
            Strategy.FALLBACK,
            f"{TARGET} takes '{HOOKS_PARAM}' but has {missing} '{FLAG_PARAM}' to turn off: hooked calls "
            "run on this package's route-major kernels",
            hooks_index=hooks_index,
        )
    found = dict(flag_index=flag_index, hooks_index=hooks_index, native_guard=native)
    unavailable = weight_tma_module.unavailable_reason(func) if weight_tma else "not asked for (plain fix)"
    if unavailable is None:
        reason = (
            "hooked calls that ask for TMA keep it for the weights, with route-major buffers "
            + ("(a speed-up of SGLang's own fix)" if native else "(the fix, and faster than TMA off)")
        )
        return Inspection(Strategy.WEIGHT_TMA, reason, **found)
    if native:
        return Inspection(Strategy.NATIVE, NATIVE_REASON, weight_tma_unavailable=unavailable, **found)
    return Inspection(
        Strategy.FLAG,
        "hooked calls run with down_moe_use_tma=False (route-major buffers, as the hooks expect)",
        weight_tma_unavailable=unavailable,
        **found,
    )


NATIVE_REASON = "SGLang already sets down_moe_use_tma=False when LoRA hooks are set"


def _positional_index(params, name: str) -> int | None:
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for index, param in enumerate(params.values()):
        if param.name == name:
            return index if param.kind in positional else None
    return None


def has_native_guard(func) -> bool:
    """True only when the function's source proves that hooked calls run with TMA off.

    The proof is upstream's fix (0.5.17) in the one place where it holds for every call: a
    statement of the function body itself, before anything reads or writes ``down_moe_use_tma``,
    ``if <hooks test>: down_moe_use_tma = False``, where the hooks test is true whenever
    ``after_gate_up`` or ``after_down`` is set. Without source (a compiled-only install) nothing is
    proven: the guard then stays on, which is harmless where SGLang does turn TMA off itself.
    """
    try:
        return native_guard_in(inspect.getsource(inspect.unwrap(func)))
    except (OSError, TypeError):
        return False


def native_guard_in(source: str) -> bool:
    """:func:`has_native_guard` on the source text of the function's definition."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for stmt in node.body:
        if isinstance(stmt, ast.If) and _covers_every_hooked_call(stmt.test) and any(
            _assigns_false_to_flag(inner) for inner in stmt.body
        ):
            return True
        if _mentions_flag(stmt):
            return False  # the flag is read or changed before any guard: not proven
    return False


def _covers_every_hooked_call(test: ast.expr) -> bool:
    """Is ``test`` true for every hooks object with ``after_gate_up`` or ``after_down`` set?

    Accepted shapes: ``hooks and X``, ``hooks is not None and X``, where X is an ``or`` of
    ``hooks.after_gate_up`` and ``hooks.after_down``, each bare or ``is not None``.
    """
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and len(test.values) == 2):
        return False
    presence, attributes = test.values
    if not (_is_hooks_name(presence) or _is_not_none(presence, _is_hooks_name)):
        return False
    if not (isinstance(attributes, ast.BoolOp) and isinstance(attributes.op, ast.Or)):
        return False
    seen = set()
    for value in attributes.values:
        attribute = value.left if _is_not_none(value, _is_hook_attribute) else value
        if not _is_hook_attribute(attribute):
            return False
        seen.add(attribute.attr)
    return seen == set(HOOK_ATTRIBUTES)


def _is_hooks_name(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == HOOKS_PARAM


def _is_hook_attribute(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in HOOK_ATTRIBUTES and _is_hooks_name(node.value)


def _is_not_none(node: ast.expr, operand) -> bool:
    return (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.IsNot)
        and isinstance(node.comparators[0], ast.Constant)
        and node.comparators[0].value is None
        and operand(node.left)
    )


def _assigns_false_to_flag(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Assign):
        targets, value = stmt.targets, stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        targets, value = [stmt.target], stmt.value
    else:
        return False
    return (
        isinstance(value, ast.Constant)
        and value.value is False
        and any(isinstance(t, ast.Name) and t.id == FLAG_PARAM for t in targets)
    )


def _mentions_flag(stmt: ast.stmt) -> bool:
    return any(isinstance(sub, ast.Name) and sub.id == FLAG_PARAM for sub in ast.walk(stmt))


def sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def release_tuple(version: str | None) -> tuple[int, int, int] | None:
    """``"0.5.16.post1"`` -> ``(0, 5, 16)`` (``packaging``'s reading); None for a string that is no version."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version or "").release
    except InvalidVersion:
        return None
    return (tuple(release) + (0, 0))[:3]


def version_note(version: str | None) -> str | None:
    """A sentence for versions outside the range this guard was checked against, else None."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version or "")
    except InvalidVersion:
        return f"SGLang version {version!r} is not a release number; the strategy comes from the code alone"
    if not SpecifierSet(SUPPORTED_SGLANG).contains(Version(parsed.base_version), prereleases=True):
        return (f"SGLang {version} is outside the releases checked ({SUPPORTED_SGLANG}); every fix is decided from "
                "the code alone")
    return None


def release_is_affected(version: str | None) -> bool | None:
    """What the version number alone says (None when it says nothing)."""
    release = release_tuple(version)
    if release is None:
        return None
    return FIRST_WITH_HOOKS <= release < FIRST_FIXED
