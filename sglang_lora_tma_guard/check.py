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
with the fix's hooks applied through SGLang's ``HookRegistry``, must come out with shared-experts
fusion off. With ``--model-path`` it also predicts, from the model's config.json and the installed
SGLang's own config lookup, whether SGLang fuses that model's shared expert and whether the shape the
server will really build takes the TMA down path at all (see ``exposure``).
With ``--selftest`` it also runs a tiny LoRA-hooked block-fp8 MoE through the installed SGLang,
TMA requested, without and with the guard (on a GPU natively, else through Triton's interpreter).

The report is a tree of frozen dataclasses (:class:`Report`), built by :func:`build_report`, judged
by :func:`verdict`, printed by :func:`render` or, with ``--json``, serialised as it is
(``schema_version`` 4: 3 plus the ``defects`` list, one entry per defect of the catalogue, and the
``adapter`` of ``--adapter``).

Exit status: 0 not affected or protected; 1 affected and not protected, the guard would refuse this
deployment, or the self-test failed; 2 cannot tell (SGLang missing or not importable, the self-test could
not run, or the answer depends on the model or the flags: give --model-path and the server flags).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from dataclasses import dataclass
from importlib import metadata

from . import __version__, adapter_check, catalogue, defects, exposure, guard, lora_path, selftest, serving
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

SCHEMA_VERSION = 4
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "lora_tma_guard"

EXIT_OK, EXIT_EXPOSED, EXIT_UNKNOWN = 0, 1, 2


# --- the report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Environment:
    python: str
    sglang: str | None
    torch: str | None
    triton: str | None
    wrapt: str | None
    gpu: str | None
    gpu_compute_capability: str | None
    triton_tensor_descriptors: bool
    gpu_has_tma: bool | None


@dataclass(frozen=True)
class Target:
    """The installed ``_fused_moe_kernel_sequence`` and the strategy its code calls for."""

    target: str
    importable: bool
    error: str | None = None
    strategy: Strategy | None = None
    reason: str | None = None
    native_guard: bool = False
    weight_tma_unavailable: str | None = None
    location: str | None = None
    flag_parameter: str | None = None
    hooks_parameter: str | None = None
    fallback_covers: str | None = None


@dataclass(frozen=True)
class SwitchReport:
    variable: str
    value: str | None
    enabled: bool
    valid: bool
    plain: bool
    fast: bool = False
    state: str = ""
    """What the value means, as the plugin says it (``Switch.state()``)."""


@dataclass(frozen=True)
class LoRAPathReport:
    """The LoRA MoE hooks a server builds with this switch (``lora_path``)."""

    mode: str | None
    """``fast``, ``correct`` (SGLang's hooks, its virtual-experts path corrected) or None (guard off)."""
    builder: str | None
    """Where SGLang's ``build_lora_hooks`` is (None: not found; nothing to place then)."""
    virtual_experts_fixed_upstream: bool | None
    """SGLang's own ``--lora-use-virtual-experts`` path is right on gated MoE (0.5.23), read from its code."""
    error: str | None = None
    bypassed: str | None = None
    """The server flags given run the MoE LoRA without any hook builder (``lora_path.bypassed_by``)."""


@dataclass(frozen=True)
class FusionFixTrial:
    """The shared-expert fix tried on the installed SGLang's own ``ServerArgs``."""

    hook: str | None
    lora_server_fusion_off: bool
    error: str | None = None


@dataclass(frozen=True)
class GuardReport:
    switch: SwitchReport
    entry_point: str | None
    sglang_plugins: str | None
    admitted_by_sglang_plugins: bool
    shared_expert_fix: FusionFixTrial
    wrapper_installs: bool | None = None
    """None where the strategy installs no wrapper."""
    installed_strategy: Strategy | None = None
    """The strategy the trial install really installed (it can differ: a copy that did not build)."""
    lora_moe_path: LoRAPathReport | None = None


@dataclass(frozen=True)
class DefectReport(catalogue.Assessment):
    """One defect of the catalogue, judged for this SGLang, the deployment given (if any) and the switch."""

    state: str = "ok"
    """``ok`` (not in this release, or not met), ``fixed``, ``refused`` (the guard stops this
    deployment: ``refusal`` says what to change), ``exposed`` or ``unknown``."""


@dataclass(frozen=True)
class Verdict:
    status: str
    exit_code: int
    message: str


@dataclass(frozen=True)
class Report:
    schema_version: int
    tool: dict
    environment: Environment
    sglang_version_note: str | None
    version_says_affected: bool | None
    target: Target
    guard: GuardReport | None
    exposure: exposure.Exposure | None = None
    exposure_error: str | None = None
    selftest: selftest.SelfTestResult | None = None
    defects: tuple[DefectReport, ...] = ()
    adapter: adapter_check.AdapterReport | None = None
    """``--adapter PATH``: what SGLang does with that adapter, and what the guard changes."""
    server_flags: tuple[str, ...] | None = None
    """The server's command line given after ``--`` (None: none given)."""
    verdict: Verdict | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


# --- what is installed -----------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> Environment:
    gpu = capability = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
            capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:  # a broken CUDA install must not stop the check
        gpu = f"unknown ({type(exc).__name__}: {exc})"
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

        descriptors = True
    except Exception:
        descriptors = False
    return Environment(
        python=platform.python_version(), sglang=sglang_version(), torch=_dist_version("torch"),
        triton=_dist_version("triton"), wrapt=_dist_version("wrapt"), gpu=gpu, gpu_compute_capability=capability,
        triton_tensor_descriptors=descriptors,
        gpu_has_tma=None if capability is None else int(capability.split(".")[0]) >= 9,
    )


def target_report() -> Target:
    """What the installed SGLang has, read from the original function (under any wrapper)."""
    if sglang_version() is None and _find_spec("sglang") is None:
        return Target(TARGET, importable=False, error="SGLang is not installed in this Python environment")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(TARGET_MODULE)
    except Exception as exc:
        return Target(TARGET, importable=False, error=f"cannot import {TARGET_MODULE}: {type(exc).__name__}: {exc}")
    function = getattr(module, TARGET_NAME, None)
    original = inspect.unwrap(function) if function is not None else None
    inspection = inspect_target(original, weight_tma=not read_switch().plain)
    return Target(
        TARGET, importable=True, strategy=inspection.strategy, reason=inspection.reason,
        native_guard=inspection.native_guard, weight_tma_unavailable=inspection.weight_tma_unavailable,
        location=_location(original),
        flag_parameter=f"positional #{inspection.flag_index}" if inspection.flag_index is not None else None,
        hooks_parameter=_hooks_kind(original),
        fallback_covers=_fallback_covers() if inspection.strategy is Strategy.FALLBACK else None,
    )


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


def guard_report(strategy: Strategy) -> GuardReport:
    switch = read_switch()
    entry = next(
        (ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME), None
    )
    allow = os.environ.get("SGLANG_PLUGINS") or None
    with _trial_lines_quiet(logging.WARNING):  # a variant that did not build still says so
        installs, installed = (_try_the_wrapper(weight_tma=not switch.plain) if strategy.installs_wrapper
                               else (None, None))
    with _trial_lines_quiet(logging.ERROR):  # the trial's LoRA server is no user's
        fusion_trial = _try_the_fusion_fix()
    return GuardReport(
        switch=SwitchReport(ENV_VAR, switch.value, switch.enabled, switch.valid, switch.plain, switch.fast,
                            switch.state()),
        entry_point=None if entry is None else f"{entry.name} = {entry.value}",
        sglang_plugins=allow,
        admitted_by_sglang_plugins=allow is None or ENTRY_POINT_NAME in {x.strip() for x in allow.split(",")},
        shared_expert_fix=fusion_trial,
        wrapper_installs=installs,
        installed_strategy=installed,
        lora_moe_path=lora_path_report(switch),
    )


def lora_path_report(switch) -> LoRAPathReport:
    mode = (lora_path.Mode.FAST if switch.fast else lora_path.Mode.CORRECT).value if switch.enabled else None
    try:
        module = importlib.import_module(lora_path.MODULE)
    except Exception as error:  # an SGLang without LoRA MoE runners: nothing to place
        return LoRAPathReport(mode, None, None, f"{type(error).__name__}: {error}"[:300])
    found = callable(getattr(module, lora_path.NAME, None))
    return LoRAPathReport(mode, lora_path.TARGET if found else None,
                          lora_path.virtual_experts_fixed_upstream(module) if found else None)


def _try_the_fusion_fix() -> FusionFixTrial:
    """Apply the fix's hooks through SGLang's registry and build a LoRA server's arguments, as a launcher would.

    The record goes through a pickle, as it does to each scheduler. The hooks stay applied in this
    process (SGLang's registry cannot take them back) and go inert when the fix was off before.
    """
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        return FusionFixTrial(None, False, f"{type(exc).__name__}: {exc}")
    hook = f"ServerArgs.{serving.resolution_method(ServerArgs)}"
    was_active = serving.active()
    try:
        serving.arm()
        record = ServerArgs(model_path="dummy", enable_lora=True)
        if hasattr(record, "resolve_once"):
            record.resolve_once()
        received = pickle.loads(pickle.dumps(record))
        return FusionFixTrial(hook, received.disable_shared_experts_fusion is True)
    except Exception as exc:
        return FusionFixTrial(hook, False, f"{type(exc).__name__}: {exc}")
    finally:
        if not was_active:
            serving.disarm()


def _try_the_wrapper(weight_tma: bool) -> tuple[bool, Strategy | None]:
    """Install and remove the wrapper in this process, as a server process would install it."""
    was_active = guard.status().active
    try:
        state = guard.activate(weight_tma=weight_tma)
        return state.installed, state.strategy
    finally:
        if not was_active:
            guard.deactivate()


@contextlib.contextmanager
def _trial_lines_quiet(below: int):
    """A trial's routine lines (install, remove, "fusion is turned off") are not news in a check."""
    logger = logging.getLogger("sglang_lora_tma_guard")
    level = logger.level
    logger.setLevel(below)
    try:
        yield
    finally:
        logger.setLevel(level)


def build_report() -> Report:
    env = environment()
    target = target_report()
    return Report(
        schema_version=SCHEMA_VERSION,
        tool={"name": "sglang-lora-tma-guard", "version": __version__},
        environment=env,
        sglang_version_note=version_note(env.sglang) if env.sglang else None,
        version_says_affected=release_is_affected(env.sglang),
        target=target,
        guard=guard_report(target.strategy) if target.importable else None,
    )


# --- the verdict ---------------------------------------------------------------------------------


def verdict(report: Report) -> Verdict:
    """The one verdict, from everything the report found: target, guard, exposure, self-test.

    Two bugs are judged apart (the TMA down path, a fused shared expert), each ``ok``, ``fixed``,
    ``exposed`` or ``unknown``; the worst decides: exposed, then unknown, then protected (the guard
    fixes one), then not affected.
    """
    target, result = report.target, report.selftest
    if not target.importable:
        return Verdict("unknown", EXIT_UNKNOWN, target.error)
    if report.exposure_error:
        return Verdict("unknown", EXIT_UNKNOWN, report.exposure_error)
    if result is not None and result.error:
        return Verdict("unknown", EXIT_UNKNOWN, f"the self-test could not run: {result.error}")
    if result is not None and result.passed is False:
        return Verdict("exposed", EXIT_EXPOSED, "self-test FAILED: LoRA-hooked calls are wrong on the TMA path "
                       f"even with the guard (strategy {target.strategy.value})")
    if target.strategy is Strategy.ABSENT:
        return Verdict("not-affected", EXIT_OK, target.reason)
    parts = [_tma_part(report), _fusion_part(report), *_virtual_experts_part(report), *_catalogue_parts(report)]
    if report.adapter is not None:
        parts += adapter_check.parts(report.adapter, guard_on=not _missing_for_the_plugin(report.guard))
    where = _deployment(report.exposure)
    for state, status, code in (("exposed", "exposed", EXIT_EXPOSED), ("refused", "refused", EXIT_EXPOSED),
                                ("unknown", "unknown", EXIT_UNKNOWN), ("fixed", "protected", EXIT_OK),
                                ("ok", "not-affected", EXIT_OK)):
        if any(s == state for s, _ in parts):
            ordered = [text for s, text in parts if s == state] + [text for s, text in parts if s != state]
            return Verdict(status, code, (f"{where}: " if where else "") + "; ".join(ordered))
    raise AssertionError(parts)  # every part has one of the five states


OWN_PARTS = ("tma-down-path", "fused-shared-expert", "virtual-experts-up-half")
"""Entries the verdict judges with what only ``check`` knows (TMA buckets, SGLang's fusion rules)."""


def _catalogue_parts(report: Report) -> list[tuple[str, str]]:
    """Every other entry of the catalogue that this SGLang has and this deployment may meet."""
    parts, covered, by_adapter = [], [], []
    adapter_read = report.adapter is not None and not report.adapter.error
    for found in report.defects:
        if found.id in OWN_PARTS or found.state == "ok":
            continue
        if found.state == "fixed":
            covered.append(found.id if found.remedy is catalogue.Remedy.FIX else f"{found.id} (refused if met)")
            continue
        if found.state == "unknown" and defects.BY_ID[found.id].judged_by_adapter:
            if not adapter_read:  # with an adapter read, its own parts say which of these it meets
                by_adapter.append(found.id)
            continue
        hint = ("it depends on the adapters loaded" if found.id in ADAPTER_IDS
                else "give --model-path and the server flags after --")
        text = {"refused": f"the guard will not start this server: {found.refusal}",
                "exposed": f"{found.title} (SGLang {found.releases}); the guard is not on",
                "unknown": f"{found.title} (SGLang {found.releases}) if this deployment meets it ({hint}); the "
                           "guard is not on"}[found.state]
        parts.append((found.state, text))
    if by_adapter:
        parts.append(("unknown", f"{len(by_adapter)} defect(s) are met by some adapters only "
                                 f"({', '.join(by_adapter)}) and the guard is not on: check each adapter with "
                                 "--adapter PATH, or switch the guard on (it fixes or refuses them at load)"))
    if covered:
        parts.append(("fixed", f"the guard also covers {len(covered)} more defect(s) this deployment may meet "
                               "(see Defects)"))
    return parts


ADAPTER_IDS = frozenset(module.DEFECT.id for module in defects.ADAPTERS)


def defects_report(guarded: GuardReport | None, deployment: catalogue.Deployment) -> tuple[DefectReport, ...]:
    """Every defect of the catalogue, judged for the installed SGLang, this deployment and this switch."""
    on = guarded is not None and not _missing_for_the_plugin(guarded)
    found = []
    for assessed in defects.assess(deployment, guarded=on):
        if assessed.present is False or assessed.affects is False:
            state = "ok"
        elif on:
            state = "refused" if assessed.refusal else "fixed"
        else:
            state = "exposed" if assessed.affects else "unknown"
        found.append(DefectReport(**dataclasses.asdict(assessed), state=state))
    return tuple(found)


def server_arguments(flags: list[str] | None, model_path: str | None):
    """The server's raw arguments as the installed SGLang's own parser reads ``flags`` (unresolved: no
    hardware is asked), with SGLang's defaults for what they leave out; a LoRA server where they do not
    say. None where SGLang cannot be imported."""
    try:
        from sglang.srt.server_args import ServerArgs

        add_cli_args = ServerArgs.add_cli_args
    except Exception:
        return None
    flags = list(flags or [])
    if not any(flag.split("=")[0] in ("--model-path", "--model") for flag in flags):
        flags += ["--model-path", model_path or "dummy"]
    if not any(flag.split("=")[0] in ("--enable-lora", "--lora-paths") for flag in flags):
        flags.append("--enable-lora")
    parser = argparse.ArgumentParser(prog="server flags", add_help=False)
    add_cli_args(parser)
    return parser.parse_args(flags)


def _virtual_experts_part(report: Report) -> list[tuple[str, str]]:
    """SGLang's own ``--lora-use-virtual-experts`` path (0.5.11-0.5.22, gated MoE): ``fixed`` with the
    guard on; without it, a warning that does not change the verdict (the flag is off by default)."""
    found = report.guard.lora_moe_path if report.guard else None
    if found is None or found.builder is None or found.virtual_experts_fixed_upstream or found.bypassed:
        return []
    if found.mode is not None:
        return [("fixed", "--lora-use-virtual-experts on a gated MoE is corrected (SGLang's own path computes "
                          "the up half of the gate-up delta from the gate half's A)"
                 + ("; LoRA MoE deltas on the fast path" if found.mode == lora_path.Mode.FAST else ""))]
    return [("ok", "do not pass --lora-use-virtual-experts without the guard: SGLang's own path is wrong on "
                   "gated MoE in this release")]


def _tma_part(report: Report) -> tuple[str, str]:
    """The TMA down path: ``ok`` (never taken, or SGLang turns it off), ``fixed`` or ``exposed``."""
    version, target, found = report.environment.sglang, report.target, report.exposure
    strategy = target.strategy
    if strategy is Strategy.UNSUPPORTED:
        return "exposed", f"{target.reason}; this build needs the upstream fix (SGLang 0.5.17 or later)"
    if found and not found.tma_anywhere:
        shape = found.shape
        return "ok", (f"never takes the TMA down path: no tuned down config for E={shape.experts_per_rank}, "
                      f"N={shape.intermediate_per_shard} says USE_TMA")
    where = f"takes the TMA down path at batch sizes {_ranges(found.buckets)}; " if found else ""
    missing = _missing_for_protection(report.guard)
    if target.native_guard:
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
    }[report.guard.installed_strategy or strategy]
    return "fixed", (f"{where}SGLang {version} is affected; every SGLang process will run LoRA-hooked "
                     f"MoE calls {how}")


