"""The guard on every SGLang release it claims, each from its own PyPI wheel.

    python -m scripts.version_matrix [--versions 0.5.11 ...] [--fusion-versions 0.5.11 ...] [--json FILE]

Each release is installed with ``--no-deps`` into its own folder under the cache
(``$LORA_TMA_GUARD_CACHE``, default ``~/.cache/sglang-lora-tma-guard``; kept between runs) and put
first on ``PYTHONPATH`` of a fresh ``python -m sglang_lora_tma_guard.check --selftest --json``,
which reads its strategy and, where the guard has work to do, runs the real kernels on the CPU
(Triton's interpreter): hooked + TMA requested, without and with the guard. Then, for every release
0.5.11-0.5.23, ``scripts/release_probe.py`` with the guard on: the shared-expert fix on that release's
own ``ServerArgs`` (hook placement, LoRA asked for in each way, records sent to a spawned child), and
its LoRA MoE seam (the fast hooks built through the release's own ``build_lora_hooks``).
The rest of the import chain is the one of this environment (requirements/sglang-0.5.16-cpu.txt).
Then the catalogue: which release has which defect (read from its files), and one table per defect:
what the guard does with the release's own ``ServerArgs`` (``release_probe.py``), the defect shown on
its own code (``defect_probes.py``), and SGLang's own MoE layers wrapped by its own LoRA manager, run
on the CPU against a float32 reference, unguarded and guarded (``harness/layer_probe.py``, in the
interpreter of ``release_probe.py --layers``, after it: one SGLang import a release). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

from harness import tables
from sglang_lora_tma_guard.tiny_moe import WEIGHT_TMA_LAUNCH

REPO = Path(__file__).resolve().parents[1]

AFFECTED = ["0.5.11", "0.5.12.post1", "0.5.13.post1", "0.5.14", "0.5.15.post1", "0.5.16"]
FIXED = ["0.5.17", "0.5.20", "0.5.23"]
VERSIONS = AFFECTED + FIXED
FUSION_VERSIONS = AFFECTED + ["0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "sglang-lora-tma-guard"
    return Path(os.environ.get("LORA_TMA_GUARD_CACHE", default))


def install(version: str) -> Path:
    """The folder holding ``sglang==version`` alone, installed once per machine."""
    target = cache_dir() / f"sglang-{version}"
    done = target / ".installed"
    if not done.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
             "--upgrade", "--target", str(target), f"sglang=={version}"],
            check=True,
        )
        done.write_text(version)
    return target


def release_env(version: str, **extra: str) -> dict:
    """This environment with ``sglang==version`` first on the path and the switch as given."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LORA_TMA_GUARD", "SGLANG_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(install(version)), str(REPO)])
    return {**env, **extra}


def probe_release(version: str) -> dict:
    """Strategy, verdict and self-test of one release, from a fresh interpreter."""
    env = release_env(version)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_lora_tma_guard.check", "--selftest", "--json", "--selftest-device", "cpu"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"version": version, "error": (proc.stdout + proc.stderr)[-2000:]}
    report["version"] = version
    report["exit_code"] = proc.returncode
    return report


