"""The HTTP side of every server benchmark: greedy requests to a running SGLang server (token ids in,
token ids out), concurrent waves of them, SGLang's other endpoints, and timed waves.

Each campaign's own ``client.py`` (``benchmarks/e2e``, ``fast_lora``, ``shared_expert``) holds only its
prompts and what it asks for.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

TIMEOUT_S = 600


def post(port: int, path: str, body: dict) -> dict:
    """POST ``body`` as JSON to ``path``; an HTTP error comes back as ``{"success": False, ...}``, an
    answer in plain text (``/start_profile``'s) as ``{"text": ...}``."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        answer = urllib.request.urlopen(request, timeout=TIMEOUT_S).read() or b"{}"
    except urllib.error.HTTPError as error:
        return {"success": False, "status": error.code, "message": error.read().decode()[:500]}
    try:
        return json.loads(answer)
    except json.JSONDecodeError:
        return {"text": answer.decode(errors="replace")[:500]}


def ask(port: int, path: str, body: dict) -> dict:
    """``post``, raising on an error answer."""
    answer = post(port, path, body)
    if answer.get("success") is False:
        raise RuntimeError(f"{path}: {answer}")
    return answer


def generate(port: int, ids: list[int], lora: str | None, new_tokens: int, logprobs: bool = False) -> dict:
    """One greedy request of exactly ``new_tokens`` tokens: ``{"ids": output ids, "top": per output
    position the top-5 ``[logprob, token]`` pairs (with ``logprobs``; else None)}``."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    if lora:
        body["lora_path"] = lora
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=5)
    answer = ask(port, "/generate", body)
    top = answer.get("meta_info", {}).get("output_top_logprobs") if logprobs else None
    return {"ids": answer["output_ids"], "top": [[[lp, tok] for lp, tok, *_ in step] for step in top] if top else None}


def forced(port: int, ids: list[int], lora: str | None, top: int = 5) -> list[list[list[float]]]:
    """The server's next-token distribution at every position of ``ids``, teacher-forced in one prefill: per
    position ``j`` (0 .. len(ids) - 1; the one that predicts token ``j + 1``, the last one the next token) the
    top ``top`` ``[logprob, token]`` pairs. SGLang answers the input positions from the second token on (the
    first has no distribution) and the last one as the first output token's."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top}
    if lora:
        body["lora_path"] = lora
    meta = ask(port, "/generate", body)["meta_info"]
    rows = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"][:1]
    assert len(rows) == len(ids) and all(rows), f"{len(rows)} distributions for {len(ids)} positions"
    return [[[lp, tok] for lp, tok, *_ in row] for row in rows]


def wave(port: int, jobs: list[tuple[list[int], str | None]], new_tokens: int, logprobs: bool = False) -> list[dict]:
    """Every ``(prompt ids, adapter)`` of ``jobs`` at once, one thread each; answers in the jobs' order."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: generate(port, *job, new_tokens, logprobs), jobs))


def tokens_of(answers: list[dict]) -> int:
    return sum(len(answer["ids"]) for answer in answers)


def timed_waves(count: Callable[[], int], waves: int) -> dict:
    """``count()`` (one wave; it returns the tokens it made) once to warm up (every kernel the wave needs
    is compiled and captured before timing), then ``waves`` timed times: tokens/s of each, sorted, with
    their median."""
    count()
    rates = []
    for _ in range(waves):
        started = time.perf_counter()
        made = count()
        rates.append(made / (time.perf_counter() - started))
    return {"per_s": [round(r, 1) for r in sorted(rates)], "median": round(statistics.median(rates), 1)}
