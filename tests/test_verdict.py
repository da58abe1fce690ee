"""``check``'s one verdict, per combination of what it found (no SGLang needed)."""

from __future__ import annotations

import pytest

from sglang_lora_tma_guard.check import (
    EXIT_EXPOSED,
    EXIT_OK,
    EXIT_UNKNOWN,
    Environment,
    FusionFixTrial,
    GuardReport,
    Report,
    SwitchReport,
    Target,
    verdict,
)
from sglang_lora_tma_guard.exposure import Exposure, MoEShape, SharedExpert
from sglang_lora_tma_guard.inspection import Strategy
from sglang_lora_tma_guard.selftest import SelfTestResult

ENVIRONMENT = Environment(python="3.11", sglang="0.5.16", torch=None, triton=None, wrapt=None, gpu=None,
                          gpu_compute_capability=None, triton_tensor_descriptors=True, gpu_has_tma=None)


def report(strategy="weight_tma", native=False, switch=True, entry=True, admitted=True, installs=True,
           exposure=None, selftest=None, importable=True, fix_takes=True, exposure_error=None):
    strategy = Strategy(strategy)
    target = Target("t", importable=importable, error=None if importable else "cannot import it",
                    strategy=strategy, reason=f"reason of {strategy.value}", native_guard=native)
    guard = GuardReport(
        switch=SwitchReport("SGLANG_LORA_TMA_GUARD", "1" if switch else None, switch, True, False),
        entry_point="lora_tma_guard = x" if entry else None, sglang_plugins=None,
        admitted_by_sglang_plugins=admitted,
        shared_expert_fix=FusionFixTrial("ServerArgs.__post_init__", fix_takes, None if fix_takes else "no hook registry"),
        wrapper_installs=installs, installed_strategy=strategy if installs else None)
    return Report(schema_version=4, tool={}, environment=ENVIRONMENT, sglang_version_note=None,
                  version_says_affected=None, target=target, guard=guard, exposure=exposure,
                  exposure_error=exposure_error, selftest=selftest)


def exposure(tma: bool, fuses: bool = True, turned_off_by: str | None = None):
    """A deployment: whether SGLang fuses its shared expert, who turns that off, and TMA buckets."""
    fused = fuses and not turned_off_by
    shape = MoEShape(architecture="DeepseekV3ForCausalLM", routed_experts=256, fused_shared_experts=int(fused),
                     experts_per_rank=257 if fused else 256, intermediate_per_shard=256, hidden_size=7168, topk=8,
                     dtype="fp8_w8a8", block_shape=(128, 128), tp=8, ep=1)
    return Exposure(model_path="m", shape=shape, shared_expert=SharedExpert(fuses, turned_off_by, 257),
                    device_name="NVIDIA H200", down_config_file="f", triton_tensor_descriptors=True,
                    buckets={1: tma, 64: tma, 1024: tma}, tma_anywhere=tma)


