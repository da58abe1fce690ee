"""A self-test on the installed SGLang: one tiny block-fp8 MoE, TMA requested, LoRA-style hooks.

Runs SGLang's own ``_fused_moe_kernel_sequence`` three ways and compares each with its non-TMA
hooked path: without the guard (does this SGLang corrupt hooked rows?), with the guard (must be
bit-identical), and without hooks, guard on and off (must be untouched). On a GPU natively; on a CPU
through Triton's interpreter, which has to be switched on before SGLang is imported, so call
:func:`prepare` first in a fresh process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .inspection import Strategy

TOKENS = (3, 17)
"""Two batch sizes: a ragged one and one whose routes span several kernel blocks."""


@dataclass(frozen=True)
class SelfTestResult:
    """What the self-test found; ``skipped`` or ``error`` say why it has no cases."""

    device: str | None = None
    strategy: Strategy | None = None
    exposed_without_guard: bool | None = None
    passed: bool | None = None
    seconds: float | None = None
    cases: list[dict] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None


def prepare(device: str | None = None) -> str:
    """Pick the device and, for the CPU, switch Triton's interpreter on. Call before importing SGLang."""
    if device is None:
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:  # reported by the check itself; the self-test will say it cannot run
            device = "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def run(device: str) -> SelfTestResult:
    """The self-test; the guard is left as it was found."""
    import torch

    from . import guard, tiny_moe

    started = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 is off
    was_active = guard.status().active
    cases, strategy = [], None
    try:
        for tokens in TOKENS:
            problem = tiny_moe.make_problem(num_tokens=tokens, num_experts=4, topk=2, seed=tokens,
                                         device=device, dtype=dtype)
            hooks = tiny_moe.lora_hooks(problem)
            guard.deactivate()
            reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks)
            unguarded = tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks)
            hookless_off = tiny_moe.run_sequence(problem, use_tma=True, hooks=None)
            state = guard.activate()
            installed, strategy = state.installed, state.strategy
            with tiny_moe.launch_recorder() as launches:
                guarded = tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks)
            hookless_on = tiny_moe.run_sequence(problem, use_tma=True, hooks=None)
            without, with_ = tiny_moe.compare(unguarded, reference), tiny_moe.compare(guarded, reference)
            cases.append({
                "tokens": tokens,
                "rows_wrong_without_guard": without.rows_wrong,
                "max_rel_err_without_guard": without.max_rel_err,
                "guard_installed": installed,
                "identical_with_guard": with_.identical,
                # The fallback's own kernels round differently: 2% relative (L2) is its contract.
                "within_tolerance_with_guard": with_.rel_err <= 0.02,
                "rel_err_with_guard": with_.rel_err,
                "max_abs_diff_with_guard": with_.max_abs_diff,
                "hookless_untouched": bool(torch.equal(hookless_on, hookless_off)),
                # What SGLang's launcher was told for the guarded call's gate-up and down GEMMs.
                "guarded_launches": launches,
            })
    finally:
        guard.activate() if was_active else guard.deactivate()
    exposed = any(c["rows_wrong_without_guard"] for c in cases)
    passed = all(c["hookless_untouched"] for c in cases) and (
        all(c["identical_with_guard"] for c in cases) if strategy in (Strategy.FLAG, Strategy.WEIGHT_TMA)
        else all(c["within_tolerance_with_guard"] for c in cases) if strategy is Strategy.FALLBACK
        else not exposed  # nothing installed: SGLang has to get it right by itself
    )
    if strategy is Strategy.WEIGHT_TMA:  # the speed-up must really be taken, and A must stay route-major
        passed = passed and all(c["guarded_launches"] == [tiny_moe.WEIGHT_TMA_LAUNCH] * 2 for c in cases)
    return SelfTestResult(device=device, strategy=strategy, exposed_without_guard=exposed, passed=passed,
                          seconds=round(time.perf_counter() - started, 2), cases=cases)


def render(result: SelfTestResult) -> list[str]:
    from .tiny_moe import WEIGHT_TMA_LAUNCH

    lines = [f"Self-test ({result.device}{', Triton interpreter' if result.device == 'cpu' else ''}, "
             f"{result.seconds} s): block-fp8 MoE, 4 experts, top-2, LoRA hooks, TMA requested"]
    for c in result.cases:
        with_guard = ("bit-identical" if c["identical_with_guard"]
                      else f"relative error {c['rel_err_with_guard']:.2%}") if c["guard_installed"] else "not installed"
        weights = " (TMA weights)" if c["guarded_launches"] == [WEIGHT_TMA_LAUNCH] * 2 else ""
        lines.append(
            f"  {c['tokens']:>3} tokens: without the guard {c['rows_wrong_without_guard']}/{c['tokens']} rows wrong; "
            f"with it {with_guard}{weights}; hook-less calls {'untouched' if c['hookless_untouched'] else 'CHANGED'}"
        )
    lines.append(f"  {'PASS' if result.passed else 'FAIL'}")
    return lines
