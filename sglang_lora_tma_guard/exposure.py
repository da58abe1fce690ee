"""Does this model, on this GPU, at this parallel size, meet either LoRA bug?

Reads the model's ``config.json`` into the fused-MoE shape SGLang's Triton runner will see on one
rank (experts per rank including a fused shared expert, intermediate size per shard, weight dtype,
fp8 block shape). First: does SGLang fuse the model's shared expert (LoRA on it is wrong on every
release 0.5.11-0.5.23, see :mod:`~sglang_lora_tma_guard.fusion`), and will the server really fuse
it? Then, for the shape the server will really build, the installed SGLang's own config lookup
(``get_moe_configs``, with its device-name and Triton-version rules) says which batch-size buckets
have a tuned down config that says ``USE_TMA``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path


class ExposureError(ValueError):
    """Input the prediction cannot use; the message is one line for the user."""


# Shared-expert fusion in SGLang 0.5.11-0.5.23 (each model's ``determine_num_fused_shared_experts``,
# from 0.5.18 ``resolve_shared_experts_config``): on NVIDIA GPUs of compute capability 8.0 or newer,
# without expert parallelism, these architectures fold their shared expert into the routed ones.
FUSE_IF_256_ROUTED_AND_ONE_SHARED = {"DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM"}
FUSE_IF_ONE_SHARED = {"Glm4MoeLiteForCausalLM"}
FUSE_ALWAYS = {"Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration", "MiniMaxM3SparseForCausalLM"}
FUSE_IF_EQUAL_WIDTHS = {"Qwen3NextForCausalLM"}  # one shared expert as wide as a routed one

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoEShape:
    architecture: str
    routed_experts: int
    fused_shared_experts: int
    experts_per_rank: int
    """E: the first dimension of the expert weights on one rank."""
    intermediate_per_shard: int
    """N in SGLang's config file names: the down projection's input size on one rank."""
    hidden_size: int
    topk: int
    dtype: str | None
    """SGLang's config dtype string: ``fp8_w8a8``, or None for bf16/fp16 weights."""
    block_shape: tuple[int, int] | None
    tp: int
    ep: int


@dataclass(frozen=True)
class SharedExpert:
    sglang_fuses: bool
    """SGLang folds this model's shared expert into the routed ones by default."""
    turned_off_by: str | None
    """``"user"`` (--disable-shared-experts-fusion), ``"guard"`` (a LoRA server with the guard), or None."""
    experts_per_rank_fused: int
    """E at the runner when fused (routed + shared), as the verdict names it."""


@dataclass(frozen=True)
class Exposure:
    """One deployment: the shape its server builds, its shared expert, and SGLang's TMA answer."""

    model_path: str
    shape: MoEShape
    shared_expert: SharedExpert
    device_name: str
    down_config_file: str
    triton_tensor_descriptors: bool
    buckets: dict[int, bool]
    """Tuned down-config buckets (batch size) and whether each takes the TMA down path."""
    tma_anywhere: bool


