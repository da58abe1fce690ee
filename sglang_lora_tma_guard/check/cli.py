"""``python -m sglang_lora_tma_guard.check``: the command line, and what only the command adds to the report
(the server's flags read by SGLang's own parser, the model's exposure, the adapter, the self-test)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import warnings

from .. import adapter_check, catalogue, exposure, lora_path, selftest
from ..inspection import (
    Strategy,
)
from .render import render
from .report import Report, build_report, defects_report, missing_for_fusion_fix, server_arguments
from .verdict import EXIT_UNKNOWN, verdict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_lora_tma_guard.check", description="Am I affected, and am I protected?"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--selftest", action="store_true",
        help="also run a tiny LoRA-hooked MoE through the installed SGLang, with and without the guard",
    )
    parser.add_argument("--selftest-device", choices=["cpu", "cuda"], default=None,
                        help="where the self-test runs (default: cuda if present, else the CPU interpreter)")
    model = parser.add_argument_group("exposure of one deployment")
    model.add_argument("--model-path", help="a Hugging Face model folder, or its config.json")
    model.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    model.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    model.add_argument("--device-name", help="ask about this GPU (as torch names it, e.g. 'NVIDIA H200') "
                                             "instead of the one here")
    model.add_argument("--no-shared-experts-fusion", action="store_true",
                       help="the server runs with --disable-shared-experts-fusion")
    parser.add_argument("--adapter", help="a peft adapter folder: what this SGLang does with it, and what the guard "
                                          "changes (read on the CPU; --model-path gives the model's layer count)")
    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else None
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    logging.getLogger("sglang").setLevel(logging.ERROR)
    if args.selftest:
        device = selftest.prepare(args.selftest_device)  # before SGLang is imported
    report = build_report()
    try:
        server = server_arguments(server_flags, args.model_path)
    except SystemExit:  # SGLang's parser has printed what it did not understand
        return EXIT_UNKNOWN
    if server is not None and server_flags is not None:
        args.tp, args.ep = server.tp_size, server.ep_size or 1
        args.no_shared_experts_fusion = args.no_shared_experts_fusion or bool(server.disable_shared_experts_fusion)
        args.model_path = args.model_path or server.model_path
    model = _model_config(args.model_path)
    if server is not None and server_flags is not None and report.guard and report.guard.lora_moe_path:
        bypassed = lora_path.bypassed_by(server)
        report = dataclasses.replace(report, guard=dataclasses.replace(
            report.guard, lora_moe_path=dataclasses.replace(report.guard.lora_moe_path, bypassed=bypassed)))
    report = dataclasses.replace(report, server_flags=tuple(server_flags) if server_flags is not None else None,
                                 defects=defects_report(report.guard, catalogue.Deployment(server, model)))
    if args.adapter:
        report = dataclasses.replace(report, adapter=adapter_check.inspect_adapter(args.adapter, args.model_path))
    if args.model_path:
        report = _with_exposure(report, args)
    if args.selftest:
        report = dataclasses.replace(report, selftest=_run_selftest(report, device))
    report = dataclasses.replace(report, verdict=verdict(report))
    print(report.to_json() if args.json else render(report))
    return report.verdict.exit_code



def _model_config(model_path: str | None) -> dict | None:
    if not model_path:
        return None
    try:
        return exposure.load_config(model_path)
    except exposure.ExposureError:
        return None  # the exposure section says why



def _with_exposure(report: Report, args) -> Report:
    if not report.target.importable:
        return dataclasses.replace(report, exposure_error=report.target.error)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = exposure.predict(
                args.model_path, args.tp, args.ep, args.device_name,
                fusion_disabled=args.no_shared_experts_fusion,
                guard_disables_fusion=not missing_for_fusion_fix(report.guard))
    except exposure.ExposureError as exc:
        return dataclasses.replace(report, exposure_error=str(exc))
    # What only the exposure knows: whether this shape takes the TMA down path at all.
    defects = tuple(dataclasses.replace(d, affects=found.tma_anywhere, state="ok" if not found.tma_anywhere else d.state)
                    if d.id == "tma-down-path" and d.present else d for d in report.defects)
    return dataclasses.replace(report, exposure=found, defects=defects)



def _run_selftest(report: Report, device: str) -> selftest.SelfTestResult:
    target = report.target
    if not target.importable or target.strategy is Strategy.ABSENT:
        return selftest.SelfTestResult(skipped="nothing to run: " + (target.reason or target.error))
    if target.strategy is Strategy.NATIVE:
        return selftest.SelfTestResult(skipped="nothing of this guard's to test: " + target.reason)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return selftest.run(device)
    except Exception as exc:
        return selftest.SelfTestResult(passed=False, error=f"{type(exc).__name__}: {exc}")



