"""Reading the installed SGLang: where the fused-MoE sequence lives and how it must be guarded.

The strategy is decided from the function itself (its signature and its code), not from the
version string alone: source builds and forks carry versions such as ``0.5.16.dev12+g…`` and may
or may not carry the upstream fix.
"""

from __future__ import annotations

import ast
import dis
import enum
import inspect
import re
import textwrap
from dataclasses import dataclass
from importlib import metadata

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
# The newest release this guard was checked against; later ones get a note, not a refusal.
NEWEST_CHECKED = (0, 5, 23)


class Strategy(enum.Enum):
    """How the installed ``_fused_moe_kernel_sequence`` is guarded."""

    NATIVE = "native"
    """SGLang turns TMA off for hooked calls itself (0.5.17 and later): nothing to do."""

    FLAG = "flag"
    """Hooked calls are re-issued with ``down_moe_use_tma=False`` (0.5.11 to 0.5.16)."""

    ABSENT = "absent"
    """No fused-MoE sequence with LoRA hooks (SGLang before 0.5.11): nothing to guard."""

    FALLBACK = "fallback"
    """Hooks exist but no ``down_moe_use_tma`` can be turned off: hooked calls run on this
    package's own route-major kernels (:mod:`sglang_lora_tma_guard.fallback`)."""

    UNSUPPORTED = "unsupported"
    """The function cannot be read: left unpatched, with a warning."""


@dataclass(frozen=True)
class Inspection:
    strategy: Strategy
    reason: str
    flag_index: int | None = None
    """Positional index of ``down_moe_use_tma``; every SGLang caller passes it positionally."""
    hooks_index: int | None = None
    """Positional index of ``hooks``, or None where it is keyword-only (every release so far)."""


def inspect_target(func) -> Inspection:
    """Decide the strategy for one ``_fused_moe_kernel_sequence`` object."""
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
    if has_native_guard(func):
        return Inspection(
            Strategy.NATIVE, "SGLang already sets down_moe_use_tma=False when LoRA hooks are set"
        )
    flag_index = _positional_index(params, FLAG_PARAM)
    if flag_index is None:
        missing = "no" if FLAG_PARAM not in params else "no positional"
        return Inspection(
            Strategy.FALLBACK,
            f"{TARGET} takes '{HOOKS_PARAM}' but has {missing} '{FLAG_PARAM}' to turn off: hooked calls "
            "run on this package's route-major kernels",
            hooks_index=_positional_index(params, HOOKS_PARAM),
        )
    return Inspection(
        Strategy.FLAG,
        "hooked calls run with down_moe_use_tma=False (route-major buffers, as the hooks expect)",
        flag_index=flag_index,
        hooks_index=_positional_index(params, HOOKS_PARAM),
    )


def _positional_index(params, name: str) -> int | None:
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for index, param in enumerate(params.values()):
        if param.name == name:
            return index if param.kind in positional else None
    return None


def has_native_guard(func) -> bool:
    """True when the function itself resets ``down_moe_use_tma`` to False under a hooks test.

    Upstream's fix (0.5.17) is ``if hooks and (hooks.after_gate_up is not None or ...):
    down_moe_use_tma = False``. Read it from the source where there is one, else from the bytecode.
    """
    func = inspect.unwrap(func)
    try:
        source = textwrap.dedent(inspect.getsource(func))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return _bytecode_has_native_guard(getattr(func, "__code__", None))
    return any(_is_guard_branch(node) for node in ast.walk(tree) if isinstance(node, ast.If))


def _is_guard_branch(node: ast.If) -> bool:
    tests_hooks = any(
        isinstance(sub, ast.Attribute) and sub.attr in HOOK_ATTRIBUTES for sub in ast.walk(node.test)
    )
    return tests_hooks and any(_assigns_false_to_flag(stmt) for stmt in node.body)


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


def _bytecode_has_native_guard(code) -> bool:
    # Without source (a compiled-only install), look for the store itself: the flag is a
    # parameter, so any ``down_moe_use_tma = False`` in a function that reads the hook
    # attributes is a reset of what the caller asked for.
    if code is None or not any(attr in code.co_names for attr in HOOK_ATTRIBUTES):
        return False
    previous = None
    for instr in dis.get_instructions(code):
        if (
            instr.opname.startswith("STORE_FAST")
            and instr.argval == FLAG_PARAM
            and previous is not None
            and previous.opname.startswith("LOAD_CONST")
            and previous.argval is False
        ):
            return True
        previous = instr
    return False


def sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def release_tuple(version: str | None) -> tuple[int, int, int] | None:
    """``"0.5.16.post1"`` -> ``(0, 5, 16)``; None when the string does not start with X.Y.Z."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(part) for part in match.groups()) if match else None


def version_note(version: str | None) -> str | None:
    """A sentence for versions outside the range this guard was checked against, else None."""
    release = release_tuple(version)
    if release is None:
        return f"SGLang version {version!r} is not a release number; the strategy comes from the code alone"
    if release > NEWEST_CHECKED:
        return (
            f"SGLang {version} is newer than the newest release checked "
            f"({'.'.join(map(str, NEWEST_CHECKED))}); the strategy comes from the code alone"
        )
    return None


def release_is_affected(version: str | None) -> bool | None:
    """What the version number alone says (None when it says nothing)."""
    release = release_tuple(version)
    if release is None:
        return None
    return FIRST_WITH_HOOKS <= release < FIRST_FIXED
