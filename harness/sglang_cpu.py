"""SGLang's own MoE layers and LoRA manager on a CPU, as one scheduler process builds them.

:func:`scheduler` publishes real ``ServerArgs`` (SGLang's own class, its own defaults) and sets up
SGLang's distributed state over gloo with one rank, as a one-GPU scheduler has it, once per process;
:func:`moe_layer` is SGLang's ``FusedMoE`` built by its own constructor (unquantized fp16 weights);
:func:`lora_manager` is SGLang's ``LoRAManager`` as far as ``init_lora_modules`` reads it, over a model
of such layers, wrapping them with SGLang's own ``FusedMoEWithLoRA`` through its own
``set_lora_module``. What is not real: the model around the layers (a ``ModuleList``) and the LoRA
backend object (the attribute ``FusedMoEWithLoRA`` writes, and the name 0.5.23 reads). Each release
0.5.11-0.5.23 runs: where they differ, the code asks the release what it has (a signature, a
dataclass's fields, a module), never its version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import socket
from dataclasses import dataclass
from types import SimpleNamespace

import torch

_published = None


def scheduler(**fields):
    """SGLang's server arguments for this process (defaults plus ``fields``), published once; its
    distributed and MoE state for one rank. Later calls change the published fields in place (the first
    call's ``fields`` are resolved and published with the record: only they reach what 0.5.17+ reads from
    its published config, such as ``disable_shared_experts_fusion``)."""
    global _published
    from sglang.srt.server_args import ServerArgs

    if _published is None:
        args = ServerArgs(**{"model_path": "dummy", "enable_lora": True, "device": "cpu", **fields})
        if hasattr(args, "resolve_once"):
            args.resolve_once()
        _publish(args)
        _init_distributed()
        from sglang.srt.layers.moe import initialize_moe_config

        if inspect.signature(initialize_moe_config).parameters:
            initialize_moe_config(args)
        else:  # from 0.5.19 it reads what was published
            initialize_moe_config()
        _published = args
    for name, value in fields.items():
        # Past ServerArgs' own __setattr__, which refuses writes after resolution (0.5.19+). The record is
        # what the guard reads; the config SGLang projects from it when published (0.5.19+) keeps its values.
        super(type(_published), _published).__setattr__(name, value)
    return _published


def _publish(args) -> None:
    """As the release's scheduler process publishes its arguments: ``runtime_context.publish`` with this
    process's place (rank 0) where it takes one (0.5.21+), ``publish`` (0.5.19, 0.5.20), or the older
    scheduler's setter (a module global; the runtime context from 0.5.16)."""
    try:
        from sglang.srt import runtime_context
    except ImportError:
        runtime_context = None
    publish = getattr(runtime_context, "publish", None)
    if publish is None:
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(args)
    elif hasattr(runtime_context, "SpawnRanks"):  # the ranks, read by the MoE layers, come from here
        publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    else:
        publish(args, role="scheduler")


def _init_distributed() -> None:
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    if "tensor_model_parallel_size" in inspect.signature(initialize_model_parallel).parameters:
        initialize_model_parallel(1, 1)
    else:  # from 0.5.21 the widths are the published arguments' (all 1 here)
        initialize_model_parallel()


def moe_layer(experts: int = 4, topk: int = 2, hidden: int = 64, intermediate: int = 32, *, layer_id: int = 0,
              seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float16, **options):
    """SGLang's ``FusedMoE``, random weights (``options``: its own keyword arguments); fp16 on the CPU
    (Triton's interpreter computes bf16 GEMMs wrongly), bf16 is for a GPU."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    scheduler()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            layer = FusedMoE(num_experts=experts, top_k=topk, hidden_size=hidden, intermediate_size=intermediate,
                             layer_id=layer_id, quant_config=None, prefix=f"model.layers.{layer_id}.mlp.experts",
                             **options)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (layer.w13_weight, layer.w2_weight):
            weight.copy_(torch.randn(weight.shape, generator=gen) * 0.2)
    return layer


def model_over(layers) -> torch.nn.Module:
    """A stand-in model whose decoder layer ``i`` has ``layers[i]`` as ``mlp.experts`` (where SGLang's LoRA
    manager looks for MoE layers)."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for layer in layers:
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = layer
        model.model.layers.append(block)
    return model


