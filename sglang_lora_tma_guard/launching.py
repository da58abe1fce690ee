"""The fast path's Triton launches, with less of the host's time.

Outside a CUDA-graph replay (every prefill batch) each MoE layer of a LoRA batch launches five to seven of
this package's kernels, and a 16-layer prefill step on the H200 is paced by the host. Triton's own launch
(``JITFunction.run``) binds and specializes every argument, builds the cache key and looks the variant up
before it launches: tens of microseconds a launch for kernels of some twenty arguments. A :class:`Launcher`
takes that path once for each variant, which compiles it or finds it compiled, keeps the compiled kernel
under a key of its own, and launches later calls of that key through the compiled kernel's own launcher
(``CompiledKernel[grid](*args)``, which still honours Triton's launch hooks).

The key holds everything Triton specializes a variant on, or more: for each positional argument, a tensor's
dtype and whether its address is a multiple of 16 bytes, an integer's being 1, a multiple of 16, and in the
32-bit or unsigned 64-bit range, a None, a tensor descriptor's base (as a tensor's) and all its other fields
(shape, strides, block shape, padding); the keyword arguments (constexprs, ``num_warps``, ``num_stages``) as given;
the current device (tests/test_launching.py holds it against the installed Triton's own specializer). A key
that is finer than Triton's only costs one more trip through Triton's path. An argument of any other kind, a
constexpr given by position, a kernel that is not a ``JITFunction`` (Triton's interpreter), ``DIRECT`` off,
or a compiled launcher that refuses the arguments: Triton's own path, every time.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .log import logger

DIRECT = True
"""Off: every launch through Triton's own path (the benchmarks' A/B)."""


def argument_key(value):
    """What Triton's choice of variant may depend on in one positional argument (TypeError: a kind this
    key does not cover)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value >= 2**63
    if isinstance(value, float):
        return "float"
    if value is None:
        return None
    if type(value).__name__ == "TensorDescriptor" and dataclasses.is_dataclass(value):
        # Triton's own TensorDescriptor: its base keyed as a tensor is, then every other field as given.
        return ("descriptor", argument_key(value.base),
                *(_plain(getattr(value, field.name)) for field in dataclasses.fields(value) if field.name != "base"))
    raise TypeError(f"an argument of type {type(value).__name__}")


def _plain(value):
    """A descriptor's field as a key: its lists as tuples."""
    return tuple(map(_plain, value)) if isinstance(value, (list, tuple)) else value


_Tensor = torch.Tensor


def arguments_key(args) -> tuple:
    """:func:`argument_key` of each argument; tensors and ints (nearly all of them) inline, at half the cost."""
    return tuple([(a.dtype, not a.data_ptr() & 15) if a.__class__ is _Tensor
                  else (a == 1, not a & 15, -(2**31) <= a < 2**31, a >= 2**63) if a.__class__ is int
                  else argument_key(a) for a in args])


class Launcher:
    """``Launcher(fn)[grid](*args, **kwargs)`` launches as ``fn[grid](*args, **kwargs)`` does: positional
    arguments are the kernel's runtime ones, keywords its constexprs and launch options."""

    def __init__(self, fn):
        self.fn = fn
        self.kernels: dict = {}
        self.direct = _is_jit(fn)

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        if not (DIRECT and self.direct):
            return self.fn[grid](*args, **kwargs)
        try:
            key = (torch.cuda.current_device(), arguments_key(args), tuple(kwargs.items()))
        except TypeError:
            return self.fn[grid](*args, **kwargs)
        known = self.kernels.get(key)
        if known is None:
            kernel = self.fn[grid](*args, **kwargs)  # compiles the variant, or finds it compiled, and launches
            rest = tuple(self.fn.arg_names[len(args):])
            if any(param.is_constexpr for param in self.fn.params[:len(args)]):
                self.direct = False  # a constexpr given by position: the key holds its kind, not its value
            elif kernel is not None and all(name in kwargs for name in rest):
                self.kernels[key] = kernel, rest
            return kernel
        kernel, rest = known
        try:
            kernel[tuple(grid) + (1,) * (3 - len(grid))](*args, *(kwargs[name] for name in rest))
        except TypeError as error:  # a launcher of another signature: refused before anything ran
            self.direct = False
            logger.warning("Triton's compiled launcher of %s refused its arguments (%s); its launches go through "
                           "Triton's own path from now on", getattr(self.fn, "__name__", self.fn), error)
            self.fn[grid](*args, **kwargs)
        return kernel


@functools.cache
def launcher(fn) -> Launcher:
    """The one :class:`Launcher` of ``fn`` in this process."""
    return Launcher(fn)


def _is_jit(fn) -> bool:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return isinstance(fn, JITFunction)
