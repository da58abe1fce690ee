"""Run in a spawned process, as an SGLang scheduler process is: load plugins, then one MoE call."""


def scheduler_like(queue, name: str = "") -> None:
    import sglang.srt.plugins

    sglang.srt.plugins.load_plugins()

    import sglang_lora_tma_guard as guard
    from sglang_lora_tma_guard import probe

    problem = probe.make_problem(num_tokens=4, seed=4)
    hooks = probe.lora_hooks(problem)
    reference = probe.run_sequence(problem, use_tma=False, hooks=hooks)
    result = probe.compare(probe.run_sequence(problem, use_tma=True, hooks=hooks), reference)
    queue.put({"name": name, "installed": guard.status().installed, "identical": result.identical,
               "rows_wrong": result.rows_wrong})
