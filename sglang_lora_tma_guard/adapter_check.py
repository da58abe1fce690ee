"""``check --adapter PATH``: what the installed SGLang does with one peft adapter folder, and what the guard changes.

The folder (``adapter_config.json`` and its safetensors) is read by SGLang's own ``LoRAConfig`` and
``LoRAAdapter`` on the CPU, as a server reads it (the model's ``config.json`` only where given: the
number of decoder layers is otherwise read from the weights' names). Then the modules SGLang keeps, the
scaling it gives against peft's, the expert layout, and every adapter entry of the catalogue that this
SGLang has asked what it would do wrong with this adapter (:meth:`Defect.diagnose
<sglang_lora_tma_guard.catalogue.Defect.diagnose>`).
"""

from __future__ import annotations

import collections
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from . import defects
from .adapters import EXPERT, is_shared_outer, module_of, names, peft_config
from .catalogue import Remedy


@dataclass(frozen=True)
class AdapterFinding:
    defect: str
    sglang: str
    """What SGLang does with this adapter without the guard."""
    guard: str
    """What the guard does about it."""
    refused: bool
    """The guard refuses the adapter (at load, the server serving the others)."""


@dataclass(frozen=True)
class AdapterReport:
    path: str
    error: str | None = None
    rank: int | None = None
    lora_alpha: float | None = None
    scaling_sglang: float | None = None
    scaling_peft: float | None = None
    layout: str | None = None
    """``per-expert``, ``shared-outer``, or None without expert LoRA."""
    modules: tuple[str, ...] = ()
    """What SGLang keeps, a line per module kind: ``down_proj (experts): 8``."""
    findings: tuple[AdapterFinding, ...] = ()


def load(path: str, model_path: str | None = None):
    """SGLang's own ``LoRAAdapter`` for the folder, its weights normalised by SGLang, on the CPU.

    The tensors are read here and handed to SGLang's ``initialize_weights_from_tensors`` (its path for
    adapters given as tensors): the same processing as a server's, without its model loader, which wants
    a server's published arguments.
    """
    from safetensors.torch import load_file
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    config = LoRAConfig(str(path))
    base = SimpleNamespace(num_hidden_layers=_layers(path, model_path))
    adapter = LoRAAdapter("check", config, base, LoadConfig(), None, base_model=None)
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    adapter.initialize_weights_from_tensors(tensors)
    return adapter


def _layers(path: str, model_path: str | None) -> int:
    if model_path:
        from .exposure import load_config

        settings = load_config(model_path)
        layers = (settings.get("text_config") or {}).get("num_hidden_layers") or settings.get("num_hidden_layers")
        if isinstance(layers, int):
            return layers
    from safetensors import safe_open

    found = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                match = re.search(r"\.layers\.(\d+)\.", key)
                found = max(found, int(match.group(1)) + 1) if match else found
    return found or 1


def modules_kept(adapter) -> tuple[str, ...]:
    kinds = collections.Counter()
    for name in names(adapter):
        if name.endswith("lora_A.weight"):
            kind = module_of(name).rsplit(".", 1)[-1]
            kinds[f"{kind} (experts)" if EXPERT.search(name) or ".experts." in name else kind] += 1
    return tuple(f"{kind}: {count}" for kind, count in sorted(kinds.items()))


def inspect_adapter(path: str, model_path: str | None = None) -> AdapterReport:
    """The report for one folder; a folder SGLang cannot read is an ``error``, never an exception."""
    quiet = logging.getLogger("sglang")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        adapter = load(path, model_path)
    except Exception as exc:
        return AdapterReport(str(path), error=f"SGLang cannot read it: {type(exc).__name__}: {exc}"[:400])
    finally:
        quiet.setLevel(level)
    config = peft_config(adapter)
    from .defects.rslora_scaling import peft_scaling

    layout = {True: "shared-outer", False: "per-expert", None: None}[is_shared_outer(adapter)]
    findings = []
    for defect in defects.DEFECTS:
        if defect.present().present is False:
            continue
        said = defect.diagnose(adapter)
        if said:
            findings.append(AdapterFinding(defect.id, said, defect.does, defect.remedy is Remedy.REFUSE))
    return AdapterReport(str(path), rank=config.get("r"), lora_alpha=config.get("lora_alpha"),
                         scaling_sglang=config["lora_alpha"] / config["r"], scaling_peft=peft_scaling(config),
                         layout=layout, modules=modules_kept(adapter), findings=tuple(findings))


def parts(report: AdapterReport, guard_on: bool) -> list[tuple[str, str]]:
    """The verdict's parts for the adapter: ``fixed`` / ``refused`` with the guard, ``exposed`` without."""
    where = f"adapter {report.path}"
    if report.error:
        return [("unknown", f"{where}: {report.error}")]
    if not report.findings:
        return [("ok", f"{where}: SGLang serves it as peft defines it")]
    state = lambda f: ("refused" if f.refused else "fixed") if guard_on else "exposed"  # noqa: E731
    return [(state(f), f"{where}: {f.sglang}" + (f"; the guard: {f.guard}" if guard_on else "")) for f in report.findings]


def render(report: AdapterReport) -> list[str]:
    lines = ["Adapter", f"  path              {report.path}"]
    if report.error:
        return lines + [f"  error             {report.error}"]
    lines += [f"  rank, alpha       {report.rank}, {report.lora_alpha}",
              f"  scaling           SGLang {report.scaling_sglang:.4g}, peft {report.scaling_peft:.4g}",
              f"  expert layout     {report.layout or 'no expert LoRA'}",
              "  SGLang keeps      " + ("; ".join(report.modules) or "nothing")]
    width = max([17, *(len(f.defect) for f in report.findings)])
    for finding in report.findings:
        lines += [f"  {finding.defect:<{width}} {finding.sglang}", f"  {'':<{width}} -> the guard: {finding.guard}"]
    return lines


def to_json(report: AdapterReport) -> str:
    import dataclasses

    return json.dumps(dataclasses.asdict(report))
