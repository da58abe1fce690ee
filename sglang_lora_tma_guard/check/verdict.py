"""``check``'s one verdict (:func:`verdict`) from everything the report found, and its exit codes."""

from __future__ import annotations

from .. import adapter_check, catalogue, defects, exposure, lora_path
from ..inspection import (
    Strategy,
)
from .report import Report, Verdict, missing_for_fusion_fix, missing_for_protection, missing_for_the_plugin

EXIT_OK, EXIT_EXPOSED, EXIT_UNKNOWN = 0, 1, 2



def verdict(report: Report) -> Verdict:
    """The one verdict, from everything the report found: target, guard, exposure, self-test.

    Each defect (and, with ``--adapter``, each thing the adapter meets) is one part, ``exposed``,
    ``refused``, ``unknown``, ``fixed`` or ``ok``; the worst decides, in that order (``fixed``: protected,
    ``ok``: not affected).
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
        parts += adapter_check.parts(report.adapter, guard_on=not missing_for_the_plugin(report.guard))
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
    where = f"takes the TMA down path at batch sizes {ranges(found.buckets)}; " if found else ""
    missing = missing_for_protection(report.guard)
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
    missing = missing_for_fusion_fix(report.guard)
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



def _deployment(found: exposure.Exposure | None) -> str:
    if found is None:
        return ""
    shape = found.shape
    return f"{shape.architecture} at tp {shape.tp}, ep {shape.ep} on {found.device_name}"



def ranges(buckets: dict) -> str:
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

