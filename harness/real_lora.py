"""SGLang's own LoRA MoE hooks on a tiny problem, run by SGLang's own Triton MoE runner.

What a server does for one MoE layer of a LoRA batch, without the server: a ``LoRAInfo`` built as
SGLang's LoRA manager builds it (several adapters of mixed ranks padded to the largest, one adapter
disabled, the batch's tokens in segments mapped to adapters, gate-up A with ``2*r`` rows), the
hooks from ``sglang.srt.lora.lora_moe_runners.build_lora_hooks`` (their deltas computed by
SGLang's ``fused_moe_lora`` Triton kernels), and ``TritonRunnerCore.run`` calling the fused-MoE
sequence with them. Used by the tests (CPU, Triton's interpreter) and the H200 benchmarks.

On a CPU, SGLang registers its LoRA kernels for CUDA only: :func:`enable_cpu_lora_ops` gives the
same Python launchers the CPU dispatch key. Its LoRA alignment has a CUDA kernel for larger batches
and a Python one for small batches; on a CPU the Python one serves every batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from harness.tiny_moe import MoEProblem, align_block_size, sequence_kwargs
from sglang_lora_tma_guard.installed import ensure_server_args

_cpu_library = None  # kept alive: registrations live as long as their Library object


def enable_cpu_lora_ops() -> None:
    """Give ``torch.ops.sglang.fused_moe_lora`` (and its shrink/expand) a CPU implementation."""
    global _cpu_library
    if _cpu_library is not None:
        return
    import importlib

    # The module that registers them moved: 0.5.22+, 0.5.16-0.5.21, up to 0.5.15.
    for package in ("sglang.kernels.ops.lora.moe", "sglang.kernels.ops.moe", "sglang.srt.lora.triton_ops"):
        module = f"{package}.fused_moe_lora_kernel"
        try:
            kernels = importlib.import_module(module)
            break
        except ModuleNotFoundError as missing:
            if not module.startswith(missing.name or "?"):  # there, but it does not import
                raise
    else:
        raise ModuleNotFoundError("this SGLang has no fused_moe_lora_kernel module")
    library = torch.library.Library("sglang", "IMPL")
    for name, function in (("fused_moe_lora", kernels._fused_moe_lora),
                           ("fused_moe_lora_shrink", kernels._fused_moe_lora_shrink),
                           ("fused_moe_lora_expand", kernels._fused_moe_lora_expand)):
        library.impl(name, function, "CPU")
    _cpu_library = library
    from sglang.srt.lora import lora_moe_runners

    if not hasattr(lora_moe_runners, "moe_lora_align_block_size"):  # imported on GPUs only
        lora_moe_runners.moe_lora_align_block_size = _align_on_cpu


def _align_on_cpu(topk_ids, seg_indptr, req_to_lora, num_experts, block_size_m, max_loras,
                  max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, expert_ids,
                  num_tokens_post_padded, adapter_enabled, lora_ids, **_buffers):
    """The CUDA alignment kernel's contract, filled by SGLang's own small-batch (Python) alignment."""
    from sglang.srt.lora.lora_moe_runners import _naive_moe_lora_align_block_size

    results = _naive_moe_lora_align_block_size(
        topk_ids, seg_indptr, req_to_lora, num_experts, block_size_m, max_loras,
        max_num_tokens_padded, max_num_m_blocks, adapter_enabled, topk_ids.device)
    for out, result in zip((sorted_token_ids, expert_ids, num_tokens_post_padded), results):
        out.copy_(result)


@contextlib.contextmanager
def cpu_virtual_experts():
    """Let SGLang's virtual-experts path (``merged_experts_fused_moe_lora_add``) run on a CPU: its
    expert alignment (a CUDA kernel) is given the plain-PyTorch one of ``tiny_moe``, and its config
    lookup a device name. Undone on exit."""
    import importlib

    align = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size")
    config = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    saved = align.moe_align_block_size, config.get_device_name
    align.moe_align_block_size = lambda topk_ids, block_m, num_experts: align_block_size(topk_ids, block_m, num_experts)
    config.get_device_name = lambda: "cpu"
    try:
        yield
    finally:
        align.moe_align_block_size, config.get_device_name = saved


@dataclass(frozen=True)
class Adapters:
    """A batch's adapters: ranks (padded to the largest in the buffers), which are enabled, and
    the batch's segments (token counts) with the adapter each uses (-1: the base model)."""

    ranks: tuple[int, ...] = (8, 16, 4)
    enabled: tuple[bool, ...] = (True, True, False)
    segments: tuple[int, ...] | None = None
    """Token counts per segment; None: one segment per adapter slot, tokens spread evenly."""
    segment_adapters: tuple[int, ...] | None = None
    lora_experts: int | None = None
    """Experts in the LoRA buffers; None: as many as the runner (see the fused-shared-expert test)."""
    scale: float = 0.3
    gated: bool = True
    """Gate-up A with gate and up ranks (``2 * r`` rows), as for SwiGLU; False: one projection."""
    shared_outer: bool = False
    """``experts_shared_outer_loras``: one gate-up A and one down B per adapter for every expert."""
    virtual_experts: bool = False
    """``--lora-use-virtual-experts``: SGLang's ``merged_experts_fused_moe_lora_add`` path."""
    padding: float = 0.0
    """What the buffers hold past each adapter's rank: SGLang's pool zeros; NaN proves that no kernel
    lets those rows and columns into a delta."""
    pool_rank: int | None = None
    """The buffers' width (SGLang's ``--max-lora-rank``); None: the largest of ``ranks``. Wider: a batch whose
    adapters are all below the rank of another one loaded in the pool."""


