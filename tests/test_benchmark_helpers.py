"""The benchmarks' shared helpers, on this machine: the table writer, and one server's start, health wait
and stop (``benchmarks/serving/server.sh``) with the HTTP client (``benchmarks/serving/client.py``) against
a stand-in for ``sglang.launch_server`` (``tests/fake_server``: the H200 runs use the real one)."""

from __future__ import annotations

import copy
import gzip
import inspect
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.fast_lora import profile
from benchmarks.serving.reference import Reference, forced_verdict, load_runs, verdict
from benchmarks.serving.reference import main as reference_main
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
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(sys.executable)
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "PYTHONPATH": f"{REPO / 'tests' / 'fake_server'}{os.pathsep}{REPO}", **env}
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source benchmarks/serving/server.sh; {script}"],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # the benchmarks' server harness, not the package: out of the default run
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


@pytest.mark.slow  # the benchmarks' server harness, not the package: out of the default run
def test_a_runs_requests_are_kept_as_the_reference_scores_them(tmp_path):
    port, log, out = free_port(), tmp_path / "server.log", tmp_path / "run-fast.json"
    done = run_campaign(tmp_path, f"""
        start_server {log} {port} 20 -- --model-path m
        python3 -m benchmarks.fast_lora.client run {port} {out} lora
        stop_server""")
    assert done.returncode == 0, done.stderr
    run = json.loads(out.read_text())
    assert run["name"] == "fast" and len(run["requests"]) == len(run["outputs"]) == 40
    for request, (key, answer) in zip(run["requests"], run["outputs"].items()):
        # The stand-in answers the prompt's last id plus one, counting up: each output is its own prompt's.
        assert request["output"] == answer["ids"] == [request["prompt"][-1] + 1 + k for k in range(32)]
        assert key.endswith(request["adapter"] or "base")
    assert [r["adapter"] for r in run["requests"][-8:]] == [None, "a1", "a2", "a3", "a4", None, "a1", "a2"]


@pytest.mark.slow  # the benchmarks' server harness, not the package: out of the default run
def test_a_forced_runs_distributions_are_kept_one_per_position_of_its_prompt(tmp_path):
    port, log, out = free_port(), tmp_path / "server.log", tmp_path / "forced-fast.json"
    done = run_campaign(tmp_path, f"""
        start_server {log} {port} 20 -- --model-path m
        PROMPTS=3 python3 -m benchmarks.fast_lora.client forced {port} {out} lora
        stop_server""")
    assert done.returncode == 0, done.stderr
    run = json.loads(out.read_text())
    assert run["name"] == "fast" and len(run["forced"]) == 3 * 5
    assert [r["adapter"] for r in run["forced"][:5]] == [None, "a1", "a2", "a3", "a4"]  # each kind's first alone
    assert {r["batch"] for r in run["forced"][:5]} == {"alone"} and {r["batch"] for r in run["forced"][5:]} == {"wave"}
    for request in run["forced"]:
        # The stand-in's distribution at position j ranks ids[j] + 1 first: row j must be position j's.
        assert [row[0][1] for row in request["top"]] == [t + 1 for t in request["prompt"]]
        assert [lp for lp, _ in request["top"][0]] == [0.0, -0.5, -1.0, -1.5, -2.0]
    # The same tokens for a prompt and kind whatever the server serves; each prompt its own.
    again = tmp_path / "forced-nolora.json"
    done = run_campaign(tmp_path, f"""
        start_server {log} {port} 20 -- --model-path m
        PROMPTS=3 python3 -m benchmarks.fast_lora.client forced {port} {again}
        stop_server""")
    assert done.returncode == 0, done.stderr
    base = {r["key"]: r["prompt"] for r in json.loads(again.read_text())["forced"]}
    assert sorted(base) == ["p0-base", "p1-base", "p2-base"]
    assert all(base[r["key"]] == r["prompt"] for r in run["forced"] if r["adapter"] is None)
    assert len({tuple(r["prompt"]) for r in run["forced"]}) == 15


@pytest.mark.slow  # the benchmarks' server harness, not the package: out of the default run
def test_a_server_that_exits_at_start_is_said_and_not_waited_for(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    done = run_campaign(tmp_path, f"""
        if start_server {log} {port} 30 FAKE_EXIT=1 --; then echo came up; else echo "start failed: $?"; fi
        echo "after $SECONDS s"
        """)
    assert done.returncode == 0, done.stderr
    assert "start failed: 1" in done.stdout and "fake server: exiting at start" in done.stdout
    assert int(done.stdout.split("after ")[-1].split()[0]) < 10  # not 30 checks of 2 s: it saw the exit


def test_a_profile_is_summarized_per_step_by_category(tmp_path, capsys):
    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    forward = "sglang/srt/model_executor/model_runner.py(1232): forward"
    prep = "sglang/srt/lora/lora_manager.py(368): prepare_lora_batch"
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
        x("python_function", forward, 0, 5000), x("python_function", forward, 10000, 5000),
        x("python_function", "sglang/srt/model_executor/model_runner.py(1300): forward_decode", 50, 4000),
        x("python_function", prep, 100, 300), x("python_function", prep, 10100, 500),
        # Ours: [200, 1200] with [400, 600] nested in it on tid 1, [10200, 10600] on tid 1, [300, 900] on tid 2.
        x("python_function", "sglang_lora_tma_guard/fused_lora.py(10): plan", 200, 1000),
        x("python_function", "sglang_lora_tma_guard/lora_moe.py(20): route", 400, 200),
        x("python_function", "sglang_lora_tma_guard/fused_lora.py(10): plan", 10200, 400),
        x("python_function", "sglang_lora_tma_guard/fused_lora.py(10): plan", 300, 600, tid=2),
        x("python_function", "torch/nn/modules/module.py(1750): _call_impl", 0, 15000),
        # The host waits for the GPU: in SGLang's LoRA preparation through Tensor.item (a frame that only
        # passes the wait on), and in ours; a launch is no wait.
        x("python_function", "<built-in method item of Tensor object at 0x7f>", 140, 80),
        x("cuda_runtime", "cudaStreamSynchronize", 150, 50),
        x("cuda_runtime", "cudaDeviceSynchronize", 10300, 100),
        x("cuda_runtime", "cudaLaunchKernel", 10250, 10),
        # Step 1's GPU work: [900, 1650] [2000, 2250] [2300, 2900] [2950, 3050] busy, 1700 us of 1900 us summed.
        x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 900, 200),
        x("kernel", "fused_moe_kernel", 1000, 400),
        x("kernel", "_shrink_kernel", 1400, 100),
        x("kernel", "_fused_moe_lora_kernel", 1450, 200),
        x("kernel", "_fwd_kernel_stage1", 2000, 250),
        x("kernel", "nvjet_tst_128x64", 2300, 600),
        x("kernel", "rmsnorm_kernel", 2950, 50),
        x("kernel", "elementwise_kernel", 2950, 100),
        # Step 2's: [11000, 11700] [12000, 12600] [12700, 12900] busy, 1500 us.
        x("kernel", "fused_moe_kernel", 11000, 400),
        x("kernel", "_fused_moe_lora_kernel", 11400, 300),
        x("kernel", "nvjet_tst_128x64", 12000, 300),
        x("kernel", "nvjet_tst_128x64", 12300, 300),
        x("kernel", "_fwd_kernel_stage1", 12700, 200),
    ]
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    path = trace_dir / "trace-TP-0-DECODE.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = profile.summarize(str(path))
    assert summary["trace"] == str(path)
    assert summary["steps"] == 2
    assert summary["gpu_span_ms"] == 6.0  # (12900 - 900) / 2 / 1000
    assert summary["gpu_busy_ms"] == 1.6  # (1700 + 1500) / 2 / 1000; summed durations would give 1.7
    assert list(summary["kernels_ms"].items()) == [("dense_gemm", 0.6), ("moe_base", 0.4), ("moe_lora", 0.3),
                                                   ("attention", 0.225), ("other", 0.05), ("norm", 0.025)]
    assert summary["host_lora_prep_ms"] == 0.4  # (300 + 500) / 2 / 1000
    assert summary["host_ours_ms"] == 1.0  # (1000 + 400 + 600) / 2 / 1000; the nested 200 us not again
    assert summary["host_waits"] == {"per_step": 1.0, "ms": 0.075, "callers": [  # (50 + 100) / 2 / 1000
        {"caller": "sglang_lora_tma_guard/fused_lora.py(10): plan", "ms": 0.05}, {"caller": prep, "ms": 0.025}]}
    assert summary["top_kernels"][0] == {"name": "nvjet_tst_128x64", "ms": 0.6, "calls_per_step": 1.5,
                                         "category": "dense_gemm"}
    assert [k["name"] for k in summary["top_kernels"][:4]] == [
        "nvjet_tst_128x64", "fused_moe_kernel", "_fused_moe_lora_kernel", "_fwd_kernel_stage1"]
    assert len(summary["top_kernels"]) == 7

    out = tmp_path / "profile.json"
    assert profile.main([str(trace_dir), "x", str(out)]) == 0
    assert json.loads(out.read_text()) == {"decode": summary}
    assert "== x decode: 2 steps; per step: GPU span 6.0 ms, busy 1.6;" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert profile.main([str(empty), "x"]) == 1


