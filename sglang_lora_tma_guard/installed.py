"""The installed SGLang, as this package reaches it outside a server: its fused-MoE module, and the
server settings that module reads, given where no server has published them.

Used by the check (exposure, self-test), the tiny MoE (:mod:`sglang_lora_tma_guard.tiny_moe`) and
the tests' harness (SGLang's LoRA runner on a tiny problem). The guard itself needs none of it: it
runs inside SGLang's own processes.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

from .inspection import TARGET_MODULE


def fused_moe_module():
    return importlib.import_module(TARGET_MODULE)


def ensure_server_args() -> None:
    """Give SGLang the server settings the sequence reads, outside a server process only.

    0.5.11-0.5.15 read them through ``server_args.get_global_server_args()``, 0.5.16 through
    ``runtime_context.get_server_args()``, 0.5.17 on through resolved namespaces
    (``get_exec().moe``), published by a server; outside one, the fused-MoE module is given a
    stand-in that answers the one setting the sequence reads there.
    """
    settings = SimpleNamespace(enable_fused_moe_sum_all_reduce=False, enable_deterministic_inference=False)
    module = fused_moe_module()
    get_exec = getattr(module, "get_exec", None)
    if get_exec is not None:
        try:
            get_exec().moe  # noqa: B018 (raises where no server published its settings)
        except Exception:  # not published: no server in this process
            module.get_exec = lambda: SimpleNamespace(moe=settings)
        return
    try:
        from sglang.srt import runtime_context
    except ImportError:
        runtime_context = None
    if getattr(runtime_context, "get_server_args", None) is not None:
        try:
            runtime_context.get_server_args()
        except ValueError:
            runtime_context._CONTEXT.set_server_args(settings)
    from sglang.srt import server_args

    setter = getattr(server_args, "set_global_server_args_for_scheduler", None)
    getter = getattr(server_args, "get_global_server_args", None)
    if setter is not None and getter is not None:
        try:
            getter()
        except ValueError:
            setter(settings)
