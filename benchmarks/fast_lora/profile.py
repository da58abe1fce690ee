"""Where a server step's time goes: a summary of the torch-profiler traces of client.py profile.

    python -m benchmarks.fast_lora.profile TRACE_DIR NAME [OUT.json]

For each trace under TRACE_DIR (``prefill-TP-0.trace.json.gz`` and ``decode-TP-0...`` from client.py;
SGLang's own by-stage names, ``...-EXTEND...`` and ``...-DECODE...``, read the same): the steps it holds
(calls of the model runner's ``forward``; in a trace taken without stacks, of the token embedding, or where
CUDA graphs replay the steps, launches of a graph), the
wall span of its GPU work, the time the GPU was busy (the union of its kernels and copies), the kernels'
time by category (table below, first match wins), the host's time in SGLang's per-batch LoRA preparation
(``LoRAManager.prepare_lora_batch``) and in this package's Python, callees included (on the fast path its
hooks and their launches, on the default path SGLang's hook builder under this package's wrapper; none of
it runs in a CUDA-graph replay), the host's waits for the GPU (CUDA's synchronize calls and synchronous
copies: while the host waits it queues no work, so the GPU drains and then idles until the host is ahead
again) with the Python code that asked for each, where the host paced the GPU (``host_bound``: read it in
a trace taken without stacks, whose host is not slowed by the profiler), and the 12 kernels that took
longest. Per step, in ms.
"""

from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import os
import re
import sys

# Kernel name -> category, the first pattern that matches. "moe_lora": SGLang's LoRA MoE kernels and this
# package's (its routing, shrink and expand); "moe_base": the expert GEMMs and what serves them.
CATEGORIES = [
    ("moe_lora", re.compile(r"lora|^_(count|count_all|offsets|scatter|route_one_program|shrink|expand)_kernel$")),
    ("moe_base", re.compile(r"fused_moe|moe_align|moe_sum|act_and_mul|silu_and_mul|topk|_moe_gemm|_gated_activation"
                            r"|count_and_sort|moe_")),
    ("attention", re.compile(r"attention|attn|_fwd_kernel|_fwd_grouped|decode|extend|rotary|rope", re.I)),
    ("dense_gemm", re.compile(r"gemm|nvjet|cutlass|sm90_|xmma|cublas|splitk", re.I)),
    ("norm", re.compile(r"norm", re.I)),
]
STEP = re.compile(r"model_runner\.py\(\d+\): forward$")
MODULE_LOAD = re.compile(r"^cu(Module|Library)Load")
STEP_OP = "aten::embedding"
"""Without stacks: the op that runs once a step (the token embedding)."""
GRAPH_LAUNCH = "cudaGraphLaunch"
"""A step replayed from a CUDA graph (decode) runs no op on the host: it is one launch of its graph."""
LORA_PREP = re.compile(r"lora_manager\.py\(\d+\): prepare_lora_batch$")
OURS = re.compile(r"sglang_lora_tma_guard/")
WAIT = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$")
"""CUDA runtime calls in which the host waits for the GPU."""
NOT_A_CALLER = re.compile(r"^torch/|^<built-in")
"""Frames that only pass a wait on (``Tensor.item``, ``torch.cuda.synchronize``): the caller is above them."""


def category(kernel: str) -> str:
    return next((name for name, pattern in CATEGORIES if pattern.search(kernel)), "other")


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def waits(events: list[dict], python: list[dict], per: float) -> dict:
    """The host's waits for the GPU per step: how many, how long, and the innermost Python frame around
    each that is not torch's own (the code that asked), longest first."""
    found = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and WAIT.search(e["name"])]
    frames = collections.defaultdict(list)  # per thread: the frames that can be a caller, by start
    for p in sorted(python, key=lambda p: p["ts"]):
        if not NOT_A_CALLER.search(p["name"]):
            frames[p["tid"]].append(p)
    starts = {tid: [p["ts"] for p in ps] for tid, ps in frames.items()}
    by_caller: dict[str, float] = collections.Counter()
    for w in found:
        ps, caller = frames[w["tid"]], "(no Python frame)"
        # The innermost frame around the wait is the latest to start of those that end after it.
        for i in range(bisect.bisect_right(starts.get(w["tid"], []), w["ts"]) - 1, -1, -1):
            if ps[i]["ts"] + ps[i]["dur"] >= w["ts"] + w["dur"]:
                caller = ps[i]["name"]
                break
        by_caller[caller] += w["dur"]
    return {"per_step": round(len(found) * per * 1000.0, 1), "ms": round(sum(w["dur"] for w in found) * per, 3),
            "callers": [{"caller": name[:120], "ms": round(us * per, 4)} for name, us in by_caller.most_common(5)]}


