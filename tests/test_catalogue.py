"""The catalogue itself: one entry per defect, the README's table made from it, presence read from the
installed SGLang's own files, and the launcher's decisions on SGLang 0.5.16's own ServerArgs."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_lora_tma_guard import serving
from sglang_lora_tma_guard.catalogue import Deployment, RefusedDeployment, Remedy, definition, source_of
from sglang_lora_tma_guard.defects import BY_ID, DEFECTS, markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"
MOE = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 16, "n_shared_experts": 1,
       "num_experts_per_tok": 4, "moe_intermediate_size": 64, "hidden_size": 256}
DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000}


def test_every_entry_says_what_it_is_and_what_the_guard_does():
    assert len(BY_ID) == len(DEFECTS) == 19
    for defect in DEFECTS:
        assert re.fullmatch(r"[a-z0-9-]+", defect.id)
        assert defect.title and defect.exposed and defect.does and isinstance(defect.remedy, Remedy)
        assert defect.in_range(defect.first) and defect.in_range(defect.last)
        assert not defect.in_range("0.5.10") and not defect.in_range("0.5.24")


def test_the_readme_table_is_the_catalogue():
    text = README.read_text()
    start = text.index("<!-- defect table")
    table = text[text.index("\n", start) + 1:text.index("<!-- end of defect table -->")].strip()
    assert table == markdown_table()


@pytest.mark.real
def test_on_sglang_0_5_16_presence_read_from_its_files_matches_the_reviewed_releases():
    """The code says what the reviews say, release by release (every release: tests/test_version_matrix.py)."""
    for defect in DEFECTS:
        assert defect.present().present is defect.in_range("0.5.16"), (defect.id, defect.present())


def test_sources_are_read_without_importing_sglang_or_torch():
    """What the launcher pays: every entry's presence read from files, in a fresh interpreter."""
    code = ("import sys; from sglang_lora_tma_guard.defects import DEFECTS; [d.present() for d in DEFECTS]; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('sglang.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    assert definition("sglang.srt.lora.layers", "FusedMoEWithLoRA._get_lora_info").startswith("def _get_lora_info")
    assert source_of("sglang.srt.no_such_module") is None and definition("sglang.srt.lora.layers", "Nope.x") is None


@pytest.mark.parametrize("fields, model, affects", [
    (dict(enable_lora=True, enable_dp_attention=True, dp_size=2), MOE, True),
    (dict(enable_lora=True, enable_dp_attention=True, dp_size=2), None, None),  # a scheduler will know
    (dict(enable_lora=True, enable_dp_attention=True, dp_size=2), DENSE, False),
    (dict(enable_lora=True, enable_dp_attention=True, dp_size=1), MOE, False),
    (dict(enable_lora=False, enable_dp_attention=True, dp_size=2), MOE, False),
])
def test_a_refusal_needs_lora_an_moe_model_and_the_flag(fields, model, affects):
    assert BY_ID["dp-attention"].affects(Deployment(SimpleNamespace(**fields), model)) is affects


# --- the launcher, on SGLang 0.5.16's own ServerArgs (its own resolution after the guard's step) -------


@pytest.fixture
def launcher(fm, tmp_path):
    def model(config):
        folder = tmp_path / config["architectures"][0]
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    serving.arm()
    yield model
    serving.disarm()


def server_args(**fields):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(**{"model_path": "dummy", "enable_lora": True, "device": "cpu", **fields})


def refusal(**fields) -> str | None:
    """The guard's refusal of these server arguments, or None (SGLang's own checks may still object
    after the guard's step: no GPU here)."""
    try:
        server_args(**fields)
    except RefusedDeployment as refused:
        return str(refused)
    except Exception:
        pass
    return None


@pytest.mark.real
@pytest.mark.parametrize("flags, phrase", [
    (dict(tp_size=2, dp_size=2, enable_dp_attention=True), "Drop --enable-dp-attention"),
    (dict(tp_size=2, ep_size=2, enable_eplb=True), "Drop --enable-eplb"),
    (dict(speculative_algorithm="NGRAM"), "Pass --disable-cuda-graph"),
])
def test_the_launcher_refuses_an_moe_deployment_before_anything_loads(launcher, flags, phrase):
    assert phrase in refusal(model_path=launcher(MOE), **flags)
    serving.disarm()
    assert refusal(model_path=launcher(MOE), **flags) is None  # SGLang alone goes on


@pytest.mark.real
def test_the_launcher_leaves_a_dense_model_and_a_server_without_lora_alone(launcher):
    for fields in (dict(model_path=launcher(DENSE)), dict(model_path=launcher(MOE), enable_lora=None)):
        assert refusal(tp_size=2, dp_size=2, enable_dp_attention=True, **fields) is None


@pytest.mark.real
def test_the_launcher_turns_off_the_fused_sum_all_reduce_for_lora_and_says_so(launcher, caplog):
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        record = server_args(enable_fused_moe_sum_all_reduce=True)
        untouched = server_args(enable_lora=None, enable_fused_moe_sum_all_reduce=True)
    assert record.enable_fused_moe_sum_all_reduce is False and untouched.enable_fused_moe_sum_all_reduce is True
    assert sum("--enable-fused-moe-sum-all-reduce is turned off" in m for m in caplog.messages) == 1
    assert record.lora_backend != "triton" or untouched.lora_backend == "triton"  # csgmv is right on 0.5.16


def test_one_supported_range_for_setup_cfg_the_inspection_and_the_version_matrix():
    import configparser

    from packaging.specifiers import SpecifierSet

    from scripts import version_matrix
    from sglang_lora_tma_guard.inspection import SUPPORTED_SGLANG

    setup = configparser.ConfigParser()
    setup.read(README.parent / "setup.cfg")
    assert setup["options.extras_require"]["sglang"].split() == [f"sglang{SUPPORTED_SGLANG}"]
    assert all(SpecifierSet(SUPPORTED_SGLANG).contains(v) for v in version_matrix.FUSION_VERSIONS)