def _fusion_part(report: Report) -> tuple[str, str]:
    """A fused shared expert under LoRA: ``ok``, ``fixed``, ``exposed``, or ``unknown`` without a model."""
    shared = report.exposure.shared_expert if report.exposure else None
    missing = _missing_for_fusion_fix(report.guard)
    if shared is not None and not shared.sglang_fuses:
        return "ok", "SGLang does not fuse this model's shared expert"
    if shared is not None and shared.turned_off_by == "user":
        return "ok", "shared-experts fusion is off (--disable-shared-experts-fusion)"
    if not missing:
        which = f"SGLang fuses this model's shared expert (E={shared.experts_per_rank_fused}); " if shared else ""
        return "fixed", (f"{which}LoRA servers run with shared-experts fusion off, so SGLang's LoRA MoE "
                         "kernels never read another adapter's weights for a fused shared expert")
    if shared is not None:
        return "exposed", (f"SGLang fuses this model's shared expert (E={shared.experts_per_rank_fused}) and its "
                           "LoRA MoE path then reads another adapter's weights there (every release 0.5.11-0.5.23): "
                           + "; ".join(missing) + ", or pass --disable-shared-experts-fusion")
    return "unknown", ("LoRA on a model whose shared expert SGLang fuses (DeepSeek-V3/R1, GLM-4.5 and later, "
                       "GLM-5) is wrong on every release 0.5.11-0.5.23 and the guard's fix is not on ("
                       + "; ".join(missing) + "): give --model-path to know about yours")


