"""The TMA campaign's requests to a running SGLang server, and their comparison.

    python -m benchmarks.e2e.client run PORT OUT.json    one request per adapter and prompt alone, then
                                            waves of 4, 16 and 64 concurrent requests mixing the base model
                                            and four adapters (prefill lengths 3-48), then a timed load
    python -m benchmarks.e2e.client load PORT OUT.json   throughput only: one warm-up wave, then 5 timed
                                            waves of 64 concurrent requests x 256 new tokens
    python -m benchmarks.e2e.client compare REF.json A.json [B.json ...]   per request: equal, or the first
                                            differing token
"""

from __future__ import annotations

import json
import sys

from benchmarks.serving.client import generate, timed_waves, tokens_of, wave

KINDS = [None, "a1", "a2", "a3", "a4"]  # None: the base model
NEW_TOKENS = 32


def prompt(i: int) -> list[int]:
    length = 3 + (i * 7) % 46
    return [(17 * i + 31 * k + 5) % 2000 + 3 for k in range(length)]


def run(port: int) -> dict:
    outputs = {}
    for i in range(3):
        for lora in KINDS:
            outputs[f"alone-p{i}-{lora or 'base'}"] = generate(port, prompt(i), lora, NEW_TOKENS)["ids"]
    for size in (4, 16, 64):
        jobs = [(prompt(100 + k), KINDS[k % len(KINDS)]) for k in range(size)]
        for k, out in enumerate(wave(port, jobs, NEW_TOKENS)):
            outputs[f"wave{size}-r{k}-{jobs[k][1] or 'base'}"] = out["ids"]
    jobs = [(prompt(200 + k), KINDS[k % len(KINDS)]) for k in range(64)]
    rates = timed_waves(lambda: tokens_of(wave(port, jobs, 64)), waves=2)
    return {"outputs": outputs, "load": {"requests": 64, "new_tokens_per_request": 64, "tokens_per_s": rates["per_s"][-1]}}


def load(port: int, waves: int = 5, new_tokens: int = 256) -> dict:
    jobs = [(prompt(300 + k), KINDS[k % len(KINDS)]) for k in range(64)]
    rates = timed_waves(lambda: tokens_of(wave(port, jobs, new_tokens)), waves)
    return {"requests": 64, "new_tokens_per_request": new_tokens, "tokens_per_s_waves": rates["per_s"],
            "tokens_per_s_median": rates["median"]}


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
    with open(argv[1]) as f:
        reference = json.load(f)
    for path in argv[2:]:
        with open(path) as f:
            diffs = compare(reference, json.load(f))
        differing = {k: v for k, v in diffs.items() if v is not None}
        print(f"{path}: {len(diffs) - len(differing)}/{len(diffs)} equal to {argv[1]}; differing "
              f"(request: first differing token): {json.dumps(differing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
