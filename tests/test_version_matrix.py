"""Every release in range, from its own PyPI wheel: strategy, verdict and the real-kernel self-test."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import version_matrix  # noqa: E402
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
    assert report["verdict"]["status"] == "not-affected" and report["exit_code"] == 0
    result = report["selftest"]
    assert result["passed"] is True and result["exposed_without_guard"] is False
    for case in result["cases"]:
        assert case["identical_with_guard"] and case["guarded_launches"] == [WEIGHT_TMA_LAUNCH] * 2