def _missing_for_the_plugin(guarded: GuardReport) -> list[str]:
    """What keeps SGLang from loading the plugin with the switch on (both fixes need it)."""
    missing = []
    if not guarded.switch.enabled:
        missing.append(f"set {ENV_VAR}=1 in the server's environment")
    if guarded.entry_point is None:
        missing.append("reinstall sglang-lora-tma-guard (its entry point is not registered)")
    if not guarded.admitted_by_sglang_plugins:
        missing.append(f"add {ENTRY_POINT_NAME} to SGLANG_PLUGINS")
    return missing


def _missing_for_protection(guarded: GuardReport) -> list[str]:
    missing = _missing_for_the_plugin(guarded)
    if not guarded.wrapper_installs:
        missing.append("report this: the wrapper did not install on this SGLang")
    return missing


def _missing_for_fusion_fix(guarded: GuardReport) -> list[str]:
    fix = guarded.shared_expert_fix
    missing = _missing_for_the_plugin(guarded)
    if not fix.lora_server_fusion_off:
        missing.append(f"report this: the shared-expert fix did not take on this SGLang ({fix.error})")
    return missing


def _deployment(found: exposure.Exposure | None) -> str:
    if found is None:
        return ""
    shape = found.shape
    return f"{shape.architecture} at tp {shape.tp}, ep {shape.ep} on {found.device_name}"


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


