"""The example scripts, in their dry-run modes, checked against SGLang's own argument definitions."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(command, env=None, **kwargs):
    full_env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LORA_TMA_GUARD", "SGLANG_PLUGINS")}
    full_env.update({"PYTHON": sys.executable, **(env or {})})
    return subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=300, **kwargs)


def sglang_cli():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_launch_script_prints_a_command_sglang_accepts():
    proc = run([str(EXAMPLES / "launch_glm51_fp8_tp8_lora.sh"), "--model-path", "/models/GLM-5.1-FP8",
                "--lora", "support=/adapters/support", "--lora", "legal=/adapters/legal", "--dry-run",
                "--", "--mem-fraction-static", "0.85"])
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[:5] == ["env", "SGLANG_LORA_TMA_GUARD=1", sys.executable, "-m", "sglang.launch_server"]
    args = sglang_cli().parse_args(argv[5:])
    assert args.model_path == "/models/GLM-5.1-FP8" and args.tp_size == 8
    assert args.enable_lora and args.moe_runner_backend == "triton"
    assert not args.disable_cuda_graph
    # The guard turns shared-experts fusion off for LoRA servers itself (tests/test_fusion.py).
    assert not args.disable_shared_experts_fusion
    assert args.mem_fraction_static == 0.85
    names = {getattr(ref, "lora_name", None) or str(ref) for ref in args.lora_paths}
    assert any("support" in n for n in names) and any("legal" in n for n in names)


def test_launch_script_takes_its_paths_from_the_environment():
    proc = run([str(EXAMPLES / "launch_glm51_fp8_tp8_lora.sh"), "--dry-run"],
               env={"MODEL_PATH": "/m", "LORA_PATHS": "a=/x b=/y", "TP": "4"})
    assert proc.returncode == 0, proc.stderr
    assert "--tp-size 4" in proc.stdout and "--lora-paths a=/x b=/y" in proc.stdout


def test_launch_script_without_a_model_says_what_it_needs():
    proc = run([str(EXAMPLES / "launch_glm51_fp8_tp8_lora.sh"), "--dry-run"])
    assert proc.returncode == 2 and "need a model" in proc.stderr


def test_offline_engine_plan_uses_real_server_args_fields():
    from sglang.srt.server_args import ServerArgs

    proc = run([sys.executable, str(EXAMPLES / "offline_engine.py"), "--model-path", "/m",
                "--lora", "a=/x", "--lora", "b=/y", "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(job["engine"]) <= fields
    assert job["env"] == {"SGLANG_LORA_TMA_GUARD": "1"}
    assert job["engine"]["max_loras_per_batch"] == 3
    assert len(job["lora_path"]) == len(job["prompts"]) and None in job["lora_path"]
    assert set(filter(None, job["lora_path"])) == {"a", "b"}


@pytest.mark.real
@pytest.mark.slow  # each runs the check in a fresh interpreter
class TestPrelaunch:
    script = str(EXAMPLES / "prelaunch_check.sh")

    def test_refuses_to_start_when_the_check_says_exposed(self, tmp_path):
        marker = tmp_path / "started"
        proc = run([self.script, "--", "touch", str(marker)])
        assert proc.returncode == 1 and "refusing to start" in proc.stderr
        assert not marker.exists()

    def test_starts_the_command_when_protected(self, tmp_path):
        marker = tmp_path / "started"
        proc = run([self.script, "--", "touch", str(marker)], env={"SGLANG_LORA_TMA_GUARD": "1"})
        assert proc.returncode == 0, proc.stderr
        assert marker.exists()

    def test_dry_run_prints_the_command_and_starts_nothing(self, tmp_path):
        marker = tmp_path / "started"
        proc = run([self.script, "--dry-run", "--", "touch", str(marker)], env={"SGLANG_LORA_TMA_GUARD": "1"})
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1].strip() == f"touch {marker}"
        assert not marker.exists()
