"""A tiny MoE layer (block-fp8 weights, or 16-bit ones for the benchmarks), run through the installed
SGLang's own ``_fused_moe_kernel_sequence``: what ``check --selftest`` and the demo need to show the TMA
bug and its fix on SGLang's real kernels, on a GPU natively, on a CPU through Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before Triton is first imported). The tests and benchmarks use it
through ``harness.tiny_moe``, which adds what only they call. The LoRA-style hooks add a per-expert
low-rank delta to each route's row, in place, the way SGLang's LoRA MoE hooks do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch

from .inspection import TARGET_NAME
from .installed import ensure_server_args, fused_moe_module

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, R, C) float -> fp8 weight and (E, ceil(R/128), ceil(C/128)) float32 scales, one per 128x128 block
    (the last block of a width that is no multiple of 128 is partial, as in SGLang's block-fp8 checkpoints)."""
    experts, rows, cols = weight.shape
    br, bc = FP8_BLOCK
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % bc, 0, -rows % br))
    blocks = padded.view(experts, padded.shape[1] // br, br, padded.shape[2] // bc, bc)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-6) / FP8_MAX
    quantized = (blocks / scale[:, :, None, :, None]).view(padded.shape)[:, :rows, :cols]
    return quantized.contiguous().to(torch.float8_e4m3fn), scale


def align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """What SGLang's ``moe_align_block_size`` returns, in plain PyTorch (it has no CPU kernel).

    Route indices ``t * topk + j`` grouped by expert, each group padded with the sentinel
    ``num_tokens * topk`` to a multiple of ``block_m``; one expert id per block. Routes to expert
    -1 (filtered out under expert parallelism) form the first group, its blocks marked -1, as in
    SGLang's kernel, which counts ``num_experts + 1`` ids.
    """
    flat = topk_ids.flatten().long().cpu()
    numel = flat.numel()
    order = torch.argsort(flat, stable=True).tolist()
    counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    start = 0
    for slot, count in enumerate(counts):
        if count == 0:
            continue
        padding = -count % block_m
        sorted_ids += order[start : start + count] + [numel] * padding
        expert_ids += [slot - 1] * ((count + padding) // block_m)
        start += count
    post_padded = len(sorted_ids)
    # Sized as SGLang sizes them, so the TMA path's buffer arithmetic sees what it would in a server.
    capacity = numel * block_m if numel < num_experts + 1 else numel + (num_experts + 1) * (block_m - 1)
    sorted_ids += [numel] * (capacity - len(sorted_ids))
    expert_ids += [-1] * (-(-capacity // block_m) - len(expert_ids))
    device = topk_ids.device
    as_i32 = dict(dtype=torch.int32, device=device)
    return (
        torch.tensor(sorted_ids, **as_i32),
        torch.tensor(expert_ids, **as_i32),
        torch.tensor([post_padded], **as_i32),
    )


@dataclass
class MoEProblem:
    """Weights, routing, kernel configs and LoRA factors for one MoE layer: block-fp8 weights with their
    scales, or 16-bit weights (scales ``None``)."""

    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    config: dict
    down_config: dict
    lora: dict = field(repr=False)

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def block_fp8(self) -> bool:
        return self.w1_scale is not None

    @functools.cached_property
    def alignment(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Computed once, before any CUDA-graph capture (it copies from the host)."""
        return align_block_size(self.topk_ids, self.config["BLOCK_SIZE_M"], self.num_experts)


def small_config(block_m: int = 16) -> dict:
    """A kernel config small enough for Triton's CPU interpreter."""
    return {
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": 128,
        "BLOCK_SIZE_K": FP8_BLOCK[1],
        "GROUP_SIZE_M": 1,
        "num_warps": 4,
        "num_stages": 2,
    }


def make_weights(num_experts, hidden, intermediate, *, seed=0, device="cpu", dtype=None):
    """``w1`` (E, 2I, H) and ``w2`` (E, H, I), generated on ``device``: block fp8 with their scales, or in
    ``dtype`` (a 16-bit float) with scales ``None``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen, device=device) * 0.05
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen, device=device) * 0.05
    if dtype is not None:
        return w1.to(dtype), w2.to(dtype), None, None
    w1, w1_scale = quantize_block_fp8(w1)
    w2, w2_scale = quantize_block_fp8(w2)
    return w1, w2, w1_scale, w2_scale


def make_problem(
    num_tokens: int = 8,
    num_experts: int = 4,
    hidden: int = 256,
    intermediate: int = 128,
    topk: int = 2,
    rank: int = 4,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float16,
    weights=None,
    config: dict | None = None,
    down_config: dict | None = None,
) -> MoEProblem:
    """One layer's inputs; ``weights`` (from :func:`make_weights`) can be shared between sizes."""
    if weights is None:
        weights = make_weights(num_experts, hidden, intermediate, seed=seed, device=device)
    w1, w2, w1_scale, w2_scale = weights
    num_experts, hidden, intermediate = w2.shape
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    scores = randn(num_tokens, num_experts).softmax(dim=-1)
    topk_weights, topk_ids = torch.topk(scores, topk, dim=-1)
    # LoRA-style factors: one rank-r update per projection, scaled per expert, so that each
    # route's delta depends on its token and its expert, as an adapter's does.
    lora = {
        "A1": randn(hidden, rank, scale=0.1).to(dtype),
        "B1": randn(rank, 2 * intermediate, scale=0.1).to(dtype),
        "gain1": randn(num_experts, scale=1.0).to(dtype),
        "A2": randn(intermediate, rank, scale=0.1).to(dtype),
        "B2": randn(rank, hidden, scale=0.1).to(dtype),
        "gain2": randn(num_experts, scale=1.0).to(dtype),
    }
    config = dict(config or small_config())
    return MoEProblem(
        hidden_states=randn(num_tokens, hidden).to(dtype),
        w1=w1,
        w2=w2,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        topk_weights=topk_weights.float(),
        topk_ids=topk_ids.to(torch.int32),
        config=config,
        down_config=dict(down_config or config),
        lora=lora,
    )


def lora_hooks(problem: MoEProblem, gate_up: bool = True, down: bool = True):
    """SGLang's ``LoRAHooks`` adding each route's low-rank delta in place, row by row.

    Both hooks index the buffers as SGLang's LoRA hooks do: route ``(t, j)`` is row ``t*topk + j``.
    """
    from sglang.srt.lora.lora_moe_runners import LoRAHooks

    lora = problem.lora

    def after_gate_up(hidden_states, cache1, topk_weights, topk_ids):
        delta = (hidden_states @ lora["A1"]) @ lora["B1"]  # (T, 2I)
        cache1 += delta[:, None, :] * lora["gain1"][topk_ids.long()][..., None]

    def after_down(cache2, cache3, topk_weights, topk_ids):
        tokens, topk, hidden = cache3.shape
        delta = ((cache2[: tokens * topk] @ lora["A2"]) @ lora["B2"]).view(tokens, topk, hidden)
        scale = topk_weights.to(cache3.dtype) * lora["gain2"][topk_ids.long()]
        cache3 += delta * scale[..., None]

    return LoRAHooks(
        after_gate_up=after_gate_up if gate_up else None,
        after_down=after_down if down else None,
    )


LAUNCH_FLAGS = ("a_use_tma", "b_use_tma", "c_sorted")
WEIGHT_TMA_LAUNCH = {"a_use_tma": False, "b_use_tma": True, "c_sorted": False}
"""Each GEMM launch of a hooked call under strategy weight_tma: activations route-major."""


@contextlib.contextmanager
def launch_recorder():
    """Record the TMA arguments of each ``invoke_fused_moe_kernel`` call made inside the block.

    The launcher is replaced on the fused-MoE module (where the sequence looks it up at call time)
    by a recorder that carries its signature, and put back on exit.
    """
    module = fused_moe_module()
    real = module.invoke_fused_moe_kernel
    launches: list[dict] = []

    @functools.wraps(real)
    def recorder(*args, **kwargs):
        launches.append({name: bool(kwargs.get(name, False)) for name in LAUNCH_FLAGS})
        return real(*args, **kwargs)

    module.invoke_fused_moe_kernel = recorder
    try:
        yield launches
    finally:
        module.invoke_fused_moe_kernel = real


def run_sequence(problem: MoEProblem, *, use_tma: bool, hooks=None, function=None, **overrides) -> torch.Tensor:
    """One call of ``_fused_moe_kernel_sequence`` as SGLang's Triton runner makes it.

    The function is looked up on its module at call time, as SGLang's runner does, so an installed
    guard is on the path. ``down_moe_use_tma`` goes positionally, as in every SGLang caller.
    ``overrides`` replace keyword arguments of :func:`sequence_kwargs` (``filter_expert=True``...).
    """
    ensure_server_args()
    if function is None:
        function = getattr(fused_moe_module(), TARGET_NAME)
    sorted_ids, expert_ids, post_padded = problem.alignment
    # The eleven leading arguments go by position, as every SGLang caller passes them (a fork may
    # have renamed one); a later positional one (0.5.18+: up_moe_use_tma) gets False.
    leading = (
        problem.hidden_states.clone(), problem.w1, problem.w2, problem.topk_weights, problem.topk_ids,
        sorted_ids, expert_ids, post_padded, dict(problem.config), dict(problem.down_config), use_tma,
    )
    extra, accepted = _call_shape(function)
    trailing = [{"up_moe_use_tma": False}[name] for name in extra]
    kwargs = {**sequence_kwargs(problem, hooks), **overrides}
    return function(*leading, *trailing, **{k: v for k, v in kwargs.items() if k in accepted})


@functools.lru_cache(maxsize=8)
def _call_shape(function) -> tuple[tuple[str, ...], frozenset[str]]:
    """Positional parameters after the eleventh, and every parameter name, of ``function``."""
    params = inspect.signature(function).parameters
    positional = [p.name for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    return tuple(positional[11:]), frozenset(params)


def sequence_kwargs(problem: MoEProblem, hooks) -> dict:
    """The keyword arguments SGLang 0.5.16's Triton runner passes, for the problem's weights."""
    unset = dict.fromkeys(("b1", "b2", "w1_zp", "w2_zp", "a1_scale", "a2_scale", "routed_scaling_factor",
                           "gemm1_alpha", "gemm1_limit"), None)
    off = dict.fromkeys(("use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16", "per_channel_quant", "no_combine",
                         "apply_router_weight_on_input", "filter_expert"), False)
    return dict(
        **unset, **off, use_fp8_w8a8=problem.block_fp8, w1_scale=problem.w1_scale, w2_scale=problem.w2_scale,
        block_shape=list(FP8_BLOCK) if problem.block_fp8 else None, activation="silu", is_gated=True,
        inplace=True,  # the out-of-place path asks for a tensor-parallel group
        hooks=hooks,
    )


@dataclass(frozen=True)
class Comparison:
    rows: int
    rows_wrong: int
    max_abs_diff: float
    max_rel_err: float
    identical: bool
    rel_err: float
    """Relative L2 error of the whole output."""

    def __str__(self) -> str:
        verdict = "bit-identical" if self.identical else f"{self.rows_wrong}/{self.rows} rows wrong"
        return f"{verdict}, max |diff| {self.max_abs_diff:.3g}, max relative error {self.max_rel_err:.3g}"


ROW_TOLERANCE = 1e-2
"""A row counts as wrong when its relative L2 error exceeds 1% or it holds a NaN/inf."""


def rel_err(output: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative L2 error of ``output`` against ``reference``, over the whole tensor."""
    out, ref = output.float(), reference.float()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-12))


def compare(output: torch.Tensor, reference: torch.Tensor) -> Comparison:
    out, ref = output.float().flatten(1), reference.float().flatten(1)
    diff = (out - ref).abs()
    rel = (out - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-12)
    wrong = ~torch.isfinite(out).all(dim=1) | ~(rel <= ROW_TOLERANCE)
    return Comparison(
        rows=out.shape[0],
        rows_wrong=int(wrong.sum()),
        max_abs_diff=float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0,
        max_rel_err=float(rel.nan_to_num(nan=float("inf")).max()) if rel.numel() else 0.0,
        identical=torch.equal(output, reference),
        rel_err=rel_err(out, ref),
    )