# --- the text ------------------------------------------------------------------------------------

YES_NO = {True: "yes", False: "no", None: "n/a"}


def render(report: Report) -> str:
    sections = [_render_environment(report), _render_target(report), _render_guard(report.guard),
                _render_exposure(report), _render_defects(report),
                adapter_check.render(report.adapter) if report.adapter else [], _render_selftest(report.selftest)]
    lines = [f"sglang-lora-tma-guard {report.tool['version']}: check"]
    for section in filter(None, sections):
        lines += ["", *section]
    lines += ["", f"{report.verdict.status.upper()}: {report.verdict.message}"]
    return "\n".join(lines)


def _render_environment(report: Report) -> list[str]:
    env = report.environment
    gpu = env.gpu or "none (CPU only)"
    if env.gpu_compute_capability:
        gpu += f", compute capability {env.gpu_compute_capability}"
    return [
        "Environment",
        f"  python            {env.python}",
        f"  sglang            {env.sglang or 'not installed'}",
        f"  torch             {env.torch or 'not installed'}",
        f"  triton            {env.triton or 'not installed'}",
        f"  GPU               {gpu}",
        f"  TMA               Triton tensor descriptors: {YES_NO[env.triton_tensor_descriptors]}; "
        f"GPU with TMA (sm90+): {YES_NO[env.gpu_has_tma]}",
    ]


