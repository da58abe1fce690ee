"""The fast-path campaign's requests to a running SGLang server with the adapters of make_model.py.

    python -m benchmarks.fast_lora.client run PORT OUT.json [lora]
        correctness: 40 greedy requests x 32 new tokens with their top-5 log-probabilities (8 prompts
        alone for each of the 4 adapters, $PROMPTS to take more, then a wave of 8 mixing them and the base
        model); "lora"
        marks a server with adapters. OUT.json also lists every request as benchmarks/serving/reference.py
        scores it (prompt, adapter, output), named after OUT.json's stem
    python -m benchmarks.fast_lora.client forced PORT OUT.json [lora]
        teacher-forced prefills: $PROMPTS (default 8) prompts of 192 random tokens for each adapter and the base
        model, the server's top-5 log-probabilities at every position (no decoding: what benchmarks/serving/
        reference.py compares with the fp32 model's distribution there). Each kind's first prompt alone (a
        batch of 192 tokens), then all the others in one wave (prefill batches of thousands of tokens, the
        adapters mixed)
    python -m benchmarks.fast_lora.client load PORT OUT.json [lora]
        decode throughput at 1, 16 and 64 concurrent requests (128 new tokens), and prefill throughput
        (32 concurrent prompts of 1024 tokens, 1 new token): one warm-up wave, then 5 timed, all kept
        with their median
    python -m benchmarks.fast_lora.client single PORT OUT.json [lora]
        decode throughput at 1 request only, 20 timed waves after a warm-up (one wave is a third of a second:
        load's 5 of them leave a spread of 1.5x on a noisy host)
    python -m benchmarks.fast_lora.client profile PORT TRACE_DIR [lora]
        SGLang's torch profiler (/start_profile ... /stop_profile) over one prefill wave (32 prompts of
        1024 tokens, 1 new token) and over 0.3 s of steady decoding (64 concurrent requests, 256 new
        tokens, 0.8 s in): TRACE_DIR/prefill-*.trace.json.gz and decode-*, summarized by
        benchmarks/fast_lora/profile.py; PROFILE_STACK=0: without Python stacks (the host at its own speed)
    python -m benchmarks.fast_lora.client compare DEFAULT.json FAST.json
        equal greedy tokens per request, and the log-probability gap at each first differing token
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.serving.client import ask, forced, generate, timed_waves, tokens_of, wave

ADAPTERS = ["a1", "a2", "a3", "a4"]
NEW_TOKENS = 32
WAVES = 5
"""Timed waves per figure (after one warm-up): the median is quoted, with the spread."""


def prompt(i: int, length: int | None = None) -> list[int]:
    length = length or 5 + (i * 13) % 60
    return [(97 * i + 31 * k + 5) % 2000 + 3 for k in range(length)]


def run(port: int, lora: bool) -> dict:
    kinds = ADAPTERS if lora else [None]
    prompts = int(os.environ.get("PROMPTS", "8"))  # more: a finer count of bad positions an adapter (w8a8's spread)
    alone = {f"alone-p{i}-{adapter or 'base'}": (prompt(i), adapter) for i in range(prompts) for adapter in kinds}
    mixed = [None, *kinds] if lora else kinds
    waved = {f"wave8-r{k}-{mixed[k % len(mixed)] or 'base'}": (prompt(100 + k), mixed[k % len(mixed)])
             for k in range(8)}
    outputs = {key: generate(port, *job, NEW_TOKENS, True) for key, job in alone.items()}
    outputs.update(zip(waved, wave(port, list(waved.values()), NEW_TOKENS, True)))
    jobs = {**alone, **waved}
    requests = [{"prompt": jobs[key][0], "adapter": jobs[key][1], "output": out["ids"], "top": out["top"]}
                for key, out in outputs.items()]
    return {"outputs": outputs, "requests": requests}


FORCED_LENGTH = 192
VOCAB = 2048  # make_model.py's


def forced_run(port: int, lora: bool) -> dict:
    kinds = [None, *ADAPTERS] if lora else [None]

    def tokens_for(i: int, kind: str | None) -> list[int]:  # the same tokens for a prompt and kind on every server
        draw = random.Random(f"{i}-{kind}")
        return [draw.randrange(3, VOCAB) for _ in range(FORCED_LENGTH)]

    jobs = [(f"p{i}-{kind or 'base'}", tokens_for(i, kind), kind)
            for i in range(int(os.environ.get("PROMPTS", "8"))) for kind in kinds]
    alone = [job for job in jobs if job[0].startswith("p0-")]
    together = [job for job in jobs if not job[0].startswith("p0-")]
    tops = [forced(port, prompt, kind) for _, prompt, kind in alone]
    with ThreadPoolExecutor(max(1, len(together))) as pool:
        tops += list(pool.map(lambda job: forced(port, job[1], job[2]), together))
    return {"forced": [{"key": key, "prompt": prompt, "adapter": kind, "top": top,
                        "batch": "alone" if i < len(alone) else "wave"}
                       for i, ((key, prompt, kind), top) in enumerate(zip(alone + together, tops))]}


@contextlib.contextmanager
def traced(port: int, trace_dir: str, stage: str):
    """SGLang's torch profiler from entry to exit; it writes TRACE_DIR/STAGE-TP-0.trace.json.gz as it stops."""
    ask(port, "/start_profile", {"output_dir": os.path.abspath(trace_dir), "profile_id": stage,
                                 "activities": ["CPU", "GPU"],
                                 "with_stack": os.environ.get("PROFILE_STACK", "1") != "0", "record_shapes": False})
    yield
    ask(port, "/stop_profile", {})


