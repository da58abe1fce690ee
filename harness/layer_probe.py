"""What the installed SGLang's own MoE layers do with LoRA, with and without the guard: one JSON line.

``python -m harness.layer_probe`` (cwd: the repository, ``PYTHONPATH=<sglang release>:.``,
``TRITON_INTERPRET=1``; the version matrix runs :func:`probe` after ``scripts/release_probe.py`` in its
interpreter, every patch of the guard taken off first) builds each case with :mod:`harness.sglang_cpu` (SGLang's ``FusedMoE``, its
``init_lora_modules``, its LoRA forward on a CPU) as ``tests/test_defects.py`` does, once unguarded and
once after ``serving.arm()``, and prints the report as one JSON object, the last line of its output. Each
case reports its own failure (``{"error": ...}``), so one that breaks on a release leaves the others to be
read; a refusal by the guard is an answer, not a failure. The numbers are measurements, not verdicts: what
a release should show is the catalogue's business, and ``guard_reads`` says what the guard found in it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import torch  # noqa: E402

OWNERS = [0, 0, 0, 1, 1, -1, -1]  # two adapters, then the base model (as tests/test_defects.py)
ADAPTER_ROWS, BASE_ROWS = slice(0, 5), slice(5, None)
MINIMAX = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0, gate_up_interleaved=False)


def _guard(guarded: bool) -> None:
    """Unguarded takes off every patch an earlier guarded run placed, the defects' own ones too."""
    from sglang_lora_tma_guard import serving

    serving.arm() if guarded else serving.deactivate()


def _wrap(cpu, guarded: bool, topk: int = 2, **options):
    _guard(guarded)
    layer = cpu.moe_layer(4, topk=topk, **options)
    manager = cpu.lora_manager([layer])
    manager.init_lora_modules()
    [module] = cpu.wrapped(manager)
    return layer, module


def _run(cpu, layer, module, topk: int = 2):
    """The wrapped layer's forward on a copy of a batch: (input, the copy after the call, output, reference)."""
    adapters = [cpu.ExpertAdapter.random(4, 64, 32, rank, seed=10 + i) for i, rank in enumerate((8, 4))]
    x = (torch.randn(len(OWNERS), 64, generator=torch.Generator().manual_seed(3)) * 0.5).half()
    routing = cpu.routing(len(OWNERS), 4, topk, seed=4)
    given = x.clone()
    out = cpu.forward(module, given, routing, cpu.lora_info_for(module, adapters, OWNERS))
    return x, given, out, cpu.reference(layer, x, routing, adapters, OWNERS)


def _rows(cpu, out, ref) -> dict:
    return {"adapter_rel_error": round(cpu.relative_error(out[ADAPTER_ROWS], ref[ADAPTER_ROWS]), 4),
            "base_rel_error": round(cpu.relative_error(out[BASE_ROWS], ref[BASE_ROWS]), 4)}


def inplace(cpu, guarded: bool) -> dict:
    layer, module = _wrap(cpu, guarded)
    x, given, out, ref = _run(cpu, layer, module)
    # The base layer's config is the one the wrapper's LoRA runner was given in every release (the
    # wrapper has no moe_runner_config of its own before 0.5.13).
    return {"inplace": module.base_layer.moe_runner_config.inplace,
            "aliases": out.data_ptr() == given.data_ptr(), "input_changed": not torch.equal(given, x),
            "rel_error": round(cpu.relative_error(out, ref), 4)}


def minimax_unsupported() -> str | None:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    missing = [name for name in MINIMAX if name not in inspect.signature(FusedMoE.__init__).parameters]
    return f"this FusedMoE takes no {', '.join(missing)}" if missing else None


def gate_up_layout(cpu, guarded: bool) -> dict:
    # SGLang torch.compiles the alpha-SwiGLU; on a CPU that is a C++ build per shape.
    with torch.compiler.set_stance("force_eager"):
        layer, module = _wrap(cpu, guarded, **MINIMAX)
        _, _, out, ref = _run(cpu, layer, module)
    return {**_rows(cpu, out, ref), "uses_interleaved_gate_up": getattr(module, "_uses_interleaved_gate_up", None)}


def router_weight_on_input(cpu, guarded: bool) -> dict:
    options = dict(topk=1, apply_router_weight_on_input=True)
    layer, module = _wrap(cpu, guarded, **options)  # guarded, the guard should refuse right here
    if guarded:
        return {"refused": False}
    _, _, out, ref = _run(cpu, layer, module, topk=1)
    return _rows(cpu, out, ref)


