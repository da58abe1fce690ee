"""Run in a spawned process, as an SGLang scheduler process is: load plugins, then one MoE call."""


def scheduler_like(queue, name: str = "") -> None:
    import sglang.srt.plugins

    sglang.srt.plugins.load_plugins()

    import sglang_lora_tma_guard as guard
    from harness import tiny_moe

    problem = tiny_moe.make_problem(num_tokens=4, seed=4)
    hooks = tiny_moe.lora_hooks(problem)
    reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks)
    result = tiny_moe.compare(tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks), reference)
    queue.put({"name": name, "installed": guard.status().installed, "identical": result.identical,
               "rows_wrong": result.rows_wrong})