def make_lora_info(problem: MoEProblem, adapters: Adapters | None = None, *, seed: int = 0, cg_buffers=None):
    """SGLang's ``LoRAInfo`` for ``problem``, with random adapter weights, as its LoRA manager lays it out."""
    adapters = adapters or Adapters()
    from sglang.srt.lora.lora_moe_runners import LoRAInfo

    tokens = problem.hidden_states.shape[0]
    device, dtype = problem.hidden_states.device, problem.hidden_states.dtype
    experts = adapters.lora_experts or problem.num_experts
    hidden = problem.w2.shape[1]
    intermediate = problem.w2.shape[2]
    loras, rank = len(adapters.ranks), adapters.pool_rank or max(adapters.ranks)
    assert rank >= max(adapters.ranks), (adapters.pool_rank, adapters.ranks)
    gen = torch.Generator(device=device).manual_seed(seed)

    def weights(rows, cols, ranks_on_rows, shared=False):
        w = torch.randn(loras, 1 if shared else experts, rows, cols, generator=gen, device=device,
                        dtype=dtype) * adapters.scale
        for slot, r in enumerate(adapters.ranks):  # padded rank rows/columns: zero in SGLang's pool
            if ranks_on_rows:
                w[slot, :, r:rank] = adapters.padding
            else:
                w[slot, :, :, r:] = adapters.padding
        return w

    def owned_past_the_end(w):
        """``w`` at the start of an allocation of NaN that holds the runner's every expert: SGLang's default path
        reads a fused shared expert's weights past a buffer of fewer experts (under Triton's interpreter, memory the
        process may not own: a crash, not a wrong delta). NaN there, so its delta is wrong and says so."""
        past = (problem.num_experts - w.shape[1]) * w[0, 0].numel() if w.shape[1] == experts else 0
        if past <= 0:
            return w
        held = torch.full((w.numel() + past,), float("nan"), device=device, dtype=dtype)
        held[: w.numel()] = w.flatten()
        return held[: w.numel()].view(w.shape)

    shared, halves = adapters.shared_outer, 2 if adapters.gated else 1
    gate_up_a = torch.cat([weights(rank, hidden, True, shared) for _ in range(halves)], dim=2)  # gate, up
    gate_up_b = weights(halves * intermediate, rank, False)
    down_a = weights(rank, intermediate, True)
    down_b = weights(hidden, rank, False, shared)
    gate_up_a, gate_up_b, down_a, down_b = map(owned_past_the_end, (gate_up_a, gate_up_b, down_a, down_b))

    segments, owners = _segments(tokens, adapters)
    seg_indptr = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
    req_to_lora = torch.tensor(owners, dtype=torch.int32)
    token_lora = torch.repeat_interleave(req_to_lora, torch.tensor(segments))
    as_device = dict(device=device)
    return LoRAInfo(
        gate_up_lora_a_weights=gate_up_a,
        gate_up_lora_b_weights=gate_up_b,
        down_lora_a_weights=down_a,
        down_lora_b_weights=down_b,
        seg_indptr=seg_indptr.to(**as_device),
        req_to_lora=req_to_lora.to(**as_device),
        lora_ranks=torch.tensor(adapters.ranks, dtype=torch.int32, **as_device),
        adapter_enabled=torch.tensor([int(e) for e in adapters.enabled], dtype=torch.int32, **as_device),
        token_lora_mapping=token_lora.to(dtype=torch.int32, **as_device),
        max_lora_rank=rank,
        num_experts=problem.num_experts,
        has_active_lora=True,
        cg_buffers=cg_buffers,
        hidden_size=hidden,
        experts_shared_outer_loras=adapters.shared_outer,
        lora_use_virtual_experts=adapters.virtual_experts,
    )