def test_a_profile_says_where_the_host_paced_the_gpu(tmp_path):
    def x(cat, name, ts, dur, corr=None, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
                **({"args": {"correlation": corr}} if corr is not None else {})}

    events = [
        x("cpu_op", "aten::embedding", 0, 5),  # one step, counted without stacks
        x("cuda_runtime", "cudaLaunchKernel", 0, 10, 1), x("kernel", "fused_moe_kernel", 20, 100, 1),
        # Launched while the GPU was busy: its 10 us gap is not the host's.
        x("cuda_runtime", "cudaLaunchKernel", 30, 10, 2), x("kernel", "_shrink_kernel", 130, 50, 2),
        # Launched at 300-310, the GPU idle since 180: 140 us waiting for the host.
        x("cuda_driver", "cuLaunchKernelEx", 300, 10, 3), x("kernel", "_expand_kernel", 320, 50, 3),
        x("cuda_runtime", "cudaMemcpyAsync", 330, 5, 4), x("gpu_memcpy", "Memcpy HtoD", 340, 10, 4),
        x("cuda_runtime", "cudaEventRecord", 400, 2, 5),  # no GPU work: not a launch
        x("cuda_runtime", "cudaLaunchKernel", 500, 10, 6), x("kernel", "nvjet_tst_128x64", 520, 10, 6),
        x("cuda_runtime", "cudaLaunchKernel", 505, 10, 7, tid=2), x("kernel", "rmsnorm_kernel", 530, 10, 7),
        x("cuda_driver", "cuModuleLoadData", 200, 90),  # GPU code loaded, no correlation to a launch
    ]
    path = tmp_path / "prefill-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = profile.summarize(str(path))
    assert summary["steps"] == 1

    # Decode steps replayed from CUDA graphs, without stacks: no op runs on the host, a graph launch a step.
    replayed = [x("cuda_runtime", "cudaGraphLaunch", 1000 * i, 20, 10 + i) for i in range(3)] + [
        x("kernel", "fused_moe_kernel", 1000 * i + 30, 600, 10 + i) for i in range(3)]
    graphs = tmp_path / "decode-TP-0.trace.json.gz"
    with gzip.open(graphs, "wt") as f:
        json.dump({"traceEvents": replayed}, f)
    decode = profile.summarize(str(graphs))
    assert decode["steps"] == 3 and decode["kernels_ms"] == {"moe_base": 0.6}
    assert summary["host_bound"] == {
        "idle_ms": {"dense_gemm": 0.15, "moe_lora": 0.14},  # 520 - 370, 320 - 180
        # Between launch ends on each thread: 40 - 10, 310 - 40; 335 - 310; 510 - 335; tid 2's first launch: none.
        "host_ms": {"moe_lora": 0.3, "dense_gemm": 0.175, "copy": 0.025},
        "longest": [{"ms": 0.15, "kernel": "nvjet_tst_128x64"}, {"ms": 0.14, "kernel": "_expand_kernel"}],
        "module_loads": {"count": 1, "ms": 0.09}}