def _render_target(report: Report) -> list[str]:
    target = report.target
    lines = ["SGLang fused MoE", f"  function          {target.target}"]
    if report.sglang_version_note:
        lines.append(f"  note              {report.sglang_version_note}")
    if not target.importable:
        return lines + [f"  error             {target.error}"]
    lines += [
        f"  defined at        {target.location or 'unknown (no source)'}",
        f"  {FLAG_PARAM:<17} {target.flag_parameter or 'not a positional parameter / absent'}",
        f"  {HOOKS_PARAM:<17} {target.hooks_parameter or 'absent'}",
        f"  native guard      {'proven in its source' if target.native_guard else 'not proven'}",
        f"  strategy          {target.strategy.value}: {target.reason}",
    ]
    if target.weight_tma_unavailable:
        lines.append(f"  weight TMA        no: {target.weight_tma_unavailable}")
    if target.fallback_covers:
        lines.append(f"  fallback covers   {target.fallback_covers}")
    return lines


def _render_guard(guarded: GuardReport | None) -> list[str]:
    if guarded is None:
        return []
    switch = guarded.switch
    value = "unset" if switch.value is None else repr(switch.value)
    state = switch.state
    installs = YES_NO[guarded.wrapper_installs]
    if guarded.wrapper_installs and guarded.installed_strategy:
        installs += f" (strategy {guarded.installed_strategy.value})"
    fix = guarded.shared_expert_fix
    fix_text = (f"works here: a LoRA server's arguments come out with fusion off (hook on {fix.hook})"
                if fix.lora_server_fusion_off else f"does not take on this SGLang: {fix.error}")
    return [
        "Guard",
        f"  entry point       {guarded.entry_point or 'not registered'}",
        f"  SGLANG_PLUGINS    {guarded.sglang_plugins or 'unset (every plugin loads)'}"
        + ("" if guarded.admitted_by_sglang_plugins else "  <- excludes lora_tma_guard"),
        f"  {ENV_VAR} {value} ({state})",
        f"  wrapper installs  {installs}",
        f"  shared-expert fix {fix_text}",
        *_render_lora_path(guarded.lora_moe_path),
    ]