# --- the adapters SGLang's own LoRA manager, loader and pool get wrong (tests/test_adapters.py) -------------


SIZES = dict(layers=2, experts=4, hidden=64, intermediate=32)
SLOTS = [1, 1, 1, 0, 0]  # pool slot 1 (the adapter), then slot 0 (the base model)


def _guard_adapters(guarded: bool) -> None:
    """As the plugin arms it: both moments and every defect's own patches (the adapter entries' too)."""
    from sglang_lora_tma_guard import serving
    from sglang_lora_tma_guard.settings import read_switch

    serving.activate(read_switch({"SGLANG_LORA_TMA_GUARD": "1"})) if guarded else serving.deactivate()


_scratch_root = None


def _scratch() -> Path:
    """A new folder for one case's adapters, under one temporary folder that lives as long as the process."""
    global _scratch_root
    if _scratch_root is None:
        _scratch_root = tempfile.TemporaryDirectory(prefix="layer-probe-")
    return Path(tempfile.mkdtemp(dir=_scratch_root.name))


def _raised(exc: BaseException) -> dict:
    """An exception, short: its type, its message's start, and the innermost line of SGLang's it came from."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}sglang{os.sep}" in f.filename]
    at = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    where = at.filename.split(f"{os.sep}sglang{os.sep}", 1)[-1]
    return {"raised": type(exc).__name__, "message": str(exc)[:400], "at": f"{where}:{at.lineno}"}


def _forward_error(cpu, manager, moe, written, scale, rank: int) -> float:
    """Layer 0's forward over slots 0 (base) and 1 (rank ``rank``) as the pool holds them, against the
    reference of the adapter ``written`` at ``scale`` on slot 1's tokens."""
    x = (torch.randn(len(SLOTS), SIZES["hidden"], generator=torch.Generator().manual_seed(3)) * 0.5).half()
    topk = cpu.routing(len(SLOTS), SIZES["experts"], 2, seed=4)
    module = cpu.wrapped(manager)[0]
    out = cpu.forward(module, x.clone(), topk, cpu.pool_lora_info(manager, 0, [0, rank], SLOTS))
    meant = cpu.as_expert_adapter(written, 0, SIZES["experts"], SIZES["hidden"], SIZES["intermediate"], scale)
    ref = cpu.reference(moe[0], x, topk, [meant], [0 if s else -1 for s in SLOTS])
    return round(cpu.relative_error(out, ref), 4)


def _serve(cpu, manager, refs, moe, name, written, scale, rank: int = 8) -> dict:
    """A batch's slot fill (adapter ``name`` into slot 1, the base model into 0) by SGLang's own loader,
    then the forward: its relative error, or where it failed (the fill is where a scheduler dies)."""
    try:
        cpu.fill_slot(manager, 1, name, refs)
        cpu.fill_slot(manager, 0, None, refs)
    except Exception as exc:
        return {"fill": _raised(exc)}
    return {"fill": "ok", "rel_error": _forward_error(cpu, manager, moe, written, scale, rank)}


def _load(manager, name: str, folder) -> tuple:
    """SGLang's dynamic load (``/load_lora_adapter``): (its answer, short; the ref)."""
    from sglang.srt.lora.lora_registry import LoRARef

    ref = LoRARef(lora_name=name, lora_path=str(folder), pinned=False)
    answer = manager.load_lora_adapter(ref)
    message = getattr(answer, "error_message", None) or ""
    return {"success": bool(answer.success), "message": message[:120]}, ref


def _slot_max(manager, slot: int, module: str) -> dict:
    """The largest |value| in one pool slot's buffers of ``module``, every layer, A and B."""
    pool = manager.memory_pool
    return {side: round(max(float(t[slot].abs().max()) for t in buffers[module] if t is not None), 4)
            for side, buffers in (("A", pool.A_buffer), ("B", pool.B_buffer))}


