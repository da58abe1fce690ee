"""Worker of the seeded sweep of random MoE cases on the real SGLang 0.5.16 kernels (CPU interpreter).

Tokens 1-64, experts 2-16, top-k 1-4, ragged routing with empty experts, filtered experts (-1),
two kernel block sizes, and hooks after gate-up only, after down only, both, or neither. For every
case: the guarded hooked call is bit-identical to SGLang's non-TMA path; a hook-less call reaches
the kernels exactly as without the guard; and without the guard a hooked call with TMA differs
from the non-TMA path exactly when the TMA layout differs from the route-major one.

Run by tests/test_random_cases.py as ``python -m tests.random_sweep --worker I --of N --cases C``:
worker I takes cases I, I+N, ...; prints one JSON line with its counts and mismatches.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import sys
from collections import Counter

# Before SGLang is imported: its kernels run through Triton's CPU interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import sglang_lora_tma_guard as guard  # noqa: E402
from harness import tiny_moe
from sglang_lora_tma_guard import installed  # noqa: E402

SEED = 20261130
HOOKS = ("gate_up", "down", "both", "neither")


def random_case(rng: random.Random, index: int) -> dict:
    experts = rng.randint(2, 16)
    return {
        "index": index,
        "tokens": round(math.exp(rng.uniform(0, math.log(64)))),
        "experts": experts,
        "topk": rng.randint(1, min(4, experts)),
        "active": rng.randint(1, experts),  # experts that get routes; the others stay empty
        "filtered": rng.random() < 0.25,
        "block_m": rng.choice([16, 32]),
        "hooks": HOOKS[index % len(HOOKS)],
        "seed": rng.randrange(1 << 30),
    }


def build(case: dict) -> tiny_moe.MoEProblem:
    problem = tiny_moe.make_problem(
        num_tokens=case["tokens"], num_experts=case["experts"], hidden=128, intermediate=128,
        topk=case["topk"], seed=case["seed"], config=tiny_moe.small_config(case["block_m"]),
    )
    gen = torch.Generator().manual_seed(case["seed"])
    scores = torch.randn(case["tokens"], case["experts"], generator=gen)
    scores[:, case["active"]:] -= 1e3  # ragged: routes go to the first `active` experts first
    weights, ids = torch.topk(scores.softmax(dim=-1), case["topk"], dim=-1)
    if case["filtered"]:
        # Experts this rank does not own under expert parallelism arrive as -1.
        ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
    problem.topk_weights, problem.topk_ids = weights.float(), ids.to(torch.int32)
    return problem


def layout_differs(problem: tiny_moe.MoEProblem) -> bool:
    """Whether the expert-sorted TMA layout puts any route elsewhere than route-major order does."""
    routes = problem.topk_ids.numel()
    sorted_ids = problem.alignment[0][:routes]
    return not torch.equal(sorted_ids, torch.arange(routes, dtype=sorted_ids.dtype))


def hooks_for(problem, kind):
    if kind == "neither":
        # Both shapes of "no hooks" SGLang produces: None, and LoRAHooks() with nothing set.
        return None if problem.hidden_states.shape[0] % 2 else tiny_moe.lora_hooks(problem, False, False)
    return tiny_moe.lora_hooks(problem, gate_up=kind in ("gate_up", "both"), down=kind in ("down", "both"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN payloads included (``torch.equal`` says NaN != NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@contextlib.contextmanager
def uninitialised_memory_as_nan():
    """Floating-point ``torch.empty`` buffers come filled with NaN inside the block.

    The TMA path leaves block padding in its buffers uninitialised, and hooks that read the wrong
    rows read it. Whatever the allocator hands back there may by chance be the right values (a
    buffer of the previous run at the same address): NaN makes every such read visible, so that the
    unguarded outcome is decided by the layout alone.
    """
    real = torch.empty

    def empty(*args, **kwargs):
        tensor = real(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def record_arrivals(fm, arrivals: list) -> None:
    """Put a recorder between the guard and SGLang: what each call really hands SGLang."""
    original = fm._fused_moe_kernel_sequence

    @functools.wraps(original)
    def _fused_moe_kernel_sequence(*args, **kwargs):
        arrivals.append((args[10], kwargs.get("hooks")))
        return original(*args, **kwargs)

    fm._fused_moe_kernel_sequence = _fused_moe_kernel_sequence


def run_cases(indices) -> dict:
    with tiny_moe.launch_recorder() as launches:
        return _run_cases(indices, launches)


def _run_cases(indices, launches: list) -> dict:
    fm = installed.fused_moe_module()
    sglang_function = fm._fused_moe_kernel_sequence
    arrivals = []
    record_arrivals(fm, arrivals)
    recording = fm._fused_moe_kernel_sequence
    rng = random.Random(SEED)
    cases = [random_case(rng, index) for index in range(max(indices, default=-1) + 1)]
    counts, mismatches = Counter(), []
    for index in indices:
        case = cases[index]
        problem = build(case)
        hooks = hooks_for(problem, case["hooks"])

        def run(use_tma):
            return tiny_moe.run_sequence(problem, use_tma=use_tma, hooks=hooks, filter_expert=case["filtered"])

        guard.deactivate()
        # Hook-less cases run behind the arrivals recorder. Hooked ones do not: under another
        # wrapper the guard would (rightly) not build its weight-TMA variant, the path to check.
        fm._fused_moe_kernel_sequence = recording if case["hooks"] == "neither" else sglang_function
        launches.clear()
        with uninitialised_memory_as_nan():
            unguarded = run(True)
        unguarded_calls = list(launches)
        guard.activate()
        launches.clear()
        with uninitialised_memory_as_nan():
            guarded = run(True)
        counts[case["hooks"]] += 1
        counts["filtered"] += case["filtered"]
        if case["hooks"] == "neither":
            # What SGLang was handed: TMA still requested, the same hooks object, the same launches.
            if arrivals[-1] != (True, hooks) or arrivals[-2] != (True, hooks) or launches != unguarded_calls:
                mismatches.append(["hook-less call changed", case])
            # Outputs are compared bit for bit, NaN included, where SGLang itself is deterministic.
            # With filtered experts and top-1 it writes straight into the output and leaves rows of
            # uninitialised memory on this (CPU) path; read as NaN here, they are the same each run.
            guard.deactivate()
            with uninitialised_memory_as_nan():
                again = run(True)
            if same_bits(again, unguarded):
                if not same_bits(guarded, unguarded):
                    mismatches.append(["hook-less output changed", case])
            else:
                counts["hook-less, SGLang nondeterministic"] += 1
            continue
        if launches != [tiny_moe.WEIGHT_TMA_LAUNCH] * 2:
            mismatches.append(["hooked call did not take weight TMA", case, launches])
        else:
            counts["weight tma"] += 1
        guard.deactivate()
        reference = run(False)
        if not torch.equal(guarded, reference):
            mismatches.append(["guarded differs from non-TMA", case, str(tiny_moe.compare(guarded, reference))])
        differs, wrong = layout_differs(problem), not torch.equal(unguarded, reference)
        counts["layout differs"] += differs
        counts["unguarded wrong"] += wrong
        if differs != wrong:
            mismatches.append(["unguarded outcome not explained by the layout", case])
    guard.deactivate()
    fm._fused_moe_kernel_sequence = sglang_function
    return {"counts": dict(counts), "mismatches": mismatches}


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--of", type=int, default=1)
    parser.add_argument("--cases", type=int, default=200)
    args = parser.parse_args(argv)
    result = run_cases(list(range(args.worker, args.cases, args.of)))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
