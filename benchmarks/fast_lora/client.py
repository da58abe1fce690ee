"""The fast-path campaign's requests to a running SGLang server with the adapters of make_model.py.

    python -m benchmarks.fast_lora.client run PORT OUT.json [lora]
        correctness: 40 greedy requests x 32 new tokens with their top-5 log-probabilities (8 prompts
        alone for each of the 4 adapters, then a wave of 8 mixing them and the base model); "lora"
        marks a server with adapters
    python -m benchmarks.fast_lora.client load PORT OUT.json [lora]
        decode throughput at 1, 16 and 64 concurrent requests (128 new tokens), and prefill throughput
        (32 concurrent prompts of 1024 tokens, 1 new token): one warm-up wave, then 5 timed, all kept
        with their median
    python -m benchmarks.fast_lora.client compare DEFAULT.json FAST.json
        equal greedy tokens per request, and the log-probability gap at each first differing token
"""

from __future__ import annotations

import json
import sys

from benchmarks.serving.client import generate, timed_waves, tokens_of, wave

ADAPTERS = ["a1", "a2", "a3", "a4"]
NEW_TOKENS = 32
WAVES = 5
"""Timed waves per figure (after one warm-up): the median is quoted, with the spread."""


def prompt(i: int, length: int | None = None) -> list[int]:
    length = length or 5 + (i * 13) % 60
    return [(97 * i + 31 * k + 5) % 2000 + 3 for k in range(length)]


def run(port: int, lora: bool) -> dict:
    kinds = ADAPTERS if lora else [None]
    outputs = {}
    for i in range(8):
        for adapter in kinds:
            outputs[f"alone-p{i}-{adapter or 'base'}"] = generate(port, prompt(i), adapter, NEW_TOKENS, True)
    mixed = [None, *kinds] if lora else kinds
    jobs = [(prompt(100 + k), mixed[k % len(mixed)]) for k in range(8)]
    for k, out in enumerate(wave(port, jobs, NEW_TOKENS, True)):
        outputs[f"wave8-r{k}-{jobs[k][1] or 'base'}"] = out
    return {"outputs": outputs}


def load(port: int, lora: bool) -> dict:
    kinds = ADAPTERS if lora else [None]
    result = {}
    for concurrency in (1, 16, 64):
        jobs = [(prompt(300 + k, 32), kinds[k % len(kinds)]) for k in range(concurrency)]
        result[f"decode_c{concurrency}_tok_s"] = timed_waves(lambda j=jobs: tokens_of(wave(port, j, 128)), WAVES)
    jobs = [(prompt(500 + k, 1024), kinds[k % len(kinds)]) for k in range(32)]
    result["prefill_tok_s"] = timed_waves(lambda: len(wave(port, jobs, 1)) * 1024, WAVES)
    return result


def compare(default: dict, fast: dict) -> dict:
    """Per request: equal, or the first differing position with the gap there, read from the default
    run's top 5 (log p of its token minus log p of the fast run's token; inf when that is not in its top 5)."""
    rows = {}
    for key, ref in default["outputs"].items():
        other = fast["outputs"].get(key)
        if other is None:
            rows[key] = {"missing": True}
            continue
        first = next((k for k, (a, b) in enumerate(zip(ref["ids"], other["ids"])) if a != b), None)
        if first is None:
            rows[key] = {"equal": True}
            continue
        top = {tok: lp for lp, tok in (ref["top"] or [[]] * (first + 1))[first]}
        chosen = top.get(ref["ids"][first])
        gap = chosen - top[other["ids"][first]] if chosen is not None and other["ids"][first] in top else float("inf")
        rows[key] = {"equal": False, "first_difference": first, "logprob_gap": gap}
    equal = sum(1 for r in rows.values() if r.get("equal"))
    gaps = [r["logprob_gap"] for r in rows.values() if "logprob_gap" in r]
    return {"requests": len(rows), "equal": equal, "equal_fraction": equal / max(1, len(rows)),
            "max_gap_where_different": max(gaps) if gaps else None,
            "differing": {k: r for k, r in rows.items() if not r.get("equal")}}


def main(argv) -> int:
    if argv[0] in ("run", "load"):
        lora = len(argv) > 3 and argv[3] == "lora"
        result = run(int(argv[1]), lora) if argv[0] == "run" else load(int(argv[1]), lora)
        with open(argv[2], "w") as f:
            json.dump(result, f)
        if argv[0] == "load":
            print(json.dumps(result))
        return 0
    with open(argv[1]) as default, open(argv[2]) as fast:
        verdict = compare(json.load(default), json.load(fast))
    print(json.dumps(verdict, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
