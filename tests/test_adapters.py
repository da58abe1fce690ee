"""Adapters SGLang's loader gets wrong, on SGLang 0.5.16's own LoRA manager, loader and memory pool.

Each test writes a peft adapter folder, lets SGLang's own ``LoRAManager`` (its constructor, its
``--lora-paths`` loading, its ``init_lora_modules``, its pool) take it, fills a pool slot with SGLang's
own ``load_lora_weight_to_buffer``, builds a batch's ``LoRAInfo`` from the pool's buffers and runs the
LoRA-wrapped layer's own forward on the CPU against the float32 reference of the adapter as peft
defines it (``harness.sglang_cpu``): without the guard, then with it (``serving.activate``, as the
plugin arms it). Tolerance as in ``tests/test_defects.py``: right below 5e-3, the defects 0.1 and more.
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_lora_tma_guard import serving
from sglang_lora_tma_guard.settings import read_switch

pytestmark = pytest.mark.real

RIGHT, WRONG = 5e-3, 0.1
LAYERS, EXPERTS, HIDDEN, INTERMEDIATE = 2, 4, 64, 32
SIZES = dict(layers=LAYERS, experts=EXPERTS, hidden=HIDDEN, intermediate=INTERMEDIATE)
TOKENS = [1, 1, 1, 0, 0]  # pool slot 1 (the adapter), then slot 0 (the base model)


@pytest.fixture
def cpu(fm):
    from harness import sglang_cpu

    sglang_cpu.scheduler(lora_backend="triton")
    yield sglang_cpu
    serving.deactivate()


def guard(on: bool) -> None:
    (lambda: serving.activate(read_switch({"SGLANG_LORA_TMA_GUARD": "1"})) if on else serving.deactivate)()


def served_error(cpu, manager, refs, moe, name, written, scale, rank):
    """The adapter in pool slot 1 of SGLang's own pool, its first layer's forward against the reference."""
    cpu.fill_slot(manager, 1, name, refs)
    cpu.fill_slot(manager, 0, None, refs)
    x = (torch.randn(len(TOKENS), HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.5).half()
    topk = cpu.routing(len(TOKENS), EXPERTS, 2, seed=4)
    module = cpu.wrapped(manager)[0]
    out = cpu.forward(module, x.clone(), topk, cpu.pool_lora_info(manager, 0, [0, rank], TOKENS))
    meant = cpu.as_expert_adapter(written, 0, EXPERTS, HIDDEN, INTERMEDIATE, scale)
    return cpu.relative_error(out, cpu.reference(moe[0], x, topk, [meant], [0 if s else -1 for s in TOKENS]))


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_an_rslora_adapter_is_served_at_peft_scale_only_with_the_guard(cpu, tmp_path, guarded):
    from sglang_lora_tma_guard.defects import rslora_scaling

    guard(guarded)
    placed = rslora_scaling.PATCH.status()
    assert guarded or not (placed.installed and not placed.inert), placed  # unguarded: nothing of ours engaged
    written = cpu.write_adapter(tmp_path / "rs", rank=8, alpha=16, use_rslora=True, **SIZES)
    manager, refs, moe = cpu.real_manager({"rs": tmp_path / "rs"})
    peft = 16 / math.sqrt(8)
    assert manager.loras[refs["rs"].lora_id].scaling == (peft if guarded else 2.0)
    error = served_error(cpu, manager, refs, moe, "rs", written, peft, 8)
    assert (error < RIGHT) if guarded else (error > WRONG)


def test_alpha_and_rank_patterns_are_applied_module_by_module(cpu, tmp_path):
    """rank_pattern: the down projections rank 4 (r 8); alpha_pattern: their alpha 32 (adapter's 16)."""
    written = cpu.write_adapter(tmp_path / "p", rank=8, alpha=16, ranks={"down_proj": 4},
                                rank_pattern={"down_proj": 4}, alpha_pattern={"down_proj": 32}, **SIZES)
    guard(False)
    manager, refs, moe = cpu.real_manager({"p": tmp_path / "p"})
    with pytest.raises(AssertionError, match="shape"):  # SGLang alone: the first batch's slot fill fails
        cpu.fill_slot(manager, 1, "p", refs)
    guard(True)
    manager, refs, moe = cpu.real_manager({"p": tmp_path / "p"})
    scale = {"gate_proj": 2.0, "up_proj": 2.0, "down_proj": 32 / 4}
    assert served_error(cpu, manager, refs, moe, "p", written, scale, 8) < RIGHT


def test_a_rank_pattern_above_r_is_refused_at_load_with_the_module_named(cpu, tmp_path):
    cpu.write_adapter(tmp_path / "big", rank=8, ranks={"down_proj": 16}, rank_pattern={"down_proj": 16}, **SIZES)
    guard(True)
    with pytest.raises(RuntimeError, match="rank_pattern gives 'down_proj' rank 16, above the adapter's r=8"):
        cpu.real_manager({"big": tmp_path / "big"}, rank=16)


def test_expert_lora_on_up_proj_alone_is_served_instead_of_crashing(cpu, tmp_path):
    written = cpu.write_adapter(tmp_path / "up", rank=8, projections=("up_proj", "down_proj"), **SIZES)
    guard(False)
    manager, refs, moe = cpu.real_manager({"up": tmp_path / "up"})
    with pytest.raises(ValueError, match="Cannot find target module name for .*experts.0.up_proj"):
        cpu.fill_slot(manager, 1, "up", refs)  # SGLang alone: the first batch's slot fill fails
    guard(True)
    manager, refs, moe = cpu.real_manager({"up": tmp_path / "up"})
    assert served_error(cpu, manager, refs, moe, "up", written, 2.0, 8) < RIGHT


def test_a_target_parameters_adapter_is_refused_and_the_server_keeps_serving(cpu, tmp_path):
    """SGLang's own dynamic load path: the refused adapter gets an error answer, the others serve on."""
    from safetensors.torch import load_file, save_file

    written = cpu.write_adapter(tmp_path / "ok", rank=8, **SIZES)
    cpu.write_adapter(tmp_path / "fused", rank=8, target_parameters=["mlp.experts.gate_up_proj"], **SIZES)
    tensors = load_file(str(tmp_path / "fused" / "adapter_model.safetensors"))
    save_file({name.replace(".experts.0.gate_proj.", ".experts.base_layer."): t for name, t in tensors.items()
               if ".experts.0.gate_proj." in name}, str(tmp_path / "fused" / "adapter_model.safetensors"))
    guard(True)
    manager, refs, moe = cpu.real_manager({"ok": tmp_path / "ok"})
    from sglang.srt.lora.lora_registry import LoRARef

    answer = manager.load_lora_adapter(LoRARef(lora_name="fused", lora_path=str(tmp_path / "fused"), pinned=False))
    assert answer.success is False and "fused expert tensors" in answer.error_message
    assert set(manager.loras) == {refs["ok"].lora_id}
    assert served_error(cpu, manager, refs, moe, "ok", written, 2.0, 8) < RIGHT


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_one_sided_targets_leave_expert_lora_unapplied_without_the_guard(cpu, tmp_path, guarded):
    written = cpu.write_adapter(tmp_path / "down", rank=8, projections=("down_proj",), **SIZES)
    guard(guarded)
    manager, refs, moe = cpu.real_manager({"down": tmp_path / "down"}, targets=None)  # targets from the adapter
    wrapped = [type(m).__name__ for m in cpu.wrapped(manager)]
    if not guarded:
        assert wrapped == [] and "down_proj" in manager.target_modules  # loaded, never applied
        return
    assert wrapped == ["FusedMoEWithLoRA"] * LAYERS and {"gate_up_proj", "down_proj"} <= manager.target_modules
    assert served_error(cpu, manager, refs, moe, "down", written, 2.0, 8) < RIGHT


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_a_shared_outer_adapter_loaded_into_a_per_expert_pool(cpu, tmp_path, guarded):
    from sglang.srt.lora.lora_registry import LoRARef

    cpu.write_adapter(tmp_path / "per", rank=8, **SIZES)
    written = cpu.write_adapter(tmp_path / "shared", rank=8, shared_outer=True, seed=5, **SIZES)
    guard(guarded)
    manager, refs, moe = cpu.real_manager({"per": tmp_path / "per"})
    ref = LoRARef(lora_name="shared", lora_path=str(tmp_path / "shared"), pinned=False)
    answer = manager.load_lora_adapter(ref)
    if guarded:
        assert answer.success is False and "per-expert adapters" in answer.error_message
        return
    assert answer.success
    refs["shared"] = ref
    error = served_error(cpu, manager, refs, moe, "shared", written, 2.0, 8)
    assert error > WRONG  # expert 0 only


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_mixtral_target_names_start_the_server_only_with_the_guard(cpu, tmp_path, guarded):
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    written = cpu.write_adapter(tmp_path / "mix", rank=8, names=names, **SIZES)
    guard(guarded)
    if not guarded:
        with pytest.raises(NotImplementedError, match="get_hidden_dim not implemented for w"):
            cpu.real_manager({"mix": tmp_path / "mix"}, targets=None)  # the server does not start
        return
    manager, refs, moe = cpu.real_manager({"mix": tmp_path / "mix"}, targets=None)
    assert served_error(cpu, manager, refs, moe, "mix", written, 2.0, 8) < RIGHT


# --- check --adapter: SGLang's own loader on the CPU, the catalogue's diagnosis -------------------------


def check(*args, guard_value=None):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LORA_TMA_GUARD", "SGLANG_PLUGINS")}
    if guard_value:
        env["SGLANG_LORA_TMA_GUARD"] = guard_value
    proc = subprocess.run([sys.executable, "-m", "sglang_lora_tma_guard.check", "--json", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_check_adapter_says_what_sglang_does_with_an_rslora_adapter_and_what_the_guard_changes(cpu, tmp_path):
    cpu.write_adapter(tmp_path / "rs", rank=16, alpha=32, use_rslora=True, **SIZES)
    code, report = check("--adapter", str(tmp_path / "rs"))
    found = report["adapter"]
    assert (found["scaling_sglang"], found["scaling_peft"], found["layout"]) == (2.0, 8.0, "per-expert")
    assert [f["defect"] for f in found["findings"]] == ["rslora-scaling"]
    assert code == 1 and "4.00x too weak" in report["verdict"]["message"]
    code, report = check("--adapter", str(tmp_path / "rs"), guard_value="1")
    assert code == 0 and report["verdict"]["status"] == "protected"


@pytest.mark.slow
def test_check_adapter_names_each_crash_and_a_clean_adapter_has_none(cpu, tmp_path):
    cpu.write_adapter(tmp_path / "up", rank=8, projections=("up_proj",), **SIZES)
    cpu.write_adapter(tmp_path / "clean", rank=8, **SIZES)
    _, report = check("--adapter", str(tmp_path / "up"), guard_value="1")
    assert {f["defect"] for f in report["adapter"]["findings"]} == {"up-proj-only-experts", "one-sided-expert-targets"}
    _, report = check("--adapter", str(tmp_path / "clean"), guard_value="1")
    assert report["adapter"]["findings"] == [] and report["adapter"]["modules"] == [
        "down_proj (experts): 8", "gate_up_proj (experts): 8"]
    code, report = check("--adapter", str(tmp_path / "missing"), guard_value="1")
    assert code == 2 and "SGLang cannot read it" in report["adapter"]["error"]
