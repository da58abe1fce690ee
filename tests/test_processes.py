"""Processes started the way SGLang starts its schedulers (spawn) load and apply the guard."""

import multiprocessing

import pytest

import child

pytestmark = pytest.mark.real


def run_children(monkeypatch, env_value, count):
    if env_value is None:
        monkeypatch.delenv("SGLANG_LORA_TMA_GUARD", raising=False)
    else:
        monkeypatch.setenv("SGLANG_LORA_TMA_GUARD", env_value)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=child.scheduler_like, args=(queue,)) for _ in range(count)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return results


def test_spawned_processes_with_the_switch_on_are_guarded(monkeypatch):
    results = run_children(monkeypatch, "1", count=2)
    assert results == [{"installed": True, "identical": True, "rows_wrong": 0}] * 2


def test_spawned_process_with_the_switch_unset_is_not(monkeypatch):
    [result] = run_children(monkeypatch, None, count=1)
    assert result == {"installed": False, "identical": False, "rows_wrong": 4}
