"""Tiles for the LoRA MoE GEMMs of :mod:`~sglang_lora_tma_guard.lora_moe`.

Tuned tiles ship as data (``lora_moe_tiles.json``, written by ``benchmarks/tune_lora_moe.py`` on an
H200): per GPU name, per hook kind (``gate_up``: K = hidden, two halves; ``down``: K = intermediate)
and per bucket of pairs (tokens x topk) the best tiles of that sweep. Where the file has nothing for
this GPU or shape, a rule of thumb: split K when too few blocks would fill the GPU.
"""

from __future__ import annotations

import functools
import json
from dataclasses import fields
from importlib import resources

import torch

from .lora_moe import StageConfig

DATA = "lora_moe_tiles.json"
SMS_TO_FILL = 264  # two programs per SM of an H100/H200 (132 SMs)


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    try:
        return json.loads(resources.files(__package__).joinpath(DATA).read_text())
    except (FileNotFoundError, OSError, ValueError):
        return {}


def _gpu() -> str | None:
    try:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


def kind(k: int, halves: int) -> str:
    return "gate_up" if halves == 2 or k >= 1024 else "down"


def lookup(num_pairs: int, num_keys: int, k: int, max_rank: int, halves: int) -> StageConfig:
    """The tiles for one hook of a batch of ``num_pairs`` (tokens x topk)."""
    gpu = _gpu()
    entries = _table().get(gpu or "", {}).get(kind(k, halves), [])
    for entry in entries:  # buckets in increasing ``max_pairs``
        if num_pairs <= entry["max_pairs"]:
            names = {f.name for f in fields(StageConfig)}
            return StageConfig(**{key: value for key, value in entry["tiles"].items() if key in names})
    return rule_of_thumb(num_pairs, num_keys, k, max_rank, halves)


def rule_of_thumb(num_pairs: int, num_keys: int, k: int, max_rank: int, halves: int) -> StageConfig:
    block_r = 16 if num_pairs <= 1024 else 32
    rank_tiles = halves * -(-max_rank // block_r)
    blocks = max(1, min(num_pairs, num_keys))
    block_k = 128 if k >= 512 else 64
    split_k = 1
    if blocks * rank_tiles < SMS_TO_FILL:
        split_k = max(1, min(k // (4 * block_k), SMS_TO_FILL // (blocks * rank_tiles)))
    return StageConfig(shrink_block_r=block_r, shrink_block_k=block_k, split_k=split_k,
                       expand_block_n=64, expand_block_r=min(32, max(16, block_r)))
