"""Every release in range, from its own PyPI wheel: strategy, verdict and the real-kernel self-test."""


import pytest

from harness.tiny_moe import WEIGHT_TMA_LAUNCH  # noqa: E402
from scripts import version_matrix
from sglang_lora_tma_guard.inspection import release_tuple  # noqa: E402

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
def serving():
    """Every release 0.5.11-0.5.23 in one interpreter each, two at a time: its serving path with the guard
    on, then SGLang's own MoE layers wrapped by its own LoRA manager, unguarded and guarded."""
    return version_matrix.probe_all(version_matrix.FUSION_VERSIONS, probe=version_matrix.probe_serving)


@pytest.fixture(scope="module")
def fusion_results(serving):
    """The shared-expert fix, the LoRA MoE seam and the catalogue's launcher step, guard on."""
    return {version: found["fusion"] for version, found in serving.items()}


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


# --- the catalogue, release by release -----------------------------------------------------------------

RIGHT, WRONG = 5e-3, 0.1


@pytest.mark.parametrize("version", version_matrix.FUSION_VERSIONS)
def test_every_defect_is_read_from_each_releases_own_files_as_the_reviews_date_it(fusion_results, version):
    """Presence comes from the release's code; the releases the reviews give come from their reading:
    the two agree on every release (a fork or a source build is read from its code alone)."""
    from sglang_lora_tma_guard.defects import DEFECTS

    presence = fusion_results[version]["catalogue"]["presence"]
    assert {d.id: presence[d.id]["present"] for d in DEFECTS} == {d.id: d.in_range(version) for d in DEFECTS}


@pytest.mark.parametrize("version", version_matrix.FUSION_VERSIONS)
def test_each_releases_own_server_arguments_get_the_launchers_changes_and_refusals(fusion_results, version):
    from sglang_lora_tma_guard.defects import BY_ID

    found = fusion_results[version]["catalogue"]
    assert found["changes"]["fused_sum_all_reduce"] is False  # as a spawned scheduler receives it
    assert found["changes"]["csgmv"] == ("triton" if BY_ID["csgmv-segments"].in_range(version) else "csgmv")
    refused = {case: bool(text) for case, text in found["refused"].items()}
    assert refused == {"dp_attention": BY_ID["dp-attention"].in_range(version), "eplb": True,
                       "redundant_experts": True, "ngram": BY_ID["ngram-cuda-graph"].in_range(version),
                       "plain_lora_server": False}


@pytest.mark.parametrize("version", version_matrix.FUSION_VERSIONS)
def test_csgmv_and_dp_attention_shown_on_each_releases_own_code(fusion_results, version):
    from sglang_lora_tma_guard.defects import BY_ID

    probes = fusion_results[version]["probes"]
    segments, mapping = probes["csgmv_segments"], probes["dp_attention_mapping"]
    assert segments["triton"]["right"] is True  # what the guard makes a 0.5.11 LoRA server run
    assert segments["csgmv"]["right"] is not BY_ID["csgmv-segments"].in_range(version)
    assert mapping["wrong"] is True  # the local layout, on every release
    fixed = not BY_ID["dp-attention"].in_range(version)
    assert mapping["fixed_upstream"] is fixed and (mapping.get("tp_global_marked") == [3, 4]) is fixed


@pytest.fixture(scope="module")
def layers(serving):
    """SGLang's own MoE layers wrapped by its own LoRA manager, unguarded and guarded."""
    return {version: found["layers"] for version, found in serving.items()}


@pytest.mark.parametrize("version", version_matrix.FUSION_VERSIONS)
def test_each_releases_own_lora_moe_layer_against_the_reference_unguarded_and_guarded(layers, version):
    from sglang_lora_tma_guard.defects import BY_ID

    found = layers[version]
    assert "error" not in found, found.get("error")
    inplace = found["inplace"]
    assert inplace["unguarded"]["aliases"] is BY_ID["inplace-race"].in_range(version)
    assert inplace["guarded"]["aliases"] is False and inplace["guarded"]["rel_error"] < RIGHT
    layout = found["gate_up_layout"]
    if BY_ID["gate-up-layout"].in_range(version):
        assert layout["unguarded"]["adapter_rel_error"] > WRONG and layout["unguarded"]["base_rel_error"] > WRONG
        assert layout["guarded"]["adapter_rel_error"] < RIGHT and layout["guarded"]["base_rel_error"] < RIGHT
    router = found["router_weight_on_input"]
    assert router["unguarded"]["adapter_rel_error"] > WRONG and router["unguarded"]["base_rel_error"] < RIGHT
    assert router["guarded"]["refused"] and "router weight" in router["guarded"]["reasons"][0]


@pytest.mark.parametrize("version", version_matrix.FUSION_VERSIONS)
def test_each_releases_own_lora_manager_loader_and_pool_take_the_adapters_right_only_guarded(layers, version):
    """SGLang's own LoRAManager (its constructor, --lora-paths, /load_lora_adapter, init_lora_modules) and
    memory pool on every release, each adapter served against the float32 reference of it as peft defines
    it; without the guard each one is wrong, crashes or is dropped, as the reviews say."""
    from sglang_lora_tma_guard.defects import BY_ID

    found = layers[version]
    stale = found["stale_expert_slot"]
    assert (stale["unguarded"]["down_after_z"]["B"] > 0) is BY_ID["stale-expert-slot"].in_range(version)
    assert stale["guarded"]["down_after_z"] == {"A": 0.0, "B": 0.0} and stale["guarded"]["z_rel_error"] < RIGHT
    rs = found["rslora_scaling"]
    assert rs["unguarded"]["rel_error"] > WRONG and rs["guarded"]["rel_error"] < RIGHT
    # A slot's MoE B past the rank of the adapter now in it: zero on every release, with or without the guard (what
    # the fused down GEMM's B tiles used as loaded would rely on); the larger adapter before it had ranks there.
    for side in ("unguarded", "guarded"):
        tails = found["rank_tails"][side]
        assert min(tails["after_x"].values()) > 0 and set(tails["after_w"].values()) == {0.0}, (side, tails)
    patterns = found["lora_patterns"]
    assert patterns["unguarded"]["patterns"]["fill"]["raised"] == "AssertionError"
    assert patterns["guarded"]["patterns"]["rel_error"] < RIGHT
    assert "rank_pattern gives" in patterns["guarded"]["rank_above_r"]["start"]["message"]
    up = found["up_proj_only_experts"]
    assert up["unguarded"]["fill"]["raised"] == "ValueError" and up["guarded"]["rel_error"] < RIGHT
    fused = found["peft_target_parameters"]
    assert fused["unguarded"]["load"]["success"] and fused["unguarded"]["first_batch"]["raised"] == "ValueError"
    assert not fused["guarded"]["load"]["success"] and fused["guarded"]["others"]["rel_error"] < RIGHT
    sided = found["one_sided_expert_targets"]
    assert sided["unguarded"]["wrapped"] == [] and sided["guarded"]["rel_error"] < RIGHT
    outer = found["shared_outer_at_runtime"]
    assert outer["unguarded"]["load"]["success"] and outer["unguarded"]["experts_with_lora"] == [True, False, False, False]
    assert not outer["guarded"]["load"]["success"] and not outer["guarded"]["reverse"]["load"]["success"]
    mixtral = found["mixtral_target_names"]
    assert mixtral["unguarded"]["start"]["raised"] == "NotImplementedError" and mixtral["guarded"]["rel_error"] < RIGHT
