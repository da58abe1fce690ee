"""For the fast_lora campaign's "onestream" server only: the fast path with every LoRA kernel on the MoE
call's own stream (``sglang_lora_tma_guard.lora_path.OVERLAP`` off: the routing and gate-up shrink in the
gate-up hook, after the gate-up GEMM, as before they ran beside it), in every Python process of the server
that finds this folder on its path, at start-up. run.sh's "onestream" server is the A/B of the second
stream on one machine."""

try:
    from sglang_lora_tma_guard import lora_path

    lora_path.OVERLAP = False
except Exception as error:  # a server with the second stream is the fast one: say so, loudly
    print(f"onestream_site: the fast hooks keep their second stream: {type(error).__name__}: {error}", flush=True)
