"""Tiles for the LoRA MoE GEMMs of :mod:`~sglang_lora_tma_guard.lora_moe`, per batch.

Tuned tiles ship as data (``lora_moe_tiles.json``, written by ``benchmarks/tune_lora_moe.py`` on an
H200, a few buckets on an H100): per GPU name and per layer shape (hidden, intermediate per shard, experts
in the LoRA buffers, max rank), for buckets of pairs (tokens x topk), the rows per block and both hooks'
tiles that were fastest in that sweep. ``SGLANG_LORA_TMA_GUARD_TILES`` names another such file to read
instead. A GPU may take another's tiles for the buckets the data has none of its own of (:data:`TILES_OF`).
Where the data has nothing for this GPU and shape, a rule of thumb: blocks of about the pairs each virtual
expert gets, and K split when too few blocks would fill the GPU.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

import torch

from .log import info_once, logger
from .lora_moe import StageConfig

DATA = "lora_moe_tiles.json"
TILES_ENV = "SGLANG_LORA_TMA_GUARD_TILES"
TILES_OF = {"NVIDIA H100 80GB HBM3": "NVIDIA H200"}
"""GPUs that take another's tiles where the data has none of their own. The H100 SXM (Hopper, 132 SMs as the H200,
less memory bandwidth): with the H200's tiles the whole hooked call took 1-13% less time than with the rule of thumb on
an H100 at every batch of GLM-5.1 TP8, Qwen3-30B-A3B tp 1 and 2, E=80 N=640 and E=513 N=512 measured but one (mixed
ranks, 64 to 8192 tokens; 0.2% more, within noise, on Qwen3 tp 1 at 8192: ``benchmarks/results/lora_moe/tiles-on-h100/``)."""
PROGRAMS_PER_SM = 2
"""A split-K shrink aims at this many programs per SM of the GPU (read from the device)."""


@dataclass(frozen=True)
class Plan:
    """One batch's tiling: rows per block (the routing's) and each hook's GEMM tiles."""

    block_m: int
    gate_up: StageConfig
    down: StageConfig


def shape_key(hidden: int, intermediate: int, experts: int, max_rank: int) -> str:
    return f"H={hidden} I={intermediate} E={experts} R={max_rank}"


@functools.cache
def _table(path: str | None) -> dict:
    try:
        if path:
            return json.loads(Path(path).read_text())
        return json.loads(resources.files(__package__).joinpath(DATA).read_text())
    except (FileNotFoundError, OSError, ValueError) as error:
        if path:
            logger.warning("%s=%s could not be read (%s); using the shipped tiles",
                           TILES_ENV, path, error)
            return _table(None)
        return {}


@functools.cache
def _gpu() -> str:
    try:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    except Exception:
        return ""


def _stage(values: dict) -> StageConfig:
    names = {f.name for f in fields(StageConfig)}
    return StageConfig(**{key: value for key, value in values.items() if key in names})


@torch.compiler.assume_constant_result  # a function of the shapes: Dynamo runs it once per shape, no tracing
def plan(num_pairs: int, hidden: int, intermediate: int, experts: int, loras: int, max_rank: int) -> Plan:
    """The tiling for a batch of ``num_pairs`` (tokens x topk) on this GPU."""
    return _plan(num_pairs, hidden, intermediate, experts, loras, max_rank, os.environ.get(TILES_ENV) or None)


@functools.lru_cache(maxsize=4096)  # every MoE layer of a batch asks for the same plan
def _plan(num_pairs: int, hidden: int, intermediate: int, experts: int, loras: int, max_rank: int,
          tiles_path: str | None) -> Plan:
    key, gpu = shape_key(hidden, intermediate, experts, max_rank), _gpu()
    buckets = tiles_of(_table(tiles_path), gpu).get(key)
    if buckets:
        entry = next((b for b in buckets if num_pairs <= b["max_pairs"]), buckets[-1])
        return Plan(entry["block_m"], _stage(entry["gate_up"]), _stage(entry["down"]))
    info_once(f"no LoRA MoE tiles tuned for {key} on {gpu or 'this device'}: the fast path takes a rule of thumb "
              f"(benchmarks/tune_lora_moe.py in a checkout tunes them into a file for {TILES_ENV})")
    keys = loras * experts
    return Plan(rule_block_m(num_pairs, keys),
                rule_of_thumb(num_pairs, keys, hidden, max_rank, width=intermediate),
                rule_of_thumb(num_pairs, keys, intermediate, max_rank, width=hidden))


def tiles_of(table: dict, gpu: str) -> dict:
    """The tiles ``gpu`` takes from ``table``, by layer shape: the buckets tuned on it, and where it has none of a
    bucket's size, those of the GPU :data:`TILES_OF` names for it; none (``{}``) if neither is there."""
    own, lent = table.get(gpu, {}), table.get(TILES_OF.get(gpu), {})
    return {key: merged(lent.get(key, []), own.get(key, [])) for key in {**lent, **own}}


def merged(buckets: list, over: list) -> list:
    """``buckets`` with each of ``over`` in place of the bucket of its size (or added), in rising sizes."""
    return sorted({b["max_pairs"]: b for b in buckets + over}.values(), key=lambda b: b["max_pairs"])


def rule_block_m(num_pairs: int, num_keys: int) -> int:
    """About the pairs each virtual expert gets, 16 to 64."""
    per_key = num_pairs / max(1, min(num_pairs, num_keys))
    return 16 if per_key <= 16 else 32 if per_key <= 32 else 64


@functools.cache
def programs_to_fill() -> int:
    """Programs that keep every SM of this GPU busy (132 SMs on an H100/H200: 264); 264 without a GPU."""
    if not torch.cuda.is_available():
        return PROGRAMS_PER_SM * 132
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def rule_of_thumb(num_pairs: int, num_keys: int, k: int, max_rank: int, width: int | None = None) -> StageConfig:
    """Tiles for a shape the data does not hold. ``k``: the shrink's K (hidden for gate-up, the
    intermediate for down); ``width``: the expand's output width (``k``'s counterpart; ``k`` if not given)."""
    fill = programs_to_fill()
    block_r = 16 if num_pairs <= 1024 else 32
    rank_tiles = -(-max_rank // block_r)  # a gated shrink computes both halves' tiles in one program
    blocks = max(1, min(num_pairs, num_keys))
    block_k = 128 if k >= 512 else 64
    split_k = 1
    if blocks * rank_tiles < fill:
        split_k = max(1, min(k // (4 * block_k), fill // (blocks * rank_tiles)))
    # The expand: every rank in one tile where it fits (t read once, the column loop pipelined), and as
    # many column tiles per program as still leaves twice the programs that fill the GPU.
    expand_r = min(64, max(16, 1 << (max_rank - 1).bit_length()))
    tiles = -(-(width or k) // 64)  # per half of a gated gate-up: its grid holds both
    n_tiles = max(1, min(16, tiles * blocks // (2 * fill)))
    return StageConfig(shrink_block_r=block_r, shrink_block_k=block_k, split_k=split_k,
                       expand_block_n=64, expand_block_r=expand_r, expand_n_tiles=n_tiles)