def profile(port: int, trace_dir: str, lora: bool) -> None:
    """The traces of the module's docstring, each wave warmed up first."""
    kinds = ADAPTERS if lora else [None]
    prefill = [(prompt(500 + k, 1024), kinds[k % len(kinds)]) for k in range(32)]
    decode = [(prompt(300 + k, 32), kinds[k % len(kinds)]) for k in range(64)]
    wave(port, prefill, 1)
    wave(port, decode, 32)
    with traced(port, trace_dir, "prefill"):
        wave(port, prefill, 1)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(wave, port, decode, 256)
        time.sleep(0.8)  # every request past its prefill: a batch of 64 decoding
        with traced(port, trace_dir, "decode"):
            time.sleep(0.3)
        running.result()


def load(port: int, lora: bool) -> dict:
    kinds = ADAPTERS if lora else [None]
    result = {}
    for concurrency in (1, 16, 64):
        jobs = [(prompt(300 + k, 32), kinds[k % len(kinds)]) for k in range(concurrency)]
        result[f"decode_c{concurrency}_tok_s"] = timed_waves(lambda j=jobs: tokens_of(wave(port, j, 128)), WAVES)
    jobs = [(prompt(500 + k, 1024), kinds[k % len(kinds)]) for k in range(32)]
    result["prefill_tok_s"] = timed_waves(lambda: len(wave(port, jobs, 1)) * 1024, WAVES)
    return result


SINGLE_WAVES = 20


def single(port: int, lora: bool) -> dict:
    kinds = ADAPTERS if lora else [None]
    jobs = [(prompt(300, 32), kinds[0])]
    return {"decode_c1_tok_s": timed_waves(lambda: tokens_of(wave(port, jobs, 128)), SINGLE_WAVES)}


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
    lora = len(argv) > 3 and argv[3] == "lora"
    if argv[0] == "profile":
        profile(int(argv[1]), argv[2], lora)
        return 0
    if argv[0] in ("run", "forced", "load", "single"):
        result = {"run": run, "forced": forced_run, "load": load, "single": single}[argv[0]](int(argv[1]), lora)
        if argv[0] in ("run", "forced"):
            result["name"] = os.path.basename(argv[2]).removesuffix(".json").removeprefix(f"{argv[0]}-")
        with open(argv[2], "w") as f:
            json.dump(result, f)
        if argv[0] not in ("run", "forced"):
            print(json.dumps(result))
        return 0
    with open(argv[1]) as default, open(argv[2]) as fast:
        verdict = compare(json.load(default), json.load(fast))
    print(json.dumps(verdict, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
