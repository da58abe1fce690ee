"""Requests to a running SGLang server with the adapters of make_model.py.

    python client.py run PORT OUT.json NAME    greedy requests, 24 new tokens each: every prompt alone
                                               for the base model, r1, r2 and s1 in that order (so the
                                               adapters take LoRA pool slots 1, 2, 3), then waves of 16
                                               and 32 concurrent requests mixing all four
    python client.py long PORT OUT.json NAME   long generations: a wave of 32 and one of 48 concurrent
                                               greedy requests mixing all four, 256 new tokens each
                                               (what the in-place race of SGLang 0.5.11-0.5.16 corrupts)
    python client.py adapters PORT OUT.json NAME [LORA_DIR [up]]   adapters loaded, unloaded and reloaded
                                               at runtime through the HTTP API (rs, att, and with "up" the
                                               up_proj-only one; r1 unloaded and loaded again), greedy waves
                                               of 24 mixing them with r1 and the base model, 64 new tokens
    python client.py load PORT OUT.json NAME   decode throughput with LoRA: waves of 1, 16 and 64
                                               concurrent requests (adapters in turn), 128 new tokens
                                               each, one warm-up wave then 3 timed ones (all kept, and
                                               their median)
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

# One HTTP client for every server benchmark: benchmarks/e2e/client.py (a module of the same name).
_spec = importlib.util.spec_from_file_location("e2e_client", Path(__file__).resolve().parents[1] / "e2e" / "client.py")
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)
generate, wave = _e2e.generate, _e2e.wave

ADAPTERS = [None, "r1", "r2", "s1"]  # None: the base model
NEW_TOKENS = 24


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * k + 7) % 2000 + 2 for k in range(4 + (i * 5) % 21)]


def run(port: int) -> dict:
    jobs = [(prompt(i), adapter) for i in range(5) for adapter in ADAPTERS]
    outputs = [generate(port, ids, adapter, NEW_TOKENS) for ids, adapter in jobs]
    for size in (16, 32):
        wave_jobs = [(prompt(100 + size + k), ADAPTERS[k % len(ADAPTERS)]) for k in range(size)]
        jobs += wave_jobs
        outputs += wave(port, wave_jobs, NEW_TOKENS)
    return {"requests": [{"prompt": ids, "adapter": adapter, "output": out}
                         for (ids, adapter), out in zip(jobs, outputs)]}


def long(port: int, new_tokens: int = 256) -> dict:
    jobs, outputs = [], []
    for size in (32, 48):
        wave_jobs = [(prompt(300 + size + k), ADAPTERS[k % len(ADAPTERS)]) for k in range(size)]
        jobs += wave_jobs
        outputs += wave(port, wave_jobs, new_tokens)
    return {"requests": [{"prompt": ids, "adapter": adapter, "output": out}
                         for (ids, adapter), out in zip(jobs, outputs)]}


def post(port: int, path: str, body: dict) -> dict:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(request, timeout=300).read() or b"{}")
    except urllib.error.HTTPError as error:
        return {"success": False, "status": error.code, "message": error.read().decode()[:500]}


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
            wave_outputs = wave(port, wave_jobs, new_tokens)
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


def load(port: int, new_tokens: int = 128) -> dict:
    result = {}
    for concurrency in (1, 16, 64):
        jobs = [(prompt(500 + k), ADAPTERS[1 + k % 3]) for k in range(concurrency)]
        wave(port, jobs, new_tokens)  # warm-up
        rates = []
        for _ in range(3):
            started = time.perf_counter()
            generated = sum(len(out) for out in wave(port, jobs, new_tokens))
            rates.append(generated / (time.perf_counter() - started))
        result[str(concurrency)] = {"median": round(statistics.median(rates), 1),
                                    "waves": [round(r, 1) for r in sorted(rates)]}
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
