"""A seeded sweep of random MoE cases on the real SGLang 0.5.16 kernels, on both cores.

The cases and what each must show are in tests/random_sweep.py.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real, pytest.mark.slow]

CASES = int(os.environ.get("LORA_TMA_GUARD_RANDOM_CASES", "48"))
WORKERS = 2
REPO = Path(__file__).resolve().parents[1]


def test_random_cases(capsys):
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LORA_TMA_GUARD", "SGLANG_PLUGINS")}
    env["TRITON_INTERPRET"] = "1"
    workers = [
        subprocess.Popen([sys.executable, "-m", "tests.random_sweep", "--worker", str(i), "--of", str(WORKERS),
                          "--cases", str(CASES)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for i in range(WORKERS)
    ]
    counts, mismatches = Counter(), []
    for worker in workers:
        out, err = worker.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert worker.returncode == 0 and lines, err[-3000:]
        result = json.loads(lines[-1][len("RESULT "):])
        counts.update(result["counts"])
        mismatches += result["mismatches"]
    hooked = counts["gate_up"] + counts["down"] + counts["both"]
    with capsys.disabled():
        print(f"\nrandom cases: {CASES} (hooks: gate-up only {counts['gate_up']}, down only "
              f"{counts['down']}, both {counts['both']}, neither {counts['neither']}; filtered experts "
              f"in {counts['filtered']}); TMA layout differed in {counts['layout differs']}/{hooked} "
              f"hooked cases, unguarded wrong in {counts['unguarded wrong']}; guarded hooked calls with TMA "
              f"weights {counts['weight tma']}/{hooked}; hook-less cases where SGLang "
              f"itself is nondeterministic: {counts['hook-less, SGLang nondeterministic']}; "
              f"mismatches {len(mismatches)}")
    assert sum(counts[k] for k in ("gate_up", "down", "both", "neither")) == CASES
    assert counts["layout differs"] > hooked // 2  # the sweep does exercise the bug
    assert counts["weight tma"] == hooked
    assert not mismatches, mismatches[:5]
