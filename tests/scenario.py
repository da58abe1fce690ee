"""Fresh interpreters: a few lines of Python over a fake SGLang tree (:func:`run`), or the check
command (:func:`run_check`), each returning what came out.

For :func:`run`, the code sees ``g`` (the package), ``guard``, ``fm()`` (imports the fake fused-MoE module),
``hooks()`` (a hooks object with ``after_gate_up`` set) and ``log`` (everything logged so far);
it sets ``result`` to something JSON can hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import packaging
import wrapt

REPO = Path(__file__).resolve().parents[1]

PRELUDE = """
import importlib, io, json, logging, sys, threading
from types import SimpleNamespace
_log = io.StringIO()
logging.basicConfig(stream=_log, level=logging.DEBUG, format="%(levelname)s %(name)s %(message)s")
def log():
    return _log.getvalue()
import sglang_lora_tma_guard as g
from sglang_lora_tma_guard import guard, plugin
TARGET = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
def fm():
    return importlib.import_module(TARGET)
def hooks():
    return SimpleNamespace(after_gate_up=lambda *a: None, after_down=None)
ARGS = tuple(range(10))
result = None
"""


def run(code: str, tree: Path | None, env: dict | None = None, timeout: float = 60) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LORA_TMA_GUARD", "SGLANG_PLUGINS")}
    full_env.update(env or {})
    if tree is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), full_env.get("PYTHONPATH")]))
    script = PRELUDE + textwrap.dedent(code) + "\nprint('RESULT ' + json.dumps(result))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def run_check(*args, tree: Path | None = None, env: dict | None = None, no_site: Path | None = None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LORA_TMA_GUARD", "SGLANG_PLUGINS")}
    full_env.update(env or {})
    if tree is not None:
        full_env["PYTHONPATH"] = str(tree)
    command = [sys.executable, "-m", "sglang_lora_tma_guard.check", *args]
    if no_site is not None:
        # A Python that sees this package and its dependencies, and no site-packages: no SGLang, no torch.
        for dependency in (wrapt, packaging):
            (no_site / dependency.__name__).symlink_to(Path(dependency.__file__).parent)
        (no_site / "sglang_lora_tma_guard").symlink_to(REPO / "sglang_lora_tma_guard")
        command = [sys.executable, "-S", "-c",
                   f"import sys; sys.path.insert(0, {str(no_site)!r}); "
                   "from sglang_lora_tma_guard.check import main; sys.exit(main(sys.argv[1:]))", *args]
    proc = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr
