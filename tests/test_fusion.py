"""The shared-expert fix: LoRA servers run with SGLang's shared-experts fusion off, or do not start.

Unit tests of the decisions on stand-in records; then SGLang 0.5.16's own ``ServerArgs`` with the
plugin loaded by ``load_plugins()`` (a fresh interpreter), and SGLang's own
``LoRAManager.init_lora_modules`` wrapping SGLang's own ``FusedMoE`` layers, fused and not.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sglang_lora_tma_guard import serving
from sglang_lora_tma_guard.catalogue import Deployment, RefusedDeployment
from sglang_lora_tma_guard.patching import Engaged

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fix_on(monkeypatch):
    monkeypatch.setattr(serving._switch, "on", True)  # the decisions only; no patches are placed here


@pytest.mark.parametrize("fields, asked", [
    (dict(enable_lora=True), True),
    (dict(enable_lora=None, lora_paths=["a=/x"]), True),
    (dict(enable_lora=None, lora_paths={"a": "/x"}), True),
    (dict(enable_lora=False, lora_paths=["a=/x"]), False),  # SGLang ignores the paths then
    (dict(enable_lora=None, lora_paths=None), False),
    (dict(enable_lora=None, lora_paths=[]), False),
])
def test_lora_is_requested_exactly_as_sglang_decides_it(fields, asked):
    assert Deployment(args=SimpleNamespace(**fields)).lora is asked


def raw_record(**fields):
    base = dict(enable_lora=True, lora_paths=None, disable_shared_experts_fusion=False,
                enforce_shared_experts_fusion=False, enable_waterfill=False, model_path="dummy")
    return SimpleNamespace(**{**base, **fields})


def test_a_lora_server_gets_fusion_off_before_resolution(fix_on, caplog):
    record = raw_record()
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        serving.prepare_launch(record)
    assert record.disable_shared_experts_fusion is True
    [line] = caplog.messages
    assert "shared-experts fusion is turned off" in line


@pytest.mark.parametrize("forced, flag", [("enforce_shared_experts_fusion", "--enforce-shared-experts-fusion"),
                                          ("enable_waterfill", "--enable-waterfill")])
def test_forced_fusion_is_left_with_a_loud_warning(fix_on, caplog, forced, flag):
    record = raw_record(**{forced: True})
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        serving.prepare_launch(record)
    assert record.disable_shared_experts_fusion is False
    [line] = caplog.messages
    assert flag in line and "WILL BE WRONG" in line


def test_nothing_changes_without_lora_when_resolved_or_when_the_fix_is_off(fix_on, caplog, monkeypatch):
    without_lora = raw_record(enable_lora=None)
    resolved = raw_record(_resolution_finished=True)  # a pickled child copy: final
    calls = []
    resolve = serving._make_resolution(lambda record: calls.append(record), Engaged())
    with caplog.at_level(logging.DEBUG, "sglang_lora_tma_guard"):
        serving.prepare_launch(without_lora)
        resolve(resolved)
        monkeypatch.setattr(serving._switch, "on", False)
        off = raw_record()
        resolve(off)
    assert not any(r.disable_shared_experts_fusion for r in (without_lora, resolved, off))
    assert calls == [resolved, off]  # SGLang's own resolution always runs
    assert caplog.messages == []


class Audited(SimpleNamespace):
    """A resolved record of 0.5.16/0.5.17 (``override``) or 0.5.18 (``_late_resolution``)."""

    def record_write(self, source, **fields):
        self.writes.append((source, fields))
        self.__dict__.update(fields)


@pytest.mark.parametrize("writer", ["override", "_late_resolution"])
def test_a_record_resolved_before_the_plugin_is_changed_through_sglangs_audited_write(fix_on, writer):
    record = Audited(**vars(raw_record(_declarations_materialized=True)), writes=[])
    setattr(record, writer, record.record_write)
    serving.prepare_launch(record, late=True)
    assert record.writes == [(serving.SOURCE, {"disable_shared_experts_fusion": True})]
    assert record.disable_shared_experts_fusion is True


def test_a_read_only_resolved_record_is_left_for_the_schedulers_check(fix_on, caplog):
    record = raw_record(_resolution_finished=True)  # 0.5.19+: no audited late write exists
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        serving.prepare_launch(record, late=True)
    assert record.disable_shared_experts_fusion is False
    [line] = caplog.messages
    assert "will refuse to start" in line and "--disable-shared-experts-fusion" in line


def probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LORA_TMA_GUARD", "SGLANG_PLUGINS")}
    if env_value is not None:
        env["SGLANG_LORA_TMA_GUARD"] = env_value
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "release_probe.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.real
@pytest.mark.slow  # a fresh interpreter importing SGLang, and a spawned child
@pytest.mark.parametrize("switch", ["1", "plain"])
def test_sglangs_server_args_for_a_lora_server_reach_the_schedulers_with_fusion_off(switch):
    """SGLang 0.5.16's own ServerArgs, the plugin loaded by load_plugins(), records sent to a spawned child."""
    result = probe(switch)
    assert result["hooked"] == "ServerArgs.__post_init__" and result["fix_active"] is True
    assert result["lora_paths"] is True and result["enable_lora"] is True
    assert result["enable_lora_false_with_paths"] is False and result["no_lora"] is False
    assert result["lora_forced_fusion"] is False  # the user's word
    assert result["resolved_before_plugins"]["child"] is True  # Engine(server_args=...): check_server_args
    assert sum("WILL BE WRONG" in line for line in result["warnings"]) == 1
    assert sum("fusion is turned off" in line for line in result["warnings"]) == 3


