"""The bug and the fix, on the installed SGLang's own fused-MoE kernels.

    python -m sglang_lora_tma_guard.demo [--tokens 3 8 24] [--device cpu|cuda]

For each batch size it runs one block-fp8 MoE layer with LoRA-style hooks through SGLang's
``_fused_moe_kernel_sequence``: first on the non-TMA path (the reference), then with TMA requested
and no guard, then with the guard loaded the way SGLang loads it (``SGLANG_LORA_TMA_GUARD=1`` and
``sglang.srt.plugins.load_plugins()``). Exit 0 when the unguarded call is wrong and the guarded one
bit-identical to the reference; 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_lora_tma_guard.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[3, 8, 24], help="batch sizes to run")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    args = parser.parse_args(argv)

    device = args.device or _default_device()
    if device == "cpu":
        # Must be set before Triton compiles SGLang's kernels, that is before SGLang is imported.
        os.environ["TRITON_INTERPRET"] = "1"
    logging.basicConfig(level=logging.INFO, format="  log: %(message)s")
    warnings.filterwarnings("ignore")  # SGLang's import warns about CUDA-only quantization methods
    for noisy in ("sglang", "torch", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.pop("SGLANG_LORA_TMA_GUARD", None)

    started = time.perf_counter()
    from . import installed, tiny_moe
    from .inspection import sglang_version

    installed.fused_moe_module()
    print(f"SGLang {sglang_version()} imported in {time.perf_counter() - started:.1f} s; device {device}"
          + (" (Triton interpreter)" if device == "cpu" else ""))
    print("Each row: one block-fp8 MoE layer, LoRA hooks after gate-up and after down, TMA requested.\n")

    problems = [
        tiny_moe.make_problem(num_tokens=n, num_experts=args.experts, topk=args.topk, seed=n, device=device)
        for n in args.tokens
    ]
    references = [tiny_moe.run_sequence(p, use_tma=False, hooks=tiny_moe.lora_hooks(p)) for p in problems]
    unguarded = [tiny_moe.run_sequence(p, use_tma=True, hooks=tiny_moe.lora_hooks(p)) for p in problems]

    print("Loading plugins as SGLang does, with SGLANG_LORA_TMA_GUARD=1:")
    os.environ["SGLANG_LORA_TMA_GUARD"] = "1"
    from sglang.srt.plugins import load_plugins

    from .guard import status

    load_plugins()
    state = status()
    print(f"  guard installed: {state.installed}, strategy: {state.strategy}\n")
    guarded = [tiny_moe.run_sequence(p, use_tma=True, hooks=tiny_moe.lora_hooks(p)) for p in problems]

    header = f"{'tokens':>6}  {'routes':>6}  {'without the guard':<44}  {'with the guard'}"
    print(header)
    print("-" * len(header))
    ok = state.installed
    for problem, ref, bad, good in zip(problems, references, unguarded, guarded):
        before, after = tiny_moe.compare(bad, ref), tiny_moe.compare(good, ref)
        tokens = problem.hidden_states.shape[0]
        print(f"{tokens:>6}  {problem.topk_ids.numel():>6}  {before.rows_wrong:>3}/{before.rows:<3} rows wrong, "
              f"max rel err {before.max_rel_err:<8.3g}   {'bit-identical' if after.identical else after}")
        ok = ok and before.rows_wrong > 0 and after.identical
    print()
    print("RESULT: the guard turns corrupted hooked outputs into bit-identical ones" if ok
          else "RESULT: unexpected; see the table above")
    return 0 if ok else 1


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
