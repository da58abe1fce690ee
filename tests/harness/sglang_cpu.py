"""SGLang's own MoE layers and LoRA manager on a CPU, as one scheduler process builds them.

:func:`scheduler` publishes real ``ServerArgs`` (SGLang's own dataclass, its own defaults) and sets up
SGLang's distributed state over gloo with one rank, as a one-GPU scheduler has it, once per process;
:func:`moe_layer` is SGLang's ``FusedMoE`` built by its own constructor (unquantized fp16 weights);
:func:`lora_manager` is SGLang's ``LoRAManager`` as far as ``init_lora_modules`` reads it, over a model
of such layers, wrapping them with SGLang's own ``FusedMoEWithLoRA`` through its own
``set_lora_module``. What is not real: the model around the layers (a ``ModuleList``) and the LoRA
backend object (the one attribute ``FusedMoEWithLoRA`` writes).
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch

_published = None


def scheduler(**fields):
    """SGLang's server arguments for this process (defaults plus ``fields``), published once; its
    distributed and MoE state for one rank. Later calls change the published fields in place."""
    global _published
    from sglang.srt.server_args import ServerArgs

    if _published is None:
        args = ServerArgs(model_path="dummy", enable_lora=True, device="cpu")
        _publish(args)
        _init_distributed()
        from sglang.srt.layers.moe import initialize_moe_config

        initialize_moe_config(args)
        _published = args
    for name, value in fields.items():
        object.__setattr__(_published, name, value)
    return _published


def _publish(args) -> None:
    from sglang.srt import runtime_context

    runtime_context._CONTEXT.set_server_args(args)


def _init_distributed() -> None:
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)


def moe_layer(experts: int = 4, topk: int = 2, hidden: int = 64, intermediate: int = 32, *, layer_id: int = 0,
              seed: int = 0, **options):
    """SGLang's ``FusedMoE``, fp16, random weights (``options``: its own keyword arguments)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    scheduler()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
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
    manager.lora_backend = SimpleNamespace(is_moe_lora=False)
    manager.experts_shared_outer_loras = manager.lora_use_virtual_experts = False
    return manager


def wrapped(manager):
    """The modules SGLang's ``init_lora_modules`` put in place of each MoE layer."""
    return [module for modules in manager.lora_modules for module in modules.values()]
