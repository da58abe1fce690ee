"""``check``'s report as text (:func:`render`), one section per part of the report."""

from __future__ import annotations

from .. import adapter_check, catalogue, defects, lora_path, selftest
from ..inspection import (
    FLAG_PARAM,
    HOOKS_PARAM,
)
from ..settings import ENV_VAR
from .report import GuardReport, LoRAPathReport, Report
from .verdict import ranges

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
        + (f"batch sizes {ranges(found.buckets)}: {len(on)} of {len(found.buckets)} tuned buckets "
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