def load_config(model_path: str) -> dict:
    path = Path(model_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ExposureError(f"no config.json at {model_path}")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExposureError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ExposureError(f"{path} does not hold a JSON object")
    return config


def moe_shape(config: dict, tp: int = 1, ep: int = 1, shared_experts_fusion: bool = True) -> MoEShape:
    """The per-rank fused-MoE shape SGLang 0.5.16 builds for ``config`` at ``tp``/``ep``."""
    if tp < 1 or ep < 1 or tp % ep:
        raise ExposureError(f"--ep ({ep}) must divide --tp ({tp})")
    architecture = (config.get("architectures") or ["unknown"])[0]
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    merged = {**text, **{k: v for k, v in config.items() if v is not None}}
    routed = next((merged[k] for k in EXPERT_COUNT_KEYS if isinstance(merged.get(k), int)), None)
    if not routed or routed < 2:
        raise ExposureError(f"{architecture} is not a Mixture-of-Experts model (no expert count in its config)")
    intermediate = merged.get("moe_intermediate_size") or merged.get("intermediate_size")
    hidden, topk = merged.get("hidden_size"), merged.get("num_experts_per_tok")
    if not all(isinstance(v, int) for v in (intermediate, hidden, topk)):
        raise ExposureError(f"{architecture}: config lacks moe_intermediate_size, hidden_size or num_experts_per_tok")
    dtype, block_shape = _weight_format(merged.get("quantization_config"))

    fused = fused_shared_experts(architecture, routed, merged) if shared_experts_fusion and ep == 1 else 0
    moe_tp = tp // ep
    if routed % ep or intermediate % moe_tp:
        raise ExposureError(
            f"{routed} experts / ep {ep} or intermediate size {intermediate} / moe-tp {moe_tp} does not divide")
    return MoEShape(
        architecture=architecture, routed_experts=routed, fused_shared_experts=fused,
        experts_per_rank=routed // ep + fused, intermediate_per_shard=intermediate // moe_tp,
        hidden_size=hidden, topk=topk, dtype=dtype, block_shape=block_shape, tp=tp, ep=ep,
    )


def fused_shared_experts(architecture: str, routed: int, config: dict) -> int:
    """How many shared experts SGLang folds into the routed ones for this model (0: none)."""
    shared = config.get("n_shared_experts") or 0
    if architecture in FUSE_ALWAYS and shared:
        return shared
    if architecture in FUSE_IF_256_ROUTED_AND_ONE_SHARED and routed == 256 and shared == 1:
        return 1
    if architecture in FUSE_IF_ONE_SHARED and shared == 1:
        return 1
    width = config.get("shared_expert_intermediate_size")
    if architecture in FUSE_IF_EQUAL_WIDTHS and width and width == config.get("moe_intermediate_size"):
        return 1
    return 0


def _weight_format(quantization: dict | None) -> tuple[str | None, tuple[int, int] | None]:
    if not quantization:
        return None, None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ExposureError(
            f"unknown quantization {method!r}: only unquantized and fp8 MoE weights are understood")
    block = quantization.get("weight_block_size")
    return "fp8_w8a8", (tuple(block) if block else None)


@contextlib.contextmanager
def _device_name(name: str | None):
    """Make SGLang's config lookup see ``name`` as the GPU (it reads the device in the file name)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as lookup

    if name is None:
        yield
        return
    saved = lookup.get_device_name
    lookup.get_device_name = lambda device_id=0: name
    try:
        yield
    finally:
        lookup.get_device_name = saved


def tma_buckets(shape: MoEShape, device_name: str | None = None) -> dict:
    """SGLang's own answer for this shape: the down-config buckets and which say ``USE_TMA``."""
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import support_tensor_descriptor
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as lookup

    from .installed import ensure_server_args

    ensure_server_args()
    block_n, block_k = shape.block_shape or (0, 0)
    if device_name is None and not lookup.get_device_name():
        raise ExposureError("no GPU here to read SGLang's tuned configs for: pass --device-name (e.g. 'NVIDIA H200')")
    with _device_name(device_name):
        # The lookup is cached per shape, not per device; ask the uncached function.
        find = getattr(lookup.get_moe_configs, "__wrapped__", lookup.get_moe_configs)
        file_name = lookup.get_config_file_name(
            shape.experts_per_rank, shape.intermediate_per_shard, shape.dtype,
            [block_n, block_k], down_moe=True)
        down = find(shape.experts_per_rank, shape.intermediate_per_shard, shape.dtype,
                    block_n, block_k, down_moe=True) or {}
        resolved_device = lookup.get_device_name()
    descriptors = bool(support_tensor_descriptor())
    buckets = {int(m): bool(cfg.get("USE_TMA", False)) and descriptors for m, cfg in sorted(down.items())}
    return {
        "device_name": resolved_device,
        "down_config_file": file_name,
        "triton_tensor_descriptors": descriptors,
        "buckets": buckets,
        "tma_anywhere": any(buckets.values()),
    }


def predict(model_path: str, tp: int, ep: int, device_name: str | None, *, fusion_disabled: bool,
            guard_disables_fusion: bool) -> Exposure:
    """The deployment's exposure: shared-expert fusion, and TMA for the shape the server builds.

    ``fusion_disabled``: the server is started with ``--disable-shared-experts-fusion``;
    ``guard_disables_fusion``: the guard is on in the launcher and will turn fusion off for LoRA.
    """
    config = load_config(model_path)
    by_default = moe_shape(config, tp, ep, shared_experts_fusion=True)
    turned_off_by = "user" if fusion_disabled else "guard" if guard_disables_fusion else None
    served = moe_shape(config, tp, ep, shared_experts_fusion=turned_off_by is None)
    shared = SharedExpert(by_default.fused_shared_experts > 0, turned_off_by, by_default.experts_per_rank)
    return Exposure(model_path=model_path, shape=served, shared_expert=shared, **tma_buckets(served, device_name))