@pytest.mark.real
@pytest.mark.slow
def test_without_the_guard_sglang_fuses_for_lora_servers_too():
    """What the fix changes: SGLang 0.5.16 alone leaves fusion on for every LoRA server."""
    result = probe(None)
    assert result["fix_active"] is False and result["warnings"] == []
    assert not any(result[case] for case in ("lora_paths", "enable_lora", "no_lora"))
    assert result["resolved_before_plugins"]["child"] is False


# --- the scheduler's check, on SGLang's own LoRAManager.init_lora_modules ---------------------------


@pytest.fixture
def scheduler_check(fm):
    from harness import sglang_cpu

    sglang_cpu.scheduler()
    serving.arm()
    yield sglang_cpu
    serving.disarm()


def manager_over(sglang_cpu, fused_shared: int):
    """Two of SGLang's FusedMoE layers (16 routed experts, and ``fused_shared`` fused shared ones)."""
    return sglang_cpu.lora_manager([sglang_cpu.moe_layer(16 + fused_shared, topk=2, layer_id=i,
                                                          num_fused_shared_experts=fused_shared) for i in range(2)])


@pytest.mark.real
def test_a_scheduler_refuses_a_lora_wrapped_moe_layer_with_a_fused_shared_expert(scheduler_check):
    manager = manager_over(scheduler_check, fused_shared=1)
    with pytest.raises(RefusedDeployment, match="--disable-shared-experts-fusion") as refused:
        manager.init_lora_modules()
    assert "2 LoRA-wrapped MoE layer(s)" in str(refused.value) and "17 experts" in str(refused.value)
    assert [type(m).__name__ for m in scheduler_check.wrapped(manager)] == ["FusedMoEWithLoRA"] * 2


@pytest.mark.real
def test_a_scheduler_starts_when_the_shared_expert_is_not_fused_or_the_check_is_off(scheduler_check):
    """Started means SGLang wrapped every MoE layer for LoRA and nothing was refused."""
    unfused = manager_over(scheduler_check, fused_shared=0)
    unfused.init_lora_modules()
    serving.disarm()
    fused = manager_over(scheduler_check, fused_shared=1)
    fused.init_lora_modules()  # the original method, unwrapped: SGLang wraps the fused layers as ever
    for manager in (unfused, fused):
        assert [type(m).__name__ for m in scheduler_check.wrapped(manager)] == ["FusedMoEWithLoRA"] * 2


@pytest.mark.real
def test_a_scheduler_with_fusion_forced_by_the_user_warns_instead(scheduler_check, monkeypatch, caplog):
    monkeypatch.setattr(serving, "server_args_here", lambda: raw_record(enforce_shared_experts_fusion=True))
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        manager_over(scheduler_check, fused_shared=1).init_lora_modules()
    assert any("WILL BE WRONG" in line for line in caplog.messages)