def lora_manager(layers, target_modules=("gate_up_proj", "down_proj")):
    """SGLang's ``LoRAManager`` over a model whose decoder layers have these MoE layers."""
    from sglang.srt.lora.lora_manager import LoRAManager

    model = model_over(layers)
    manager = LoRAManager.__new__(LoRAManager)
    manager.base_model = model
    manager.base_hf_config = SimpleNamespace(num_hidden_layers=len(layers))
    manager.target_modules = set(target_modules)
    manager.lora_backend = SimpleNamespace(is_moe_lora=False, name=scheduler().lora_backend)  # name: 0.5.23
    manager.experts_shared_outer_loras = manager.lora_use_virtual_experts = False
    manager.max_lora_rank = 8  # 0.5.23 reads it (the physical rank of its lora_* MoE runners only)
    return manager


def wrapped(manager):
    """The modules SGLang's ``init_lora_modules`` put in place of each MoE layer."""
    return [module for modules in manager.lora_modules for module in modules.values()]


# --- one forward of a LoRA-wrapped layer, and its float32 reference ------------------------------------


@contextlib.contextmanager
def cpu_kernels():
    """What SGLang's MoE and LoRA path lack on a CPU: its LoRA Triton ops on the CPU dispatch key, and its
    CUDA expert alignment (the fused-MoE module's own reference to it too) given a plain-PyTorch one."""
    import importlib

    from harness import real_lora
    from harness.tiny_moe import align_block_size

    real_lora.enable_cpu_lora_ops()
    fused_moe = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    saved = fused_moe.moe_align_block_size
    fused_moe.moe_align_block_size = lambda topk_ids, block_m, num_experts, **_: align_block_size(
        topk_ids, block_m, num_experts)
    try:
        with real_lora.cpu_virtual_experts():
            yield
    finally:
        fused_moe.moe_align_block_size = saved


