"""check --selftest on the CPU: it passes with the guard and fails when the guard does not work."""

import functools

import pytest

from harness import tiny_moe
from sglang_lora_tma_guard import guard, selftest

pytestmark = pytest.mark.real


def test_selftest_passes_and_shows_the_exposure(fm):
    result = selftest.run("cpu")
    assert result.passed is True and result.exposed_without_guard is True
    assert result.strategy == "weight_tma"
    assert all(c["identical_with_guard"] and c["hookless_untouched"] for c in result.cases)
    assert all(c["guarded_launches"] == [tiny_moe.WEIGHT_TMA_LAUNCH] * 2 for c in result.cases)
    assert not guard.status().active  # left as it was found


def test_selftest_fails_when_the_wrapper_does_nothing(fm, monkeypatch):
    def do_nothing(original, inspection, variant=None, engaged=None):
        @functools.wraps(original)
        def passthrough(*args, **kwargs):
            return original(*args, **kwargs)

        return passthrough

    monkeypatch.setattr(guard, "make_guarded", do_nothing)
    result = selftest.run("cpu")
    assert result.passed is False
    assert all(c["guard_installed"] and not c["identical_with_guard"] for c in result.cases)
    assert selftest.render(result)[-1].strip() == "FAIL"


@pytest.mark.slow  # a fresh interpreter importing SGLang
def test_check_selftest_command_prints_pass_and_keeps_the_verdict(tmp_path):
    from scenario import run_check

    code, out, _ = run_check("--selftest", env={"SGLANG_LORA_TMA_GUARD": "1"})
    assert code == 0 and "  PASS" in out and out.splitlines()[-1].startswith("PROTECTED")
    assert "without the guard 17/17 rows wrong; with it bit-identical (TMA weights)" in out
