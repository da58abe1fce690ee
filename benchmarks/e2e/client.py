"""Greedy requests to a running SGLang server (token ids in, token ids out), and their comparison.

    python client.py run PORT OUT.json      one request per adapter and prompt alone, then waves of
                                            4, 16 and 64 concurrent requests mixing the base model and
                                            four adapters (prefill lengths 3-48), then a timed load
    python client.py load PORT OUT.json     throughput only: one warm-up wave, then 5 timed waves of 64
                                            concurrent requests x 256 new tokens (base and four adapters)
    python client.py compare REF.json A.json [B.json ...]   per request: equal, or the first differing token
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

KINDS = [None, "a1", "a2", "a3", "a4"]  # None: the base model
NEW_TOKENS = 32


def prompt(i: int) -> list[int]:
    length = 3 + (i * 7) % 46
    return [(17 * i + 31 * k + 5) % 2000 + 3 for k in range(length)]


def generate(port: int, ids, lora, new_tokens=NEW_TOKENS) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                                  "ignore_eos": True}}
    if lora:
        body["lora_path"] = lora
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=300).read())["output_ids"]


def wave(port, jobs, new_tokens=NEW_TOKENS):
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: generate(port, *job, new_tokens), jobs))


def run(port: int) -> dict:
    outputs = {}
    for i in range(3):
        for lora in KINDS:
            outputs[f"alone-p{i}-{lora or 'base'}"] = generate(port, prompt(i), lora)
    for size in (4, 16, 64):
        jobs = [(prompt(100 + k), KINDS[k % len(KINDS)]) for k in range(size)]
        for k, out in enumerate(wave(port, jobs)):
            outputs[f"wave{size}-r{k}-{jobs[k][1] or 'base'}"] = out
    # Load: 64 concurrent requests x 64 new tokens, twice; the better wall time counts.
    jobs = [(prompt(200 + k), KINDS[k % len(KINDS)]) for k in range(64)]
    best = None
    for _ in range(2):
        started = time.perf_counter()
        results = wave(port, jobs, 64)
        seconds = time.perf_counter() - started
        best = seconds if best is None else min(best, seconds)
    generated = sum(len(r) for r in results)
    return {"outputs": outputs, "load": {"requests": 64, "new_tokens": generated, "seconds": round(best, 3),
                                         "tokens_per_s": round(generated / best, 1)}}


def load(port: int, waves: int = 5, new_tokens: int = 256) -> dict:
    jobs = [(prompt(300 + k), KINDS[k % len(KINDS)]) for k in range(64)]
    wave(port, jobs, new_tokens)  # warm-up: every kernel this load needs is compiled before timing
    timed = []
    for _ in range(waves):
        started = time.perf_counter()
        generated = sum(len(r) for r in wave(port, jobs, new_tokens))
        timed.append(generated / (time.perf_counter() - started))
    timed.sort()
    return {"requests": 64, "new_tokens_per_request": new_tokens, "tokens_per_s_waves": [round(t, 1) for t in timed],
            "tokens_per_s_median": round(timed[len(timed) // 2], 1)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: dict, other: dict) -> dict:
    """{request: None when equal, else the index of the first differing output token}."""
    return {key: first_difference(other["outputs"].get(key, []), ref) for key, ref in reference["outputs"].items()}


def main(argv) -> int:
    if argv[0] in ("run", "load"):
        result = run(int(argv[1])) if argv[0] == "run" else {"load": load(int(argv[1]))}
        with open(argv[2], "w") as f:
            json.dump(result, f)
        print(json.dumps(result["load"]))
        return 0
    reference = json.load(open(argv[1]))
    for path in argv[2:]:
        diffs = compare(reference, json.load(open(path)))
        differing = {k: v for k, v in diffs.items() if v is not None}
        print(f"{path}: {len(diffs) - len(differing)}/{len(diffs)} equal to {argv[1]}; differing "
              f"(request: first differing token): {json.dumps(differing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
