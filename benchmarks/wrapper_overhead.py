"""Host-side cost of the guard per call, against the unwrapped call with SGLang's real argument list.

    python -m benchmarks.wrapper_overhead [--calls 200000] [--repeats 7]

The function under both is a stand-in compiled with the installed SGLang's exact signature of
``_fused_moe_kernel_sequence`` (binding its 11 positional and 26 keyword arguments is part of
every real call), so the difference is the guard alone. Best of ``--repeats`` runs; compare the
two columns of one run, not figures across machines.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import timeit
import warnings
from dataclasses import replace
from types import SimpleNamespace

from harness import tables
from sglang_lora_tma_guard.guard import make_guarded
from sglang_lora_tma_guard.inspection import TARGET_NAME, Strategy, inspect_target


def real_signature():
    """The installed SGLang's signature, or None when SGLang cannot be imported here."""
    try:
        from benchmarks._bench import portable_helper_ops

        portable_helper_ops()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang_lora_tma_guard.installed import fused_moe_module

            return inspect.signature(inspect.unwrap(getattr(fused_moe_module(), TARGET_NAME)))
    except Exception as exc:
        print(f"(SGLang not importable: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def stand_in(signature: inspect.Signature):
    params = ", ".join(
        ("*, " if p.kind is p.KEYWORD_ONLY and i == first_kw else "") + p.name
        + ("=None" if p.default is not p.empty else "")
        for i, p in enumerate(signature.parameters.values())
        for first_kw in [next(j for j, q in enumerate(signature.parameters.values()) if q.kind is q.KEYWORD_ONLY)]
    )
    namespace = {}
    exec(f"def {TARGET_NAME}({params}):\n    return down_moe_use_tma\n", namespace)
    return namespace[TARGET_NAME]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="guard overhead per call")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    signature = real_signature()
    if signature is None:
        return 2
    original = stand_in(signature)
    guarded = make_guarded(original, inspect_target(original))  # a stand-in has no source: strategy FLAG
    # The weight-TMA route: the same wrapper dispatching block-fp8 hooked calls that asked for TMA to
    # the copy (here another stand-in: the copy's own cost is SGLang's function's, not the guard's).
    weight_tma = make_guarded(original, replace(inspect_target(original), strategy=Strategy.WEIGHT_TMA),
                              variant=stand_in(signature))
    positional = [p.name for p in signature.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY]
    call_args = tuple(True if name == "down_moe_use_tma" else None for name in positional)
    hooked = SimpleNamespace(after_gate_up=print, after_down=print)
    block_fp8 = {"use_fp8_w8a8": True, "block_shape": [128, 128]}
    cases = {  # name: (wrapper, hooks, keyword arguments set)
        "no hooks": (guarded, None, {}),
        "hooks, none set": (guarded, SimpleNamespace(after_gate_up=None, after_down=None), {}),
        "hooks set (plain fix: TMA off)": (guarded, hooked, {}),
        "hooks set, block fp8 (weight TMA)": (weight_tma, hooked, block_fp8),
    }

    def per_call_ns(function, hooks, extra):
        kwargs = {name: None for name in keyword}
        kwargs.update(extra, hooks=hooks)
        timer = timeit.Timer(lambda: function(*call_args, **kwargs))
        return timer.timeit(number=args.calls) / args.calls * 1e9

    print(f"{len(positional)} positional + {len(keyword)} keyword arguments, "
          f"{args.calls} calls x {args.repeats} interleaved repeats (best), Python {sys.version.split()[0]}")
    table = tables.Table(["case", "unwrapped ns/call", "guarded ns/call", "overhead ns", "ratio"])
    for name, (wrapper, hooks, extra) in cases.items():
        # Interleaved, so that a noisy neighbour slows both columns alike.
        runs = [(per_call_ns(original, hooks, extra), per_call_ns(wrapper, hooks, extra)) for _ in range(args.repeats)]
        plain, wrapped = min(r[0] for r in runs), min(r[1] for r in runs)
        table.add(name, f"{plain:.0f}", f"{wrapped:.0f}", f"{wrapped - plain:.0f}", f"{wrapped / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