def probe_serving(version: str) -> dict:
    """One release's serving path, guard on, then its own MoE layers unguarded and guarded, in one fresh
    interpreter (``scripts/release_probe.py --layers``): ``{"fusion": ..., "layers": ...}``."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "release_probe.py"), "--layers"],
                          env=release_env(version, SGLANG_LORA_TMA_GUARD="1", TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    try:
        found = json.loads(proc.stdout.splitlines()[-1])
        return {"fusion": {**found["fusion"], "version": version}, "layers": found["layers"]}
    except (IndexError, KeyError, json.JSONDecodeError):
        error = (proc.stdout + proc.stderr)[-2000:]
        return {"fusion": {"version": version, "error": error}, "layers": {"error": error}}


def probe_all(versions, jobs: int = 2, probe=probe_release) -> dict:
    """{version: probe(version)}, the wheels installed one pip at a time, then ``jobs`` probes at once."""
    for version in versions:
        install(version)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return dict(zip(versions, pool.map(probe, versions)))


def row(report: dict) -> list[str]:
    if "error" in report:
        return [report["version"], "error"] + [""] * 6
    target, result = report["target"], report.get("selftest") or {}
    cases = result.get("cases") or []
    wrong = ", ".join(f"{c['rows_wrong_without_guard']}/{c['tokens']}" for c in cases) or "–"
    with_guard = ("bit-identical" if cases and all(c["identical_with_guard"] for c in cases)
                  else "DIFFERENT" if cases else "–")
    hookless = ("untouched" if cases and all(c["hookless_untouched"] for c in cases)
                else "CHANGED" if cases else "–")
    weights = ("yes" if cases and all(c["guarded_launches"] == [WEIGHT_TMA_LAUNCH] * 2 for c in cases)
               else "no" if cases else "–")
    outcome = {True: "PASS", False: "FAIL", None: "not needed"}[result.get("passed")]
    return [report["version"], str(target.get("strategy")), "yes" if target.get("native_guard") else "no",
            wrong, with_guard, weights, hookless, outcome]


def markdown(reports: list[dict]) -> str:
    return tables.markdown(["sglang", "strategy", "native guard", "rows wrong without the guard", "with the guard",
                  "TMA weights", "hook-less calls", "self-test"], [row(r) for r in reports])


def fusion_row(result: dict) -> list[str]:
    if "error" in result:
        return [result["version"], "error"] + [""] * 4
    yes = {True: "fusion off", False: "untouched"}
    early = result["resolved_before_plugins"]["child"]
    warned = " (warned)" if any("WILL BE WRONG" in line for line in result["warnings"]) else " (SILENT)"
    return [result["version"], result["hooked"], f"{yes[result['lora_paths']]} / {yes[result['enable_lora']]}",
            f"{yes[result['no_lora']]} / {yes[result['enable_lora_false_with_paths']]}",
            f"{yes[result['lora_forced_fusion']]}{warned}", yes[early]]


def fusion_markdown(results: list[dict]) -> str:
    return tables.markdown(["sglang", "hook on", "LoRA server (--lora-paths / --enable-lora), as a scheduler receives it",
                  "no LoRA / --enable-lora false", "fusion forced", "Engine(server_args=...) built before plugins"],
                 [fusion_row(r) for r in results])


def lora_row(result: dict) -> list[str]:
    if "error" in result or "lora_path" not in result:
        return [result["version"], "error"] + [""] * 4
    lp = result["lora_path"]
    yes = {True: "yes", False: "NO"}
    return [result["version"], f"{yes[lp['runner_looks_up_at_call_time']]} / {yes[lp['wrapper_placed']]}",
            "right (0.5.23 fix)" if lp["virtual_experts_fixed_upstream"]
            else "wrong (no a_output_slices): corrected by the guard",
            "given" if lp["token_lora_mapping_given"] else "from the segments",
            f"{'used' if lp['fast_hooks_used'] else 'NOT USED'}, error {lp['fast_max_rel_error']:.1e}",
            yes[lp["restored"]]]


def lora_markdown(results: list[dict]) -> str:
    return tables.markdown(["sglang", "runner looks the builder up at call time / guard's builder placed",
                  "SGLang's virtual-experts path on gated MoE (read from its code)", "token-to-adapter map",
                  "fast hooks (release's own LoRAInfo, fp32 reference)", "deactivate() restores"],
                 [lora_row(r) for r in results])


# --- the catalogue: one table per defect -------------------------------------------------------------

YES = {True: "yes", False: "no", None: "?"}


def presence_markdown(results: list[dict]) -> str:
    """Which release has which defect, read from its own files (X: present)."""
    from sglang_lora_tma_guard.defects import DEFECTS

    header = ["sglang"] + [f"`{d.id}`" for d in DEFECTS]
    rows = []
    for result in results:
        found = (result.get("catalogue") or {}).get("presence") or {}
        rows.append([result["version"]] + [{True: "X", False: "·", None: "?"}.get(found.get(d.id, {}).get("present"), "error")
                                           for d in DEFECTS])
    return tables.markdown(header, rows)


def _refused(result: dict, case: str) -> str:
    return "refused" if result["catalogue"]["refused"][case] else "starts"


LAYER_CASES = {"inplace-race": "inplace", "gate-up-layout": "gate_up_layout",
               "router-weight-on-input": "router_weight_on_input"}
LAYER_CASES.update({name: name.replace("-", "_") for name in (
    "stale-expert-slot", "rslora-scaling", "lora-patterns", "up-proj-only-experts", "peft-target-parameters",
    "one-sided-expert-targets", "shared-outer-at-runtime", "mixtral-target-names")})
"""The cases of harness/layer_probe.py, by defect."""


def _layer(layers: dict, version: str, case: str | None) -> dict:
    return (layers.get(version) or {}).get(case) or {"error": "not run"}


def _err(value) -> str:
    return f"{value:.1e}" if isinstance(value, float) else str(value)


def entry_cells(defect_id: str, result: dict, layer: dict) -> tuple[list[str], list[str]]:
    """(header, cells) after "sglang" and "in its code" for one defect on one release."""
    change, probe = result["catalogue"]["changes"], result.get("probes") or {}
    if defect_id == "inplace-race":
        off, on = layer.get("unguarded", layer), layer.get("guarded", layer)
        return (["unguarded: output written into its input, error", "guarded: output written into its input, error"],
                [f"{YES.get(off.get('aliases'), off.get('error'))}, {_err(off.get('rel_error'))}",
                 f"{YES.get(on.get('aliases'), on.get('error') or on.get('message'))}, {_err(on.get('rel_error'))}"])
    if defect_id == "gate-up-layout":
        off, on = layer.get("unguarded", layer), layer.get("guarded", layer)
        if "skipped" in layer:
            return (["unguarded error (adapter / base rows)", "guarded error (adapter / base rows)"], [layer["skipped"], ""])
        return (["unguarded error (adapter / base rows)", "guarded error (adapter / base rows)"],
                [f"{_err(off.get('adapter_rel_error', off.get('error')))} / {_err(off.get('base_rel_error'))}",
                 f"{_err(on.get('adapter_rel_error', on.get('error')))} / {_err(on.get('base_rel_error'))}"])
    if defect_id == "router-weight-on-input":
        off, on = layer.get("unguarded", layer), layer.get("guarded", layer)
        return (["unguarded error (adapter / base rows)", "guarded"],
                [f"{_err(off.get('adapter_rel_error', off.get('error')))} / {_err(off.get('base_rel_error'))}",
                 "refused" if on.get("refused") else _err(on.get("error", "started"))])
    adapter = ADAPTER_CELLS.get(defect_id)
    if adapter is not None:
        off, on = layer.get("unguarded", layer), layer.get("guarded", layer)
        return (["unguarded", "guarded"], [adapter(off), adapter(on)])
    if defect_id == "fused-sum-all-reduce":
        received = change["fused_sum_all_reduce"]
        return (["a LoRA server's flag, as a scheduler receives it"], ["off" if received is False else "ON"])
    if defect_id == "csgmv-segments":
        segments = probe.get("csgmv_segments") or {}
        right = {k: YES[v.get("right")] if isinstance(v, dict) else "?" for k, v in segments.items()}
        return (["--lora-backend csgmv, as a scheduler receives it", "MoE path right: csgmv / triton"],
                [str(change["csgmv"]), f"{right.get('csgmv', '?')} / {right.get('triton', '?')}"])
    if defect_id == "dp-attention":
        mapping = probe.get("dp_attention_mapping") or {}
        return (["guard: --enable-dp-attention --dp 2", "local layout: rank 1's delta on rank 0's tokens",
                 "TP-global layout (0.5.21+) marks"],
                [_refused(result, "dp_attention"), YES.get(mapping.get("wrong")), str(mapping.get("tp_global_marked", "–"))])
    if defect_id == "eplb-physical-experts":
        return (["guard: --ep 2 --enable-eplb / --ep-num-redundant-experts 2"],
                [f"{_refused(result, 'eplb')} / {_refused(result, 'redundant_experts')}"])
    if defect_id == "ngram-cuda-graph":
        return (["guard: --speculative-algorithm NGRAM"], [_refused(result, "ngram")])
    return (["the guard on this release"], ["see the table above"])


def _outcome(found) -> str:
    """A step of an adapter case: ``ok``, the exception SGLang raised, or the error of the served layer."""
    if isinstance(found, dict) and "raised" in found:
        return f"{found['raised']} at {found.get('at', '?')}"
    if isinstance(found, dict) and "rel_error" in found:
        return f"error {_err(found['rel_error'])}"
    return str(found)


def _served(found: dict) -> str:
    if "error" in found:
        return f"probe error: {found['error'][:60]}"
    fill = found.get("fill", "ok")
    return _outcome(fill) if fill != "ok" else f"error {_err(found.get('rel_error'))}"


ADAPTER_CELLS = {
    "stale-expert-slot": lambda f: (f"slot 1's down LoRA after Z: {_err((f.get('down_after_z') or {}).get('B'))}, "
                                    f"Z served with error {_err(f.get('z_rel_error'))}"),
    "rslora-scaling": lambda f: f"scaling {_err(f.get('sglang_scaling'))} (peft {_err(f.get('peft_scaling'))}), {_served(f)}",
    "lora-patterns": lambda f: (f"patterns: {_served(f.get('patterns') or {})}; rank above r: "
                                + (_outcome((f.get("rank_above_r") or {}).get("start")) if (f.get("rank_above_r") or {}).get(
                                    "start") != "ok" else _served(f.get("rank_above_r") or {}))),
    "up-proj-only-experts": _served,
    "peft-target-parameters": lambda f: ("load " + ("accepted" if (f.get("load") or {}).get("success") else "refused")
                                         + (f", first batch: {_outcome(f['first_batch'])}" if "first_batch" in f else "")
                                         + f"; the others: {_served(f.get('others') or {})}"),
    "one-sided-expert-targets": lambda f: (f"targets {f.get('targets')}, {len(f.get('wrapped') or [])} layers wrapped"
                                           + (f", {_served(f)}" if f.get("wrapped") else "")),
    "shared-outer-at-runtime": lambda f: ("load " + ("accepted" if (f.get("load") or {}).get("success") else "refused")
                                          + (f", {_served(f)}, experts with LoRA {sum(f.get('experts_with_lora') or [])}"
                                             if (f.get("load") or {}).get("success") else "")),
    "mixtral-target-names": lambda f: ("starts, " + _served(f)) if f.get("start") == "ok" else _outcome(f.get("start")),
}


def catalogue_markdown(results: list[dict], layers: dict) -> str:
    from sglang_lora_tma_guard.defects import DEFECTS

    parts = [presence_markdown(results)]
    for defect in DEFECTS:
        rows, header = [], []
        for result in results:
            if "error" in result or "catalogue" not in result:
                rows.append([result["version"], "error"])
                continue
            found = result["catalogue"]["presence"][defect.id]
            header, cells = entry_cells(defect.id, result, _layer(layers, result["version"], LAYER_CASES.get(defect.id)))
            rows.append([result["version"], f"{YES[found['present']]}: {found['evidence']}", *cells])
        parts.append(f"`{defect.id}` ({defect.releases}): {defect.title}\n\n"
                     + tables.markdown(["sglang", "in its code"] + header, rows))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=VERSIONS)
    parser.add_argument("--fusion-versions", nargs="+", default=FUSION_VERSIONS)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    reports = list(probe_all(args.versions, args.jobs).values())
    print(markdown(reports))
    serving = probe_all(args.fusion_versions, args.jobs, probe_serving)
    fusion = [found["fusion"] for found in serving.values()]
    print()
    print(fusion_markdown(fusion))
    print()
    print(lora_markdown(fusion))
    layers = {version: found["layers"] for version, found in serving.items()}
    print()
    print(catalogue_markdown(fusion, layers))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"tma": reports, "fusion": fusion, "layers": layers}, indent=1))
    failed = [r["version"] for r in reports if "error" in r or (r.get("selftest") or {}).get("passed") is False]
    failed += [r["version"] for r in fusion if "error" in r or not r["lora_paths"] or r["no_lora"]
               or not r["lora_path"]["fast_hooks_used"]]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
