"""Write a Qwen3-MoE checkpoint with Qwen3-30B-A3B's per-layer shapes (hidden 2048, 128 experts,
moe_intermediate 768, top-8, 32 query / 4 KV heads of 128) and a 2048-token vocabulary, random bf16
weights generated on the GPU, saved as real safetensors; and four peft LoRA adapters on its experts
(gate, up, down), of ranks 8, 16, 32 and 64.

    python -m benchmarks.fast_lora.make_model MODEL_DIR LORA_DIR [--layers N] [--tiny] [--ranks R ...]
        [--fp8 REFERENCE_DIR]

``--layers`` (default 3): 16 makes a decode step GPU-bound (19 GB of experts, 4.2 GB of adapters).
``--tiny``: hidden 64, 8 experts of 32, top-2, 4 / 2 heads of 16, 256 tokens, for a CPU check of the
reference (benchmarks/serving/reference.py) on this model class.
``--ranks``: the four adapters' ranks (default 8 16 32 64).
``--fp8 REFERENCE_DIR``: every projection (attention and experts; not the router or the LM head) in block fp8
as Qwen3-30B-A3B-FP8 holds them (e4m3, one ``weight_scale_inv`` a 128 x 128 block, ``quantization_config``
in config.json), each block's scale a power of two, so that the dequantized weights are exact in bf16: those
go to REFERENCE_DIR as a bf16 checkpoint of the same model, the one to score an fp8 server against.

Random weights, but a real checkpoint: SGLang refuses LoRA adapters with --load-format dummy."""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("lora")
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--tiny", action="store_true")
parser.add_argument("--ranks", type=int, nargs=4, default=[8, 16, 32, 64])
parser.add_argument("--fp8", metavar="REFERENCE_DIR")
args = parser.parse_args()
model, lora, LAYERS = args.model, args.lora, args.layers
if args.tiny:
    H, E, INTER, TOPK, V, NH, KVH, HD = 64, 8, 32, 2, 256, 4, 2, 16
else:
    H, E, INTER, TOPK, V, NH, KVH, HD = 2048, 128, 768, 8, 2048, 32, 4, 128
RANKS = dict(zip(("a1", "a2", "a3", "a4"), args.ranks))
FP8_BLOCK, FP8_MAX = 128, 448.0
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator(device=dev).manual_seed(0)


def bf(*shape, scale):
    return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16).cpu()


# Output rows of log-normal norms: a few tokens dominate each position, as in a trained model, so that
# greedy decoding is not a string of near-ties (with rows of equal norms the top two logits of 2048 are
# often within one rounding step, and any two correct implementations part at the first of them).
norms = torch.exp(torch.randn(V, 1, generator=g, device=dev) * 0.8)
t = {"model.embed_tokens.weight": bf(V, H, scale=1.0), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
     "lm_head.weight": (torch.randn(V, H, generator=g, device=dev) * 0.05 * norms).to(torch.bfloat16).cpu()}
for layer in range(LAYERS):
    p = f"model.layers.{layer}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        t[f"{p}.{norm}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    for norm in ("q_norm", "k_norm"):
        t[f"{p}.self_attn.{norm}.weight"] = torch.ones(HD, dtype=torch.bfloat16)
    for name, (rows, cols) in {"q_proj": (NH * HD, H), "k_proj": (KVH * HD, H), "v_proj": (KVH * HD, H),
                               "o_proj": (H, NH * HD)}.items():
        t[f"{p}.self_attn.{name}.weight"] = bf(rows, cols, scale=cols ** -0.5)
    t[f"{p}.mlp.gate.weight"] = bf(E, H, scale=0.05)
    for e in range(E):
        q = f"{p}.mlp.experts.{e}"
        t[f"{q}.gate_proj.weight"] = bf(INTER, H, scale=H ** -0.5)
        t[f"{q}.up_proj.weight"] = bf(INTER, H, scale=H ** -0.5)
        t[f"{q}.down_proj.weight"] = bf(H, INTER, scale=INTER ** -0.5)


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (bf16) as e4m3 with one power-of-two scale a 128 x 128 block (``q * scale`` exact in bf16)."""
    rows, cols = w.shape
    pr, pc = -rows % FP8_BLOCK, -cols % FP8_BLOCK
    blocks = torch.nn.functional.pad(w.float(), (0, pc, 0, pr)).view(
        (rows + pr) // FP8_BLOCK, FP8_BLOCK, (cols + pc) // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(rows + pr, cols + pc)[:rows, :cols].contiguous(), scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (q.float() * full).to(torch.bfloat16)  # exact: a 3-bit mantissa times a power of two


config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
          "intermediate_size": 3 * H, "moe_intermediate_size": INTER, "num_experts": E, "num_experts_per_tok": TOPK,
          "num_hidden_layers": LAYERS, "num_attention_heads": NH, "num_key_value_heads": KVH, "head_dim": HD,
          "vocab_size": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
          "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def save(directory: str, tensors: dict, **extra) -> None:
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, f"{directory}/model.safetensors")
    json.dump({**config, **extra}, open(f"{directory}/config.json", "w"), indent=1)


if args.fp8:  # the projections in block fp8 for the server; their exact dequantized values, the reference
    quantized = {}
    for name in [n for n in t if n.endswith("_proj.weight")]:
        q, scale = block_fp8(t[name])
        quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
        t[name] = dequantized(q, scale)
    save(model, {**t, **quantized}, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]})
    del quantized
    save(args.fp8, t)
else:
    save(model, t)
for name, r in RANKS.items():
    d = f"{lora}/{name}"
    os.makedirs(d, exist_ok=True)
    a = {}
    for layer in range(LAYERS):
        for e in range(E):
            p = f"base_model.model.model.layers.{layer}.mlp.experts.{e}"
            for proj, (fan_in, fan_out) in {"gate_proj": (H, INTER), "up_proj": (H, INTER), "down_proj": (INTER, H)}.items():
                a[f"{p}.{proj}.lora_A.weight"] = bf(r, fan_in, scale=fan_in ** -0.5)
                a[f"{p}.{proj}.lora_B.weight"] = bf(fan_out, r, scale=0.5 * r ** -0.5)
    save_file(a, f"{d}/adapter_model.safetensors")
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": r, "lora_dropout": 0.0, "bias": "none",
               "target_modules": ["gate_proj", "up_proj", "down_proj"], "task_type": "CAUSAL_LM",
               "base_model_name_or_path": model}, open(f"{d}/adapter_config.json", "w"))
print(f"model ({LAYERS} layers) and adapters written")
