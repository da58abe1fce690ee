"""Every release in range, from its own PyPI wheel: strategy, verdict and the real-kernel self-test."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import version_matrix  # noqa: E402

from sglang_lora_tma_guard.inspection import release_tuple  # noqa: E402
from sglang_lora_tma_guard.tiny_moe import WEIGHT_TMA_LAUNCH  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def reports():
    """Every release's report, two fresh interpreters at a time (one per core), as the script runs them."""
    return version_matrix.probe_all(version_matrix.VERSIONS)


@pytest.mark.parametrize("version", version_matrix.AFFECTED)
def test_affected_release_is_wrong_unguarded_and_bit_identical_guarded(reports, version):
    report = reports[version]
    assert "error" not in report, report.get("error")
    assert report["environment"]["sglang"] == version
    assert report["target"]["strategy"] == "weight_tma" and not report["target"]["native_guard"]
    assert report["verdict"]["status"] == "exposed" and report["exit_code"] == 1  # switch is off
    result = report["selftest"]
    assert result["passed"] is True and result["exposed_without_guard"] is True
    for case in result["cases"]:
        assert case["rows_wrong_without_guard"] == case["tokens"]
        assert case["identical_with_guard"] and case["max_abs_diff_with_guard"] == 0.0
        assert case["hookless_untouched"]
        assert case["guarded_launches"] == [WEIGHT_TMA_LAUNCH] * 2


@pytest.mark.parametrize("version", version_matrix.FIXED)
def test_fixed_release_is_recognised_and_sped_up(reports, version):
    report = reports[version]
    assert "error" not in report, report.get("error")
    assert report["target"]["strategy"] == "weight_tma" and report["target"]["native_guard"]
    # Not affected by the TMA bug; without the guard, a fused shared expert depends on the model.
    assert report["verdict"]["status"] == "unknown" and report["exit_code"] == 2
    assert "turns TMA off for LoRA-hooked calls itself" in report["verdict"]["message"]
    result = report["selftest"]
    assert result["passed"] is True and result["exposed_without_guard"] is False
    for case in result["cases"]:
        assert case["identical_with_guard"] and case["guarded_launches"] == [WEIGHT_TMA_LAUNCH] * 2


@pytest.fixture(scope="module")
def fusion_results():
    """The shared-expert fix on every release 0.5.11-0.5.23, guard on, two releases at a time."""
    return version_matrix.probe_all(version_matrix.FUSION_VERSIONS, probe=version_matrix.probe_fusion)


@pytest.mark.parametrize("version", version_matrix.FUSION_VERSIONS)
def test_every_release_gives_a_lora_server_fusion_off_and_leaves_the_rest(fusion_results, version):
    result = fusion_results[version]
    assert "error" not in result, result.get("error")
    assert result["version"] == version and result["fix_active"] is True
    # From 0.5.19 resolution is its own method; from 0.5.20 a __post_init__ hook would never run.
    resolves_once = release_tuple(version) >= (0, 5, 19)
    assert result["hooked"] == ("ServerArgs.resolve_once" if resolves_once else "ServerArgs.__post_init__")
    # As a spawned child receives it (SGLang pickles the record into each scheduler):
    assert result["lora_paths"] is True and result["enable_lora"] is True
    assert result["no_lora"] is False and result["enable_lora_false_with_paths"] is False
    assert result["lora_forced_fusion"] is False
    assert result["resolved_before_plugins"]["child"] is True


@pytest.mark.parametrize("version", version_matrix.FUSION_VERSIONS)
def test_every_release_takes_the_fast_lora_hooks_through_its_own_builder(fusion_results, version):
    """The seam (SGLang's runner looks ``build_lora_hooks`` up when it runs) and the fast hooks on the
    release's own ``LoRAInfo``; its virtual-experts path judged from its code (fixed in 0.5.23)."""
    result = fusion_results[version]["lora_path"]
    assert result["runner_looks_up_at_call_time"] and result["wrapper_placed"]
    assert result["mode_with_guard_on"] == "correct"
    assert result["virtual_experts_fixed_upstream"] == (release_tuple(version) >= (0, 5, 23))
    assert result["token_lora_mapping_given"] == (release_tuple(version) >= (0, 5, 13))
    assert result["fast_hooks_used"] and result["fast_max_rel_error"] < 2e-3
    assert result["restored"]
