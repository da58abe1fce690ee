"""What every H200 benchmark shares: the shapes, the options, SGLang's set-up and configs, CUDA-graph
capture and the one timing routine.

Importing this module imports no SGLang: :func:`prepare_sglang` does, once the import set-up is done.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

SHAPES = {
    # GLM-5.1-FP8 on 8 GPUs: 256 routed experts + the fused shared expert, N per shard, hidden 6144.
    "glm51-fp8-tp8": dict(E=257, N=256, K=6144, topk=8),
    # Two more shapes whose tuned H200 down configs say USE_TMA (hidden sizes chosen here).
    "e80-n640": dict(E=80, N=640, K=4096, topk=8),
    "e513-n512": dict(E=513, N=512, K=4096, topk=8),
    # Qwen3-30B-A3B (128 experts, moe_intermediate 768, hidden 2048, top-8) at tensor parallel 1, 2 and 4:
    # shapes for the fast LoRA MoE path's tiles (SGLang's tuned configs for them do not say USE_TMA).
    "qwen3-30b-tp1": dict(E=128, N=768, K=2048, topk=8),
    "qwen3-30b-tp2": dict(E=128, N=384, K=2048, topk=8),
    "qwen3-30b-tp4": dict(E=128, N=192, K=2048, topk=8),
}
TMA_SHAPES = ["glm51-fp8-tp8", "e80-n640", "e513-n512"]
"""The shapes the TMA benchmarks default to."""


def benchmark_parser(doc: str, tokens: list[int], shapes: bool = True) -> argparse.ArgumentParser:
    """The options every H200 benchmark takes: --tokens, --out (default $OUT or results), --shapes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if shapes:
        parser.add_argument("--shapes", nargs="+", default=TMA_SHAPES, choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=tokens)
    parser.add_argument("--out", default=os.environ.get("OUT", "results"), type=Path)
    return parser


def run_meta(**extra) -> dict:
    """What a results file says it ran on (SGLang, torch, Triton, the GPU) plus ``extra``; printed as a JSON line."""
    import json

    import triton

    from sglang_lora_tma_guard.inspection import sglang_version

    meta = {"sglang": sglang_version(), "torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name(0), **extra}
    print(json.dumps(meta), flush=True)
    return meta


def results_dir(args) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out


def portable_helper_ops() -> None:
    """Without the ``sglang-kernel`` wheel, make SGLang take its portable helper ops.

    SGLang imports ``sgl_kernel`` at module level when ``torch.version.cuda`` is set. That wheel is
    too large to carry to the benchmark machine, so the version is hidden before SGLang is imported:
    activation and sum then run as plain PyTorch/Triton, while the fused-MoE Triton kernels, the
    subject of these benchmarks, still run on the GPU with real TMA descriptors.
    """
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        if os.environ.get("E2E"):  # the server kit carries sgl_kernel: its absence is an error there
            raise
        torch.version.cuda = None


def prepare_sglang(needs_gpu: bool = True) -> None:
    """Import the installed SGLang's fused-MoE module the benchmarks' way, with server settings."""
    if needs_gpu and not torch.cuda.is_available():
        sys.exit(f"{Path(sys.argv[0]).name}: needs a CUDA GPU")
    portable_helper_ops()
    import warnings

    warnings.filterwarnings("ignore")
    from sglang_lora_tma_guard import installed

    installed.fused_moe_module()
    installed.ensure_server_args()


BASES = {"fp8": None, "bf16": torch.bfloat16}
"""The base weights a LoRA MoE benchmark can run: block fp8 (128 x 128 scales), or bf16 (``--base``)."""


def lookup_configs(shape: dict, tokens: int, base: str = "fp8"):
    """SGLang's own choice for this shape, batch size and base weights: (config, down_config, use_tma)."""
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import support_tensor_descriptor
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        try_get_optimal_moe_config,
    )

    E, N, K = shape["E"], shape["N"], shape["K"]
    fp8 = base == "fp8"
    config, (down_config, _) = try_get_optimal_moe_config(
        (E, 2 * N, K), (E, K, N), shape["topk"], "fp8_w8a8" if fp8 else None, tokens,
        block_shape=[128, 128] if fp8 else None, return_down_config=True,
    )
    use_tma = bool(support_tensor_descriptor() and down_config is not None
                   and down_config.pop("USE_TMA", False))
    return dict(config), dict(down_config or config), use_tma


def capture(fn):
    """Capture ``fn`` in a CUDA graph; return (graph, its output tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def replay_times(graphs: dict, replays=50, repeats=5) -> dict:
    """Best ms per replay of each graph, the graphs interleaved within each repeat (so that a noisy
    neighbour slows them alike)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = {name: float("inf") for name in graphs}
    for _ in range(repeats):
        for name, graph in graphs.items():
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end) / replays)
    return best


def time_parts(capture_mode, parts: dict) -> dict:
    """Best ms per replay of each part (a function of no arguments), each captured in a CUDA graph in ``capture_mode``
    and the graphs replayed interleaved; a part that fails to capture (a variant that does not compile here) is
    said and left out."""
    graphs = {}
    with capture_mode():
        for part, fn in parts.items():
            try:
                graphs[part] = capture(fn)[0]
            except Exception as error:  # noqa: BLE001 - a row left out, the rest still timed
                print(f"{part}: {type(error).__name__}: {str(error)[:200]}", flush=True)
    return replay_times(graphs)


def replay_ms(graph, replays=50, repeats=5) -> float:
    return replay_times({"graph": graph}, replays, repeats)["graph"]
