"""Import set-up shared by the GPU benchmarks."""

import torch


def portable_helper_ops() -> None:
    """Without the ``sglang-kernel`` wheel, make SGLang take its portable helper ops.

    SGLang imports ``sgl_kernel`` at module level when ``torch.version.cuda`` is set. That wheel is
    too large to carry to the benchmark machine, so the version is hidden before SGLang is imported:
    activation and sum then run as plain PyTorch/Triton, while the fused-MoE Triton kernels, the
    subject of these benchmarks, still run on the GPU with real TMA descriptors.
    """
    import os

    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        if os.environ.get("E2E"):  # the server kit carries sgl_kernel: its absence is an error there
            raise
        torch.version.cuda = None
