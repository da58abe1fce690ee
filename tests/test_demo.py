"""The demo's catalogue rows (scripts/demo_defects.py): each defect shown without the guard, fixed or refused
with it, on SGLang 0.5.16's own code, in a fresh interpreter as scripts/demo.sh runs it."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.real
@pytest.mark.slow
def test_the_demo_shows_every_cpu_defect_unguarded_and_answers_it_guarded():
    proc = subprocess.run([sys.executable, "-m", "scripts.demo_defects"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "ODD" not in proc.stdout
    assert sum(line.strip().startswith("with:") for line in proc.stdout.splitlines()) == 8