def _render_lora_path(found: LoRAPathReport | None) -> list[str]:
    if found is None:
        return []
    if found.bypassed:
        return [f"  LoRA MoE hooks    none built for the flags given ({found.bypassed})"]
    if found.builder is None:
        return [f"  LoRA MoE hooks    SGLang's builder not found here ({found.error or 'no build_lora_hooks'})"]
    ve = ("right in this release" if found.virtual_experts_fixed_upstream
          else "wrong on gated MoE in this release (the up half from the gate half's A)")
    if found.mode == lora_path.Mode.FAST:
        what = "fast virtual-experts path (SGLang's hooks for what it does not cover)"
    elif found.mode == lora_path.Mode.CORRECT:
        what = ("SGLang's own" if found.virtual_experts_fixed_upstream
                else "SGLang's own; --lora-use-virtual-experts corrected")
    else:
        what = "SGLang's own (guard off)"
    return [f"  LoRA MoE hooks    {what}", f"  SGLang's --lora-use-virtual-experts  {ve}"]


def _render_exposure(report: Report) -> list[str]:
    if report.exposure_error:
        return ["Exposure", f"  error             {report.exposure_error}"]
    found = report.exposure
    if found is None:
        return []
    shape, shared = found.shape, found.shared_expert
    block = "x".join(map(str, shape.block_shape)) if shape.block_shape else "none"
    fused = f" + {shape.fused_shared_experts} fused shared" if shape.fused_shared_experts else ""
    if not shared.sglang_fuses:
        shared_text = "not fused by SGLang"
    else:
        by = {"user": "off (--disable-shared-experts-fusion)", "guard": "turned off by the guard for LoRA servers",
              None: "ON: LoRA adapters read another adapter's weights there"}[shared.turned_off_by]
        shared_text = f"SGLang fuses it by default (E={shared.experts_per_rank_fused}); fusion {by}"
    on = [m for m, tma in found.buckets.items() if tma]
    return [
        "Exposure",
        f"  model             {found.model_path} ({shape.architecture})",
        f"  shared expert     {shared_text}",
        f"  per rank          E={shape.experts_per_rank} ({shape.routed_experts} routed / ep {shape.ep}{fused}), "
        f"N={shape.intermediate_per_shard}, hidden {shape.hidden_size}, top-{shape.topk}",
        f"  weights           {shape.dtype or 'bf16/fp16'}, fp8 block {block}",
        f"  device            {found.device_name}",
        f"  down config       {found.down_config_file}",
        "  TMA down path     "
        + (f"batch sizes {_ranges(found.buckets)}: {len(on)} of {len(found.buckets)} tuned buckets "
           "(larger batches use the largest)" if on else f"never ({len(found.buckets)} tuned buckets)"),
    ]


