"""Am I affected, and am I protected? Both LoRA-on-MoE bugs: the TMA down path, and a fused shared expert.

    python -m sglang_lora_tma_guard.check [--json] [--selftest [--device cpu|cuda]]
        [--model-path DIR --tp N [--ep N] [--device-name 'NVIDIA H200']]

Reads the installed SGLang's ``_fused_moe_kernel_sequence`` (its signature and code), this
package's entry point, ``SGLANG_PLUGINS`` and ``SGLANG_LORA_TMA_GUARD``, and tries the wrapper in
this process. Runs without a GPU.

It also tries the shared-expert fix in this process: SGLang's own ``ServerArgs`` for a LoRA server,
with the fix's hooks applied through SGLang's ``HookRegistry``, must come out with shared-experts
fusion off. With ``--model-path`` it also predicts, from the model's config.json and the installed
SGLang's own config lookup, whether SGLang fuses that model's shared expert and whether the shape the
server will really build takes the TMA down path at all (see ``exposure``).
With ``--selftest`` it also runs a tiny LoRA-hooked block-fp8 MoE through the installed SGLang,
TMA requested, without and with the guard (on a GPU natively, else through Triton's interpreter).

Exit status: 0 not affected or protected; 1 affected and not protected, or the self-test failed;
2 cannot tell (SGLang missing or not importable, the self-test could not run, or the answer depends
on a model: without the guard, LoRA is wrong on models whose shared expert SGLang fuses).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import logging
import os
import pickle
import platform
import sys
import warnings
from importlib import metadata

from . import __version__, exposure, fusion, guard, selftest
from .inspection import (
    FLAG_PARAM,
    HOOKS_PARAM,
    TARGET,
    TARGET_MODULE,
    TARGET_NAME,
    Strategy,
    inspect_target,
    release_is_affected,
    sglang_version,
    version_note,
)
from .settings import ENV_VAR, read_switch

SCHEMA_VERSION = 1
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "lora_tma_guard"

EXIT_OK, EXIT_EXPOSED, EXIT_UNKNOWN = 0, 1, 2


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "sglang": sglang_version(),
        "torch": _dist_version("torch"),
        "triton": _dist_version("triton"),
        "wrapt": _dist_version("wrapt"),
        "gpu": None,
        "gpu_compute_capability": None,
    }
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:  # a broken CUDA install must not stop the check
        env["gpu"] = f"unknown ({type(exc).__name__}: {exc})"
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

        env["triton_tensor_descriptors"] = True
    except Exception:
        env["triton_tensor_descriptors"] = False
    capability = env["gpu_compute_capability"]
    env["gpu_has_tma"] = None if capability is None else int(capability.split(".")[0]) >= 9
    return env


def target_report() -> tuple[dict, object | None]:
    """What the installed SGLang has, and the original function object (None if unreadable)."""
    report = {"target": TARGET, "importable": False, "error": None}
    if sglang_version() is None and _find_spec("sglang") is None:
        report["error"] = "SGLang is not installed in this Python environment"
        return report, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(TARGET_MODULE)
    except Exception as exc:
        report["error"] = f"cannot import {TARGET_MODULE}: {type(exc).__name__}: {exc}"
        return report, None
    report["importable"] = True
    function = getattr(module, TARGET_NAME, None)
    original = inspect.unwrap(function) if function is not None else None
    inspection = inspect_target(original, weight_tma=not read_switch().plain)
    report.update(
        strategy=inspection.strategy.value,
        reason=inspection.reason,
        native_guard=inspection.native_guard,
        weight_tma_unavailable=inspection.weight_tma_unavailable,
        location=_location(original),
        flag_parameter=(
            f"positional #{inspection.flag_index}" if inspection.flag_index is not None else None
        ),
        hooks_parameter=_hooks_kind(original),
        fallback_covers=_fallback_covers() if inspection.strategy is Strategy.FALLBACK else None,
    )
    return report, original


def _fallback_covers() -> str:
    from .fallback import COVERED

    return COVERED


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _location(function) -> str | None:
    try:
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
    except (OSError, TypeError):
        return None


def _hooks_kind(function) -> str | None:
    try:
        param = inspect.signature(function).parameters.get(HOOKS_PARAM)
    except (TypeError, ValueError):
        return None
    return None if param is None else param.kind.description


def guard_report(strategy: str | None) -> dict:
    switch = read_switch()
    entry = next(
        (ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME), None
    )
    allow = os.environ.get("SGLANG_PLUGINS") or None
    admitted = allow is None or ENTRY_POINT_NAME in {x.strip() for x in allow.split(",")}
    report = {
        "switch": {"variable": ENV_VAR, "value": switch.value, "enabled": switch.enabled,
                   "valid": switch.valid, "plain": switch.plain},
        "entry_point": None if entry is None else f"{entry.name} = {entry.value}",
        "sglang_plugins": allow,
        "admitted_by_sglang_plugins": admitted,
        "wrapper_installs": None,
        "shared_expert_fix": _try_the_fusion_fix(),
    }
    if Strategy(strategy).installs_wrapper:
        report["wrapper_installs"] = _try_the_wrapper(weight_tma=not switch.plain)
    return report


def _try_the_fusion_fix() -> dict:
    """Apply the fix's hooks through SGLang's registry and build a LoRA server's arguments, as a launcher would.

    The record goes through a pickle, as it does to each scheduler. The hooks stay applied in this
    process (SGLang's registry cannot take them back) and go inert when the fix was off before.
    """
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        return {"hook": None, "lora_server_fusion_off": False, "error": f"{type(exc).__name__}: {exc}"}
    hook = f"ServerArgs.{fusion.resolution_method(ServerArgs)}"
    was_active = fusion.active()
    logger = logging.getLogger("sglang_lora_tma_guard")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the trial's "fusion is turned off" line is not news here
    try:
        fusion.activate()
        HookRegistry.apply_hooks()
        record = ServerArgs(model_path="dummy", enable_lora=True)
        if hasattr(record, "resolve_once"):
            record.resolve_once()
        received = pickle.loads(pickle.dumps(record))
        return {"hook": hook, "lora_server_fusion_off": received.disable_shared_experts_fusion is True,
                "error": None}
    except Exception as exc:
        return {"hook": hook, "lora_server_fusion_off": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if not was_active:
            fusion.deactivate()
        logger.setLevel(level)


def _try_the_wrapper(weight_tma: bool) -> bool:
    """Install and remove the wrapper in this process, as a server process would install it."""
    logger = logging.getLogger("sglang_lora_tma_guard")
    level, was_active = logger.level, guard.status().active
    logger.setLevel(logging.WARNING)  # the trial's install/remove lines are not news here
    try:
        return guard.activate(weight_tma=weight_tma).installed
    finally:
        if not was_active:
            guard.deactivate()
        logger.setLevel(level)


def verdict(report: dict) -> dict:
    """The one verdict, from everything the report found: target, guard, exposure, self-test.

    Two bugs are judged apart (the TMA down path, a fused shared expert), each ``ok``, ``fixed``,
    ``exposed`` or ``unknown``; the worst decides: exposed, then unknown, then protected (the guard
    fixes one), then not affected.
    """
    target = report["target"]
    found, result = report.get("exposure") or {}, report.get("selftest") or {}
    if not target["importable"]:
        return _verdict("unknown", EXIT_UNKNOWN, target["error"])
    if found.get("error"):
        return _verdict("unknown", EXIT_UNKNOWN, found["error"])
    if result.get("error"):
        return _verdict("unknown", EXIT_UNKNOWN, f"the self-test could not run: {result['error']}")
    strategy = Strategy(target["strategy"])
    if result.get("passed") is False:
        return _verdict(
            "exposed", EXIT_EXPOSED, "self-test FAILED: LoRA-hooked calls are wrong on the TMA path "
            f"even with the guard (strategy {strategy.value})")
    if strategy is Strategy.ABSENT:
        return _verdict("not-affected", EXIT_OK, target["reason"])
    parts = [_tma_part(report), _fusion_part(report)]
    where = _deployment(found)
    for state, status, code in (("exposed", "exposed", EXIT_EXPOSED), ("unknown", "unknown", EXIT_UNKNOWN),
                                ("fixed", "protected", EXIT_OK), ("ok", "not-affected", EXIT_OK)):
        if any(s == state for s, _ in parts):
            ordered = [text for s, text in parts if s == state] + [text for s, text in parts if s != state]
            return _verdict(status, code, (f"{where}: " if where else "") + "; ".join(ordered))
    raise AssertionError(parts)  # every part has one of the four states


def _tma_part(report: dict) -> tuple[str, str]:
    """The TMA down path: ``ok`` (never taken, or SGLang turns it off), ``fixed`` or ``exposed``."""
    version = report["environment"]["sglang"]
    target, found = report["target"], report.get("exposure") or {}
    strategy = Strategy(target["strategy"])
    if strategy is Strategy.UNSUPPORTED:
        return "exposed", f"{target['reason']}; this build needs the upstream fix (SGLang 0.5.17 or later)"
    if found and not found["tma_anywhere"]:
        shape = found["shape"]
        return "ok", (f"never takes the TMA down path: no tuned down config for E={shape['experts_per_rank']}, "
                      f"N={shape['intermediate_per_shard']} says USE_TMA")
    where = f"takes the TMA down path at batch sizes {_ranges(found['buckets'])}; " if found else ""
    missing = _missing_for_protection(report["guard"])
    if target["native_guard"]:
        speed_up = (" (not active: " + "; ".join(missing) + ")" if missing
                    else "; the guard keeps TMA for the weights of hooked calls, a speed-up")
        note = speed_up if strategy is Strategy.WEIGHT_TMA else ""
        return "ok", f"{where}SGLang {version} turns TMA off for LoRA-hooked calls itself{note}"
    if missing:
        return "exposed", (f"{where}SGLang {version} can run LoRA hooks on the TMA down path and the guard is "
                           "not on: " + "; ".join(missing))
    how = {
        Strategy.WEIGHT_TMA: "with route-major buffers and TMA for the weights (down_moe_use_tma=False, "
                             "b_use_tma=True)",
        Strategy.FLAG: "with down_moe_use_tma=False",
        Strategy.FALLBACK: "on the guard's own route-major kernels (calls they do not cover are refused "
                           "with an error)",
    }[strategy]
    return "fixed", (f"{where}SGLang {version} is affected; every SGLang process will run LoRA-hooked "
                     f"MoE calls {how}")


def _fusion_part(report: dict) -> tuple[str, str]:
    """A fused shared expert under LoRA: ``ok``, ``fixed``, ``exposed``, or ``unknown`` without a model."""
    guarded, found = report["guard"], report.get("exposure") or {}
    shared = found.get("shared_expert")
    missing = _missing_for_fusion_fix(guarded)
    if shared is not None and not shared["sglang_fuses"]:
        return "ok", "SGLang does not fuse this model's shared expert"
    if shared is not None and shared["turned_off_by"] == "user":
        return "ok", "shared-experts fusion is off (--disable-shared-experts-fusion)"
    if not missing:
        which = (f"SGLang fuses this model's shared expert (E={shape_fused(found)}); " if shared else "")
        return "fixed", (f"{which}LoRA servers run with shared-experts fusion off, so SGLang's LoRA MoE "
                         "kernels never read another adapter's weights for a fused shared expert")
    if shared is not None:
        return "exposed", (f"SGLang fuses this model's shared expert (E={shape_fused(found)}) and its LoRA MoE "
                           "path then reads another adapter's weights there (every release 0.5.11-0.5.23): "
                           + "; ".join(missing) + ", or pass --disable-shared-experts-fusion")
    return "unknown", ("LoRA on a model whose shared expert SGLang fuses (DeepSeek-V3/R1, GLM-4.5 and later, "
                       "GLM-5) is wrong on every release 0.5.11-0.5.23 and the guard's fix is not on ("
                       + "; ".join(missing) + "): give --model-path to know about yours")


def shape_fused(found: dict) -> int:
    return found["shared_expert"]["experts_per_rank_fused"]


def _missing_for_fusion_fix(guarded: dict) -> list[str]:
    fix = guarded.get("shared_expert_fix") or {}
    missing = [m for m in _missing_for_protection(guarded) if not m.startswith("report this")]
    if not fix.get("lora_server_fusion_off"):
        missing.append(f"report this: the shared-expert fix did not take on this SGLang ({fix.get('error')})")
    return missing


def _missing_for_protection(guarded: dict) -> list[str]:
    missing = []
    if not guarded["switch"]["enabled"]:
        missing.append(f"set {ENV_VAR}=1 in the server's environment")
    if guarded["entry_point"] is None:
        missing.append("reinstall sglang-lora-tma-guard (its entry point is not registered)")
    if not guarded["admitted_by_sglang_plugins"]:
        missing.append(f"add {ENTRY_POINT_NAME} to SGLANG_PLUGINS")
    if not guarded["wrapper_installs"]:
        missing.append("report this: the wrapper did not install on this SGLang")
    return missing


def _deployment(found: dict) -> str:
    if not found:
        return ""
    shape = found["shape"]
    return f"{shape['architecture']} at tp {shape['tp']}, ep {shape['ep']} on {found['device_name']}"


def _tma_buckets(found: dict) -> list:
    return [m for m, tma in found["buckets"].items() if tma]


def _verdict(status: str, exit_code: int, message: str) -> dict:
    return {"status": status, "exit_code": exit_code, "message": message}


def build_report() -> dict:
    env = environment()
    target, _ = target_report()
    guarded = guard_report(target.get("strategy")) if target["importable"] else None
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "sglang-lora-tma-guard", "version": __version__},
        "environment": env,
        "sglang_version_note": version_note(env["sglang"]) if env["sglang"] else None,
        "version_says_affected": release_is_affected(env["sglang"]),
        "target": target,
        "guard": guarded,
    }


def render(report: dict) -> str:
    env, target, guarded = report["environment"], report["target"], report["guard"]
    yes_no = {True: "yes", False: "no", None: "n/a"}
    gpu = env["gpu"] or "none (CPU only)"
    if env["gpu_compute_capability"]:
        gpu += f", compute capability {env['gpu_compute_capability']}"
    lines = [
        f"sglang-lora-tma-guard {report['tool']['version']}: check",
        "",
        "Environment",
        f"  python            {env['python']}",
        f"  sglang            {env['sglang'] or 'not installed'}",
        f"  torch             {env['torch'] or 'not installed'}",
        f"  triton            {env['triton'] or 'not installed'}",
        f"  GPU               {gpu}",
        f"  TMA               Triton tensor descriptors: {yes_no[env['triton_tensor_descriptors']]}; "
        f"GPU with TMA (sm90+): {yes_no[env['gpu_has_tma']]}",
        "",
        "SGLang fused MoE",
        f"  function          {target['target']}",
    ]
    if report["sglang_version_note"]:
        lines.append(f"  note              {report['sglang_version_note']}")
    if not target["importable"]:
        lines.append(f"  error             {target['error']}")
    else:
        lines += [
            f"  defined at        {target['location'] or 'unknown (no source)'}",
            f"  {FLAG_PARAM:<17} {target['flag_parameter'] or 'not a positional parameter / absent'}",
            f"  {HOOKS_PARAM:<17} {target['hooks_parameter'] or 'absent'}",
            f"  native guard      {'proven in its source' if target['native_guard'] else 'not proven'}",
            f"  strategy          {target['strategy']}: {target['reason']}",
        ]
        if target.get("weight_tma_unavailable"):
            lines.append(f"  weight TMA        no: {target['weight_tma_unavailable']}")
        if target.get("fallback_covers"):
            lines.append(f"  fallback covers   {target['fallback_covers']}")
    if guarded:
        switch = guarded["switch"]
        value = "unset" if switch["value"] is None else repr(switch["value"])
        state = (("on, plain fix" if switch["plain"] else "on") if switch["enabled"]
                 else ("off, not understood" if not switch["valid"] else "off"))
        lines += [
            "",
            "Guard",
            f"  entry point       {guarded['entry_point'] or 'not registered'}",
            f"  SGLANG_PLUGINS    {guarded['sglang_plugins'] or 'unset (every plugin loads)'}"
            + ("" if guarded["admitted_by_sglang_plugins"] else "  <- excludes lora_tma_guard"),
            f"  {ENV_VAR} {value} ({state})",
            f"  wrapper installs  {yes_no[guarded['wrapper_installs']]}",
            f"  shared-expert fix {_render_fusion_fix(guarded['shared_expert_fix'])}",
        ]
    found = report.get("exposure")
    if found:
        lines += ["", "Exposure"]
        if found.get("error"):
            lines.append(f"  error             {found['error']}")
        else:
            shape = found["shape"]
            block = "x".join(map(str, shape["block_shape"])) if shape["block_shape"] else "none"
            fused = f" + {shape['fused_shared_experts']} fused shared" if shape["fused_shared_experts"] else ""
            on = _tma_buckets(found)
            lines += [
                f"  model             {found['model_path']} ({shape['architecture']})",
                f"  shared expert     {_render_shared_expert(found['shared_expert'])}",
                f"  per rank          E={shape['experts_per_rank']} ({shape['routed_experts']} routed / ep {shape['ep']}"
                f"{fused}), N={shape['intermediate_per_shard']}, hidden {shape['hidden_size']}, top-{shape['topk']}",
                f"  weights           {shape['dtype'] or 'bf16/fp16'}, fp8 block {block}",
                f"  device            {found['device_name']}",
                f"  down config       {found['down_config_file']}",
                "  TMA down path     "
                + (f"batch sizes {_ranges(found['buckets'])}: {len(on)} of {len(found['buckets'])} tuned buckets "
                   "(larger batches use the largest)" if on else f"never ({len(found['buckets'])} tuned buckets)"),
            ]
    result = report.get("selftest")
    if result:
        lines.append("")
        if result.get("cases"):
            lines += selftest.render(result)
        else:
            lines.append(f"Self-test: {result.get('skipped') or 'ERROR ' + result['error']}")
    verdict_ = report["verdict"]
    lines += ["", f"{verdict_['status'].upper()}: {verdict_['message']}"]
    return "\n".join(lines)


def _render_fusion_fix(fix: dict) -> str:
    if fix.get("lora_server_fusion_off"):
        return f"works here: a LoRA server's arguments come out with fusion off (hook on {fix['hook']})"
    return f"does not take on this SGLang: {fix.get('error')}"


def _render_shared_expert(shared: dict) -> str:
    if not shared["sglang_fuses"]:
        return "not fused by SGLang"
    by = {"user": "off (--disable-shared-experts-fusion)", "guard": "turned off by the guard for LoRA servers",
          None: "ON: LoRA adapters read another adapter's weights there"}[shared["turned_off_by"]]
    return f"SGLang fuses it by default (E={shared['experts_per_rank_fused']}); fusion {by}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_lora_tma_guard.check", description="Am I affected, and am I protected?"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--selftest", action="store_true",
        help="also run a tiny LoRA-hooked MoE through the installed SGLang, with and without the guard",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="self-test device (default: cuda if present, else the CPU interpreter)")
    model = parser.add_argument_group("exposure of one deployment")
    model.add_argument("--model-path", help="a Hugging Face model folder, or its config.json")
    model.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    model.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    model.add_argument("--device-name", help="ask about this GPU (as torch names it, e.g. 'NVIDIA H200') "
                                             "instead of the one here")
    model.add_argument("--no-shared-experts-fusion", action="store_true",
                       help="the server runs with --disable-shared-experts-fusion")
    args = parser.parse_args(argv)
    logging.getLogger("sglang").setLevel(logging.ERROR)
    if args.selftest:
        device = selftest.prepare(args.device)  # before SGLang is imported
    report = build_report()
    if args.model_path:
        report["exposure"] = _exposure(report, args)
    if args.selftest:
        report["selftest"] = _run_selftest(report, device)
    report["verdict"] = verdict(report)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return report["verdict"]["exit_code"]


def _exposure(report: dict, args) -> dict:
    if not report["target"]["importable"]:
        return {"error": report["target"]["error"]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return exposure.predict(
                args.model_path, args.tp, args.ep, args.device_name,
                fusion_disabled=args.no_shared_experts_fusion,
                guard_disables_fusion=not _missing_for_fusion_fix(report["guard"]))
    except exposure.ExposureError as exc:
        return {"error": str(exc)}


def _ranges(buckets: dict) -> str:
    """The tuned buckets that say TMA, as runs of neighbouring buckets: ``1-64, 1024`` when 128-512 do not."""
    ordered = sorted((int(m), tma) for m, tma in buckets.items())
    runs, run = [], []
    for size, tma in ordered:
        if tma:
            run.append(size)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _run_selftest(report: dict, device: str) -> dict:
    target = report["target"]
    if not target["importable"] or target["strategy"] == Strategy.ABSENT.value:
        return {"passed": None, "skipped": "nothing to run: " + (target.get("reason") or target["error"])}
    if target["strategy"] == Strategy.NATIVE.value:
        return {"passed": None, "skipped": "nothing of this guard's to test: " + target["reason"]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return selftest.run(device)
    except Exception as exc:
        return {"passed": False, "error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    sys.exit(main())
