"""The fast path's launcher (:mod:`sglang_lora_tma_guard.launching`): which launches take Triton's own path and
which the compiled kernel's launcher, with what arguments. Triton's ``JITFunction.run`` is replaced by a recorder
here (a CPU has nothing to launch on); that the direct launches give the same output bit for bit is checked on a
GPU, through SGLang's runner: ``benchmarks/launch_check.py``."""

import logging

import pytest
import torch
from triton.runtime.jit import JITFunction

from sglang_lora_tma_guard import launching, lora_moe


def _kernel(x_ptr, n, BLOCK):  # the source of the JITFunction below: what Triton reads of it is its signature
    pass


class _Compiled:
    """A compiled variant: records each direct launch's grid and arguments."""

    def __init__(self, refuse=False):
        self.launched, self.refuse = [], refuse

    def __getitem__(self, grid):
        def launch(*args):
            if self.refuse:
                raise TypeError("function takes exactly 4 arguments (3 given)")
            self.launched.append((grid, args))

        return launch


class _Recorded(JITFunction):
    """A JITFunction whose ``run`` (Triton's own launch path) records its calls and returns ``compiled``."""

    def __init__(self, compiled=None):
        super().__init__(_kernel)
        self.params[2].is_constexpr = True  # BLOCK, as ``BLOCK: tl.constexpr`` would make it
        self.compiled, self.runs = compiled or _Compiled(), []

    def run(self, *args, grid, warmup, **kwargs):
        self.runs.append((grid, args, kwargs))
        return self.compiled


@pytest.fixture(autouse=True)
def a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the key's device, which a CPU has not


@pytest.fixture
def fn():
    return _Recorded()


def test_a_variant_goes_through_triton_once_then_to_its_compiled_launcher_with_every_argument_in_order(fn):
    launcher = launching.Launcher(fn)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher[(4,)](x, 32, BLOCK=16, num_warps=4)
    assert len(fn.runs) == 1 and not fn.compiled.launched
    launcher[(4, 2)](y, 48, BLOCK=16, num_warps=4)  # the same kinds: a multiple of 16, an aligned float32 tensor
    assert len(fn.runs) == 1
    (grid, args), = fn.compiled.launched
    assert grid == (4, 2, 1) and args[0] is y and args[1:] == (48, 16)


@pytest.mark.parametrize("change", ["misaligned view", "dtype", "n == 1", "n odd", "n past int32", "constexpr",
                                    "num_warps"])
def test_anything_triton_specializes_on_takes_triton_s_path_again(fn, change):
    launcher = launching.Launcher(fn)
    x = torch.zeros(64)
    launcher[(1,)](x, 32, BLOCK=16, num_warps=4)
    args, kwargs = [x, 32], {"BLOCK": 16, "num_warps": 4}
    if change == "misaligned view":
        args[0] = x[1:]
        assert args[0].data_ptr() % 16 != 0
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "n == 1":
        args[1] = 1
    elif change == "n odd":
        args[1] = 33
    elif change == "n past int32":
        args[1] = 2**31 + 16
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    else:
        kwargs["num_warps"] = 8
    launcher[(1,)](*args, **kwargs)
    assert len(fn.runs) == 2 and not fn.compiled.launched


def test_a_compiled_launcher_that_refuses_the_arguments_sends_every_later_launch_through_triton(caplog):
    fn = _Recorded(_Compiled(refuse=True))
    launcher = launching.Launcher(fn)
    x = torch.zeros(64)
    launcher[(1,)](x, 32, BLOCK=16)
    with caplog.at_level(logging.WARNING, logger="sglang_lora_tma_guard"):
        launcher[(1,)](x, 32, BLOCK=16)  # refused by the compiled launcher: launched through Triton instead
    assert len(fn.runs) == 2 and "refused its arguments" in caplog.text
    launcher[(1,)](x, 32, BLOCK=16)
    assert len(fn.runs) == 3 and not fn.compiled.launched


