"""The benchmarks' shared helpers, on this machine: the table writer, and one server's start, health wait
and stop (``benchmarks/serving/server.sh``) with the HTTP client (``benchmarks/serving/client.py``) against
a stand-in for ``sglang.launch_server`` (``tests/fake_server``: the H200 runs use the real one)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from harness import tables

REPO = Path(__file__).resolve().parents[1]


def test_a_table_is_printed_row_by_row_and_kept_whole(capsys):
    table = tables.Table(["a", "b"])
    table.add(1, "x")
    table.add(2.5, "y")
    assert capsys.readouterr().out.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | y |"]
    assert str(table) == tables.markdown(["a", "b"], [[1, "x"], [2.5, "y"]])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_campaign(tmp_path, script: str, **env) -> subprocess.CompletedProcess:
    """``script`` in bash with ``set -euo pipefail`` and server.sh sourced, python3 this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "PYTHONPATH": f"{REPO / 'tests' / 'fake_server'}{os.pathsep}{REPO}", **env}
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source benchmarks/serving/server.sh; {script}"],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120)


def test_a_server_is_waited_for_asked_and_stopped(tmp_path):
    port, log, out = free_port(), tmp_path / "server.log", tmp_path / "load.json"
    done = run_campaign(tmp_path, f"""
        start_server {log} {port} 20 FAKE_UP_AFTER_S=1 -- --model-path m
        echo "up after $SERVER_UP_S s"
        python3 -m benchmarks.e2e.client load {port} {out}
        guard_lines {log}
        stop_server
        if kill -0 "$SERVER_PID" 2> /dev/null; then echo "still running"; fi""")
    assert done.returncode == 0, done.stderr
    assert "up after" in done.stdout and "still running" not in done.stdout
    assert "1 sglang-lora-tma-guard: the fake server's one guard line" in done.stdout
    assert "--port" in log.read_text() and "--model-path m" in log.read_text()
    load = json.loads(out.read_text())["load"]
    assert len(load["tokens_per_s_waves"]) == 5 and load["tokens_per_s_median"] > 0
    assert load["tokens_per_s_waves"] == sorted(load["tokens_per_s_waves"])


def test_a_server_that_exits_at_start_is_said_and_not_waited_for(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    done = run_campaign(tmp_path, f"""
        if start_server {log} {port} 30 FAKE_EXIT=1 --; then echo came up; else echo "start failed: $?"; fi
        echo "after $SECONDS s"
        """)
    assert done.returncode == 0, done.stderr
    assert "start failed: 1" in done.stdout and "fake server: exiting at start" in done.stdout
    assert int(done.stdout.split("after ")[-1].split()[0]) < 10  # not 30 checks of 2 s: it saw the exit