STATE_WORDS = {"ok": "ok", "fixed": "fixed by the guard", "refused": "REFUSED at start", "exposed": "EXPOSED",
               "unknown": "exposed if met"}


def _render_defects(report: Report) -> list[str]:
    if not report.defects:
        return []
    given = ("the server flags given" if report.server_flags is not None
             else "a LoRA server with SGLang's defaults (give the server flags after --)")
    lines = [f"Defects (SGLang {report.environment.sglang}; {given})"]
    width = max(len(found.id) for found in report.defects)
    for found in report.defects:
        here = {True: "in this release", False: "not in this release", None: "cannot tell"}[found.present]
        met = {True: "met here", False: "not met here", None: "may be met"}[found.affects] if found.present is not False else ""
        state = STATE_WORDS[found.state]
        if found.state == "fixed" and found.remedy is catalogue.Remedy.REFUSE:
            state = f"refused at {defects.BY_ID[found.id].refused_at} if met"
        lines.append(f"  {found.id:<{width}}  {found.releases:<13} {here:<19} {met:<12} {state}")
        if found.state == "refused":
            lines.append(f"  {'':<{width}}  -> {found.refusal}")
    return lines


def _render_selftest(result: selftest.SelfTestResult | None) -> list[str]:
    if result is None:
        return []
    if result.cases:
        return selftest.render(result)
    return [f"Self-test: {result.skipped or 'ERROR ' + str(result.error)}"]


# --- the command ---------------------------------------------------------------------------------


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
                guard_disables_fusion=not _missing_for_fusion_fix(report.guard))
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


if __name__ == "__main__":
    sys.exit(main())
