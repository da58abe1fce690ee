"""The shared-expert campaign's requests to a running SGLang server with the adapters of make_model.py.

    python -m benchmarks.shared_expert.client run PORT OUT.json NAME
        greedy requests, 24 new tokens each: every prompt alone for the base model, r1, r2 and s1 in that
        order (so the adapters take LoRA pool slots 1, 2, 3), then waves of 16 and 32 concurrent requests
        mixing all four
    python -m benchmarks.shared_expert.client long PORT OUT.json NAME
        long generations: a wave of 32 and one of 48 concurrent greedy requests mixing all four, 256 new
        tokens each (what the in-place race of SGLang 0.5.11-0.5.16 corrupts)
    python -m benchmarks.shared_expert.client adapters PORT OUT.json NAME [LORA_DIR [up]]
        adapters loaded, unloaded and reloaded at runtime through the HTTP API (rs, att, and with "up" the
        up_proj-only one; r1 unloaded and loaded again), greedy waves of 24 mixing them with r1 and the
        base model, 64 new tokens
    python -m benchmarks.shared_expert.client load PORT OUT.json NAME
        decode throughput with LoRA: waves of 1, 16 and 64 concurrent requests (adapters in turn), 128 new
        tokens each, one warm-up wave then 3 timed ones (all kept, and their median)
"""

from __future__ import annotations

import json
import sys

from benchmarks.serving.client import generate, post, timed_waves, tokens_of, wave

ADAPTERS = [None, "r1", "r2", "s1"]  # None: the base model
NEW_TOKENS = 24


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * k + 7) % 2000 + 2 for k in range(4 + (i * 5) % 21)]


def run(port: int) -> dict:
    jobs = [(prompt(i), adapter) for i in range(5) for adapter in ADAPTERS]
    outputs = [generate(port, ids, adapter, NEW_TOKENS)["ids"] for ids, adapter in jobs]
    for size in (16, 32):
        wave_jobs = [(prompt(100 + size + k), ADAPTERS[k % len(ADAPTERS)]) for k in range(size)]
        jobs += wave_jobs
        outputs += [answer["ids"] for answer in wave(port, wave_jobs, NEW_TOKENS)]
    return {"requests": [{"prompt": ids, "adapter": adapter, "output": out}
                         for (ids, adapter), out in zip(jobs, outputs)]}


def long(port: int, new_tokens: int = 256) -> dict:
    jobs, outputs = [], []
    for size in (32, 48):
        wave_jobs = [(prompt(300 + size + k), ADAPTERS[k % len(ADAPTERS)]) for k in range(size)]
        jobs += wave_jobs
        outputs += [answer["ids"] for answer in wave(port, wave_jobs, new_tokens)]
    return {"requests": [{"prompt": ids, "adapter": adapter, "output": out}
                         for (ids, adapter), out in zip(jobs, outputs)]}


def adapters(port: int, lora_dir: str, with_up: bool, new_tokens: int = 64) -> dict:
    """Runtime loads through SGLang's HTTP API, then waves mixing what loaded; r1 unloaded, loaded again."""
    events, jobs, outputs = [], [], []
    names = ["rs", "att"] + (["up"] if with_up else [])
    for name in names:
        events.append({"load": name, **post(port, "/load_lora_adapter", {"lora_name": name,
                                                                          "lora_path": f"{lora_dir}/{name}"})})
    loaded = [None, "r1"] + [e["load"] for e in events if e.get("success", True) is not False]

    def serve(tag: int, kinds) -> None:
        wave_jobs = [(prompt(700 + 24 * tag + k), kinds[k % len(kinds)]) for k in range(24)]
        try:
            wave_outputs = [answer["ids"] for answer in wave(port, wave_jobs, new_tokens)]
        except Exception as error:  # the server went down: what every later request meets
            events.append({"wave": tag, "failed": f"{type(error).__name__}: {error}"[:300]})
            return
        jobs.extend(wave_jobs)
        outputs.extend(wave_outputs)

    serve(0, loaded)
    events.append({"unload": "r1", **post(port, "/unload_lora_adapter", {"lora_name": "r1"})})
    serve(1, [k for k in loaded if k != "r1"])
    events.append({"load": "r1", **post(port, "/load_lora_adapter", {"lora_name": "r1", "lora_path": f"{lora_dir}/r1"})})
    serve(2, loaded)
    return {"events": events, "requests": [{"prompt": ids, "adapter": adapter, "output": out}
                                           for (ids, adapter), out in zip(jobs, outputs)]}


def load(port: int, new_tokens: int = 128, waves: int = 3) -> dict:
    result = {}
    for concurrency in (1, 16, 64):
        jobs = [(prompt(500 + k), ADAPTERS[1 + k % 3]) for k in range(concurrency)]
        rates = timed_waves(lambda j=jobs: tokens_of(wave(port, j, new_tokens)), waves)
        result[str(concurrency)] = {"median": rates["median"], "waves": rates["per_s"]}
    return {"decode_tokens_per_s": result, "new_tokens_per_request": new_tokens}


def main(argv) -> int:
    task, port, out, name = argv[0], int(argv[1]), argv[2], argv[3]
    if task == "adapters":
        result = {"name": name, **adapters(port, argv[4], len(argv) > 5 and argv[5] == "up")}
    else:
        result = {"name": name, **{"run": run, "long": long, "load": load}[task](port)}
    with open(out, "w") as f:
        json.dump(result, f)
    summary = {k: v for k, v in result.items() if k != "requests"}
    print(json.dumps(summary) if task in ("load", "adapters") else f"{name}: {len(result['requests'])} requests answered")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
