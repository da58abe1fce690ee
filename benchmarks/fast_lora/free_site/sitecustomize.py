"""For the fast_lora campaign's "free" server only, a ceiling, never a server to use: every LoRA MoE batch the
fast path takes gets hooks that do nothing (no routing, no shrink, no expand), so the server runs SGLang's whole
LoRA machinery (adapter slots, its per-batch preparation, the hooked MoE call) with MoE LoRA that costs nothing.
No implementation of LoRA inside the MoE call can serve faster than this server; its tokens are wrong (the
deltas are missing), so run.sh does not score it. Placed in every Python process of the server that finds this
folder on its path, at start-up."""

try:
    import sys

    from sglang_lora_tma_guard import lora_path

    def free_hooks(original, hidden_states, lora_info, topk_ids):
        if lora_info is None or lora_info.max_lora_rank == 0:
            return original(hidden_states, lora_info, topk_ids)
        return sys.modules[lora_path.MODULE].LoRAHooks(after_gate_up=lambda *args: None,
                                                         after_down=lambda *args: None)

    lora_path.build_hooks = free_hooks  # looked up by the installed builder at each call
    print("free_site: LoRA MoE hooks do nothing in this process (a ceiling; its tokens are wrong)", flush=True)
except Exception as error:  # a server without it is the fast one: say so, loudly
    print(f"free_site: the LoRA MoE hooks are NOT free: {type(error).__name__}: {error}", flush=True)
