"""For the fast_lora campaign's "hookact" server only: the fast path with the gate-up LoRA expand in its hook, as
before ``=fast`` placed it in the activation (``sglang_lora_tma_guard.fused_act.BY_FAST`` off), in every Python
process of the server that finds this folder on its path, at start-up. run.sh's "hookact" server is the A/B of
that placement on one machine."""

try:
    from sglang_lora_tma_guard import fused_act

    fused_act.BY_FAST = False
except Exception as error:  # a server with the placement is the fast one: say so, loudly
    print(f"hookact_site: the gate-up expand stays in the activation: {type(error).__name__}: {error}", flush=True)
