"""What ``check`` finds: the report's tree of frozen dataclasses (:class:`Report`, serialised as it is by
``--json``) and :func:`build_report`, which reads the installed SGLang, this package's entry point and
switch, and tries the wrapper and the shared-expert fix in this process."""

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
import warnings
from dataclasses import dataclass
from importlib import metadata

from .. import __version__, adapter_check, catalogue, defects, exposure, guard, lora_path, selftest, serving
from ..inspection import (
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
from ..settings import ENV_VAR, read_switch

SCHEMA_VERSION = 4



ENTRY_POINT_GROUP = "sglang.srt.plugins"



ENTRY_POINT_NAME = "lora_tma_guard"



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
    from ..fallback import COVERED

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
    """Place the guard's seam on SGLang's ``ServerArgs`` and build a LoRA server's arguments, as a launcher
    would; the record goes through a pickle, as it does to each scheduler. The seam is taken back after
    unless the guard was already on."""
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



def defects_report(guarded: GuardReport | None, deployment: catalogue.Deployment) -> tuple[DefectReport, ...]:
    """Every defect of the catalogue, judged for the installed SGLang, this deployment and this switch."""
    on = guarded is not None and not missing_for_the_plugin(guarded)
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



def missing_for_the_plugin(guarded: GuardReport) -> list[str]:
    """What keeps SGLang from loading the plugin with the switch on (both fixes need it)."""
    missing = []
    if not guarded.switch.enabled:
        missing.append(f"set {ENV_VAR}=1 in the server's environment")
    if guarded.entry_point is None:
        missing.append("reinstall sglang-lora-tma-guard (its entry point is not registered)")
    if not guarded.admitted_by_sglang_plugins:
        missing.append(f"add {ENTRY_POINT_NAME} to SGLANG_PLUGINS")
    return missing



def missing_for_protection(guarded: GuardReport) -> list[str]:
    missing = missing_for_the_plugin(guarded)
    if not guarded.wrapper_installs:
        missing.append("report this: the wrapper did not install on this SGLang")
    return missing



def missing_for_fusion_fix(guarded: GuardReport) -> list[str]:
    fix = guarded.shared_expert_fix
    missing = missing_for_the_plugin(guarded)
    if not fix.lora_server_fusion_off:
        missing.append(f"report this: the shared-expert fix did not take on this SGLang ({fix.error})")
    return missing

