"""What the installed SGLang's own MoE layers do with LoRA, with and without the guard: one JSON line.

``python -m harness.layer_probe`` (cwd: the repository, ``PYTHONPATH=<sglang release>:.:tests``,
``TRITON_INTERPRET=1``) builds each case with :mod:`harness.sglang_cpu` (SGLang's ``FusedMoE``, its
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
import os
import traceback

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


CASES = {"inplace": inplace, "gate_up_layout": gate_up_layout, "router_weight_on_input": router_weight_on_input}
SKIP = {"gate_up_layout": minimax_unsupported}
"""Why a case cannot be built on this release (None: it can)."""
DEFECTS = {"inplace": "inplace_race", "gate_up_layout": "gate_up_layout", "router_weight_on_input": "router_weight_on_input"}
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