def stale_expert_slot(cpu, guarded: bool) -> dict:
    """X (gate/up/down) into slot 1 by SGLang's loader, then Z (gate/up, no down_proj) into the same slot."""
    _guard_adapters(guarded)
    tmp = _scratch()
    cpu.write_adapter(Path(tmp, "x"), rank=8, **SIZES)
    z = cpu.write_adapter(Path(tmp, "z"), rank=4, projections=("gate_proj", "up_proj"), seed=7, **SIZES)
    manager, refs, moe = cpu.real_manager({"x": Path(tmp, "x"), "z": Path(tmp, "z")})
    cpu.fill_slot(manager, 0, None, refs)
    cpu.fill_slot(manager, 1, "x", refs)
    x_down = _slot_max(manager, 1, "down_proj_moe")
    cpu.fill_slot(manager, 1, "z", refs)
    return {"down_after_x": x_down, "down_after_z": _slot_max(manager, 1, "down_proj_moe"),
            "z_rel_error": _forward_error(cpu, manager, moe, z, 2.0, 4)}


def _tail_max(manager, slot: int, rank: int) -> dict:
    """The largest |value| past ``rank`` in one pool slot's MoE B buffers (their last axis holds the ranks), every
    layer: what a B tile loaded in runs of ranks (``moe_gemm``'s rank granule) reads beside the adapter's own."""
    pool = manager.memory_pool
    return {module: round(max(float(t[slot][..., rank:].abs().max()) for t in pool.B_buffer[module] if t is not None), 4)
            for module in ("gate_up_proj_moe", "down_proj_moe")}


def rank_tails(cpu, guarded: bool) -> dict:
    """X (rank 8, every projection) into slot 1 by SGLang's loader, then W (rank 4) into the same slot: slot 1's MoE
    B buffers past rank 4 after each. The fused down GEMM's B tiles used as loaded (``RANKS_IN_GRANULES``, not
    placed) would read them for a rank that is no multiple of 8; zero after W is the promise they would need."""
    _guard_adapters(guarded)
    tmp = _scratch()
    cpu.write_adapter(Path(tmp, "x"), rank=8, **SIZES)
    cpu.write_adapter(Path(tmp, "w"), rank=4, seed=5, **SIZES)
    manager, refs, _ = cpu.real_manager({"x": Path(tmp, "x"), "w": Path(tmp, "w")})
    cpu.fill_slot(manager, 0, None, refs)
    cpu.fill_slot(manager, 1, "x", refs)
    after_x = _tail_max(manager, 1, 4)
    cpu.fill_slot(manager, 1, "w", refs)
    return {"after_x": after_x, "after_w": _tail_max(manager, 1, 4)}


def rslora_scaling(cpu, guarded: bool) -> dict:
    _guard_adapters(guarded)
    tmp = _scratch()
    written = cpu.write_adapter(Path(tmp, "rs"), rank=8, alpha=16, use_rslora=True, **SIZES)
    manager, refs, moe = cpu.real_manager({"rs": Path(tmp, "rs")})
    peft = 16 / math.sqrt(8)
    return {"sglang_scaling": round(manager.loras[refs["rs"].lora_id].scaling, 4), "peft_scaling": round(peft, 4),
            **_serve(cpu, manager, refs, moe, "rs", written, peft)}


def lora_patterns(cpu, guarded: bool) -> dict:
    """rank_pattern: the down projections rank 4 (r 8); alpha_pattern: their alpha 32 (the adapter's 16).
    And a rank_pattern above r (down_proj rank 16), on a pool of rank 16."""
    _guard_adapters(guarded)
    report = {}
    tmp = _scratch()
    written = cpu.write_adapter(Path(tmp, "p"), rank=8, alpha=16, ranks={"down_proj": 4},
                                rank_pattern={"down_proj": 4}, alpha_pattern={"down_proj": 32}, **SIZES)
    manager, refs, moe = cpu.real_manager({"p": Path(tmp, "p")})
    report["patterns"] = _serve(cpu, manager, refs, moe, "p", written,
                                {"gate_proj": 2.0, "up_proj": 2.0, "down_proj": 32 / 4})
    big = cpu.write_adapter(Path(tmp, "big"), rank=8, ranks={"down_proj": 16}, rank_pattern={"down_proj": 16},
                            **SIZES)
    try:
        manager, refs, moe = cpu.real_manager({"big": Path(tmp, "big")}, rank=16)
    except Exception as exc:
        report["rank_above_r"] = {"start": _raised(exc)}
    else:
        report["rank_above_r"] = {"start": "ok", **_serve(cpu, manager, refs, moe, "big", big, 2.0)}
    return report


