"""A variant of SGLang's fused-MoE sequence for hooked calls: route-major buffers, TMA weights.

The LoRA hooks need the *activations* route-major: the intermediate buffers they read and write,
and with them operand A of the down GEMM. The *weights* (operand B of both GEMMs) are read by
expert block whatever the buffer layout, so a TMA descriptor for them changes how they are loaded,
not what is computed. SGLang's launcher ``invoke_fused_moe_kernel`` takes ``a_use_tma``,
``b_use_tma`` and ``c_sorted`` separately; the sequence ties all three to ``down_moe_use_tma``.

This module builds, from the installed function's own source, a copy whose two launcher calls pass
``b_use_tma=True``. The guard calls it with ``down_moe_use_tma=False`` (so buffers, ``c_sorted``
and ``a_use_tma`` are those of the non-TMA path) and only for hooked calls whose caller asked for
TMA, which SGLang only does where Triton has tensor descriptors and the tuned down config says
``USE_TMA``. The copy is compiled into the module's own namespace: it sees every later change to
that module's globals (a spy on the launcher included), as the original does.

The copy is built only when the source matches what was verified: exactly two launcher calls, the
gate-up one sorting its output by ``down_moe_use_tma``, the down one taking A and B by TMA from
``down_moe_use_tma``, a launcher that accepts ``b_use_tma``, no decorators, no closure. Anything
else gives a reason, and the guard keeps the plain fix (``down_moe_use_tma=False``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

LAUNCHER = "invoke_fused_moe_kernel"
FLAG = "down_moe_use_tma"


class Unavailable(Exception):
    """The installed function is not one this transform was verified on; the reason says why."""


def unavailable_reason(func) -> str | None:
    """None when :func:`build` would succeed on ``func``, else a short reason."""
    try:
        _checked_tree(func)
    except Unavailable as exc:
        return str(exc)
    return None


def build(func):
    """The weight-TMA copy of ``func`` (SGLang's ``_fused_moe_kernel_sequence``); raises Unavailable."""
    tree, filename = _checked_tree(func)
    namespace: dict = {}
    code = compile(tree, filename, "exec", dont_inherit=True)
    exec(code, func.__globals__, namespace)  # noqa: S102 - SGLang's own source, one keyword changed
    variant = namespace[func.__name__]
    variant.__qualname__ = func.__qualname__
    variant.__doc__ = func.__doc__
    return variant


def _checked_tree(func) -> tuple[ast.Module, str]:
    if inspect.unwrap(func) is not func:
        # Hooked calls would go to the copy and skip whatever wraps the function now.
        raise Unavailable("the function is wrapped by other code")
    code = getattr(func, "__code__", None)
    if code is None:
        raise Unavailable("not a Python function")
    if code.co_freevars:
        raise Unavailable("the function is a closure")
    try:
        lines, first_line = inspect.getsourcelines(func)
        filename = inspect.getsourcefile(func) or code.co_filename
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        raise Unavailable("no source to transform (compiled-only install)") from None
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, ast.FunctionDef) or node.name != func.__name__:
        raise Unavailable("the source is not a plain function definition")
    if node.decorator_list:
        raise Unavailable("the function is decorated")
    _check_launcher(func.__globals__.get(LAUNCHER))
    gate_up, down = _launcher_calls(node)
    _require_keyword(gate_up, "c_sorted", FLAG, "the gate-up launch")
    _require_keyword(down, "a_use_tma", FLAG, "the down launch")
    _require_keyword(down, "b_use_tma", FLAG, "the down launch")
    for call in (gate_up, down):
        _set_keyword(call, "b_use_tma", ast.Constant(True))
    _drop_annotations(node)  # they may name types imported only for type checkers
    ast.increment_lineno(tree, first_line - 1)
    return ast.fix_missing_locations(tree), filename


def _check_launcher(launcher) -> None:
    if launcher is None:
        raise Unavailable(f"the module has no {LAUNCHER}")
    try:
        params = inspect.signature(launcher).parameters
    except (TypeError, ValueError):
        raise Unavailable(f"cannot read the signature of {LAUNCHER}") from None
    missing = [p for p in ("a_use_tma", "b_use_tma", "c_sorted") if p not in params]
    if missing:
        raise Unavailable(f"{LAUNCHER} takes no {', '.join(missing)}")


def _launcher_calls(node: ast.FunctionDef) -> tuple[ast.Call, ast.Call]:
    calls = [
        sub for sub in ast.walk(node)
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == LAUNCHER
    ]
    if len(calls) != 2:
        raise Unavailable(f"expected 2 calls of {LAUNCHER} (gate-up, down), found {len(calls)}")
    calls.sort(key=lambda call: (call.lineno, call.col_offset))
    for call in calls:
        if any(kw.arg is None for kw in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
            raise Unavailable(f"a call of {LAUNCHER} passes arguments by unpacking")
    return calls[0], calls[1]


def _require_keyword(call: ast.Call, name: str, flag: str, where: str) -> None:
    value = next((kw.value for kw in call.keywords if kw.arg == name), None)
    if not (isinstance(value, ast.Name) and value.id == flag):
        raise Unavailable(f"{where} does not pass {name}={flag}")


def _set_keyword(call: ast.Call, name: str, value: ast.expr) -> None:
    for kw in call.keywords:
        if kw.arg == name:
            kw.value = value
            return
    call.keywords.append(ast.keyword(arg=name, value=value))


def _drop_annotations(node: ast.FunctionDef) -> None:
    node.returns = None
    arguments = node.args
    for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                arguments.vararg, arguments.kwarg):
        if arg is not None:
            arg.annotation = None