CASES = {
    "sglang-not-importable": (report(importable=False), "unknown", EXIT_UNKNOWN, "cannot import"),
    "exposure-error": (report(exposure_error="no config.json"), "unknown", EXIT_UNKNOWN, "no config.json"),
    "selftest-could-not-run": (report(selftest=SelfTestResult(passed=False, error="boom")), "unknown", EXIT_UNKNOWN,
                               "could not run: boom"),
    "selftest-failed": (report(selftest=SelfTestResult(passed=False)), "exposed", EXIT_EXPOSED, "self-test FAILED"),
    "absent": (report(strategy="absent"), "not-affected", EXIT_OK, "reason of absent"),
    "unsupported": (report(strategy="unsupported"), "exposed", EXIT_EXPOSED, "needs the upstream fix"),
    # The TMA bug, with the shared-expert fix on (or a model SGLang does not fuse).
    "deployment-never-takes-tma": (report(switch=False, exposure=exposure(False, fuses=False)), "not-affected",
                                   EXIT_OK, "never takes the TMA down path"),
    "native-plain": (report(strategy="native", native=True), "protected", EXIT_OK, "turns TMA off"),
    "native-speed-up-on": (report(native=True), "protected", EXIT_OK, "a speed-up"),
    "native-model-not-fused": (report(native=True, switch=False, exposure=exposure(True, fuses=False)),
                               "not-affected", EXIT_OK, "not active"),
    "switch-off": (report(switch=False), "exposed", EXIT_EXPOSED, "set SGLANG_LORA_TMA_GUARD=1"),
    "not-allow-listed": (report(admitted=False), "exposed", EXIT_EXPOSED, "add lora_tma_guard to SGLANG_PLUGINS"),
    "no-entry-point": (report(entry=False), "exposed", EXIT_EXPOSED, "reinstall"),
    "wrapper-did-not-install": (report(installs=False), "exposed", EXIT_EXPOSED, "wrapper did not install"),
    "protected-weight-tma": (report(), "protected", EXIT_OK, "TMA for the weights"),
    "protected-flag": (report(strategy="flag"), "protected", EXIT_OK, "with down_moe_use_tma=False"),
    "protected-fallback": (report(strategy="fallback"), "protected", EXIT_OK, "own route-major kernels"),
    "protected-deployment": (report(exposure=exposure(True, turned_off_by="guard")), "protected", EXIT_OK,
                             "takes the TMA down path at batch sizes 1-1024"),
    "exposed-deployment": (report(switch=False, exposure=exposure(True, fuses=False)), "exposed", EXIT_EXPOSED,
                           "DeepseekV3ForCausalLM at tp 8"),
    "selftest-passed": (report(selftest=SelfTestResult(passed=True)), "protected", EXIT_OK, "SGLang 0.5.16 is affected"),
    # A fused shared expert under LoRA.
    "fusing-model-guard-on": (report(native=True, exposure=exposure(False, turned_off_by="guard")), "protected",
                              EXIT_OK, "LoRA servers run with shared-experts fusion off"),
    "fusing-model-guard-off": (report(native=True, switch=False, exposure=exposure(False)), "exposed",
                               EXIT_EXPOSED, "fuses this model's shared expert (E=257)"),
    "fusing-model-user-disabled": (report(native=True, switch=False, exposure=exposure(False, turned_off_by="user")),
                                   "not-affected", EXIT_OK, "--disable-shared-experts-fusion"),
    "no-model-guard-off-fixed-release": (report(native=True, switch=False), "unknown", EXIT_UNKNOWN,
                                         "give --model-path"),
    "fix-does-not-take": (report(native=True, fix_takes=False), "unknown", EXIT_UNKNOWN, "no hook registry"),
    "fix-does-not-take-fusing-model": (report(native=True, fix_takes=False, exposure=exposure(False)), "exposed",
                                       EXIT_EXPOSED, "shared-expert fix did not take"),
    "both-bugs-guard-off": (report(switch=False, exposure=exposure(True)), "exposed", EXIT_EXPOSED,
                            "takes the TMA down path at batch sizes 1-1024"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_verdict_per_combination(case):
    found, status, code, phrase = CASES[case]
    result = verdict(found)
    assert (result.status, result.exit_code) == (status, code), result
    assert phrase in result.message, result.message


def test_both_bugs_are_named_when_both_are_exposed():
    message = verdict(CASES["both-bugs-guard-off"][0]).message
    assert "TMA down path" in message and "fuses this model's shared expert" in message



@pytest.mark.parametrize("buckets, text", [
    ({"1": True, "2": True, "4": True, "8": False, "16": True}, "1-4, 16"),
    ({"1": True, "64": False, "1024": True}, "1, 1024"),
    ({"1": False, "2": True, "4": True}, "2, 4"),
    ({"1": True, "2": True, "4": True}, "1-4"),
])
def test_tma_buckets_are_printed_as_the_runs_they_are(buckets, text):
    from sglang_lora_tma_guard.check.verdict import ranges

    assert ranges(buckets) == text