def up_proj_only_experts(cpu, guarded: bool) -> dict:
    _guard_adapters(guarded)
    tmp = _scratch()
    written = cpu.write_adapter(Path(tmp, "up"), rank=8, projections=("up_proj", "down_proj"), **SIZES)
    manager, refs, moe = cpu.real_manager({"up": Path(tmp, "up")})
    return _serve(cpu, manager, refs, moe, "up", written, 2.0)


def peft_target_parameters(cpu, guarded: bool) -> dict:
    """A PEFT >= 0.18 adapter (``experts.base_layer`` keys, ``target_parameters``) loaded at runtime next to
    a served one; where SGLang accepts it, its first batch's slot fill."""
    from safetensors.torch import load_file, save_file

    _guard_adapters(guarded)
    tmp = _scratch()
    written = cpu.write_adapter(Path(tmp, "ok"), rank=8, **SIZES)
    fused = Path(tmp, "fused")
    cpu.write_adapter(fused, rank=8, target_parameters=["mlp.experts.gate_up_proj"], **SIZES)
    tensors = load_file(str(fused / "adapter_model.safetensors"))
    save_file({name.replace(".experts.0.gate_proj.", ".experts.base_layer."): t for name, t in tensors.items()
               if ".experts.0.gate_proj." in name}, str(fused / "adapter_model.safetensors"))
    manager, refs, moe = cpu.real_manager({"ok": Path(tmp, "ok")})
    load, ref = _load(manager, "fused", fused)
    report = {"load": load, "adapters_loaded": len(manager.loras)}
    if load["success"]:
        refs["fused"] = ref
        try:
            cpu.fill_slot(manager, 1, "fused", refs)
            report["first_batch"] = "ok"
        except Exception as exc:
            report["first_batch"] = _raised(exc)
    report["others"] = _serve(cpu, manager, refs, moe, "ok", written, 2.0)
    return report


def one_sided_expert_targets(cpu, guarded: bool) -> dict:
    """Expert LoRA on down_proj alone, the server's targets inferred from it (no --lora-target-modules)."""
    _guard_adapters(guarded)
    tmp = _scratch()
    written = cpu.write_adapter(Path(tmp, "down"), rank=8, projections=("down_proj",), **SIZES)
    manager, refs, moe = cpu.real_manager({"down": Path(tmp, "down")}, targets=None)
    wrapped = [type(m).__name__ for m in cpu.wrapped(manager)]
    report = {"targets": sorted(manager.target_modules), "wrapped": wrapped,
              "adapter_loaded": refs["down"].lora_id in manager.loras}
    if wrapped:
        report.update(_serve(cpu, manager, refs, moe, "down", written, 2.0))
    return report


def _experts_with_lora(manager, slot: int) -> list:
    """Per expert of layer 0, whether slot ``slot`` holds any gate-up A of it (per-expert pool)."""
    a = manager.memory_pool.A_buffer["gate_up_proj_moe"][0][slot]
    return [bool(a[e].abs().max() > 0) for e in range(a.shape[0])]


def shared_outer_at_runtime(cpu, guarded: bool) -> dict:
    """A shared-outer adapter loaded at runtime into the per-expert pool a per-expert adapter started; and
    ``reverse``: a per-expert adapter into the shared-outer pool a shared-outer adapter started (``own``: that
    adapter's own served error, the pool read right)."""
    _guard_adapters(guarded)
    tmp = _scratch()
    per = cpu.write_adapter(Path(tmp, "per"), rank=8, **SIZES)
    shared = cpu.write_adapter(Path(tmp, "shared"), rank=8, shared_outer=True, seed=5, **SIZES)
    manager, refs, moe = cpu.real_manager({"per": Path(tmp, "per")})
    load, ref = _load(manager, "shared", Path(tmp, "shared"))
    report = {"pool_shared_outer": bool(getattr(manager, "experts_shared_outer_loras", False)), "load": load}
    if load["success"]:
        refs["shared"] = ref
        report.update(_serve(cpu, manager, refs, moe, "shared", shared, 2.0))
        if report["fill"] == "ok":
            report["experts_with_lora"] = _experts_with_lora(manager, 1)
    manager, refs, moe = cpu.real_manager({"shared": Path(tmp, "shared")})
    reverse = {"pool_shared_outer": bool(getattr(manager, "experts_shared_outer_loras", False)),
               "own": _serve(cpu, manager, refs, moe, "shared", shared, 2.0)}
    reverse["load"], ref = _load(manager, "per", Path(tmp, "per"))
    if reverse["load"]["success"]:
        refs["per"] = ref
        reverse.update(_serve(cpu, manager, refs, moe, "per", per, 2.0))
    report["reverse"] = reverse
    return report