def _segments(tokens: int, adapters: Adapters) -> tuple[list[int], list[int]]:
    if adapters.segments is not None:
        assert sum(adapters.segments) == tokens and len(adapters.segments) == len(adapters.segment_adapters)
        return list(adapters.segments), list(adapters.segment_adapters)
    # One segment per adapter slot plus one for the base model, tokens spread evenly.
    owners = [*range(len(adapters.ranks)), -1]
    sizes = [tokens // len(owners) + (i < tokens % len(owners)) for i in range(len(owners))]
    kept = [(s, o) for s, o in zip(sizes, owners) if s]
    return [s for s, _ in kept], [o for _, o in kept]


def lora_hooks(problem: MoEProblem, lora_info):
    """The hooks SGLang's runner builds for this batch (``build_lora_hooks``)."""
    from sglang.srt.lora.lora_moe_runners import build_lora_hooks

    return build_lora_hooks(problem.hidden_states, lora_info, problem.topk_ids)


def run_runner(problem: MoEProblem, hooks, *, use_tma: bool, build=None) -> torch.Tensor:
    """One call of SGLang's ``TritonRunnerCore.run``, as its MoE runner makes it with LoRA.

    The runner imports the fused-MoE sequence at call time, so an installed guard is on the path;
    the routing (alignment and tuned configs) is the problem's own, given as SGLang's pre-permute
    step would give it, with ``down_moe_use_tma`` as its config lookup would decide. ``build``
    (``hooks`` then None): a function of the hidden states that builds the hooks, called as SGLang's
    ``MoeRunner.run`` calls ``build_lora_hooks``: with the very tensor the runner is then given (here a
    copy of the problem's, the call being in place).
    """
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton import (
        TritonMoeQuantInfo,
        TritonRunnerCore,
        TritonRunnerInput,
    )

    ensure_server_args()
    kwargs = sequence_kwargs(problem, None)
    num_experts = problem.num_experts
    core = TritonRunnerCore(MoeRunnerConfig(
        num_experts=num_experts, num_local_experts=num_experts, top_k=problem.topk_ids.shape[1],
        hidden_size=problem.w2.shape[1], intermediate_size_per_partition=problem.w2.shape[2],
        activation=kwargs["activation"], is_gated=kwargs["is_gated"], inplace=True,
    ))
    quant = TritonMoeQuantInfo(
        w13_weight=problem.w1, w2_weight=problem.w2, use_fp8_w8a8=kwargs["use_fp8_w8a8"],
        w13_scale=problem.w1_scale, w2_scale=problem.w2_scale, block_shape=kwargs["block_shape"],
    )
    sorted_ids, expert_ids, post_padded = problem.alignment
    hidden_states = problem.hidden_states.clone()
    if build is not None:
        hooks = build(hidden_states)
    runner_input = TritonRunnerInput(
        hidden_states=hidden_states, topk_weights=problem.topk_weights,
        topk_ids=problem.topk_ids, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
        num_tokens_post_padded=post_padded,
    )
    state = {"config": dict(problem.config), "down_config": dict(problem.down_config),
             "down_moe_use_tma": use_tma}
    return core.run(runner_input, quant, state, hooks=hooks).hidden_states
