"""check --model-path: the deployment's MoE shape, its shared-expert fusion, and SGLang 0.5.16's own answer about TMA."""

from __future__ import annotations

import json

import pytest

from sglang_lora_tma_guard import check
from sglang_lora_tma_guard.exposure import ExposureError, fused_shared_experts, load_config, moe_shape

BLOCK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
MODELS = {
    # A DeepSeek-V3 / GLM-5-style model: 256 routed experts + 1 shared, block-fp8.
    "block-fp8-256": {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256,
                      "n_shared_experts": 1, "moe_intermediate_size": 2048, "hidden_size": 7168,
                      "num_experts_per_tok": 8, "quantization_config": BLOCK_FP8},
    "bf16-moe-128": {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                     "moe_intermediate_size": 768, "hidden_size": 2048, "num_experts_per_tok": 8,
                     "torch_dtype": "bfloat16"},
    "bf16-moe-256": {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 256,
                     "moe_intermediate_size": 4096, "hidden_size": 4096, "num_experts_per_tok": 8},
    "dense": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336},
    "awq-moe": {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "moe_intermediate_size": 768,
                "hidden_size": 2048, "num_experts_per_tok": 8, "quantization_config": {"quant_method": "awq"}},
}


@pytest.mark.parametrize("architecture, routed, config, fused", [
    ("DeepseekV3ForCausalLM", 256, {"n_shared_experts": 1}, 1),
    ("GlmMoeDsaForCausalLM", 256, {"n_shared_experts": 1}, 1),       # GLM-5 / 5.1
    ("DeepseekV3ForCausalLM", 64, {"n_shared_experts": 1}, 0),        # only 256 routed experts fuse
    ("DeepseekV3ForCausalLM", 256, {"n_shared_experts": 2}, 0),
    ("Glm4MoeForCausalLM", 160, {"n_shared_experts": 1}, 1),          # GLM-4.5: any count fuses
    ("Glm4MoeForCausalLM", 16, {"n_shared_experts": 1}, 1),
    ("Glm4MoeLiteForCausalLM", 64, {"n_shared_experts": 1}, 1),
    ("MiniMaxM3SparseForCausalLM", 64, {"n_shared_experts": 1}, 1),
    ("Qwen3NextForCausalLM", 512, {"shared_expert_intermediate_size": 512, "moe_intermediate_size": 512}, 1),
    ("Qwen3NextForCausalLM", 512, {"shared_expert_intermediate_size": 1024, "moe_intermediate_size": 512}, 0),
    ("Qwen3MoeForCausalLM", 128, {}, 0),
])
def test_which_models_sglang_fuses_the_shared_expert_of(architecture, routed, config, fused):
    assert fused_shared_experts(architecture, routed, config) == fused


@pytest.fixture
def model(tmp_path):
    def write(name):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(MODELS[name]))
        return str(folder)

    return write


def run(capsys, *args):
    code = check.main(["--json", *args])
    return code, json.loads(capsys.readouterr().out)


