"""``python -m sglang_lora_tma_guard.check``: verdicts and exit codes, on real SGLang and on fakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_sglang import write_tree
from scenario import run_check

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.real
class TestOnRealSGLang:
    def test_unprotected_server_environment_exits_1_and_says_what_to_set(self):
        code, out, _ = run_check()
        assert code == 1
        assert out.splitlines()[-1].startswith("EXPOSED: SGLang 0.5.16")
        assert "set SGLANG_LORA_TMA_GUARD=1" in out
        assert "strategy          weight_tma" in out

    @pytest.mark.slow  # a fresh interpreter importing SGLang each
    def test_switch_on_exits_0_protected(self):
        code, out, _ = run_check(env={"SGLANG_LORA_TMA_GUARD": "1"})
        assert code == 0 and out.splitlines()[-1].startswith("PROTECTED: SGLang 0.5.16 is affected")
        assert "wrapper installs  yes" in out
        assert "shared-expert fix works here: a LoRA server's arguments come out with fusion off (hook on " \
               "ServerArgs.__post_init__)" in out

    @pytest.mark.slow  # a fresh interpreter importing SGLang each
    def test_plain_switch_reports_the_plain_fix(self):
        code, out, _ = run_check(env={"SGLANG_LORA_TMA_GUARD": "plain"})
        assert code == 0 and "strategy          flag" in out and "(on, plain fix)" in out
        assert "MoE calls with down_moe_use_tma=False; LoRA servers run with shared-experts fusion off" in out

    @pytest.mark.slow  # a fresh interpreter importing SGLang each
    def test_allow_list_without_the_plugin_is_not_protected(self):
        code, out, _ = run_check(env={"SGLANG_LORA_TMA_GUARD": "1", "SGLANG_PLUGINS": "other"})
        assert code == 1 and "add lora_tma_guard to SGLANG_PLUGINS" in out

    @pytest.mark.slow  # a fresh interpreter importing SGLang each
    def test_json_report_has_a_schema_version_and_the_verdict(self):
        code, out, _ = run_check("--json", env={"SGLANG_LORA_TMA_GUARD": "on"})
        report = json.loads(out)
        assert code == 0 and report["schema_version"] == 4
        assert report["verdict"] == {
            "status": "protected", "exit_code": 0, "message": report["verdict"]["message"]}
        assert report["target"]["strategy"] == "weight_tma"
        assert report["target"]["flag_parameter"] == "positional #10"
        assert report["guard"]["entry_point"] == "lora_tma_guard = sglang_lora_tma_guard.plugin:register"
        assert report["environment"]["sglang"] == "0.5.16"


@pytest.mark.parametrize(
    "version, shape, switch, code, status",
    [pytest.param("0.5.17", "0.5.17", "1", 0, "PROTECTED", marks=pytest.mark.slow),
     ("0.5.23", "0.5.23", "1", 0, "PROTECTED"),
     pytest.param("0.5.16.dev3+renamed", None, "1", 0, "PROTECTED", marks=pytest.mark.slow),
     pytest.param("0.5.11", "0.5.11", "1", 0, "PROTECTED", marks=pytest.mark.slow),
     # Without the guard a fixed release still serves LoRA wrongly on a fused shared expert.
     ("0.5.23", "0.5.23", "0", 2, "UNKNOWN")],
)
def test_verdict_per_release_shape(tmp_path, version, shape, switch, code, status):
    returncode, out, _ = run_check(tree=write_tree(tmp_path, version, shape),
                                   env={"SGLANG_LORA_TMA_GUARD": switch})
    assert (returncode, out.splitlines()[-1].split(":")[0]) == (code, status)


@pytest.mark.slow  # a fresh interpreter importing torch
def test_sglang_before_0_5_11_is_not_affected(tmp_path):
    code, out, _ = run_check(tree=write_tree(tmp_path, "0.5.10.post1", "0.5.16", with_function=False))
    assert code == 0 and "SGLang before 0.5.11" in out.splitlines()[-1]


def test_sglang_missing_exits_2_without_a_traceback(tmp_path):
    code, out, err = run_check(no_site=tmp_path)
    assert code == 2
    assert out.splitlines()[-1] == "UNKNOWN: SGLang is not installed in this Python environment"
    assert "Traceback" not in out + err


@pytest.mark.slow  # a fresh interpreter importing torch
def test_sglang_that_cannot_be_imported_exits_2_with_the_reason(tmp_path):
    tree = write_tree(tmp_path, "0.5.16")
    (tree / "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py").write_text(
        "import a_kernel_package_that_is_missing\n")
    code, out, err = run_check("--json", tree=tree)
    report = json.loads(out)
    assert code == 2 and report["verdict"]["status"] == "unknown"
    assert "No module named 'a_kernel_package_that_is_missing'" in report["verdict"]["message"]
    assert "Traceback" not in err
