"""For the fast_lora campaign's "fused" server only: places this package's fused down LoRA GEMM
(:mod:`sglang_lora_tma_guard.fused_lora`) in every Python process of the server that finds this
folder on its path (launcher, tokenizer, scheduler), at start-up, before SGLang is imported (the
launcher is placed when SGLang imports its fused-MoE module). The package itself never places it:
on an H200 the hooked call is slower with it (docs/lora_moe_floor.md); run.sh's "fused" server is
there to show it right in a real server, against the fp32 reference, and to time it."""

try:
    from sglang_lora_tma_guard import fused_lora

    fused_lora.activate()
except Exception as error:  # a server without it is the fast one: say so, loudly
    print(f"fused_site: the fused down LoRA GEMM is NOT placed: {type(error).__name__}: {error}", flush=True)
