"""Tiny checkpoints whose shared expert SGLang fuses, and peft LoRA adapters for them.

    python -m benchmarks.shared_expert.make_model glm|deepseek MODEL_DIR LORA_DIR

- ``glm``: ``Glm4MoeForCausalLM`` (the GLM-4.5/4.6/4.7 class; SGLang fuses its shared expert whatever
  the expert count): hidden 256, 2 layers, 16 routed experts top-4 + 1 shared, GQA with qk-norm.
- ``deepseek``: ``DeepseekV3ForCausalLM`` (the code path of DeepSeek-V3/R1 and GLM-5.1): 256 routed
  experts top-8 in 8 groups + 1 shared (the count SGLang requires to fuse), MLA with DeepSeek-V3's
  head sizes, 2 layers, hidden 256.

Adapters (peft layout, ``target_modules`` gate/up/down): ``r1`` (rank 16) and ``r2`` (rank 32) on the
routed experts, ``s1`` (rank 16) on the routed experts *and* the shared expert, the layout peft writes
for these models. And three that SGLang's loader gets wrong, loaded at runtime by ``client.py adapters``:
``rs`` (rsLoRA, rank 16, alpha 32: peft scales it by 8, SGLang by 2), ``up`` (expert LoRA on ``up_proj``
alone: SGLang's scheduler dies at its first batch) and ``att`` (attention only: ``q_proj``, ``v_proj``).
Random bf16 weights, seeded: the same files on every machine. Real safetensors:
SGLang refuses LoRA adapters with ``--load-format dummy``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

ADAPTERS = {"r1": (16, 32, False), "r2": (32, 32, False), "s1": (16, 16, True)}
"""name: (rank, lora_alpha, on the shared expert too)"""
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MORE_ADAPTERS = {"rs": (16, 32, EXPERT_PROJECTIONS, {"use_rslora": True}), "up": (16, 32, ("up_proj",), {}),
                 "att": (16, 32, ("q_proj", "v_proj"), {})}
"""name: (rank, lora_alpha, the modules it targets, more of its peft config) (glm only: MHA names)"""
VOCAB, HIDDEN, LAYERS = 2048, 256, 2

ARCHS = {
    "glm": dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
        n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1, moe_intermediate_size=256,
    ),
    "deepseek": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        moe_intermediate_size=128, scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True,
        moe_layer_freq=1, num_nextn_predict_layers=0, ep_size=1,
    ),
}


def config(arch: str) -> dict:
    return {
        **ARCHS[arch], "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": LAYERS,
        "n_shared_experts": 1, "first_k_dense_replace": 0, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
        "eos_token_id": 1,
    }


class Weights:
    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, *shape: int, scale: float = 0.05, value: float | None = None):
        if value is not None:
            tensor = torch.full(shape, value)
        else:
            tensor = torch.randn(*shape, generator=self.gen) * scale
        self.tensors[name] = tensor.to(torch.bfloat16)


def attention(w: Weights, cfg: dict, p: str) -> None:
    heads = cfg["num_attention_heads"]
    if cfg["model_type"] == "glm4_moe":
        hd, kv = cfg["head_dim"], cfg["num_key_value_heads"]
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            w.add(f"{p}.{name}.weight", rows, HIDDEN)
            w.add(f"{p}.{name}.bias", rows, scale=0.02)
        w.add(f"{p}.o_proj.weight", HIDDEN, heads * hd)
        w.add(f"{p}.q_norm.weight", hd, value=1.0)
        w.add(f"{p}.k_norm.weight", hd, value=1.0)
        return
    q_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    w.add(f"{p}.q_a_proj.weight", cfg["q_lora_rank"], HIDDEN)
    w.add(f"{p}.q_a_layernorm.weight", cfg["q_lora_rank"], value=1.0)
    w.add(f"{p}.q_b_proj.weight", heads * q_head, cfg["q_lora_rank"], scale=0.1)
    w.add(f"{p}.kv_a_proj_with_mqa.weight", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], HIDDEN)
    w.add(f"{p}.kv_a_layernorm.weight", cfg["kv_lora_rank"], value=1.0)
    w.add(f"{p}.kv_b_proj.weight", heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
    w.add(f"{p}.o_proj.weight", HIDDEN, heads * cfg["v_head_dim"])


def model_weights(cfg: dict) -> dict:
    w = Weights(seed=0)
    w.add("model.embed_tokens.weight", VOCAB, HIDDEN, scale=1.0)
    w.add("model.norm.weight", HIDDEN, value=1.0)
    w.add("lm_head.weight", VOCAB, HIDDEN, scale=0.2)
    experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        w.add(f"{p}.input_layernorm.weight", HIDDEN, value=1.0)
        w.add(f"{p}.post_attention_layernorm.weight", HIDDEN, value=1.0)
        attention(w, cfg, f"{p}.self_attn")
        w.add(f"{p}.mlp.gate.weight", experts, HIDDEN, scale=0.5)
        w.add(f"{p}.mlp.gate.e_score_correction_bias", experts, scale=0.01)
        for mlp in [*(f"experts.{e}" for e in range(experts)), "shared_experts"]:
            w.add(f"{p}.mlp.{mlp}.gate_proj.weight", inter, HIDDEN, scale=0.1)
            w.add(f"{p}.mlp.{mlp}.up_proj.weight", inter, HIDDEN, scale=0.1)
            w.add(f"{p}.mlp.{mlp}.down_proj.weight", HIDDEN, inter, scale=0.1)
    # The router's correction bias is kept in fp32 by both SGLang and transformers.
    for name in w.tensors:
        if name.endswith("e_score_correction_bias"):
            w.tensors[name] = w.tensors[name].float()
    return w.tensors


def adapter_weights(cfg: dict, rank: int, shared: bool, seed: int, projections=EXPERT_PROJECTIONS) -> dict:
    w = Weights(seed=seed)
    inter = cfg["moe_intermediate_size"]
    mlps = [f"experts.{e}" for e in range(cfg["n_routed_experts"])] + (["shared_experts"] if shared else [])
    sizes = {"gate_proj": (HIDDEN, inter), "up_proj": (HIDDEN, inter), "down_proj": (inter, HIDDEN)}
    for layer in range(LAYERS):
        for module, proj in [(f"mlp.{mlp}", proj) for mlp in mlps for proj in projections if proj in sizes]:
            fan_in, fan_out = sizes[proj]
            w.add(f"base_model.model.model.layers.{layer}.{module}.{proj}.lora_A.weight", rank, fan_in, scale=0.3)
            w.add(f"base_model.model.model.layers.{layer}.{module}.{proj}.lora_B.weight", fan_out, rank, scale=0.3)
        for proj in (p for p in projections if p in ("q_proj", "v_proj")):
            rows = (cfg["num_attention_heads"] if proj == "q_proj" else cfg["num_key_value_heads"]) * cfg["head_dim"]
            w.add(f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_A.weight", rank, HIDDEN, scale=0.3)
            w.add(f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_B.weight", rows, rank, scale=0.3)
    return w.tensors


def write_adapter(path: str, model_dir: str, tensors: dict, rank: int, alpha: int, targets, **more) -> None:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, f"{path}/adapter_model.safetensors")
    with open(f"{path}/adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": list(targets), "task_type": "CAUSAL_LM", "base_model_name_or_path": model_dir,
                   **more}, f)


def main(arch: str, model_dir: str, lora_dir: str) -> None:
    cfg = config(arch)
    os.makedirs(model_dir, exist_ok=True)
    save_file(model_weights(cfg), f"{model_dir}/model.safetensors")
    with open(f"{model_dir}/config.json", "w") as f:
        json.dump(cfg, f, indent=1)
    for seed, (name, (rank, alpha, shared)) in enumerate(ADAPTERS.items(), start=1):
        write_adapter(f"{lora_dir}/{name}", model_dir, adapter_weights(cfg, rank, shared, seed), rank, alpha,
                      EXPERT_PROJECTIONS)
    more = MORE_ADAPTERS if arch == "glm" else {}
    for seed, (name, (rank, alpha, projections, extra)) in enumerate(more.items(), start=len(ADAPTERS) + 1):
        write_adapter(f"{lora_dir}/{name}", model_dir, adapter_weights(cfg, rank, False, seed, projections), rank,
                      alpha, projections, **extra)
    print(f"{arch}: model in {model_dir}, adapters {[*ADAPTERS, *more]} in {lora_dir}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
