"""Am I affected, and am I protected? Every defect of LoRA on MoE in the catalogue, for this SGLang.

    python -m sglang_lora_tma_guard.check [--json] [--selftest [--selftest-device cpu|cuda]]
        [--model-path DIR --tp N [--ep N] [--device-name 'NVIDIA H200']] [--adapter DIR] [-- SERVER FLAGS...]

Everything after ``--`` is the server's own command line (``--tp 8 --enable-lora --enable-dp-attention
--dp 2 ...``), read by the installed SGLang's own argument parser: with it (and ``--model-path``) the
Defects section says, for that deployment, which defect it meets and what the guard does there.

Reads the installed SGLang's ``_fused_moe_kernel_sequence`` (its signature and code), this
package's entry point, ``SGLANG_PLUGINS`` and ``SGLANG_LORA_TMA_GUARD``, and tries the wrapper in
this process. Runs without a GPU.

It also tries the shared-expert fix in this process: SGLang's own ``ServerArgs`` for a LoRA server,
resolved with the guard's seam in place, must come out with shared-experts fusion off. With
``--model-path`` it also predicts, from the model's config.json and the installed SGLang's own config
lookup, whether SGLang fuses that model's shared expert and whether the shape the server will really
build takes the TMA down path at all (see ``exposure``). With ``--selftest`` it also runs a tiny
LoRA-hooked block-fp8 MoE through the installed SGLang, TMA requested, without and with the guard (on a
GPU natively, else through Triton's interpreter).

The report is a tree of frozen dataclasses (:class:`Report`), built by :func:`build_report`
(:mod:`.report`), judged by :func:`verdict` (:mod:`.verdict`), printed by :func:`render`
(:mod:`.render`) or, with ``--json``, serialised as it is (``schema_version`` 4: 3 plus the ``defects``
list, one entry per defect of the catalogue, and the ``adapter`` of ``--adapter``); :mod:`.cli` is the
command.

Exit status: 0 not affected or protected; 1 affected and not protected, the guard would refuse this
deployment, or the self-test failed; 2 cannot tell (SGLang missing or not importable, the self-test could
not run, or the answer depends on the model or the flags: give --model-path and the server flags).
"""

from .cli import main
from .render import render
from .report import (
    SCHEMA_VERSION,
    DefectReport,
    Environment,
    FusionFixTrial,
    GuardReport,
    LoRAPathReport,
    Report,
    SwitchReport,
    Target,
    Verdict,
    build_report,
    lora_path_report,
)
from .verdict import EXIT_EXPOSED, EXIT_OK, EXIT_UNKNOWN, verdict

__all__ = [
    "EXIT_EXPOSED", "EXIT_OK", "EXIT_UNKNOWN", "SCHEMA_VERSION", "DefectReport", "Environment", "FusionFixTrial",
    "GuardReport", "LoRAPathReport", "Report", "SwitchReport", "Target", "Verdict", "build_report",
    "lora_path_report", "main", "render", "verdict",
]