def host_bound(events: list[dict], gpu: list[dict], per: float) -> dict:
    """Where the host paced the GPU, per step: ``idle_ms``, the GPU's idle gaps that end at work launched
    only after the GPU had run dry (the host was still on its way to that launch), and ``host_ms``, the
    host's time between one launch and the next on its thread (the code that leads up to a launch, the
    launch included); both by the category of the work so launched ("copy" for copies); ``longest``, the
    five longest such gaps (ms, not per step) with the kernel that ended each; ``module_loads``, the
    host's loads of GPU code (a kernel compiled, or read from a compile cache) and their ms per step.
    CUDA-graph replays count as one launch, of their first kernel."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kind = {}  # correlation -> category of the first GPU work it launched
    idle: dict[str, float] = collections.Counter()
    gaps = []
    reach = None
    for e in sorted(gpu, key=lambda e: e["ts"]):
        corr = e.get("args", {}).get("correlation")
        what = category(e["name"]) if e["cat"] == "kernel" else "copy"
        kind.setdefault(corr, what)
        launch = launches.get(corr)
        if reach is not None and e["ts"] > reach and launch is not None and launch["ts"] + launch["dur"] > reach:
            idle[what] += e["ts"] - reach
            gaps.append((e["ts"] - reach, e["name"]))
        reach = max(reach if reach is not None else 0.0, e["ts"] + e["dur"])
    host: dict[str, float] = collections.Counter()
    last: dict = {}
    for corr, launch in sorted(launches.items(), key=lambda item: item[1]["ts"]):
        if corr not in kind:
            continue  # no GPU work (an event record, a synchronize)
        end = launch["ts"] + launch["dur"]
        if launch["tid"] in last:
            host[kind[corr]] += end - last[launch["tid"]]
        last[launch["tid"]] = end
    ms = lambda c: {k: round(v * per, 3) for k, v in sorted(c.items(), key=lambda kv: -kv[1])}  # noqa: E731
    loads = [e for e in events if e.get("cat") == "cuda_driver" and MODULE_LOAD.search(e["name"])]
    return {"idle_ms": ms(idle), "host_ms": ms(host),
            "longest": [{"ms": round(us / 1000.0, 3), "kernel": name[:80]} for us, name in sorted(gaps)[::-1][:5]],
            "module_loads": {"count": len(loads), "ms": round(sum(e["dur"] for e in loads) * per, 3)}}


def summarize(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    python = [e for e in events if e.get("cat") == "python_function"]
    steps = (sum(1 for e in python if STEP.search(e["name"]))  # with stacks
             or sum(1 for e in events if e.get("cat") == "cpu_op" and e["name"] == STEP_OP)
             or sum(1 for e in events if e.get("cat") == "cuda_runtime" and e["name"] == GRAPH_LAUNCH) or None)
    per = 1.0 / (1000.0 * (steps or 1))
    by_category: dict[str, float] = collections.Counter()
    by_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_category[category(e["name"])] += e["dur"]
        by_kernel[e["name"]][0] += e["dur"]
        by_kernel[e["name"]][1] += 1
    span = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) if gpu else 0.0
    by_thread = collections.defaultdict(list)
    for e in python:
        if OURS.search(e["name"]):
            by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:12]
    return {
        "trace": path, "steps": steps,
        "gpu_span_ms": round(span * per, 3),
        "gpu_busy_ms": round(union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) * per, 3),
        "kernels_ms": {name: round(us * per, 3) for name, us in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "host_lora_prep_ms": round(sum(e["dur"] for e in python if LORA_PREP.search(e["name"])) * per, 3),
        "host_ours_ms": round(sum(union_us(v) for v in by_thread.values()) * per, 3),
        "host_waits": waits(events, python, per),
        "host_bound": host_bound(events, gpu, per),
        "top_kernels": [{"name": name[:90], "ms": round(us * per, 4), "calls_per_step": round(n / (steps or 1), 1),
                         "category": category(name)} for name, (us, n) in top],
    }


def main(argv: list[str]) -> int:
    trace_dir, name = argv[0], argv[1]
    result = {}
    for path in sorted(glob.glob(f"{trace_dir}/*.trace.json.gz")):
        stage = "decode" if "DECODE" in os.path.basename(path).upper() else "prefill"
        result[stage] = summarize(path)
    if len(argv) > 2:
        with open(argv[2], "w") as f:
            json.dump(result, f, indent=1)
    for stage, s in result.items():
        cats = ", ".join(f"{k} {v}" for k, v in s["kernels_ms"].items())
        print(f"== {name} {stage}: {s['steps']} steps; per step: GPU span {s['gpu_span_ms']} ms, busy "
              f"{s['gpu_busy_ms']}; kernels: {cats}; host LoRA prep {s['host_lora_prep_ms']}, ours "
              f"{s['host_ours_ms']}; host waits for the GPU {s['host_waits']['per_step']} a step "
              f"({s['host_waits']['ms']} ms)")
        for c in s["host_waits"]["callers"]:
            print(f"   waited {c['ms']} ms a step in {c['caller']}")
        print(f"   GPU idle until the host launched: {s['host_bound']['idle_ms']}; host time up to each launch: "
              f"{s['host_bound']['host_ms']}; longest {s['host_bound']['longest']}; GPU code loaded "
              f"{s['host_bound']['module_loads']}")
    return 0 if result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
