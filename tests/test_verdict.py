"""``check``'s one verdict, per combination of what it found (no SGLang needed)."""

from __future__ import annotations

import pytest

from sglang_lora_tma_guard.check import EXIT_EXPOSED, EXIT_OK, EXIT_UNKNOWN, verdict


def report(strategy="weight_tma", native=False, switch=True, entry=True, admitted=True, installs=True,
           exposure=None, selftest=None, importable=True):
    target = {"importable": importable, "error": None if importable else "cannot import it",
              "strategy": strategy, "reason": f"reason of {strategy}", "native_guard": native}
    guard = {"switch": {"enabled": switch}, "entry_point": "lora_tma_guard = x" if entry else None,
             "admitted_by_sglang_plugins": admitted, "wrapper_installs": installs}
    found = {"environment": {"sglang": "0.5.16"}, "target": target, "guard": guard}
    if exposure is not None:
        found["exposure"] = exposure
    if selftest is not None:
        found["selftest"] = selftest
    return found


def exposure(tma: bool):
    return {"shape": {"architecture": "DeepseekV3ForCausalLM", "tp": 8, "ep": 1, "experts_per_rank": 257,
                      "intermediate_per_shard": 256},
            "device_name": "NVIDIA H200", "tma_anywhere": tma, "buckets": {"1": tma, "64": tma, "1024": tma}}


CASES = {
    "sglang-not-importable": (report(importable=False), "unknown", EXIT_UNKNOWN, "cannot import"),
    "exposure-error": (report(exposure={"error": "no config.json"}), "unknown", EXIT_UNKNOWN, "no config.json"),
    "selftest-could-not-run": (report(selftest={"passed": False, "error": "boom"}), "unknown", EXIT_UNKNOWN,
                               "could not run: boom"),
    "selftest-failed": (report(selftest={"passed": False}), "exposed", EXIT_EXPOSED, "self-test FAILED"),
    "absent": (report(strategy="absent"), "not-affected", EXIT_OK, "reason of absent"),
    "unsupported": (report(strategy="unsupported"), "exposed", EXIT_EXPOSED, "needs the upstream fix"),
    "deployment-never-takes-tma": (report(switch=False, exposure=exposure(False)), "not-affected", EXIT_OK,
                                   "never takes the TMA down path"),
    "native-plain": (report(strategy="native", native=True), "not-affected", EXIT_OK, "turns TMA off"),
    "native-speed-up-on": (report(native=True), "not-affected", EXIT_OK, "a speed-up"),
    "native-speed-up-off": (report(native=True, switch=False), "not-affected", EXIT_OK, "not active"),
    "switch-off": (report(switch=False), "exposed", EXIT_EXPOSED, "set SGLANG_LORA_TMA_GUARD=1"),
    "not-allow-listed": (report(admitted=False), "exposed", EXIT_EXPOSED, "add lora_tma_guard to SGLANG_PLUGINS"),
    "no-entry-point": (report(entry=False), "exposed", EXIT_EXPOSED, "reinstall"),
    "wrapper-did-not-install": (report(installs=False), "exposed", EXIT_EXPOSED, "report this"),
    "protected-weight-tma": (report(), "protected", EXIT_OK, "TMA for the weights"),
    "protected-flag": (report(strategy="flag"), "protected", EXIT_OK, "with down_moe_use_tma=False"),
    "protected-fallback": (report(strategy="fallback"), "protected", EXIT_OK, "own route-major kernels"),
    "protected-deployment": (report(exposure=exposure(True)), "protected", EXIT_OK,
                             "takes the TMA down path at batch sizes 1-1024"),
    "exposed-deployment": (report(switch=False, exposure=exposure(True)), "exposed", EXIT_EXPOSED,
                           "DeepseekV3ForCausalLM at tp 8"),
    "selftest-passed": (report(selftest={"passed": True}), "protected", EXIT_OK, "SGLang 0.5.16 is affected"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_verdict_per_combination(case):
    found, status, code, phrase = CASES[case]
    result = verdict(found)
    assert (result["status"], result["exit_code"]) == (status, code), result
    assert phrase in result["message"], result["message"]