def sglang_down_tma(E, N, dtype, block, device):
    """SGLang 0.5.16's own lookup, asked directly with the shape written out by hand."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as lookup

    from sglang_lora_tma_guard.exposure import _device_name

    with _device_name(device):
        configs = lookup.get_moe_configs.__wrapped__(E, N, dtype, *(block or (0, 0)), down_moe=True) or {}
    return {int(m): bool(c.get("USE_TMA", False)) for m, c in configs.items()}


@pytest.mark.real
def test_block_fp8_256_expert_model_at_tp8_on_h200_is_exposed(model, capsys):
    code, report = run(capsys, "--model-path", model("block-fp8-256"), "--tp", "8",
                       "--device-name", "NVIDIA H200")
    shape = report["exposure"]["shape"]
    assert (shape["experts_per_rank"], shape["intermediate_per_shard"], shape["fused_shared_experts"]) == (257, 256, 1)
    expected = sglang_down_tma(257, 256, "fp8_w8a8", (128, 128), "NVIDIA H200")
    assert {int(m): v for m, v in report["exposure"]["buckets"].items()} == expected
    assert any(expected.values())
    assert code == 1 and report["verdict"]["status"] == "exposed"
    assert "takes the TMA down path" in report["verdict"]["message"]
    assert "fuses this model's shared expert (E=257)" in report["verdict"]["message"]


@pytest.mark.real
def test_with_the_guard_the_server_builds_the_unfused_shape_and_its_tma_answer_is_used(model, capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_LORA_TMA_GUARD", "1")
    code, report = run(capsys, "--model-path", model("block-fp8-256"), "--tp", "8",
                       "--device-name", "NVIDIA H200")
    found = report["exposure"]
    assert found["shared_expert"] == {"sglang_fuses": True, "turned_off_by": "guard", "experts_per_rank_fused": 257}
    assert (found["shape"]["experts_per_rank"], found["shape"]["fused_shared_experts"]) == (256, 0)
    # SGLang 0.5.16 has no current-Triton E=256,N=256 H200 down config: its lookup falls back.
    assert {int(m): v for m, v in found["buckets"].items()} == sglang_down_tma(256, 256, "fp8_w8a8", (128, 128),
                                                                               "NVIDIA H200")
    assert code == 0 and report["verdict"]["status"] == "protected"
    assert "LoRA servers run with shared-experts fusion off" in report["verdict"]["message"]


@pytest.mark.real
def test_bf16_moe_on_h200_never_takes_the_tma_path(model, capsys):
    code, report = run(capsys, "--model-path", model("bf16-moe-128"), "--tp", "4",
                       "--device-name", "NVIDIA H200")
    assert sglang_down_tma(128, 192, None, None, "NVIDIA H200") == {int(m): v for m, v in report["exposure"]["buckets"].items()}
    assert not report["exposure"]["tma_anywhere"]
    # Without the guard and without an adapter to read, only the adapter defects are open.
    message = report["verdict"]["message"]
    assert code == 2 and report["verdict"]["status"] == "unknown" and "--adapter PATH" in message
    assert "never takes the TMA down path" in message and "TMA down path at batch" not in message


@pytest.mark.real
def test_bf16_256_expert_model_on_h20_is_exposed(model, capsys):
    code, report = run(capsys, "--model-path", model("bf16-moe-256"), "--tp", "8", "--device-name", "NVIDIA H20")
    shape = report["exposure"]["shape"]
    assert (shape["experts_per_rank"], shape["intermediate_per_shard"], shape["dtype"]) == (256, 512, None)
    assert {int(m): v for m, v in report["exposure"]["buckets"].items()} == sglang_down_tma(256, 512, None, None, "NVIDIA H20")
    assert report["exposure"]["tma_anywhere"] and code == 1


@pytest.mark.real
@pytest.mark.parametrize("args, E, N, exposed", [
    (["--tp", "8", "--ep", "8"], 32, 2048, False),           # expert parallel: no fusion, whole experts
    (["--tp", "8", "--no-shared-experts-fusion"], 256, 256, False),
])
def test_parallel_layout_changes_the_shape_and_the_answer(model, capsys, args, E, N, exposed):
    code, report = run(capsys, "--model-path", model("block-fp8-256"), *args, "--device-name", "NVIDIA H200")
    shape = report["exposure"]["shape"]
    assert (shape["experts_per_rank"], shape["intermediate_per_shard"]) == (E, N)
    assert report["exposure"]["tma_anywhere"] is exposed
    expected = sglang_down_tma(E, N, "fp8_w8a8", (128, 128), "NVIDIA H200")
    assert {int(m): v for m, v in report["exposure"]["buckets"].items()} == expected


@pytest.mark.real
@pytest.mark.parametrize("name, args, reason", [
    ("dense", [], "is not a Mixture-of-Experts model"),
    ("awq-moe", [], "unknown quantization 'awq'"),
    (None, [], "no config.json at"),
    ("block-fp8-256", ["--tp", "8", "--ep", "3"], "must divide"),
])
def test_bad_input_gets_one_line_and_exit_2(model, capsys, tmp_path, name, args, reason):
    path = model(name) if name else str(tmp_path / "missing")
    code, report = run(capsys, "--model-path", path, *args)
    assert code == 2 and report["verdict"]["status"] == "unknown"
    assert reason in report["verdict"]["message"] and "\n" not in report["verdict"]["message"]


@pytest.mark.real
def test_text_output_names_the_shape_and_the_buckets(model, capsys):
    check.main(["--model-path", model("block-fp8-256"), "--tp", "8", "--device-name", "NVIDIA H200"])
    out = capsys.readouterr().out
    assert "E=257 (256 routed / ep 1 + 1 fused shared), N=256, hidden 7168, top-8" in out
    assert "shared expert     SGLang fuses it by default (E=257); fusion ON: LoRA adapters read" in out
    assert "TMA down path     batch sizes 1-" in out


@pytest.mark.real
def test_config_json_path_works_as_well_as_its_folder(model):
    folder = model("bf16-moe-128")
    assert load_config(folder) == load_config(folder + "/config.json")
    with pytest.raises(ExposureError):
        moe_shape(load_config(folder), tp=5)  # 768 does not split five ways