def mixtral_target_names(cpu, guarded: bool) -> dict:
    """An adapter on w1 / w3 / w2 (Mixtral's names), the server's targets inferred from it."""
    _guard_adapters(guarded)
    tmp = _scratch()
    written = cpu.write_adapter(Path(tmp, "mix"), rank=8, names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                                **SIZES)
    try:
        manager, refs, moe = cpu.real_manager({"mix": Path(tmp, "mix")}, targets=None)
    except Exception as exc:
        return {"start": _raised(exc)}
    return {"start": "ok", "targets": sorted(manager.target_modules),
            "wrapped": len(cpu.wrapped(manager)), **_serve(cpu, manager, refs, moe, "mix", written, 2.0)}


CASES = {"inplace": inplace, "gate_up_layout": gate_up_layout, "router_weight_on_input": router_weight_on_input,
         "stale_expert_slot": stale_expert_slot, "rslora_scaling": rslora_scaling, "lora_patterns": lora_patterns,
         "up_proj_only_experts": up_proj_only_experts, "peft_target_parameters": peft_target_parameters,
         "one_sided_expert_targets": one_sided_expert_targets, "shared_outer_at_runtime": shared_outer_at_runtime,
         "mixtral_target_names": mixtral_target_names, "rank_tails": rank_tails}
SKIP = {"gate_up_layout": minimax_unsupported}
"""Why a case cannot be built on this release (None: it can)."""
DEFECTS = {"inplace": "inplace_race", "gate_up_layout": "gate_up_layout", "router_weight_on_input": "router_weight_on_input",
           "stale_expert_slot": "stale_expert_slot", "rslora_scaling": "rslora_scaling", "lora_patterns": "lora_patterns",
           "up_proj_only_experts": "up_proj_only_experts", "peft_target_parameters": "peft_target_parameters",
           "one_sided_expert_targets": "one_sided_expert_targets", "shared_outer_at_runtime": "shared_outer_runtime",
           "mixtral_target_names": "mixtral_target_names", "rank_tails": "stale_expert_slot"}
"""The guard's defect module of each case: what it reads in this release's code is reported with the case."""


def _safely(case, cpu, guarded: bool) -> dict:
    """A refusal is an answer (with every reason the guard gave); any other exception is the case's error."""
    from sglang_lora_tma_guard.catalogue import RefusedDeployment

    try:
        return case(cpu, guarded)
    except RefusedDeployment as refused:
        text = str(refused)  # one reason after the head, or a list of them
        reasons = text.split("\n  - ")[1:] or [text.split("wrong: ", 1)[-1]]
        return {"refused": True, "message": text[:120], "reasons": [reason[:100] for reason in reasons]}
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return {"error": f"{type(exc).__name__}: {exc}"[:400], "at": f"{frame.filename}:{frame.lineno}"}


def _guard_reads(module: str) -> list:
    """Whether the guard finds the defect in this release's code, and its evidence."""
    try:
        found = importlib.import_module(f"sglang_lora_tma_guard.defects.{module}").DEFECT.present()
        return [found.present, found.evidence]
    except Exception as exc:
        return [None, f"{type(exc).__name__}: {exc}"[:200]]


def probe() -> dict:
    import sglang

    from harness import sglang_cpu
    from sglang_lora_tma_guard import serving  # noqa: F401  (loads the catalogue before one defect is imported)

    report = {"sglang": getattr(sglang, "__version__", "?"), "from": os.path.dirname(sglang.__file__)}
    try:
        # The scheduler's arguments as a guarded launcher hands them over: --lora-backend triton (0.5.11's
        # csgmv default is what the launcher switches; the layer cases are the same on either backend).
        sglang_cpu.scheduler(lora_backend="triton")
    except Exception as exc:
        return {**report, "error": f"scheduler: {type(exc).__name__}: {exc}"[:400]}
    for name, case in CASES.items():
        skipped = SKIP[name]() if name in SKIP else None
        sides = {"skipped": skipped} if skipped else {
            "unguarded": _safely(case, sglang_cpu, False), "guarded": _safely(case, sglang_cpu, True)}
        report[name] = {**sides, "guard_reads": _guard_reads(DEFECTS[name])}
    _guard(False)
    return report


def main() -> None:
    print(json.dumps(probe()))


if __name__ == "__main__":
    main()
