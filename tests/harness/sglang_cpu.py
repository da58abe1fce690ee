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


def lora_manager(layers, target_modules=("gate_up_proj", "down_proj")):
    """SGLang's ``LoRAManager`` over a model whose decoder layers have these MoE layers."""
    from sglang.srt.lora.lora_manager import LoRAManager

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for layer in layers:
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = layer
        model.model.layers.append(block)
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
    from sglang_lora_tma_guard.tiny_moe import align_block_size

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