def test_the_fused_policy_is_read_from_down_gemm_tables_at_the_tile_the_package_places(capsys):
    """``benchmarks/fused_policy.py`` on H100 tables of GLM-5.1 TP8 (K 256) and Qwen3-30B-A3B tp2 (K 384): the fused
    side at the tile the package places (two K tiles: 128-wide columns unrolled up to rank 32, 64-wide columns with
    the B tiles copied ahead past it; three: the K steps a loop up to rank 16, 64-wide columns unrolled past it), rows
    of a tile it no longer places left out, and the thresholds from the largest batch down while each batch pays by
    the margin."""
    from benchmarks import fused_policy

    results = REPO / "benchmarks" / "results" / "lora_moe"
    short = json.loads((results / "k-loop" / "short-k" / "down_gemm.json").read_text())["rows"]
    by_batch = {(r["shape"], r["ranks"], r["tokens"]): r for r in short}

    def at(row, tile):
        return row["ms quantize"] + row["ms shrink"] + row[fused_policy.ORDERED + tile]

    for batch, tile in ((("qwen3-30b-tp2", "r16", 4096), "N_TILES=16, K_LOOP=1"),
                        (("qwen3-30b-tp2", "mixed", 4096), "N_TILES=16, BLOCK_N=64, num_stages=2"),
                        (("glm51-fp8-tp8", "r16", 8192), "N_TILES=16, num_stages=2")):
        assert fused_policy.placed_ms(by_batch[batch]) == pytest.approx(at(by_batch[batch], tile)), batch

    table, lines = fused_policy.policy(short, margin=0.05)
    # GLM-5.1's rows past rank 32 were timed before the B tiles went ahead: left out.
    assert len(short) == 8 and [line[:3] for line in lines if line[0] == "glm51-fp8-tp8"] == [
        ["glm51-fp8-tp8", "r16", 8192], ["glm51-fp8-tp8", "r16", 4096]]
    assert table == {256: ((16, 32768),), 384: ((16, 32768), (64, 32768))}

    # The sweep of the B tiles ahead (its own rows, the same launches): the placed tile's rows read from it.
    ahead = json.loads((results / "b-ahead" / "down" / "down_gemm.json").read_text())["rows"]
    mixed = next(r for r in ahead if (r["ranks"], r["tokens"]) == ("mixed", 4096))
    assert fused_policy.placed_ms(mixed) == pytest.approx(
        mixed["ms quantize"] + mixed["ms shrink"] + mixed["ms order by adapter"]
        + mixed[fused_policy.SWEEP + "N_TILES=16, BLOCK_N=64, num_stages=2, LORA_AHEAD=3"])
    # Ranks up to 64 pay 12.6% at 4096 tokens, not at 2048; rank 32 pays 7.0% at 2048, not by 10%.
    assert fused_policy.policy(ahead, margin=0.05)[0] == {256: ((32, 16384), (64, 32768))}
    assert fused_policy.policy(ahead, margin=0.1)[0] == {256: ((32, 32768), (64, 32768))}
    assert fused_policy.main([str(results / "b-ahead" / "down" / "down_gemm.json")]) == 0
    assert "FASTER_FROM_ROUTES = {256: ((32, 16384), (64, 32768))}" in capsys.readouterr().out

    # The tables from before the K loop: their rows at a tile no longer placed say nothing.
    older = [row for path in sorted(results.glob("fused-qwen3*/**/down_gemm.json"))
             for row in json.loads(path.read_text())["rows"]]
    assert {(r["shape"], r["ranks"]) for r in older if fused_policy.placed_ms(r) is None} == {
        ("qwen3-30b-tp1", "r16"), ("qwen3-30b-tp1", "r32"), ("qwen3-30b-tp2", "r8"), ("qwen3-30b-tp2", "r16")}
    assert fused_policy.policy(older, margin=0.05)[0] == {256: ((16, 16384), (32, 16384)), 384: ((32, 32768),)}


def test_a_rank_set_in_a_wider_pool_is_laid_out_as_sglang_pads_it():
    """``rNinM``: four adapters of rank N in LoRA buffers M wide (an adapter of rank M loaded, not in the batch), as
    SGLang's pool holds them: ``max_lora_rank`` M (the rank ``=fast`` places by), each adapter's rank N, zeros past
    it."""
    from benchmarks._lora_setup import lora_info, pool_rank, rank_set
    from sglang_lora_tma_guard import tiny_moe

    assert [(rank_set(n), pool_rank(n)) for n in ("mixed", "r16", "r16in64")] == [
        ((8, 16, 32, 64), 64), ((16,) * 4, 16), ((16,) * 4, 64)]
    info = lora_info(tiny_moe.make_problem(num_tokens=10), "r16in64", seed=0)
    assert info.max_lora_rank == 64 and info.lora_ranks.tolist() == [16] * 4
    assert info.down_lora_a_weights.shape[2] == 64 and info.down_lora_b_weights.shape[3] == 64
    for buffer, ranks_on_rows in ((info.gate_up_lora_b_weights, False), (info.down_lora_a_weights, True),
                                  (info.down_lora_b_weights, False)):
        past, within = (buffer[:, :, 16:], buffer[:, :, :16]) if ranks_on_rows else (buffer[..., 16:], buffer[..., :16])
        assert not past.any() and within.any()
    gate, up = info.gate_up_lora_a_weights.split(64, dim=2)
    assert not gate[:, :, 16:].any() and not up[:, :, 16:].any() and gate[:, :, :16].any()


def test_the_fused_launch_at_k_768_is_placed_no_earlier_than_two_h100_runs_measured_it_faster(capsys):
    """Qwen3-30B-A3B tp1's down GEMM (K 768), three H100 runs: two of ``down_gemm.py`` (ranks 8/16/32/up to 64,
    1024-8192 tokens; ranks 16/32/up to 64, 2048-8192, a later lease) and ``lora_moe_kernels.py``'s parts (ranks
    16/32/up to 64, 2048-8192, a session before). The narrow GEMM with the LoRA
    epilogue at SGLang's tile (the placed launch) against SGLang's down GEMM + the fast hook, read by ``fused_policy``
    from both; in the first, the narrow GEMM no slower than the wide kernel's K loop (placed at K 768 before) at its
    best tile up to 4096 tokens and within 2% at 8192; the package's entry for K 768 taking no batch the runs do not."""
    from benchmarks import fused_policy
    from sglang_lora_tma_guard import fused_lora

    results = REPO / "benchmarks" / "results" / "lora_moe"
    own = [row for path in (results / "narrow" / "down_gemm.json", results / "narrow" / "repro" / "down_gemm.json")
           for row in json.loads(path.read_text())["rows"]]
    parts = json.loads((results / "k-loop" / "kernels" / "lora_moe_kernels.json").read_text())["rows"]
    table, lines = fused_policy.policy(own + parts, margin=0.05)
    assert len(lines) == len(own) + len(parts) == 16 + 9 + 9
    assert all(float(ratio) < 0.95 for *_, ratio in lines)
    measured = dict(table[768])
    assert measured == {8: 8192, 16: 8192, 32: 8192, 64: 8192}
    for rank, from_routes in fused_lora.FASTER_FROM_ROUTES[768]:
        assert from_routes >= max(n for r, n in measured.items() if r <= rank), (rank, from_routes)
    for row in own:
        wide = min(ms for key, ms in row.items() if key.startswith(fused_policy.ORDERED + "N_TILES=16"))
        narrow = row[fused_policy.ORDERED + "N_TILES=0"]
        assert narrow <= wide * (1.02 if row["tokens"] == 8192 else 1), (row["ranks"], row["tokens"], narrow, wide)
    timed = {**own[0], "ms order by adapter": 0.01}  # the ordering, where a table timed it, is part of the fused side
    assert fused_policy.placed_ms(timed) == pytest.approx(fused_policy.placed_ms(own[0]) + 0.01)
    assert fused_policy.main([str(results / "k-loop" / "kernels" / "lora_moe_kernels.json")]) == 0
    assert "FASTER_FROM_ROUTES = {768: ((16, 16384), (32, 16384), (64, 16384))}" in capsys.readouterr().out


