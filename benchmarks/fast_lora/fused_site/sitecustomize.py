"""For the fast_lora campaign's "fused" server only: places this package's fused down LoRA GEMM
(:mod:`sglang_lora_tma_guard.fused_lora`) for every batch it covers (``activate(everywhere=True)``) in every
Python process of the server that finds this folder on its path (launcher, tokenizer, scheduler), at
start-up, before SGLang is imported (the launcher is placed when SGLang imports its fused-MoE module).
``=fast`` places it too, but takes only the batches it is measured faster on (block-fp8 experts, large
batches, ranks up to 32, a down GEMM of K 256 or 384: ``fused_lora.FASTER_FROM_ROUTES``); this server
takes it for every batch it covers, 16-bit experts, other K and the rank-64 adapter included, to show it right
in a real server against the fp32 reference, and to time it."""

try:
    from sglang_lora_tma_guard import fused_lora

    place = fused_lora.activate
    # =fast places it again when the plugin loads (lora_path.activate), by then with the policy: every batch.
    fused_lora.activate = lambda everywhere=False: place(everywhere=True)
    fused_lora.activate()
except Exception as error:  # a server without it is the fast one: say so, loudly
    print(f"fused_site: the fused down LoRA GEMM is NOT placed: {type(error).__name__}: {error}", flush=True)
