"""Write a tiny Qwen3-MoE checkpoint (block-fp8 [128,128], E=80 experts, moe_intermediate 640 per rank: a
tuned H200 shape whose down config says USE_TMA in every bucket) with random weights, and four peft LoRA
adapters on its experts, of ranks 8, 16, 32 and 64.

    python -m benchmarks.e2e.make_model MODEL_DIR LORA_DIR        (MOE_I=1280 for tensor parallel 2)

Random weights, but a real checkpoint: SGLang refuses LoRA adapters with --load-format dummy."""
import json
import os
import sys

import torch
from safetensors.torch import save_file

model, lora = sys.argv[1], sys.argv[2]
H, E, L, V, NH, KVH, HD = 256, 80, 2, 2048, 4, 4, 64
RANKS = {"a1": 8, "a2": 16, "a3": 32, "a4": 64}  # KV width 256 (NH*HD): 128 per rank at tp 2, one fp8 block
I = int(os.environ.get("MOE_I", "640"))  # per rank N = I / tp: keep it 640 (1280 at tp 2)
g = torch.Generator().manual_seed(0)
def bf(*s, scale=0.05): return (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)
def fp8(name, out_, in_, t, scale=0.05):
    w = torch.randn(out_, in_, generator=g) * scale
    wb = w.view(out_ // 128, 128, in_ // 128, 128)
    s = wb.abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448.0
    t[name + ".weight"] = (wb / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(out_, in_)
    t[name + ".weight_scale_inv"] = s.float()
t = {"model.embed_tokens.weight": bf(V, H, scale=1.0), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
     "lm_head.weight": bf(V, H, scale=0.2)}
for l in range(L):
    p = f"model.layers.{l}"
    t[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    t[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    t[f"{p}.self_attn.q_norm.weight"] = torch.ones(HD, dtype=torch.bfloat16)
    t[f"{p}.self_attn.k_norm.weight"] = torch.ones(HD, dtype=torch.bfloat16)
    for n, (o_, i_) in {"q_proj": (NH * HD, H), "k_proj": (KVH * HD, H), "v_proj": (KVH * HD, H), "o_proj": (H, NH * HD)}.items():
        fp8(f"{p}.self_attn.{n}", o_, i_, t)
    t[f"{p}.mlp.gate.weight"] = bf(E, H, scale=0.5)
    for e in range(E):
        fp8(f"{p}.mlp.experts.{e}.gate_proj", I, H, t, 0.1); fp8(f"{p}.mlp.experts.{e}.up_proj", I, H, t, 0.1)
        fp8(f"{p}.mlp.experts.{e}.down_proj", H, I, t, 0.1)
os.makedirs(model, exist_ok=True)
save_file(t, f"{model}/model.safetensors")
json.dump({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
  "intermediate_size": 1024, "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 4,
  "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": KVH, "head_dim": HD,
  "vocab_size": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
  "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}}, open(f"{model}/config.json", "w"), indent=1)
for name, r in RANKS.items():
    d = f"{lora}/{name}"; os.makedirs(d, exist_ok=True)
    a = {}
    for l in range(L):
        for e in range(E):
            p = f"base_model.model.model.layers.{l}.mlp.experts.{e}"
            for proj, (i_, o_) in {"gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}.items():
                a[f"{p}.{proj}.lora_A.weight"] = bf(r, i_, scale=0.3)
                a[f"{p}.{proj}.lora_B.weight"] = bf(o_, r, scale=0.3)
    save_file(a, f"{d}/adapter_model.safetensors")
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
               "target_modules": ["gate_proj", "up_proj", "down_proj"], "task_type": "CAUSAL_LM",
               "base_model_name_or_path": model}, open(f"{d}/adapter_config.json", "w"))
print("model and adapters written")