def test_triton_s_path_every_time_when_direct_launches_are_off_or_the_key_cannot_hold_the_arguments(fn, monkeypatch):
    launcher = launching.Launcher(fn)
    x = torch.zeros(64)
    monkeypatch.setattr(launching, "DIRECT", False)
    for _ in range(2):
        launcher[(1,)](x, 32, BLOCK=16)
    monkeypatch.setattr(launching, "DIRECT", True)
    for _ in range(2):
        launcher[(1,)](x, "32", BLOCK=16)  # an argument of a kind the key does not cover
    assert len(fn.runs) == 4 and not fn.compiled.launched


def _descriptor(t, block=(16, 32)):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def test_none_and_tensor_descriptors_launch_directly_and_each_descriptor_kind_is_a_variant_of_its_own(fn):
    # The fused down GEMM's weights argument: None without weight TMA, Triton's TensorDescriptor with it.
    launcher = launching.Launcher(fn)
    w = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    calls = [None, None, _descriptor(w[0]), _descriptor(w[1]), _descriptor(w[1], (32, 32)),
             _descriptor(w[0].float())]
    for desc in calls:
        launcher[(1,)](desc, 32, BLOCK=16)
    # Triton's path for the first None, the first descriptor and each other block shape or dtype; the rest direct.
    assert [args[0] for _, args, _ in fn.runs] == [calls[0], calls[2], calls[4], calls[5]]
    assert [args[0] for _, args in fn.compiled.launched] == [calls[1], calls[3]]


def test_a_constexpr_given_by_position_is_never_launched_directly(fn):
    launcher = launching.Launcher(fn)
    x = torch.zeros(64)
    for _ in range(2):
        launcher[(1,)](x, 32, 16)  # BLOCK by position: the key would hold its kind, not its value
    assert len(fn.runs) == 2 and not fn.compiled.launched


def test_the_interpreter_s_kernels_always_take_triton_s_path():
    # These tests run SGLang's and this package's kernels through Triton's interpreter: no JITFunction there.
    assert not launching.launcher(lora_moe._expand_kernel).direct


def test_the_inline_key_of_a_launch_is_each_argument_s_own_key():
    t = torch.zeros(64)
    args = (t, t[1:], t.half(), torch.nn.Parameter(t), 0, 1, 16, 17, -16, -17, 2**31 - 1, 2**31, 2**63, True, False,
            1.5, None, _descriptor(t.view(4, 16), (4, 16)))
    assert launching.arguments_key(args) == tuple(map(launching.argument_key, args))


def test_arguments_of_one_key_get_one_specialization_from_the_installed_triton():
    # The invariant the launcher rests on, against the installed Triton's own specializer: a key at least as
    # fine as Triton's, so that a kept variant is the one Triton would have chosen.
    native = pytest.importorskip("triton._C.libtriton").__dict__.get("native_specialize_impl")
    if native is None:
        pytest.skip("this Triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    buf = torch.zeros(256)
    values = [buf, buf[1:], buf[4:], buf[8:], buf[2:], buf.half(), buf[1:].half(), buf.to(torch.bfloat16),
              0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31, 2**31 + 1, 2**63 - 16, 2**63, 2**64 - 16,
              True, False, 1.5, 2.0, None]
    w = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    values += [_descriptor(w[0]), _descriptor(w[1]), _descriptor(w[0, 1:]), _descriptor(w[0], (32, 32)),
               _descriptor(w[0].float()), _descriptor(w[0].half(), (64, 64))]

    def triton_kind(value):
        kind = native(BaseBackend, value, False, True, True)
        return kind if not isinstance(value, torch.Tensor) else (kind, value.dtype)

    by_key = {}
    for value in values:
        by_key.setdefault(launching.argument_key(value), set()).add(repr(triton_kind(value)))
    assert all(len(kinds) == 1 for kinds in by_key.values()), by_key