def test_the_hooks_host_time_is_timed_with_the_launches_left_out_and_put_back(capsys):
    from benchmarks import hook_host_time
    from sglang_lora_tma_guard import lora_moe

    kernels = {name: getattr(lora_moe, name) for name in dir(lora_moe) if name.endswith("_kernel")}
    assert len(kernels) >= 7
    with hook_host_time.launches_left_out():
        hooks = hook_host_time.layer(16)
        for step in hooks.values():
            step()  # builds and calls both hooks: nothing launched, nothing left half-built
    assert {name: getattr(lora_moe, name) for name in kernels} == kernels  # every kernel back
    assert hook_host_time.main(["--repeats", "1", "--layers", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "tokens x top-8" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["64 tokens x top-8", "1024 tokens x top-8"]
    assert all(row.split("|")[3].strip() == "left out" for row in rows)  # a CPU: the CUDA rows are not run
    assert all(float(cell) > 0 for row in rows for cell in row.split("|")[4:8])


def tuner_batch():
    """The tuner's batch set-up on the CPU (its tensors and routing as on the H200), ranks 8/16/32/64."""
    from benchmarks import tune_lora_moe as tune
    from harness import real_lora, tiny_moe

    real_lora.enable_cpu_lora_ops()
    weights = tiny_moe.make_weights(8, 64, 40, seed=0, device="cpu")
    return tune.Batch.make(dict(E=8, N=40, K=64, topk=2), "mixed", 6, weights, device="cpu", dtype=torch.float16)


def tuner_batch_and_default_deltas():
    """:func:`tuner_batch`, and each hook's delta with the default tiles' two-launch hook: (batch, {hook name:
    (hook, delta)})."""
    from benchmarks import tune_lora_moe as tune

    batch = tuner_batch()
    hooks = {}
    for name, hook in (("gate_up", batch.gate_up), ("down", batch.down)):
        hook.out.zero_()
        tune.hook_launch(hook, batch.route(16), tune.BASE)()
        hooks[name] = hook, hook.out.float().clone()
        assert hooks[name][1].abs().max() > 0.05
    return batch, hooks


@pytest.mark.slow  # about 10 s on CPU: 24 one-kernel hooks through the interpreter
def test_each_one_kernel_candidate_of_the_tuner_adds_the_two_launch_hooks_delta(fm):
    """The tuner's batch set-up on the CPU (its tensors and routing as on the H200) and each one-kernel
    tile it would time, against the two-launch hook of the default tiles: the same delta within two fp16
    steps of the output (both round the same float32 ranks to fp16 before the expand)."""
    from benchmarks import tune_lora_moe as tune

    batch, hooks = tuner_batch_and_default_deltas()
    routing = batch.route(16)
    for hook, expected in hooks.values():
        candidates = tune.one_kernel_launches(hook, routing)
        assert len(candidates) == 12
        for config, launch in candidates.items():
            hook.out.zero_()
            launch()
            error = (hook.out.float() - expected).abs().max() / expected.abs().max()
            assert error < 2 * 2.0**-10, (config, float(error))


@pytest.mark.slow  # about 3 s on CPU: the down hook through the interpreter
def test_where_the_fused_down_launch_is_split_the_tuner_times_the_expand_that_runs_there(fm, monkeypatch):
    """Where ``=fast`` splits the fused down launch by rank (``fused_lora.SPLIT_FROM_ROUTES``, here from this
    batch's routes at rank 16), its epilogue adds the adapters up to that rank and the hook's expand the others: the
    tuner's down hook, and each expand it times, adds exactly the full delta's rows of the adapters above 16 (the
    same kernels, the others' blocks skipped) and nothing to the rest; no one-kernel candidate (it adds all)."""
    from dataclasses import replace

    from benchmarks import tune_lora_moe as tune
    from sglang_lora_tma_guard import fused_lora, lora_moe

    batch, hooks = tuner_batch_and_default_deltas()
    full_hook, full = hooks["down"]
    assert full_hook.rank_above == 0  # not split at this K: the whole hook, as before
    monkeypatch.setattr(fused_lora, "SPLIT_FROM_ROUTES", {full_hook.x.shape[1]: (16, batch.num_pairs)})
    assert tuner_batch().down.rank_above == 16
    down = replace(full_hook, rank_above=16)  # on the same activation (the tuner's is drawn unseeded)
    adapters = batch.adapters.long()
    above = (adapters >= 0) & (batch.ranks[adapters.clamp(min=0)] > 16)
    assert above.any() and not above.all()
    want = full * above[:, None, None]
    routing = batch.route(16)
    t = lora_moe.shrink(down.x, down.a, routing, topk=down.topk, max_rank=down.rank, halves=1, config=tune.BASE)
    expands = tune.expand_launches(down, routing, t)
    for launch in (tune.hook_launch(down, routing, tune.BASE), next(iter(expands.values()))):
        down.out.zero_()
        launch()
        assert torch.equal(down.out.float(), want)
    assert tune.one_kernel_launches(down, routing) == {}


def shipped_tiles():
    """Every distinct (hook, rows per block, its tiles) the shipped table holds, for any GPU and shape; warps and
    pipeline stages left at their defaults, as the interpreter runs a program the same whatever they are."""
    from dataclasses import replace

    from sglang_lora_tma_guard import lora_moe, tuning

    same = {f: getattr(lora_moe.StageConfig(), f) for f in ("shrink_warps", "shrink_stages", "expand_warps",
                                                             "expand_stages")}
    found = set()
    for gpu, shapes in tuning._table(None).items():
        if not gpu.startswith("_"):
            for buckets in shapes.values():
                for entry in buckets:
                    found.update((hook, entry["block_m"], replace(tuning._stage(entry[hook]), **same))
                                 for hook in ("gate_up", "down"))
    return sorted(found, key=repr)


@pytest.mark.slow  # about 70 s on CPU: each shipped tile on its hook through the interpreter
def test_each_tile_the_package_ships_adds_the_default_tiles_delta(fm):
    """The tuner's batch set-up on the CPU and each tile of ``lora_moe_tiles.json`` on its hook (split K,
    column groups, every rank in one tile, one kernel a hook), routed at its own rows per block, against the
    default tiles' two-launch hook (itself scored against the float32 reference in test_fast_lora.py):
    within two fp16 steps of the output, as both round the same float32 ranks to fp16."""
    from benchmarks import tune_lora_moe as tune

    tiles = shipped_tiles()
    assert len(tiles) >= 20 and any(cfg.one_kernel for *_, cfg in tiles) and any(cfg.split_k > 1 for *_, cfg in tiles)
    batch, hooks = tuner_batch_and_default_deltas()
    for name, block_m, config in tiles:
        hook, want = hooks[name]
        hook.out.zero_()
        tune.hook_launch(hook, batch.route(block_m), config)()
        error = (hook.out.float() - want).abs().max() / want.abs().max()
        assert error < 2 * 2.0**-10, (name, block_m, config, float(error))


@pytest.mark.slow  # about 3 s on CPU: both hooks through the interpreter
def test_the_tiles_ab_runs_the_routing_and_both_hooks_with_the_plan_of_its_table(fm):
    """``tune_lora_moe --against``'s launch, on the plan the package makes for the batch (here its rule of
    thumb: the shape is in no table): each hook's delta as the default tiles' two-launch hook adds it."""
    from benchmarks import tune_lora_moe as tune
    from sglang_lora_tma_guard import tuning

    batch, hooks = tuner_batch_and_default_deltas()
    plan = tuning._plan(*batch.plan_sizes, None)
    assert plan == tuning.plan(*batch.plan_sizes)
    for hook, _ in hooks.values():
        hook.out.zero_()
    tune.plan_launch(batch, plan)()
    for name, (hook, want) in hooks.items():
        error = (hook.out.float() - want).abs().max() / want.abs().max()
        assert error < 2 * 2.0**-10, (name, plan, float(error))


@pytest.mark.slow  # about 5 s: two worker processes started
def test_a_failed_compile_warm_up_is_said_and_the_tuning_goes_on_cold(capsys):
    """Here a worker exits (the warm-up needs a CUDA GPU): the pool neither hangs nor raises."""
    from benchmarks import tune_lora_moe as tune

    tune.warm_all([("qwen3-30b-tp1", "mixed", 8)], workers=2, timeout_s=120)
    out = capsys.readouterr().out
    assert "warm-up stopped" in out and "needs a CUDA GPU" in out and "the tuning compiles the rest" in out, out


def test_a_block_fp8_table_of_a_shape_128_does_not_divide_is_refused_before_any_gpu_work(tmp_path):
    """Qwen3-30B-A3B tp4 (intermediate 192): block fp8 is refused with what to run instead; with bf16 experts
    the same table passes that check and stops only here, where there is no GPU."""
    from benchmarks import lora_moe_h200, lora_moe_kernels

    for script in (lora_moe_kernels, lora_moe_h200):
        with pytest.raises(SystemExit) as refused:
            script.main(["--shapes", "qwen3-30b-tp1", "qwen3-30b-tp4", "--out", str(tmp_path / "refused")])
        assert str(refused.value) == ("qwen3-30b-tp4: block fp8 needs widths in multiples of 128 (its intermediate "
                                      "192); run it with --base bf16")
    with pytest.raises(SystemExit) as no_gpu:
        lora_moe_kernels.main(["--shapes", "qwen3-30b-tp4", "--base", "bf16", "--out", str(tmp_path / "bf16")])
    assert "needs a CUDA GPU" in str(no_gpu.value)
    assert not (tmp_path / "refused").exists()  # refused before its results folder was made


@pytest.mark.slow  # about 7 s on CPU: the checkpoint written, transformers' model loaded, 9 greedy generations
def test_the_reference_scores_its_own_tokens_right_and_another_adapters_wrong(tmp_path):
    model, lora = tmp_path / "model", tmp_path / "lora"
    made = subprocess.run([sys.executable, "-m", "benchmarks.fast_lora.make_model", str(model), str(lora),
                           "--layers", "2", "--tiny"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    ref = Reference(str(model), str(lora), "cpu")
    prompts = [[219, 101, 197, 230, 110, 13, 69, 250], [133, 127, 106, 238, 203, 215, 80, 250],
               [125, 94, 152, 231, 235, 58, 132, 38]]
    requests = []
    for adapter in (None, "a1", "a4"):
        ref.use(adapter)
        for prompt in prompts:
            out = ref.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=16, do_sample=False, pad_token_id=0)
            requests.append({"prompt": prompt, "adapter": adapter, "output": out[0, len(prompt):].tolist()})
    assert all(len(r["output"]) == 16 for r in requests)
    swap = {None: None, "a1": "a4", "a4": "a1"}
    self_path, swapped_path = tmp_path / "self.json", tmp_path / "swapped.json"
    self_path.write_text(json.dumps({"name": "self", "requests": requests}))
    swapped_path.write_text(json.dumps({"name": "swapped", "requests": [
        {**r, "adapter": swap[r["adapter"]]} for r in requests]}))

    text = verdict(ref, load_runs([str(self_path), str(swapped_path)]))
    assert "VERDICT self: 9/9 right" in text
    right, total = map(int, re.search(r"VERDICT swapped: (\d+)/(\d+) right", text).groups())
    assert total == 9 and right < 9
    for r in requests:
        ref.use(r["adapter"])
        assert ref.score(r["prompt"], r["output"])["bad"] == 0
    # Calibrated on a run (here its own: no bad position, so none allowed), with the rotated control beside it.
    scores: dict = {}
    text = verdict(ref, load_runs([str(self_path)]), calibrate="self", with_rotated=True, scores=scores)
    assert "worst request (0.000)" in text and "VERDICT self: 9/9 right" in text
    right, total = map(int, re.search(r"VERDICT self rotated: (\d+)/(\d+) right", text).groups())
    assert total == 9 and 3 <= right < 9  # the base requests stay right, the adapters' are scored as another's
    assert sorted(scores) == ["self", "self rotated"] and scores["self"]["a1"] == [0, 0, 0]

    # Teacher-forced: the reference's own top 5 at every position is no error; another adapter's is.
    forced = []
    for adapter in (None, "a1", "a4"):
        ref.use(adapter)
        for prompt in prompts:
            with torch.no_grad():
                logprobs = torch.log_softmax(ref.model(torch.tensor([prompt])).logits[0].float(), dim=-1)
            values, tokens = logprobs.topk(5, dim=-1)
            forced.append({"prompt": prompt, "adapter": adapter,
                           "top": [[[v, t] for v, t in zip(vs, ts)] for vs, ts in zip(values.tolist(), tokens.tolist())]})
    # A greedy request's own top 5 at its output positions likewise.
    r = forced[4]  # a1's second prompt
    prompt, output = r["prompt"][:3], r["prompt"][3:]
    ref.use("a1")
    assert ref.score(prompt, output, r["top"][2:-1])["error"] < 1e-5
    ref.use("a4")
    assert ref.score(prompt, output, r["top"][2:-1])["error"] > 0.01
    for r in forced:
        ref.use(r["adapter"])
        own = ref.forced_error(r["prompt"], r["top"])
        assert own["error"] < 1e-5 and own["agree"] == 1.0
        ref.use(swap[r["adapter"]])
        if r["adapter"] is not None:
            assert ref.forced_error(r["prompt"], r["top"])["error"] > 100 * max(own["error"], 1e-6)
    scores = {}
    text = forced_verdict(ref, [("self.json", {"name": "self", "forced": forced})], with_rotated=True, scores=scores)
    rows = {line[:22].strip(): line[22:].split() for line in text.splitlines() if line.startswith("   self")}
    assert sorted(rows) == ["self", "self rotated"]
    assert rows["self"] == ["0.0000", "[0.0000]", "(1.000)"] * 3  # base, a1, a4
    errors = {kind: max(v) for kind, v in scores["self rotated forced"].items()}
    assert errors["base"] < 1e-5 and min(errors["a1"], errors["a4"]) > 0.01

    # The command: greedy and teacher-forced runs given together, each scored its own way.
    forced_path = tmp_path / "forced-self.json"
    forced_path.write_text(json.dumps({"name": "self", "forced": forced}))
    out = tmp_path / "verdict.txt"
    assert reference_main([str(model), str(lora), str(self_path), str(forced_path), "--device", "cpu", "--out", str(out)]) == 0
    text = out.read_text()
    assert "VERDICT self: 9/9 right" in text and "Teacher-forced prefills" in text and "self rotated" not in text


def test_the_fp8_checkpoint_is_sglangs_block_fp8_and_its_reference_the_exact_dequantized_weights(tmp_path):
    """``make_model --fp8``: the checkpoint of the fp8 server campaign (``FP8=1 benchmarks/fast_lora/run.sh``)
    holds every projection as e4m3 with one power-of-two ``weight_scale_inv`` a 128 x 128 block, under a
    ``quantization_config`` SGLang's own ``Fp8Config`` reads as block fp8; the reference checkpoint holds the
    same weights dequantized, bit for bit in bf16, and every other tensor as the fp8 one does."""
    from safetensors.torch import load_file
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    model, lora, ref = tmp_path / "model", tmp_path / "lora", tmp_path / "ref"
    made = subprocess.run([sys.executable, "-m", "benchmarks.fast_lora.make_model", str(model), str(lora),
                           "--layers", "1", "--tiny", "--ranks", "8", "16", "16", "16", "--fp8", str(ref)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    config = json.loads((model / "config.json").read_text())
    assert "quantization_config" not in json.loads((ref / "config.json").read_text())
    fp8 = Fp8Config.from_config(config["quantization_config"])
    assert fp8.is_checkpoint_fp8_serialized and fp8.weight_block_size == [128, 128]
    served, reference = load_file(str(model / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    projections = [name for name in reference if name.endswith("_proj.weight")]
    assert len(projections) == 4 + 3 * config["num_experts"]
    for name in projections:
        q, scale = served[name], served[name.removesuffix("weight") + "weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (-(-q.shape[0] // 128), -(-q.shape[1] // 128))
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
        full = scale.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
        assert torch.equal(q.float() * full, reference[name].float())  # exact in bf16
    assert {n for n in served if not n.endswith(("_proj.weight", "weight_scale_inv"))} == set(reference) - set(projections)
    for name in set(reference) - set(projections):
        assert torch.equal(served[name], reference[name]), name
    assert json.loads((lora / "a4" / "adapter_config.json").read_text())["r"] == 16


def test_the_launch_key_timing_runs_both_keys_on_a_real_expand_s_arguments(capsys):
    from benchmarks import launch_key_time
    from sglang_lora_tma_guard import lora_moe

    assert launch_key_time.main(["--repeats", "1", "--number", "10"]) == 0
    out = capsys.readouterr().out
    kernel = inspect.signature(lora_moe._expand_kernel.fn).parameters.values()  # jitted or interpreted: its Python
    arguments = sum("constexpr" not in str(p.annotation) for p in kernel)  # what a launch passes
    assert f"{arguments} positional arguments" in out and "per argument:" in out and "inline (the launcher's):" in out


def test_fused_down_everywhere_narrow_places_one_column_tile_a_program_at_every_k_and_puts_the_tables_back(monkeypatch):
    """``FUSED_DOWN=everywhere-narrow`` (the benchmarks' switch): inside, the fused launch's tile at any K and rank is
    SGLang's, one column tile a program; after it, the package's tables as they were; an unknown value is refused."""
    from benchmarks._lora_setup import fused_down
    from harness.ptx import HOPPER_SHARED_BYTES
    from sglang_lora_tma_guard import fused_lora, moe_gemm

    config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4,
              "num_stages": 3}
    cases = [(k, rank) for k in (256, 384, 768) for rank in (16, 64)]
    placed = {case: fused_lora.wide_tile(config, 128, *case, 1, HOPPER_SHARED_BYTES) for case in cases}
    assert all(placed[k, rank][1] for k in (256, 384) for rank in (16, 64))  # wide there, as the package places
    monkeypatch.setenv("FUSED_DOWN", "everywhere-narrow")
    with fused_down(True):
        assert fused_lora._everywhere
        for case in cases:
            assert fused_lora.wide_tile(config, 128, *case, 1, HOPPER_SHARED_BYTES) == (moe_gemm.tile(config, 64, 128), 0), case
    assert not fused_lora._everywhere
    assert {case: fused_lora.wide_tile(config, 128, *case, 1, HOPPER_SHARED_BYTES) for case in cases} == placed
    monkeypatch.setenv("FUSED_DOWN", "narrow")
    with pytest.raises(SystemExit, match="everywhere-narrow"), fused_down(True):
        pass


def test_fused_down_takes_its_placement_from_the_caller_before_the_environment(monkeypatch):
    """``launch_check``'s fused rows: every batch (``how="everywhere"``) whatever ``FUSED_DOWN`` says; the gate-up
    delta in the activation with the fused down GEMM unless ``act`` is off; after it, both seams off."""
    from benchmarks._lora_setup import fused_down
    from sglang_lora_tma_guard import fused_act, fused_lora

    monkeypatch.setenv("FUSED_DOWN", "placed")
    with fused_down(True, how="everywhere"):
        assert fused_lora._everywhere and fused_act.placed()
    with fused_down(True, act=False):
        assert not fused_lora._everywhere and not fused_act.placed()
    with fused_down(True):
        assert not fused_lora._everywhere and fused_act.placed()
    assert not fused_lora._everywhere and not fused_act.placed()
    placed_here = fused_lora._placed(1 << 20, 16, 256)
    assert placed_here == 16  # the shipped rows take a rank-16 batch this large at K 256, on any GPU
    monkeypatch.setenv("FUSED_DOWN", "everywhere")
    with fused_down(True, how="nowhere"):  # lora_moe_kernels' fast, act: the activation's, no fused launch anywhere
        assert not fused_lora._everywhere and fused_act.placed() and fused_lora._placed(1 << 20, 16, 256) is None
    assert fused_lora._placed(1 << 20, 16, 256) == placed_here and not fused_act.placed()


def test_wide_change_adds_kernel_switches_to_the_wide_tiles_the_fused_launch_places_while_it_runs(monkeypatch):
    """``WIDE_CHANGE``: the switches given (``{"LORA_AHEAD": 1}``) on every wide tile ``fused_lora.wide_tile`` places
    inside ``fused_down``, none on a narrow one (its kernel takes no such switch), the shipped tables after; an odd
    value is refused by name."""
    from benchmarks._lora_setup import fused_down
    from harness.ptx import HOPPER_SHARED_BYTES
    from sglang_lora_tma_guard import fused_lora

    config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
              "num_stages": 3}
    cases = [(256, 16), (256, 64), (384, 16), (768, 32)]  # K, max rank: wide, wide, wide with a K loop, narrow
    shipped = {case: fused_lora.wide_tile(config, 128, *case, 1, HOPPER_SHARED_BYTES) for case in cases}
    monkeypatch.setenv("WIDE_CHANGE", '{"LORA_AHEAD": 1}')
    with fused_down(True, how="everywhere"):
        changed = {case: fused_lora.wide_tile(config, 128, *case, 1, HOPPER_SHARED_BYTES) for case in cases}
    for case, (tile, n_tiles) in shipped.items():
        assert changed[case] == (({**tile, "LORA_AHEAD": 1} if n_tiles else tile), n_tiles), case
    assert [n for _, n in shipped.values()] == [16, 16, 16, 0]
    assert {case: fused_lora.wide_tile(config, 128, *case, 1, HOPPER_SHARED_BYTES) for case in cases} == shipped
    monkeypatch.setenv("WIDE_CHANGE", "[1]")
    with pytest.raises(SystemExit, match="WIDE_CHANGE"), fused_down(True):
        pass


def test_the_fused_policy_reads_the_whole_call_of_runs_with_the_launch_everywhere(capsys, tmp_path):
    """``fused_policy --whole``: the whole hooked call's fused column against ``fast, act``, only of rows run with
    ``FUSED_DOWN=everywhere``. The kept Qwen3-30B-A3B tp2 tables (an H100) predate ``fast, act``: they are read with
    the hooks' time standing in for it, where the rows say (all 16 0.95-0.96 at 2048 tokens, 0.87 at 4096; ranks up to
    64 0.96-0.97 at 4096, 0.89 at 8192); a row placed as ``=fast`` places it, or without the column, is not read."""
    from benchmarks import fused_policy

    results = REPO / "benchmarks/results/lora_moe/h100-qwen3"
    kept = [row for run in ("tp2-1", "tp2-2") for row in
            json.loads((results / run / "lora_moe_kernels.json").read_text())["rows"]]
    assert all(fused_policy.whole_ms(row) is None for row in kept)  # no fast, act column yet
    rows = [{**row, "ms_fast_act": row["ms_fast"], "fused_down": "everywhere"} for row in kept]
    assert fused_policy.policy(rows, margin=0.05, whole=True)[0] == {384: ((16, 32768), (64, 65536))}
    assert fused_policy.policy(rows, margin=0.02, whole=True)[0] == {384: ((16, 16384), (64, 32768))}
    placed = [{**row, "fused_down": "placed"} for row in rows]
    assert fused_policy.policy(placed, margin=0.02, whole=True) == ({}, [])
    assert fused_policy.policy(rows, margin=0.05)[0] == {}  # no down-side parts at the placed tile in these tables
    (tmp_path / "k.json").write_text(json.dumps({"rows": rows}))
    assert fused_policy.main(["--whole", "--margin", "0.02", str(tmp_path / "k.json")]) == 0
    out = capsys.readouterr().out
    assert "| whole call, fused (ms) | fast, act (ms) |" in out and "{384: ((16, 16384), (64, 32768))}" in out


def test_the_kernels_table_puts_the_call_without_a_fused_launch_beside_the_fused_one():
    """``lora_moe_kernels``' placement table: the hooks, the hooks with the gate-up expand in the activation
    (``fast, act``: how ``=fast`` runs a batch it places no fused launch for), the fused and split calls side by side;
    a kept run from before ``fast, act`` renders with a dash there."""
    from benchmarks import lora_moe_kernels

    kept = json.loads((REPO / "benchmarks/results/lora_moe/h100-qwen3/tp2-1/lora_moe_kernels.json").read_text())
    row = kept["rows"][0]
    assert "ms_fast_act" not in row and row["split_rank"] == 32
    old = lora_moe_kernels.split_table([row])[-1].splitlines()[-1]
    assert old.startswith(f"| qwen3-30b-tp2 | mixed | 2048 | 32 | {row['ms_fast']:.3f} | – | {row['ms_fused']:.3f} |")
    new = lora_moe_kernels.split_table([{**row, "ms_fast_act": 0.4615}])[-1].splitlines()[-1]
    assert f"| {row['ms_fast']:.3f} | 0.462 | {row['ms_fused']:.3f} | {row['ms_fused_split']:.3f} |" in new
    without_split = {k: v for k, v in row.items() if not k.startswith(("split", "ms_fused_split", "fused_split"))}
    assert "| mixed | 2048 | – | " in lora_moe_kernels.split_table([{**without_split, "ms_fast_act": 0.4615}])[-1]
    assert lora_moe_kernels.split_table([without_split]) == []


def test_the_gemm_tables_show_every_part_timed_in_a_kept_run():
    """``gate_up_gemm`` and ``down_gemm`` write one table of parts (``_lora_setup.parts_table``): every part a row of
    the kept H100 run has, one column a batch, its errors after it."""
    from benchmarks import down_gemm, gate_up_gemm

    kept = json.loads((REPO / "benchmarks/results/lora_moe/gate-up-shrink/gate_up_gemm.json").read_text())
    text = gate_up_gemm.markdown(kept["rows"], kept["meta"])
    assert "| part | qwen3-30b-tp1 mixed 4096 | qwen3-30b-tp1 mixed 32768 |" in text
    for part in ("sglang", "shrink", "own + shrink, ordered", "fast", "fused ordered"):
        assert f"| {part} | {kept['rows'][0]['ms ' + part]:.4f} |" in text
    assert "mixed 4096: 0.0e+00, 0.0e+00" in text  # ranks and output errors
    row = {"shape": "s", "ranks": "r16", "tokens": 8, "tile": {}, "use_tma": False, "ms sglang": 1.0,
           "best wide + LoRA": None, "best ordered wide + LoRA": None}
    assert "| sglang | 1.0000 |" in down_gemm.markdown([row], kept["meta"])


def test_the_act_tiles_table_shows_every_variant_of_a_kept_run_and_marks_those_a_run_lacks():
    """``act_tiles.markdown`` over two kept H100 runs: the best-tile table, and a table of every variant (a row each)
    at every batch (a column each), ``–`` where the earlier run had no ``rows only``."""
    from benchmarks import act_tiles

    kept = REPO / "benchmarks/results/lora_moe/act/order"
    late = json.loads((kept / "prefetch/act_tiles.json").read_text())
    early = json.loads((kept / "small/act_tiles.json").read_text())
    text = act_tiles.markdown(early["rows"][:1] + late["rows"][:1], late["meta"])
    first, second = early["rows"][0], late["rows"][0]
    assert "| variant | qwen3-30b-tp1 mixed 2048 | qwen3-30b-tp1 mixed 8192 |" in text
    assert f"| rows only | – | {second['ms']['rows only']:.3f} |" in text
    assert f"| N64x1 w4 s2 B | {first['ms']['N64x1 w4 s2 B']:.3f} | {second['ms']['N64x1 w4 s2 B']:.3f} |" in text
    assert f"| qwen3-30b-tp1 | mixed | 2048 | {first['ms']['silu']:.3f} | – |" in text


@pytest.mark.parametrize(("site", "read", "expected"), [
    ("hookact_site", "fused_act.BY_FAST", "False"),
    ("onestream_site", "lora_path.OVERLAP", "False"),
    (None, "fused_act.BY_FAST, lora_path.OVERLAP", "True True"),
])
def test_a_campaign_site_folder_switches_its_seam_off_in_every_server_process(site, read, expected):
    """``run.sh``'s A/B servers ("hookact", "onestream"): a process that finds the folder on its path starts with that
    one seam of ``=fast`` off (Python imports its ``sitecustomize`` at start-up); without it both stay on."""
    path = [str(REPO / "benchmarks" / "fast_lora" / site)] if site else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO)])}
    out = subprocess.run([sys.executable, "-c", f"from sglang_lora_tma_guard import fused_act, lora_path; print({read})"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected, out.stderr


def test_two_servers_forced_errors_are_compared_prompt_by_prompt(tmp_path, capsys):
    """The prompts' own spread cancels in the difference: a path a constant 0.01 nats further from the reference
    on every prompt is 0.01 ± 0 off, however far the prompts lie apart; a noisy one is off by its mean, with the
    standard error of the differences."""
    from benchmarks.serving.paired import main as paired_main
    from benchmarks.serving.paired import paired

    prompts = [0.7, 1.5, 0.9, 1.2]
    noise = [0.03, -0.01, 0.02, -0.04]
    scores = {"default forced": {"base": prompts, "a1": prompts},
              "fast forced": {"base": prompts, "a1": [p + 0.01 for p in prompts]},
              "fused forced": {"base": prompts, "a1": [p + e for p, e in zip(prompts, noise)]}}
    mean, se, n = paired(scores, "fast", "default")["a1"]
    assert n == 4 and mean == pytest.approx(0.01) and se == pytest.approx(0.0, abs=1e-12)
    mean, se, _ = paired(scores, "fused", "default")["a1"]
    assert mean == pytest.approx(0.0) and se == pytest.approx(0.0158114, rel=1e-5)  # stdev 0.0316 / 2
    assert paired(scores, "fast", "default")["base"][:2] == (0.0, 0.0)
    with pytest.raises(ValueError, match="a1: 3 prompts in fast, 4 in default"):
        paired({**scores, "fast forced": {"a1": prompts[:3]}}, "fast", "default")
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(scores))
    assert paired_main([str(path), "fast", "default", "fused", "default"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "fast - default (nats, prompt by prompt, 4 prompts a kind): base +0.0000 ± 0.0000, a1 +0.0100 ± 0.0000"
    assert lines[1].startswith("fused - default") and lines[1].endswith("a1 +0.0000 ± 0.0158")


def test_a_batch_that_cannot_launch_is_named_and_the_next_one_runs(tmp_path, monkeypatch, capsys):
    """A kernel Triton refuses at its launch (a tile over a Hopper program's shared memory) stopped a whole kernel
    table on an H100 at its fifth batch, the rows after it never measured: now that batch is named, under the table
    and in the json, and the rest run; the exit status says one failed."""
    from types import SimpleNamespace

    from triton.runtime.errors import OutOfResources

    from benchmarks import _bench, _lora_setup

    monkeypatch.setattr(_bench, "prepare_sglang", lambda: None)
    monkeypatch.setattr(_bench, "run_meta", lambda **extra: {"gpu": "none", **extra})
    monkeypatch.setattr(_lora_setup, "batches", lambda shapes, tokens, rank_sets, base: (
        ("qwen3-30b-tp1", None, ranks, n, None) for ranks in ("r16", "mixed") for n in tokens))

    def measure(capture_mode, name, shape, ranks, tokens, weights):
        if (ranks, tokens) == ("mixed", 2048):
            raise OutOfResources(262144, 232448, "shared memory")
        return {"shape": name, "ranks": ranks, "tokens": tokens, "ms": tokens / 1000}

    def markdown(rows, meta):
        return "\n".join(f"| {r['ranks']} | {r['tokens']} | {r['ms']} |" for r in rows)

    args = SimpleNamespace(shapes=["qwen3-30b-tp1"], tokens=[1024, 2048, 8192], rank_sets=None, base="bf16",
                           out=tmp_path)
    assert _lora_setup.run_batches(args, "table", measure, markdown) == 1
    kept = json.loads((tmp_path / "table.json").read_text())
    assert [(r["ranks"], r["tokens"]) for r in kept["rows"]] == [("r16", 1024), ("r16", 2048), ("r16", 8192),
                                                                 ("mixed", 1024), ("mixed", 8192)]
    assert kept["failed"] == [{"shape": "qwen3-30b-tp1", "ranks": "mixed", "tokens": 2048, "base": "bf16",
                               "error": "OutOfResources: out of resource: shared memory, Required: 262144, "
                                        "Hardware limit: 232448. Reducing block sizes or `num_stages` may help."}]
    text = (tmp_path / "table.md").read_text()
    assert text.splitlines()[-1] == ("Not measured: qwen3-30b-tp1 mixed 2048 tokens (OutOfResources: out of resource: "
                                     "shared memory, Required: 262144, Hardware limit: 232448. Reducing block sizes "
                                     "or `num_stages` may help.)")
    assert "| mixed | 8192 | 8.192 |" in text
    assert "Traceback" in capsys.readouterr().err
    assert _lora_setup.run_batches(SimpleNamespace(**{**vars(args), "tokens": [1024]}), "table", measure, markdown) == 0


def test_tiles_with_writes_the_shipped_tiles_with_a_field_changed_from_a_bucket_on(tmp_path, monkeypatch):
    from benchmarks import tiles_with
    from sglang_lora_tma_guard import tuning

    gpu = "NVIDIA H100 80GB HBM3"  # its own tuned buckets and the H200's (TILES_OF)
    monkeypatch.setattr(tuning, "_gpu", lambda: gpu)
    shipped = copy.deepcopy(tuning._table(None))
    out = tmp_path / "tiles.json"
    assert tiles_with.main([str(out), "gate_up.shrink_block_r=64", "--from-pairs", "16384"]) == 0
    assert tuning._table(None) == shipped  # the cached shipped table is not what it changed
    tuning._plan.cache_clear()
    try:
        for shape, buckets in tuning.tiles_of(shipped, gpu).items():
            sizes = [int(part.split("=")[1]) for part in shape.split()]
            for bucket in buckets:
                plan = tuning._plan(bucket["max_pairs"], sizes[0], sizes[1], sizes[2], 4, sizes[3], str(out))
                changed = bucket["max_pairs"] >= 16384
                assert plan.gate_up.shrink_block_r == (64 if changed else bucket["gate_up"]["shrink_block_r"])
                assert plan.down == tuning._stage(bucket["down"]) and plan.block_m == bucket["block_m"]
    finally:
        tuning._plan.cache_clear()


def test_an_h100s_floors_take_its_own_bandwidth_and_every_other_gpus_the_h200s(monkeypatch):
    from benchmarks import _lora_setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    speeds = {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        speeds[name] = _lora_setup.hbm_bytes_per_s()
    assert speeds == {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.3e12, "NVIDIA H100 PCIe": 4.3e12}


def test_down_gemm_parts_name_rows_by_substring_or_exactly():
    """``down_gemm --parts``: a row whose name holds an entry, or with ``=`` only the row so named (one variant's
    launches, for Nsight Compute, where its A-once twin's name holds its own)."""
    from benchmarks.down_gemm import AHEAD_ROWS, _wants

    row = AHEAD_ROWS + "N_TILES=16, BLOCK_N=64, num_stages=2, LORA_AHEAD=3"
    assert _wants("LORA_AHEAD=3", row) and _wants("LORA_AHEAD=3", row + ", A_ONCE=1")
    assert _wants("=" + row, row) and not _wants("=" + row, row + ", A_ONCE=1")
    assert not _wants("=LORA_AHEAD=3", row)
