"""The guard under torch.compile: Dynamo must trace it, not step around it (as it does a wrapt FunctionWrapper)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
import wrapt

from sglang_lora_tma_guard.guard import make_guarded
from sglang_lora_tma_guard.inspection import inspect_target

HOOKS = SimpleNamespace(after_gate_up=lambda *a: None, after_down=None)


@pytest.fixture
def module(monkeypatch):
    """A module holding a traceable stand-in: 2x on the TMA path, 3x on the plain one."""
    mod = types.ModuleType("fake_fused_moe_for_dynamo")

    def _fused_moe_kernel_sequence(x, down_moe_use_tma, *, hooks=None):
        return x * (2.0 if down_moe_use_tma else 3.0)

    mod._fused_moe_kernel_sequence = _fused_moe_kernel_sequence
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    torch._dynamo.reset()
    yield mod
    torch._dynamo.reset()


def caller_of(mod):
    def caller(x, hooks):
        return mod._fused_moe_kernel_sequence(x + 1, True, hooks=hooks)

    return caller


def test_guard_is_traced_into_the_compiled_graph(module):
    wrapt.wrap_object(module, "_fused_moe_kernel_sequence", make_guarded,
                      (inspect_target(module._fused_moe_kernel_sequence),))
    # fullgraph: the guard is part of the graph, not run beside it after a graph break.
    compiled = torch.compile(caller_of(module), backend="eager", fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(compiled(x, HOOKS), torch.full((3,), 6.0))  # plain path
    assert torch.equal(compiled(x, None), torch.full((3,), 4.0))  # TMA path kept


def test_a_wrapt_function_wrapper_is_skipped_by_dynamo(module):
    # Why the guard is a plain function: the same logic as a wrapt FunctionWrapper runs in eager
    # mode and silently not at all in a compiled caller. If this starts failing, Dynamo learnt to
    # honour wrapt proxies and the design note in guard.py can be revisited.
    def wrapper(wrapped, instance, args, kwargs):
        if kwargs.get("hooks") is not None:
            args = (args[0], False)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "_fused_moe_kernel_sequence", wrapper)
    caller, x = caller_of(module), torch.ones(3)
    assert torch.equal(caller(x, HOOKS), torch.full((3,), 6.0))
    assert torch.equal(torch.compile(caller, backend="eager")(x, HOOKS), torch.full((3,), 4.0))