def routing(tokens: int, experts: int, topk: int, seed: int = 0):
    """SGLang's ``StandardTopKOutput`` for random router logits (softmax, top-k, not renormalised)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), topk)
    return StandardTopKOutput(topk_weights=weights, topk_ids=ids.to(torch.int32), router_logits=logits)


@dataclass
class ExpertAdapter:
    """One adapter's expert LoRA as peft writes it, per expert: gate/up A ``(r, H)``, B ``(I, r)``, down
    A ``(r, I)``, B ``(H, r)``; the scaling already folded into B (as SGLang's loader does)."""

    gate_a: torch.Tensor
    up_a: torch.Tensor
    gate_b: torch.Tensor
    up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor

    @classmethod
    def random(cls, experts: int, hidden: int, intermediate: int, rank: int, seed: int, scale: float = 0.3):
        gen = torch.Generator().manual_seed(seed)

        def w(*shape):
            return (torch.randn(experts, *shape, generator=gen) * scale).half()

        return cls(w(rank, hidden), w(rank, hidden), w(intermediate, rank), w(intermediate, rank),
                   w(rank, intermediate), w(hidden, rank))


def lora_info_for(module, adapters, token_adapter):
    """SGLang's ``LoRAInfo`` for a batch: pool slots of ``adapters`` (rank padded to the largest), their B
    put in the buffers by the LoRA layer's own slicer (``slice_moe_lora_b_weights``), as its pool does."""
    from sglang.srt.lora.lora_moe_runners import LoRAInfo

    rank = max(a.gate_a.shape[1] for a in adapters)
    experts, hidden = adapters[0].gate_a.shape[0], adapters[0].gate_a.shape[2]

    def pad(t, dim):
        shape = list(t.shape)
        shape[dim] = rank - shape[dim]
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    gate_up_a = torch.stack([torch.cat([pad(a.gate_a, 1), pad(a.up_a, 1)], dim=1) for a in adapters])
    gate_up_b = torch.stack([module.slice_moe_lora_b_weights(
        torch.cat([pad(a.gate_b, 2), pad(a.up_b, 2)], dim=1), 0, "gate_up_proj_moe") for a in adapters])
    down_a = torch.stack([pad(a.down_a, 1) for a in adapters])
    down_b = torch.stack([pad(a.down_b, 2) for a in adapters])
    token_adapter = torch.tensor(token_adapter, dtype=torch.int32)
    bounds = [0] + [i for i in range(1, len(token_adapter)) if token_adapter[i] != token_adapter[i - 1]]
    seg_indptr = torch.tensor(bounds + [len(token_adapter)], dtype=torch.int32)
    fields = dict(
        gate_up_lora_a_weights=gate_up_a, gate_up_lora_b_weights=gate_up_b,
        down_lora_a_weights=down_a, down_lora_b_weights=down_b, seg_indptr=seg_indptr,
        req_to_lora=token_adapter[seg_indptr[:-1].long()],
        lora_ranks=torch.tensor([a.gate_a.shape[1] for a in adapters], dtype=torch.int32),
        adapter_enabled=torch.ones(len(adapters), dtype=torch.int32), token_lora_mapping=token_adapter,
        max_lora_rank=rank, num_experts=experts, has_active_lora=True, hidden_size=hidden,
    )
    # Releases add and drop fields (token_lora_mapping from 0.5.13, hidden_size up to 0.5.21).
    known = {field.name for field in dataclasses.fields(LoRAInfo)}
    return LoRAInfo(**{name: value for name, value in fields.items() if name in known})


def forward(module, hidden_states, topk_output, lora_info):
    """The LoRA-wrapped layer's own forward for one batch (its dispatcher, runner, hooks and combine)."""
    with cpu_kernels():
        return module._forward_with_lora(hidden_states, topk_output, lora_info)


def reference(layer, hidden_states, topk_output, adapters, token_adapter):
    """The layer in float32 PyTorch, from its config and the adapters as written: per route,
    ``W13 x + [Bg Ag x; Bu Au x]``, the activation, ``W2 a + Bd Ad a``, weighted by the router (on the
    input instead where the layer says ``apply_router_weight_on_input``)."""
    config = layer.moe_runner_config
    w13, w2 = layer.w13_weight.float(), layer.w2_weight.float()
    x = hidden_states.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        a = adapters[token_adapter[t]] if token_adapter[t] >= 0 else None
        for weight, e in zip(topk_output.topk_weights[t].tolist(), topk_output.topk_ids[t].tolist()):
            xin = x[t] * weight if config.apply_router_weight_on_input else x[t]
            gate, up = (w13[e] @ xin).chunk(2)
            if a is not None:
                gate = gate + a.gate_b[e].float() @ (a.gate_a[e].float() @ xin)
                up = up + a.up_b[e].float() @ (a.up_a[e].float() @ xin)
            if config.gemm1_alpha is not None:
                limit = config.gemm1_clamp_limit
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = gate * torch.sigmoid(config.gemm1_alpha * gate) * (up + 1)
            else:
                act = torch.nn.functional.silu(gate) * up
            y = w2[e] @ act
            if a is not None:
                y = y + a.down_b[e].float() @ (a.down_a[e].float() @ act)
            out[t] += y if config.apply_router_weight_on_input else weight * y
    return out


def relative_error(got, want) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


# --- SGLang's own LoRA manager, loader and pool over such a model, adapters as peft writes them ----------


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def write_adapter(folder, *, layers: int, experts: int, hidden: int, intermediate: int, rank: int,
                  projections=EXPERT_PROJECTIONS, alpha: float | None = None, seed: int = 0, names=None,
                  ranks: dict | None = None, shared_outer: bool = False, **config):
    """A peft adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``) with LoRA on the
    experts' ``projections``; ``ranks``: a rank per projection where it differs from ``rank`` (what
    ``rank_pattern`` describes); ``names``: the projections' names in the file (Mixtral's ``w1``...);
    ``shared_outer``: one gate/up A and one down B for every expert (packed 3-D tensors). Returns the
    weights as written (float32), by (layer, expert, projection): (A, B)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    written, tensors = {}, {}
    for layer in range(layers):
        for expert in range(experts):
            for projection in projections:
                r = (ranks or {}).get(projection, rank)
                fan_in, fan_out = (intermediate, hidden) if projection == "down_proj" else (hidden, intermediate)
                a = torch.randn(r, fan_in, generator=gen) * 0.3
                b = torch.randn(fan_out, r, generator=gen) * 0.3
                written[layer, expert, projection] = (a, b)
                name = (names or {}).get(projection, projection)
                prefix = f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{name}"
                tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a.half(), b.half()
    if shared_outer:
        tensors, written = _shared_outer(written, layers, experts), _shared_outer_written(written, layers, experts)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = [(names or {}).get(p, p) for p in projections]
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
        "target_modules": targets, **config}))
    return written


def _shared_outer(written, layers, experts):
    """The packed shared-outer layout, 3-D tensors without an expert index: ``experts.gate_proj`` and
    ``experts.up_proj`` A ``(1, r, H)`` and down B ``(1, H, r)`` shared, their B ``(E, I, r)`` and down A
    ``(E, r, I)`` per expert. SGLang stacks gate and up into ``experts.gate_up_proj`` (A ``(1, 2r, H)``), the
    layout its ``_detect_shared_outer_loras`` reads. (A packed ``experts.gate_up_proj`` lora_A is read as one A
    for both halves and repeated: ``normalize_gate_up_proj``, the ``elif "gate_up_proj"`` branch.)"""
    tensors = {}
    for layer in range(layers):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        for projection in ("gate_proj", "up_proj"):
            tensors[f"{prefix}.{projection}.lora_A.weight"] = written[layer, 0, projection][0][None].half()
            tensors[f"{prefix}.{projection}.lora_B.weight"] = torch.stack(
                [written[layer, e, projection][1] for e in range(experts)]).half()
        tensors[f"{prefix}.down_proj.lora_A.weight"] = torch.stack(
            [written[layer, e, "down_proj"][0] for e in range(experts)]).half()
        tensors[f"{prefix}.down_proj.lora_B.weight"] = written[layer, 0, "down_proj"][1][None].half()
    return tensors


def _shared_outer_written(written, layers, experts):
    """What a shared-outer adapter means per expert: expert 0's gate/up A and down B for every expert."""
    return {(layer, e, p): ((written[layer, 0, p][0] if p != "down_proj" else written[layer, e, p][0]),
                            (written[layer, e, p][1] if p != "down_proj" else written[layer, 0, p][1]))
            for (layer, e, p) in written}


def model_config(layers: int, experts: int, hidden: int, intermediate: int, topk: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                          num_experts_per_tok=topk, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=4 * hidden, vocab_size=128, head_dim=16)


def real_manager(adapters: dict, *, layers: int = 2, experts: int = 4, hidden: int = 64, intermediate: int = 32,
                 topk: int = 2, rank: int = 8, targets=("gate_up_proj", "down_proj"), max_loras: int = 2):
    """SGLang's own ``LoRAManager``, built by its own constructor over a model of SGLang's ``FusedMoE``
    layers, with ``adapters`` ({name: folder}) as ``--lora-paths``: its loader, its init_lora_modules, its
    memory pool. Returns (manager, refs by name, the MoE layers)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARef

    args = scheduler()
    moe = [moe_layer(experts, topk=topk, hidden=hidden, intermediate=intermediate, layer_id=i, seed=i)
           for i in range(layers)]
    model = model_over(moe)
    model.config = model_config(layers, experts, hidden, intermediate, topk)
    refs = {name: LoRARef(lora_name=name, lora_path=str(path), pinned=False) for name, path in adapters.items()}
    manager = LoRAManager(model, model.config, max_loras_per_batch=max_loras, load_config=LoadConfig(),
                          dtype=torch.float16, server_args=args, lora_backend="triton", max_lora_rank=rank,
                          target_modules=list(targets) if targets else None, lora_paths=list(refs.values()) or None)
    return manager, refs, moe


def fill_slot(manager, slot: int, name: str | None, refs):
    """SGLang's own pool loader puts adapter ``name`` (None: the base model) into pool slot ``slot``."""
    uid = refs[name].lora_id if name else None
    adapter = manager.loras[uid] if uid else None
    manager.memory_pool.load_lora_weight_to_buffer(uid, slot, adapter, manager.lora_modules,
                                                   getattr(manager, "embed_tokens_module", None),
                                                   getattr(manager, "lm_head_module", None))


def pool_lora_info(manager, layer: int, slot_ranks, token_slots):
    """SGLang's ``LoRAInfo`` for one layer of a batch, as that layer's own ``_get_lora_info`` builds it: its
    weights the pool's buffers as filled; the expert count, layout flags and sizes the LoRA-wrapped layer's
    (``base_layer.num_experts``, not the buffers': a shared-outer pool keeps one down B); which slots are
    enabled, and each token's slot, by the release's own rule (:func:`_moe_batch_maps`)."""
    from sglang.srt.lora.lora_moe_runners import LoRAInfo

    pool = manager.memory_pool
    module = next(m for m in manager.lora_modules[layer].values() if hasattr(getattr(m, "base_layer", None), "w13_weight"))
    ranks = torch.tensor(slot_ranks, dtype=torch.int32)
    bounds = [0] + [i for i in range(1, len(token_slots)) if token_slots[i] != token_slots[i - 1]]
    seg = torch.tensor(bounds + [len(token_slots)], dtype=torch.int32)
    req_to_lora = torch.tensor([token_slots[i] for i in bounds], dtype=torch.int32)
    enabled, mapping = _moe_batch_maps(seg, ranks, req_to_lora, len(token_slots))
    values = dict(
        gate_up_lora_a_weights=pool.A_buffer["gate_up_proj_moe"][layer],
        gate_up_lora_b_weights=pool.B_buffer["gate_up_proj_moe"][layer],
        down_lora_a_weights=pool.A_buffer["down_proj_moe"][layer], down_lora_b_weights=pool.B_buffer["down_proj_moe"][layer],
        seg_indptr=seg, req_to_lora=req_to_lora, lora_ranks=ranks, adapter_enabled=enabled, token_lora_mapping=mapping,
        max_lora_rank=pool.A_buffer["down_proj_moe"][layer].shape[2], num_experts=module.base_layer.num_experts,
        has_active_lora=bool((ranks[req_to_lora.long()] > 0).any()), hidden_size=getattr(module.base_layer, "hidden_size", 0),
        experts_shared_outer_loras=bool(getattr(module, "experts_shared_outer_loras", False)),
        lora_use_virtual_experts=bool(getattr(module, "lora_use_virtual_experts", False)),
        tp_size=getattr(module, "tp_size", 1), tp_rank=getattr(module, "tp_rank", 0))
    fields = {f.name for f in dataclasses.fields(LoRAInfo)}
    return LoRAInfo(**{k: v for k, v in values.items() if k in fields})


def _moe_batch_maps(seg_indptr, lora_ranks, req_to_lora, num_tokens: int):
    """(adapter_enabled, token_lora_mapping) of a batch as the release computes them: its LoRA backend's
    ``_compute_moe_lora_info`` where it has one (0.5.13+: a slot is enabled when the batch uses it and its
    rank is above 0); before that the LoRA layer's ``_get_lora_info`` enables every slot the batch uses,
    the base model's (rank 0) too, and the MoE path maps tokens from the segments."""
    try:
        from sglang.srt.lora.backend.base_backend import _compute_moe_lora_info
    except ImportError:
        _compute_moe_lora_info = None
    if _compute_moe_lora_info is not None:
        lengths = (seg_indptr[1:] - seg_indptr[:-1]).tolist()
        return _compute_moe_lora_info(num_tokens, seg_indptr, lora_ranks, req_to_lora, None, None,
                                      max_len=max(lengths, default=1))
    enabled = torch.zeros(len(lora_ranks), dtype=torch.int32)
    enabled.index_fill_(0, req_to_lora.long(), 1)
    mapping = torch.repeat_interleave(req_to_lora, (seg_indptr[1:] - seg_indptr[:-1]).long())
    return enabled, mapping


def as_expert_adapter(written, layer: int, experts: int, hidden: int, intermediate: int, scale):
    """What an adapter means for one layer as peft defines it (``scale``: a number, or one per projection),
    as an ``ExpertAdapter``; a projection it lacks adds nothing (zeros)."""
    def pair(projection):
        fan_in, fan_out = (intermediate, hidden) if projection == "down_proj" else (hidden, intermediate)
        if (layer, 0, projection) not in written:
            return torch.zeros(experts, 1, fan_in), torch.zeros(experts, fan_out, 1)
        factor = scale[projection] if isinstance(scale, dict) else scale
        return (torch.stack([written[layer, e, projection][0] for e in range(experts)]),
                torch.stack([written[layer, e, projection][1] for e in range(experts)]) * factor)

    (gate_a, gate_b), (up_a, up_b), (down_a, down_b) = (pair(p) for p in EXPERT_PROJECTIONS)
    return ExpertAdapter(gate_a, up_a, gate_b, up_b, down_a, down_b)
