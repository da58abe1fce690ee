"""The fast LoRA MoE path (``SGLANG_LORA_TMA_GUARD=fast``) and the corrected virtual-experts path.

On SGLang 0.5.16's own ``LoRAInfo`` (laid out as its LoRA manager lays it out), its hook builder and
its MoE runner, on Triton's CPU interpreter, against the float32 PyTorch reference of the adapters'
math (``harness/reference.py``); the plugin is loaded by SGLang's ``load_plugins()``.

Tolerance. The caches are fp16 and every path adds a float32 delta into them: each result carries
fp16 roundings of values as large as the largest delta (2**-11 of it each). We ask the fast path for
no more error than SGLang's default path shows on the same inputs plus one fp16 step of the largest
delta (2**-10, relative), and for less than 2e-3 everywhere (measured: 3e-4 to 1e-3).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from harness import real_lora, tiny_moe
from harness.reference import ReferenceLoRAHooks, interpreter_fp8, reference_moe
from sglang_lora_tma_guard import fused_act, log, lora_moe, lora_path, tuning

pytestmark = pytest.mark.real

TOLERANCE = 2e-3
ONE_FP16_STEP = 2.0**-10
FAST = "sglang_lora_tma_guard.lora_path"


@dataclass(frozen=True)
class Case:
    topk: int = 2
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    enabled: tuple[bool, ...] = (True, True, True, True)
    gated: bool = True
    shared_outer: bool = False
    shared_expert_route: bool = False
    """The runner has one expert more than the LoRA buffers (a fused shared expert) and routes every
    token to it: no adapter has a delta for it (SGLang's default path reads another slot there)."""
    filtered: bool = False
    """Some routes are -1 (filtered out, as under expert parallelism)."""
    hidden: int = 128
    intermediate: int = 128
    padding: float = 0.0
    """What the LoRA buffers hold past each adapter's rank (``real_lora.Adapters.padding``)."""


CASES = {
    "mixed-ranks-top2": Case(),
    "top1": Case(topk=1),
    "top8": Case(topk=8),
    "ungated": Case(gated=False),
    "disabled-slot": Case(enabled=(True, False, True, True)),
    "shared-outer": Case(shared_outer=True),
    "fused-shared-expert-route": Case(shared_expert_route=True),
    "filtered-routes": Case(filtered=True),
    # No width a multiple of any tile (BLOCK_K 64/128, BLOCK_N 32/64): every kernel's last tile is partial.
    "odd-widths": Case(hidden=200, intermediate=72),
    # Ranks that no vector load divides (the expand loads B and t in runs of 8 ranks, then zeroes the
    # elements past each rank): the buffers' columns past them NaN, as no pool would leave them.
    "odd-ranks-nan-padding": Case(ranks=(5, 12, 24, 64), padding=float("nan")),
}
DEFAULT_RUN = {"mixed-ranks-top2"}  # the rest in the full run (CI)


def case_params():
    return [pytest.param(name, marks=() if name in DEFAULT_RUN else pytest.mark.slow) for name in CASES]


EXPERTS, TOKENS = 8, 10


def make_case(name: str, seed: int = 0, base_dtype=None, **changes):
    """The case's problem (block-fp8 experts, or ``base_dtype`` ones) and SGLang's ``LoRAInfo`` for it."""
    case = dataclasses.replace(CASES[name], **changes)
    weights = tiny_moe.make_weights(EXPERTS, case.hidden, case.intermediate, seed=seed, dtype=base_dtype)
    problem = tiny_moe.make_problem(num_tokens=TOKENS, topk=case.topk, seed=seed, weights=weights)
    ids = problem.topk_ids.clone()
    if case.shared_expert_route:
        ids[:, -1] = EXPERTS - 1
    if case.filtered:
        ids[::3, 0] = -1
    tiny_moe.reroute(problem, ids)
    adapters = real_lora.Adapters(ranks=case.ranks, enabled=case.enabled, gated=case.gated,
                                  shared_outer=case.shared_outer, padding=case.padding,
                                  lora_experts=EXPERTS - 1 if case.shared_expert_route else None)
    return problem, real_lora.make_lora_info(problem, adapters, seed=seed)


def run_hooks(hooks, problem, info):
    """Both hooks on fixed random caches; their deltas (gate-up, down)."""
    tokens, topk = problem.topk_ids.shape
    hidden, intermediate = problem.w2.shape[1], problem.w2.shape[2]
    gen = torch.Generator().manual_seed(5)
    c1 = torch.randn(tokens, topk, info.gate_up_lora_b_weights.shape[2], generator=gen).half()
    act = torch.randn(tokens * topk, intermediate, generator=gen).half()
    c3 = torch.randn(tokens, topk, hidden, generator=gen).half()
    before = c1.float(), c3.float()
    hooks.after_gate_up(problem.hidden_states, c1, problem.topk_weights, problem.topk_ids)
    hooks.after_down(act, c3, problem.topk_weights, problem.topk_ids)
    return c1.float() - before[0], c3.float() - before[1]


def errors(deltas, reference) -> list[float]:
    return [float((d - r).abs().max() / r.abs().max()) for d, r in zip(deltas, reference)]


@pytest.fixture(scope="module")
def runners(fm):
    real_lora.enable_cpu_lora_ops()
    from sglang.srt.lora import lora_moe_runners

    lora_path.deactivate()  # whatever an earlier test module armed: SGLang's own builder to start from
    return lora_moe_runners


def sglang_build(runners):
    """SGLang's own hook builder, whatever is installed on the module."""
    import inspect

    return inspect.unwrap(runners.build_lora_hooks)


@pytest.mark.parametrize("name", case_params())
def test_fast_hooks_add_each_adapters_delta(runners, name):
    problem, info = make_case(name)
    reference = run_hooks(ReferenceLoRAHooks(info), problem, info)
    assert min(r.abs().max() for r in reference) > 0.1  # the adapters do add something
    fast = run_hooks(lora_path.build_hooks(sglang_build(runners), problem.hidden_states, info, problem.topk_ids),
                     problem, info)
    # SGLang's default path on the same adapters as its pool lays them out (zeros past each rank).
    problem, zero_padded = make_case(name, padding=0.0)
    default = run_hooks(sglang_build(runners)(problem.hidden_states, zero_padded, problem.topk_ids), problem,
                        zero_padded)
    fast_err, default_err = errors(fast, reference), errors(default, reference)
    assert max(fast_err) < TOLERANCE, fast_err
    if CASES[name].shared_expert_route:
        # SGLang's default path reads another slot's weights there (or past the buffer: NaN counts as wrong).
        assert not all(e <= 0.1 for e in default_err), default_err
    else:
        assert all(f <= d + ONE_FP16_STEP for f, d in zip(fast_err, default_err)), (fast_err, default_err)


@pytest.mark.slow  # the default run sees it wrong in test_guard_corrects_sglangs_virtual_experts_path
@pytest.mark.parametrize("name", ["mixed-ranks-top2", "shared-outer", "ungated"])
def test_sglangs_virtual_experts_path_is_wrong_on_gated_moe_only(runners, name):
    problem, info = make_case(name)
    reference = run_hooks(ReferenceLoRAHooks(info), problem, info)
    ve_info = dataclasses.replace(info, lora_use_virtual_experts=True)
    with real_lora.cpu_virtual_experts():
        gate_up_err, down_err = errors(run_hooks(sglang_build(runners)(problem.hidden_states, ve_info, problem.topk_ids),
                                                 problem, info), reference)
    assert down_err < TOLERANCE
    if CASES[name].gated:  # the up half computed from the gate half's A
        assert gate_up_err > 0.3, gate_up_err
    else:
        assert gate_up_err < TOLERANCE, gate_up_err


@pytest.mark.slow
@pytest.mark.parametrize("block_m, config, case", [
    (16, lora_moe.StageConfig(split_k=2, shrink_block_k=64), "mixed-ranks-top2"),
    (32, lora_moe.StageConfig(shrink_block_r=32, expand_block_r=32, expand_block_n=32), "mixed-ranks-top2"),
    # 3 column tiles per expand program: widths 200 / 2 x 72 in tiles of 32 leave the last group part-empty.
    (16, lora_moe.StageConfig(expand_block_n=32, expand_n_tiles=3), "odd-widths"),
    # Every rank in one tile (64): t read once per program, the column loop the pipelined one.
    (16, lora_moe.StageConfig(expand_block_r=64, expand_block_n=32, expand_n_tiles=3), "odd-widths"),
    # Ranks of no multiple of 8 with NaN past them, through both expand paths.
    (16, lora_moe.StageConfig(expand_block_r=16), "odd-ranks-nan-padding"),
    (16, lora_moe.StageConfig(expand_block_r=64, expand_n_tiles=2), "odd-ranks-nan-padding"),
], ids=["split-k", "block-32", "column-tile-groups", "one-rank-tile", "odd-ranks", "odd-ranks-one-rank-tile"])
def test_tiles_and_routing_paths_agree_with_the_reference(runners, block_m, config, case, monkeypatch):
    """Split K (atomic adds), wider rank tiles, 32-row blocks, several column tiles per expand program,
    and the four-launch routing of large batches."""
    problem, info = make_case(case, seed=3)
    reference = run_hooks(ReferenceLoRAHooks(info), problem, info)
    monkeypatch.setattr(lora_moe, "ONE_PROGRAM_PAIRS", 0)
    plan = tuning.Plan(block_m, config, config)
    monkeypatch.setattr(tuning, "plan", lambda *args, **kwargs: plan)
    fast = run_hooks(lora_path.build_hooks(sglang_build(runners), problem.hidden_states, info, problem.topk_ids),
                     problem, info)
    assert max(errors(fast, reference)) < TOLERANCE


def test_the_shipped_tiles_name_only_known_tiles_in_rising_buckets():
    """``tuning`` drops a key StageConfig does not know (a newer table read by an older package): so the
    shipped table itself must hold none, each shape's buckets rising, blocks of 16, 32 or 64 rows."""
    names = {f.name for f in dataclasses.fields(lora_moe.StageConfig)}
    table = tuning._table(None)
    shapes = [buckets for gpu, per_gpu in table.items() if not gpu.startswith("_") for buckets in per_gpu.values()]
    assert len(shapes) >= 7
    for buckets in shapes:
        assert [b["max_pairs"] for b in buckets] == sorted({b["max_pairs"] for b in buckets}), buckets
        for entry in buckets:
            assert entry["block_m"] in (16, 32, 64), entry
            for hook in ("gate_up", "down"):
                assert set(entry[hook]) <= names, set(entry[hook]) - names


def test_an_h100_takes_its_own_tuned_buckets_and_the_h200s_for_the_rest_and_other_gpus_the_rule_of_thumb(monkeypatch, tmp_path):
    """An H100 SXM takes the buckets tuned on it, and the H200's (``tuning.TILES_OF``) for every other bucket and
    shape; any other GPU the rule of thumb. So with the shipped data and with a file of other H100 buckets."""
    import json

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"

    def sizes(shape_key: str, pairs: int) -> tuple:  # what tuning._plan takes, 4 adapters
        hidden, intermediate, experts, rank = (int(part.split("=")[1]) for part in shape_key.split())
        return pairs, hidden, intermediate, experts, 4, rank

    def plan_of(bucket: dict) -> tuning.Plan:
        return tuning.Plan(bucket["block_m"], tuning._stage(bucket["gate_up"]), tuning._stage(bucket["down"]))

    def plan_on(gpu: str, *args) -> tuning.Plan:
        monkeypatch.setattr(tuning, "_gpu", lambda: gpu)
        tuning._plan.cache_clear()  # cached by shape: one GPU a process
        return tuning._plan(*args)

    table = tuning._table(None)
    own_shipped = {(shape, b["max_pairs"]): b for shape, buckets in table[h100].items() for b in buckets}
    taken = {"own": 0, "lent": 0}
    for shape, buckets in table[h200].items():
        for bucket in buckets:
            own = own_shipped.get((shape, bucket["max_pairs"]))
            taken["own" if own else "lent"] += 1
            assert plan_on(h100, *sizes(shape, bucket["max_pairs"]), None) == plan_of(own or bucket)
            assert plan_on(h200, *sizes(shape, bucket["max_pairs"]), None) == plan_of(bucket)
    assert taken["own"] and taken["lent"]

    (shape, buckets), (other, _) = list(table[h200].items())[:2]
    largest = sizes(shape, buckets[-1]["max_pairs"])
    own = tmp_path / "tiles.json"
    own.write_text(json.dumps({**table, h100: {shape: [{**buckets[-1], "block_m": 16}]}}))
    assert plan_on(h100, *largest, str(own)).block_m == 16  # its own tiles before another's
    # A bucket and a shape it has none of in that file: the H200's (not its own last bucket, not the rule of thumb).
    for elsewhere in (sizes(shape, buckets[0]["max_pairs"]), sizes(other, 8192)):
        assert plan_on(h100, *elsewhere, str(own)) == plan_on(h200, *elsewhere, None)
    none = tmp_path / "none.json"
    none.write_text("{}")
    assert plan_on("NVIDIA H100 PCIe", *largest, None) == plan_on(h200, *largest, str(none)) != plan_of(buckets[-1])
    tuning._plan.cache_clear()


def test_a_shape_or_gpu_the_tiles_do_not_cover_is_said_once_with_how_to_tune_it(monkeypatch, caplog):
    """Where the fast path takes the rule of thumb (no tuned tiles for the shape on this GPU), the server's log
    says so once a shape, and how to tune them; where it takes tuned tiles, nothing."""
    monkeypatch.setattr(log, "said", set())
    qwen3_tp1 = (2048, 768, 128, 4, 64)  # hidden, intermediate, experts, adapters, max rank: shipped for the H200
    narrow = (1024, 256, 16, 4, 16)  # no such shape shipped
    for gpu, sizes, said in (("NVIDIA H200", qwen3_tp1, False), ("NVIDIA H100 80GB HBM3", qwen3_tp1, False),
                             ("NVIDIA H200", narrow, True), ("NVIDIA B200", qwen3_tp1, True)):
        monkeypatch.setattr(tuning, "_gpu", lambda gpu=gpu: gpu)
        tuning._plan.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sglang_lora_tma_guard"):
            for pairs in (8, 4096, 65536):
                tuning._plan(pairs, *sizes, None)
        lines = [r.getMessage() for r in caplog.records if "no LoRA MoE tiles tuned" in r.getMessage()]
        assert len(lines) == said, (gpu, sizes, lines)
        if said:
            key = tuning.shape_key(*sizes[:3], sizes[4])
            assert f"for {key} on {gpu}" in lines[0] and "benchmarks/tune_lora_moe.py" in lines[0]
            assert tuning.TILES_ENV in lines[0]
    tuning._plan.cache_clear()


ONE_KERNEL = lora_moe.StageConfig(one_kernel=True, shrink_block_k=64, expand_block_n=32, expand_n_tiles=3)


@pytest.mark.parametrize("name", case_params())
def test_one_kernel_hooks_add_each_adapters_delta(runners, name, monkeypatch):
    """Both GEMMs of a hook in one launch (``StageConfig.one_kernel``): every case the two-launch hooks
    meet, within the same tolerance of the float32 reference. Tiles of 32 columns, 3 a program, and K
    tiles of 64 leave the last column group and the last K tile partial at the odd widths."""
    problem, info = make_case(name, seed=4)
    reference = run_hooks(ReferenceLoRAHooks(info), problem, info)
    plan = tuning.Plan(16, ONE_KERNEL, ONE_KERNEL)
    monkeypatch.setattr(tuning, "plan", lambda *args, **kwargs: plan)
    launches = []
    launch = lora_moe.one_kernel
    monkeypatch.setattr(lora_moe, "one_kernel", lambda *a, **k: launches.append(1) or launch(*a, **k))
    fast = run_hooks(lora_path.build_hooks(sglang_build(runners), problem.hidden_states, info, problem.topk_ids),
                     problem, info)
    assert len(launches) == 2  # one a hook
    assert max(errors(fast, reference)) < TOLERANCE, errors(fast, reference)


def expected_moe(problem, hooks):
    """The plain PyTorch reference MoE with ``hooks`` (None: no adapter at all)."""
    args = tiny_moe.call_arguments(problem, hooks or SimpleNamespace(after_gate_up=None, after_down=None))
    return reference_moe(args, to_fp8=interpreter_fp8)


def test_fast_switch_puts_the_fast_hooks_in_sglangs_runner(sglang_plugins, runners):
    """``SGLANG_LORA_TMA_GUARD=fast`` through ``load_plugins()``: SGLang's runner builds this package's
    hooks (it looks ``build_lora_hooks`` up when it runs) and the whole MoE call is right."""
    problem, info = make_case("mixed-ranks-top2", seed=1)
    sglang_plugins("fast")
    hooks = real_lora.lora_hooks(problem, info)
    assert hooks.after_gate_up.__module__ == FAST
    output = real_lora.run_runner(problem, hooks, use_tma=True)
    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    assert tiny_moe.rel_err(output, reference) < 1e-2
    assert tiny_moe.rel_err(output, expected_moe(problem, None)) > 0.1


def test_the_gate_up_shrink_launched_with_the_hooks_leaves_sglangs_call_bit_for_bit(sglang_plugins, runners,
                                                                                    monkeypatch):
    """The routing and gate-up shrink launched when the hooks are built (``lora_path.OVERLAP``; on a GPU on a
    second stream, beside the gate-up GEMM): SGLang's runner gives the very output it gives with the shrink in
    the gate-up hook, and the shrink runs once, at the build. (On the CPU both run on one stream: that the
    gate-up hook waits for the second stream is shown on the H200, benchmarks/overlap_race.py.)"""
    problem, info = make_case("mixed-ranks-top2", seed=2)
    sglang_plugins("fast")  # the guard keeps the hooked call route-major (SGLang 0.5.16 would take TMA here)
    shrink, outputs, at_build = lora_moe.shrink, {}, {}
    for overlap in (False, True):
        monkeypatch.setattr(lora_path, "OVERLAP", overlap)
        calls = []
        monkeypatch.setattr(lora_moe, "shrink", lambda *a, **k: calls.append(a[0]) or shrink(*a, **k))

        def build(hidden):  # as SGLang's MoeRunner.run: from the tensor the runner is given
            hooks = lora_path.build_hooks(sglang_build(runners), hidden, info, problem.topk_ids)
            at_build[overlap] = (hidden, list(calls))
            return hooks

        outputs[overlap] = real_lora.run_runner(problem, None, use_tma=True, build=build)
        assert len(calls) == 2, overlap  # gate-up and down, once each
    hidden, early = at_build[True]
    assert at_build[False][1] == [] and len(early) == 1 and early[0] is hidden
    assert torch.equal(outputs[True], outputs[False])
    assert tiny_moe.rel_err(outputs[True], expected_moe(problem, ReferenceLoRAHooks(info))) < 1e-2


def test_a_gate_up_hook_given_other_hidden_states_than_its_builder_shrinks_those(runners):
    """The shrink launched at the build is of the builder's hidden states; a gate-up hook called with another
    tensor (no SGLang sequence does: a wrapper that copied them would) computes its delta from what it is given."""
    problem, info = make_case("mixed-ranks-top2", seed=3)
    hooks = lora_path.build_hooks(sglang_build(runners), problem.hidden_states, info, problem.topk_ids)
    other = problem.hidden_states.flip(0).contiguous()

    def gate_up_delta(hooks, hidden):
        tokens, topk = problem.topk_ids.shape
        c1 = torch.zeros(tokens, topk, info.gate_up_lora_b_weights.shape[2], dtype=hidden.dtype)
        hooks.after_gate_up(hidden, c1, problem.topk_weights, problem.topk_ids)
        return c1.float()

    fast = gate_up_delta(hooks, other)
    assert errors([fast], [gate_up_delta(ReferenceLoRAHooks(info), other)])[0] < TOLERANCE
    assert errors([fast], [gate_up_delta(ReferenceLoRAHooks(info), problem.hidden_states)])[0] > 0.1


def test_the_tensors_the_second_stream_reads_live_until_the_gate_up_hook_waits_for_it(runners, monkeypatch):
    """The builder's own tensors that the routing reads (each token's adapter, made here from SGLang's segments on
    0.5.11-0.5.12, or a copy of another dtype) are held until the gate-up hook's wait: freed at the build's end,
    their blocks would go to the gate-up GEMM's output while the second stream may still read them."""
    import gc
    import weakref

    problem, info = make_case("mixed-ranks-top2", seed=1)
    made = []
    adapters = lora_path.token_adapters
    monkeypatch.setattr(lora_path, "token_adapters", lambda *a: made.append(adapters(*a).clone()) or made[-1])
    hooks = lora_path.build_hooks(sglang_build(runners), problem.hidden_states, info, problem.topk_ids)
    token_lora = weakref.ref(made.pop())
    gc.collect()
    assert token_lora() is not None  # the build is over; the wait has not come
    run_hooks(hooks, problem, info)
    gc.collect()
    assert token_lora() is None  # let go once waited for


@pytest.mark.slow  # the fast path's own kernels are the same whatever the base; a second base is for CI
@pytest.mark.parametrize("name, changes", [("mixed-ranks-top2", {"intermediate": 96}), ("odd-widths", {})],
                         ids=["mixed-ranks-top2", "odd-widths"])
def test_fast_and_fused_calls_are_right_on_16_bit_experts_in_sglangs_runner(sglang_plugins, runners, monkeypatch,
                                                                            name, changes):
    """fp16 experts (SGLang's un-quantized Triton path, what ``--base bf16`` of the LoRA MoE benchmarks runs,
    and the only one for widths no 128 divides, so the fused launch's case of odd widths, which block fp8
    cannot take, is taken here): the fast hooked call in SGLang's runner, and with the fused down launch (its
    16-bit GEMM, taken), each right against the float32 reference MoE on the same weights."""
    from sglang_lora_tma_guard import fused_lora

    problem, info = make_case(name, seed=1, base_dtype=torch.float16, **changes)
    assert not problem.block_fp8 and tiny_moe.sequence_kwargs(problem, None)["block_shape"] is None
    taken = []
    run = fused_lora.DownWork.run
    monkeypatch.setattr(fused_lora.DownWork, "run", lambda self, a: taken.append(a["C"].shape) or run(self, a))
    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    sglang_plugins("fast")
    hooks = real_lora.lora_hooks(problem, info)
    assert hooks.after_gate_up.__module__ == FAST
    fast = real_lora.run_runner(problem, hooks, use_tma=True)
    fused_lora.activate(everywhere=True)
    try:
        fused = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    finally:
        fused_lora.deactivate()
    assert taken == [(TOKENS, CASES[name].topk, problem.w2.shape[1])]  # the 16-bit GEMM ran
    for output in (fast, fused):
        assert tiny_moe.rel_err(output, reference) < 1e-2
    assert tiny_moe.rel_err(fast, expected_moe(problem, None)) > 0.05  # the adapters do change the output


def test_the_fused_down_launch_orders_sglangs_route_list_by_adapter(sglang_plugins, runners, monkeypatch):
    """SGLang's GPU ``moe_align_block_size`` leaves each expert's routes in the order its atomics took them
    (here: shuffled within each expert), and every adapter in a block of that list is one more GEMM in the
    fused down GEMM's epilogue (on the H200 the fused launch was no faster than the hook over such a list).
    The launch walks the list with each expert's routes ordered by adapter, the same routes in the same
    blocks, and the call is right against the float32 reference."""
    from sglang_lora_tma_guard import fused_lora, moe_gemm

    problem, info = make_case("mixed-ranks-top2", seed=1)
    block_m = problem.config["BLOCK_SIZE_M"]
    given = problem.__dict__["alignment"] = tiny_moe.shuffle_runs(problem.alignment, block_m)
    walked, gemm = [], moe_gemm.moe_gemm
    monkeypatch.setattr(moe_gemm, "moe_gemm", lambda *a, **k: (k["lora"] is not None and walked.append(
        k["sorted_ids"].clone())) or gemm(*a, **k))
    sglang_plugins("fast")
    fused_lora.activate(everywhere=True)
    try:
        out = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    finally:
        fused_lora.deactivate()
    assert len(walked) == 1
    assert tiny_moe.rel_err(out, expected_moe(problem, ReferenceLoRAHooks(info))) < 1e-2
    assert tiny_moe.assert_ordered_by_adapter(given, walked[0], lora_path.token_adapters(info, TOKENS),
                                              problem.topk_ids.shape[1], block_m, info.lora_ranks.numel()) > 0


# The tiny MoE is gated, and SGLang's block-fp8 quantizer takes no partial K group: an un-gated gate-up is the
# kernel's own test (tests/test_fused_lora.py) and the hooks' test above; odd widths run over 16-bit experts above.
@pytest.mark.slow  # =fast takes the fused down launch only for large batches: out of the default run
@pytest.mark.parametrize("name", [p for p in case_params() if p.values[0] not in ("ungated", "odd-widths")])
def test_fused_down_gemm_adds_the_down_delta_in_sglangs_runner(sglang_plugins, runners, name, monkeypatch):
    """With the fused down launch taking every batch (``fused_lora.activate(everywhere=True)``) the down
    GEMM of a fast hooked call is this package's, the down delta in its epilogue: taken in SGLang's own
    runner, the whole call as right as the unfused fast path (the float32 reference MoE; tolerance as above,
    on outputs of size about 1), and the hook adds nothing twice. Taken away, the same call goes through
    SGLang's down GEMM and the hook."""
    from sglang_lora_tma_guard import fused_lora

    problem, info = make_case(name, seed=1)
    taken = []
    run = fused_lora.DownWork.run
    monkeypatch.setattr(fused_lora.DownWork, "run", lambda self, a: taken.append(a["C"].shape) or run(self, a))
    fused_and_unfused_are_as_right(sglang_plugins, problem, info)
    assert taken == [(TOKENS, CASES[name].topk, problem.w2.shape[1])]  # the fused run's down GEMM, only it


def fused_and_unfused_are_as_right(sglang_plugins, problem, info) -> None:
    """The call through SGLang's runner with the fused down launch taking every batch, then without it: the fused
    call as right against the float32 reference MoE as the unfused fast path (tolerance as above, on outputs of
    size about 1), and the adapters changing its output."""
    from sglang_lora_tma_guard import fused_lora

    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    sglang_plugins("fast")
    fused_lora.activate(everywhere=True)
    try:
        assert fused_lora.PATCH.status().working
        fused = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    finally:
        fused_lora.deactivate()
    unfused = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    fused_err, unfused_err = tiny_moe.rel_err(fused, reference), tiny_moe.rel_err(unfused, reference)
    assert fused_err < 1e-2 and fused_err <= unfused_err + ONE_FP16_STEP, (fused_err, unfused_err)
    assert tiny_moe.rel_err(fused, expected_moe(problem, None)) > 0.05  # the adapters do change the output


def launched_tiles(monkeypatch) -> list[tuple[dict, int]]:
    """Each fused GEMM launch's tile and column tiles a program, in order, from now on (the launch itself runs)."""
    from sglang_lora_tma_guard import moe_gemm

    tiles = []
    gemm = moe_gemm.moe_gemm
    monkeypatch.setattr(moe_gemm, "moe_gemm", lambda *a, **k: tiles.append((k["tile"], k["n_tiles"])) or gemm(*a, **k))
    return tiles


@pytest.mark.slow  # as the other fused launches through the runner
@pytest.mark.parametrize(("ranks", "k_loop", "block_n"), [((8, 16, 4, 16), 1, 128), ((8, 16, 32, 64), None, 64)])
def test_the_fused_down_launch_over_three_k_tiles_in_sglangs_runner(sglang_plugins, runners, monkeypatch, ranks, k_loop,
                                                                    block_n):
    """A down GEMM of three block-fp8 K tiles (Qwen3-30B-A3B tp2's K 384), through SGLang's own runner, as right
    against the float32 reference MoE as the unfused fast path: adapters up to rank 16 take the wide kernel's K loop,
    up to rank 64 (an H100 places those from 4096 tokens) its K steps unrolled over 64-wide columns
    (``fused_lora.WIDE_TILES_BY_K_TILES``)."""
    problem, info = make_case("mixed-ranks-top2", seed=1, ranks=ranks, intermediate=384)
    tiles = launched_tiles(monkeypatch)
    fused_and_unfused_are_as_right(sglang_plugins, problem, info)
    assert [(tile.get("K_LOOP"), tile["BLOCK_N"], n_tiles) for tile, n_tiles in tiles] == [(k_loop, block_n, 16)]


@pytest.mark.slow  # as the other fused launches through the runner
@pytest.mark.parametrize("ranks", [(8, 16, 4, 16), (8, 16, 32, 64)])
def test_the_fused_down_launch_over_six_k_tiles_is_one_column_tile_a_program_in_sglangs_runner(sglang_plugins, runners,
                                                                                              monkeypatch, ranks):
    """A down GEMM of six block-fp8 K tiles (Qwen3-30B-A3B tp1's K 768), adapters up to rank 16 and up to 64: the
    fused launch takes the narrow GEMM at SGLang's tile (``fused_lora.WIDE_TILES_BY_K_TILES``), through SGLang's own
    runner, as right against the float32 reference MoE as the unfused fast path."""
    problem, info = make_case("mixed-ranks-top2", seed=1, ranks=ranks, intermediate=768)
    tiles = launched_tiles(monkeypatch)
    fused_and_unfused_are_as_right(sglang_plugins, problem, info)
    assert [n_tiles for _, n_tiles in tiles] == [0]
    assert "K_LOOP" not in tiles[0][0] and tiles[0][0]["BLOCK_N"] == problem.down_config["BLOCK_SIZE_N"]


def test_fast_takes_the_fused_down_launch_only_where_it_is_measured_faster(sglang_plugins, runners, monkeypatch):
    """``=fast`` places the fused down launch, for batches of adapters up to rank 32 over block-fp8 experts
    with at least the routes ``FASTER_FROM_ROUTES`` names for their max rank at their down GEMM's K: a batch short
    of that size, one with a rank-64 adapter, or one of a K the table does not name keeps SGLang's down GEMM and the
    hook; a rank-16 batch at the size and the K is taken. Right either way."""
    from sglang_lora_tma_guard import fused_lora

    taken = []
    run = fused_lora.DownWork.run
    monkeypatch.setattr(fused_lora.DownWork, "run", lambda self, a: taken.append(a["C"].shape) or run(self, a))
    sglang_plugins("fast")
    assert fused_lora.PATCH.status().working
    low, mixed = make_case("mixed-ranks-top2", seed=1, ranks=(8, 16, 4, 16)), make_case("mixed-ranks-top2", seed=1)
    k = low[0].w2.shape[2]  # the tiny case's
    monkeypatch.setattr(fused_lora, "FASTER_FROM_ROUTES", {k + 1: ((8, 1), (16, 1), (32, 1))})  # not at its K
    assert fused_lora.epilogue_rank(TOKENS * 2, 16, k) is None and fused_lora.epilogue_rank(TOKENS * 2, 16, k + 1) == 16
    other_k = real_lora.run_runner(low[0], real_lora.lora_hooks(*low), use_tma=True)
    assert tiny_moe.rel_err(other_k, expected_moe(low[0], ReferenceLoRAHooks(low[1]))) < 1e-2
    assert taken == []
    outputs = {}
    for min_routes in (TOKENS * 2 + 1, TOKENS * 2):  # the tiny case's routes: one short of the size, then at it
        monkeypatch.setattr(fused_lora, "FASTER_FROM_ROUTES", {k: ((8, 10**9), (16, min_routes), (32, 10**9))})
        for label, (problem, info) in {"low": low, "mixed": mixed}.items():
            outputs[label, min_routes] = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
            assert tiny_moe.rel_err(outputs[label, min_routes], expected_moe(problem, ReferenceLoRAHooks(info))) < 1e-2
    assert taken == [(TOKENS, 2, low[0].w2.shape[1])]  # the rank-16 batch at the size, only it
    assert tiny_moe.rel_err(outputs["low", TOKENS * 2], outputs["low", TOKENS * 2 + 1]) > 0  # a GEMM of its own
    fused_lora.deactivate()
    assert not fused_lora.PATCH.status().working


@pytest.mark.parametrize("split_rank", [16, 32])
@pytest.mark.parametrize("name", [p for p in case_params() if p.values[0] not in ("ungated", "odd-widths")])
def test_a_split_fused_down_launch_adds_the_low_ranks_in_its_epilogue_and_the_rest_by_the_hooks_expand(
        sglang_plugins, runners, monkeypatch, name, split_rank):
    """Adapters of mixed ranks (8/16/32/64, or 5/12/24/64 with NaN past each rank) with the epilogue taking those up
    to ``split_rank`` (its rank tile that size) and the hook's expand only the others, over their routes alone, in
    every case the whole fused launch is tested on (above): through SGLang's runner, as right against the float32
    reference MoE as the unfused fast path. Without the expand, or with the epilogue adding every adapter at the
    smaller tile, the call is wrong."""
    from sglang_lora_tma_guard import fused_lora, lora_moe, moe_gemm

    problem, info = make_case(name, seed=1)
    epilogues, expands = [], []
    gemm, expand = moe_gemm.moe_gemm, lora_moe.expand
    monkeypatch.setattr(moe_gemm, "moe_gemm", lambda *a, **k: epilogues.append(
        (k["lora"].block_r(), k["lora"].enabled.tolist())) or gemm(*a, **k))
    monkeypatch.setattr(lora_moe, "expand", lambda *a, **k: expands.append((a[0].shape[2], k.get("rank_above", 0)))
                        or expand(*a, **k))
    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    sglang_plugins("fast")
    fused_lora.activate(everywhere=True, split_rank=split_rank)
    try:
        split = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    finally:
        fused_lora.deactivate()
    case = CASES[name]
    assert epilogues == [(split_rank, [int(on and r <= split_rank) for r, on in zip(case.ranks, case.enabled)])]
    hidden = problem.w2.shape[1]  # the down side's only expand: the fused launch's, for the ranks past it
    assert [above for width, above in expands if width == hidden] == [split_rank]
    unfused = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    split_err, unfused_err = tiny_moe.rel_err(split, reference), tiny_moe.rel_err(unfused, reference)
    assert split_err < 1e-2 and split_err <= unfused_err + ONE_FP16_STEP, (split_err, unfused_err)


def test_fast_splits_the_fused_down_launch_by_rank_where_the_table_says(sglang_plugins, runners, monkeypatch):
    """``SPLIT_FROM_ROUTES``: a batch whose max rank no rank of ``FASTER_FROM_ROUTES`` covers at its K takes the fused
    launch for the adapters up to the rank it names, from the routes it names, and not short of them; a batch the
    whole launch covers keeps it whole. A GPU's own rows of either table (``..._ON``) replace the table's there."""
    from sglang_lora_tma_guard import fused_lora

    sglang_plugins("fast")
    k = 128
    monkeypatch.setattr(fused_lora, "FASTER_FROM_ROUTES", {k: ((16, 100),)})
    monkeypatch.setattr(fused_lora, "SPLIT_FROM_ROUTES", {k: (32, 200)})
    assert [fused_lora.epilogue_rank(routes, 64, k) for routes in (199, 200)] == [None, 32]
    assert [fused_lora.epilogue_rank(routes, 16, k) for routes in (99, 100, 200)] == [None, 16, 16]
    assert fused_lora.epilogue_rank(200, 32, k) is None  # up to 32 is the split's own tile: not a split
    assert fused_lora.epilogue_rank(200, 64, k + 1) is None
    # A GPU's own rows (SPLIT_FROM_ROUTES_ON) before the table's; another GPU keeps the table's.
    monkeypatch.setattr(fused_lora, "SPLIT_FROM_ROUTES_ON", {"GPU A": {k: (16, 150)}})
    for gpu, ranks in (("GPU A", [None, 16, 16]), ("GPU B", [None, None, 32])):
        monkeypatch.setattr(tuning, "_gpu", lambda gpu=gpu: gpu)
        assert [fused_lora.epilogue_rank(routes, 64, k) for routes in (149, 150, 200)] == ranks, gpu
        assert fused_lora.epilogue_rank(150, 16, k) == 16  # the whole launch where it is placed, on any GPU
    # A GPU's own whole-launch rows (FASTER_FROM_ROUTES_ON) too: in place of the table's at that K, on that GPU only.
    monkeypatch.setattr(fused_lora, "FASTER_FROM_ROUTES_ON", {"GPU A": {k: ((16, 300), (64, 120))}})
    for gpu, ranks, rank_16 in (("GPU A", [None, 64, 64], None), ("GPU B", [None, None, 32], 16)):
        monkeypatch.setattr(tuning, "_gpu", lambda gpu=gpu: gpu)
        assert [fused_lora.epilogue_rank(routes, 64, k) for routes in (119, 120, 200)] == ranks, gpu
        assert fused_lora.epilogue_rank(150, 16, k) == rank_16, gpu
    fused_lora.deactivate()
    assert fused_lora.epilogue_rank(200, 64, k) is None


def test_the_shipped_placement_rows_are_read_as_written():
    """The fused launch's shipped tables: a GPU's own rows are under a name the shipped tiles know (``_gpu`` reads it
    from the device; a misspelt name would leave them unread), every row list ascends by rank (``_placed`` takes the
    first row covering the max rank), and a split rank is below the most the epilogue takes (a rank past it splits off
    nothing)."""
    from sglang_lora_tma_guard import fused_lora

    shipped_gpus = set(tuning._table(None)) | set(tuning.TILES_OF)
    assert set(fused_lora.FASTER_FROM_ROUTES_ON) | set(fused_lora.SPLIT_FROM_ROUTES_ON) <= shipped_gpus
    tables = [fused_lora.FASTER_FROM_ROUTES, *fused_lora.FASTER_FROM_ROUTES_ON.values()]
    for rows in (rows for table in tables for rows in table.values()):
        ranks = [rank for rank, _ in rows]
        assert ranks == sorted(set(ranks)) and all(routes > 0 for _, routes in rows), rows
    for table in (fused_lora.SPLIT_FROM_ROUTES, *fused_lora.SPLIT_FROM_ROUTES_ON.values()):
        for k, (rank, routes) in table.items():
            assert routes > 0 and 0 < rank < fused_lora.MAX_RANK, (k, rank)


@pytest.mark.parametrize(("k", "max_rank", "block_n", "stages", "k_loop", "n_tiles"), [
    (256, 16, 128, 2, 0, 16), (256, 32, 128, 2, 0, 16), (256, 64, 64, 2, 0, 16),  # GLM-5.1 TP8: two K tiles
    # Qwen3-30B-A3B tp2: three, a K loop measured fastest up to rank 16, past it 64-wide columns unrolled
    (384, 8, 128, 4, 1, 16), (384, 16, 128, 4, 1, 16), (384, 32, 64, 2, 0, 16), (384, 64, 64, 2, 0, 16),
    # tp1: six, one column tile a program at SGLang's tile (measured faster than the wide kernel's K loop)
    (768, 16, 128, 4, 0, 0), (768, 32, 128, 4, 0, 0), (768, 64, 128, 4, 0, 0),
])
def test_the_fused_down_gemm_takes_the_tile_measured_for_its_k_tiles_and_rank(k, max_rank, block_n, stages, k_loop,
                                                                              n_tiles):
    from harness.ptx import HOPPER_SHARED_BYTES
    from sglang_lora_tma_guard import fused_lora

    sglang_tile = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4,
                   "num_stages": 4}  # SGLang's tuned block-fp8 down tile on these shapes
    tile, placed_n_tiles = fused_lora.wide_tile(sglang_tile, 128, k, max_rank, 1, HOPPER_SHARED_BYTES)
    assert (tile["BLOCK_N"], tile["num_stages"], tile.get("K_LOOP", 0), placed_n_tiles) == (block_n, stages, k_loop,
                                                                                            n_tiles)
    assert (tile["BLOCK_M"], tile["BLOCK_K"]) == (64, 128)


def test_the_narrow_gemm_takes_fewer_stages_then_columns_where_sglangs_tile_leaves_no_room_for_the_epilogue():
    """SGLang tunes a tile for its GEMM alone. Its bf16 down tile of Qwen3-30B-A3B tp 1 from 1536 tokens on an H100
    (128 x 256 x 64, four stages) with a rank-64 epilogue asked for 262,144 bytes and was refused at the launch; the
    narrow GEMM drops stages down to two, then halves its columns, until the estimate fits (what Triton then
    allocates: ``test_kernel_codegen``). Every block-fp8 tile the installed SGLang ships for an H100 or H200 (what
    ``=fast`` places the fused launch over) fits as it is, up to rank 64: none is changed from what was measured."""
    import importlib.util
    import json
    from pathlib import Path

    from harness.ptx import HOPPER_SHARED_BYTES
    from sglang_lora_tma_guard import fused_lora

    large = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 8, "num_stages": 4}
    assert fused_lora.narrow_tile(large, 16, 2, HOPPER_SHARED_BYTES) == large
    assert fused_lora.narrow_tile(large, 64, 2, HOPPER_SHARED_BYTES) == {**large, "num_stages": 2}
    assert fused_lora.narrow_tile(large, 64, 2, 150_000) == {**large, "num_stages": 2, "BLOCK_N": 128}
    assert fused_lora.narrow_tile(large, 64, 2, None) == large  # off the GPU: nothing to fit
    assert fused_lora.narrow_tile(large, 64, 2, 1000)["BLOCK_N"] == 32  # the least it narrows to; the launch then says
    sglang_config = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "num_warps": 8, "num_stages": 4}
    assert fused_lora.wide_tile(sglang_config, None, 768, 64, 2, HOPPER_SHARED_BYTES) == ({**large, "num_stages": 2}, 0)

    configs = Path(importlib.util.find_spec("sglang").submodule_search_locations[0],
                   "srt/layers/moe/moe_runner/triton_utils/configs")
    seen, files = 0, sorted(configs.glob("triton_*/E=*,N=*,device_name=NVIDIA_H[12]00*dtype=fp8_w8a8,block_shape=*.json"))
    for path in files:
        k = int(path.name.split(",N=")[1].split(",")[0])  # the down GEMM's K: a shard's intermediate width
        for config in json.loads(path.read_text()).values():
            for max_rank in (16, 32, 64):
                tile, n_tiles = fused_lora.wide_tile(config, 128, k, max_rank, 1, HOPPER_SHARED_BYTES)
                if not n_tiles:
                    seen += 1
                    assert (tile["BLOCK_N"], tile["num_stages"]) == (config["BLOCK_SIZE_N"], config["num_stages"]), path
    assert len(files) >= 20 and seen >= 20, (len(files), seen)  # 0.5.16: 27 files, 54 narrow (tile, rank) pairs


def test_a_fused_launch_that_fails_is_served_unfused_and_not_tried_again_for_its_shape(sglang_plugins, runners,
                                                                                         monkeypatch, caplog):
    """A fused down launch that raises (in a real server: Triton's OutOfResources for a tile over a Hopper
    program's shared memory, at every prefill step of Qwen3-30B-A3B-FP8 before ``wide_tile`` took one stage
    there) leaves that call to SGLang's down GEMM and the hook, right; its shape is refused from then on, before
    any of its work, with one traceback and one line in the log, not one of each every call."""
    from triton.runtime.errors import OutOfResources

    from sglang_lora_tma_guard import fused_lora, moe_gemm

    attempts = []

    def out_of_shared_memory(*args, **kwargs):
        attempts.append(1)
        raise OutOfResources(305152, 232448, "shared memory")

    monkeypatch.setattr(moe_gemm, "moe_gemm", out_of_shared_memory)
    problem, info = make_case("mixed-ranks-top2", seed=1, ranks=(8, 16, 4, 16))
    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    sglang_plugins("fast")
    fused_lora.activate(everywhere=True)
    log.said.clear()
    with caplog.at_level(logging.INFO, logger="sglang_lora_tma_guard"):
        for _ in range(3):
            out = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
            assert tiny_moe.rel_err(out, reference) < 1e-2
    assert len(attempts) == 1
    failed = [r for r in caplog.records if "fused LoRA down GEMM failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
    unfused = [r.getMessage() for r in caplog.records if "runs unfused" in r.getMessage()]
    assert len(unfused) == 2 and "failed here before (OutOfResources: out of resource: shared memory" in unfused[1], \
        unfused
    fused_lora.deactivate()
    assert not fused_lora._failed


def test_guard_corrects_sglangs_virtual_experts_path(sglang_plugins, runners):
    """``--lora-use-virtual-experts`` on a gated MoE: wrong without the guard, right with ``=1``."""
    problem, info = make_case("mixed-ranks-top2", seed=2)
    ve_info = dataclasses.replace(info, lora_use_virtual_experts=True)
    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    with real_lora.cpu_virtual_experts():
        unguarded = real_lora.run_runner(problem, real_lora.lora_hooks(problem, ve_info), use_tma=False)
        assert tiny_moe.rel_err(unguarded, reference) > 0.05
        assert sglang_plugins("1").strategy == "weight_tma"
        hooks = real_lora.lora_hooks(problem, ve_info)
        assert hooks.after_gate_up.__module__ == FAST
        assert tiny_moe.rel_err(real_lora.run_runner(problem, hooks, use_tma=True), reference) < 1e-2
        # The default path stays SGLang's own under =1.
        assert real_lora.lora_hooks(problem, info).after_gate_up.__module__ != FAST


def test_a_batch_it_does_not_cover_goes_to_sglangs_hooks_with_one_log_line(runners, caplog):
    problem, info = make_case("mixed-ranks-top2")
    sharded = dataclasses.replace(info, fully_sharded=True, tp_size=2)
    lora_path._said.clear()
    with caplog.at_level(logging.WARNING, logger="sglang_lora_tma_guard"):
        for _ in range(2):
            hooks = lora_path.build_hooks(sglang_build(runners), problem.hidden_states, sharded, problem.topk_ids)
            assert hooks.after_gate_up.__module__ != FAST
    lines = [r.getMessage() for r in caplog.records if "SGLang's own LoRA hooks" in r.getMessage()]
    assert len(lines) == 1 and "fully sharded" in lines[0], lines


def test_a_rank_or_slot_count_past_what_a_routing_entry_holds_goes_to_sglangs_hooks(runners, monkeypatch):
    problem, info = make_case("mixed-ranks-top2")
    assert lora_path.not_covered(info, problem.hidden_states, problem.topk_ids) is None
    monkeypatch.setattr(lora_moe, "MAX_RANK", int(info.max_lora_rank) - 1)
    assert "past the routing" in lora_path.not_covered(info, problem.hidden_states, problem.topk_ids)
    monkeypatch.undo()
    monkeypatch.setattr(lora_moe, "MAX_KEYS", info.lora_ranks.numel() * info.gate_up_lora_b_weights.shape[1] - 1)
    assert "past the routing" in lora_path.not_covered(info, problem.hidden_states, problem.topk_ids)


def test_each_block_entry_holds_its_virtual_expert_and_its_adapters_rank():
    """What the grouped GEMMs read in one load (the rank above ``KEY_BITS``): the keys in use, each
    with its own adapter's rank; no block for the base model's token or the slot of rank 0."""
    ids = torch.tensor([[0, 3], [2, 3], [1, 0], [3, 2], [3, 1]], dtype=torch.int32)  # 5 tokens, top-2, 4 experts
    token_lora = torch.tensor([0, 1, -1, 2, 2], dtype=torch.int32)
    enabled, ranks = torch.tensor([1, 1, 1], dtype=torch.int32), torch.tensor([8, 0, 64], dtype=torch.int32)
    routing = lora_moe.route(ids, token_lora, enabled, ranks, num_experts=4, block_m=16)
    entries = routing.block_key[: int(routing.rows_used) // 16].tolist()
    keys = [e & (lora_moe.MAX_KEYS - 1) for e in entries]
    assert sorted(keys) == [0 * 4 + 0, 0 * 4 + 3, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3]
    assert [e >> lora_moe.KEY_BITS for e in entries] == [int(ranks[k // 4]) for k in keys]


@pytest.mark.slow
def test_a_virtual_experts_batch_it_does_not_cover_goes_to_sglangs_default_path(runners, monkeypatch):
    """Not to SGLang's virtual-experts path, which is wrong on this gated MoE."""
    problem, info = make_case("mixed-ranks-top2")
    ve_info = dataclasses.replace(info, lora_use_virtual_experts=True)
    reference = run_hooks(ReferenceLoRAHooks(info), problem, info)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tensors are on a CPU: "not a CUDA device"
    hooks = lora_path.build_hooks(sglang_build(runners), problem.hidden_states, ve_info, problem.topk_ids)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert hooks.after_gate_up.__module__ != FAST
    assert max(errors(run_hooks(hooks, problem, info), reference)) < TOLERANCE


def test_deactivate_restores_sglangs_builder_or_leaves_ours_inert_under_another_wrapper(runners):
    import inspect

    lora_path.deactivate()
    original = runners.build_lora_hooks
    assert original is inspect.unwrap(original)
    problem, info = make_case("mixed-ranks-top2")
    try:
        lora_path.activate(lora_path.Mode.FAST)
        assert runners.build_lora_hooks is not original and lora_path.status().installed
        lora_path.deactivate()
        assert runners.build_lora_hooks is original and not lora_path.status().installed

        lora_path.activate(lora_path.Mode.FAST)
        ours = runners.build_lora_hooks

        @functools.wraps(ours)
        def outer(*args, **kwargs):  # other code's wrapper, placed after ours
            return ours(*args, **kwargs)

        runners.build_lora_hooks = outer
        lora_path.deactivate()
        assert runners.build_lora_hooks is outer  # cannot leave the chain: switched off instead
        assert outer(problem.hidden_states, info, problem.topk_ids).after_gate_up.__module__ != FAST
        lora_path.activate(lora_path.Mode.FAST)
        assert outer(problem.hidden_states, info, problem.topk_ids).after_gate_up.__module__ == FAST
    finally:
        runners.build_lora_hooks = original
        lora_path.deactivate()
    assert runners.build_lora_hooks is original


def test_token_adapters_from_segments_where_sglang_gives_no_map(runners):
    """SGLang 0.5.11-0.5.12 have no ``token_lora_mapping``: each token's slot comes from the segments."""
    problem, info = make_case("mixed-ranks-top2")
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name != "token_lora_mapping"}
    older = type("OldLoRAInfo", (), fields)()
    assert torch.equal(lora_path.token_adapters(older, TOKENS), info.token_lora_mapping)


@pytest.mark.parametrize("tokens, topk, block_m", [(1, 8, 16), (3, 2, 16), (5, 8, 32), (8, 8, 16), (60, 1, 64)])
def test_the_decode_routing_in_registers_groups_the_pairs_as_the_one_program_routing(tokens, topk, block_m,
                                                                                      monkeypatch):
    """Up to ``REGISTER_PAIRS`` pairs the routing keeps its counts in registers: the same blocks, keys and
    ranks, rows in use and empty rows as the one-program routing's (whose atomic slots the interpreter
    takes in pair order, as the registers do), on batches with base-model tokens, a disabled slot, a slot
    of rank 0, filtered routes and routes past the LoRA buffers' experts."""
    experts, slots = 6, 4
    gen = torch.Generator().manual_seed(tokens * topk)
    ids = torch.randint(-1, experts + 1, (tokens, topk), generator=gen, dtype=torch.int32)  # -1, and one too far
    token_lora = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    token_lora[0], ids[0, 0] = 0, 0  # at least one pair with a delta
    enabled = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    ranks = torch.tensor([8, 16, 0, 64], dtype=torch.int32)
    assert tokens * topk <= lora_moe.REGISTER_PAIRS
    launches = []
    for name in ("_route_in_registers_kernel", "_route_one_program_kernel"):
        kernel = getattr(lora_moe, name)
        monkeypatch.setattr(lora_moe, name, type("Recorded", (), {
            "__getitem__": lambda self, grid, k=kernel, n=name: launches.append(n) or k[grid]})())
    ours = lora_moe.route(ids, token_lora, enabled, ranks, experts, block_m)
    monkeypatch.setattr(lora_moe, "REGISTER_PAIRS", 0)
    theirs = lora_moe.route(ids, token_lora, enabled, ranks, experts, block_m)
    assert launches == ["_route_in_registers_kernel", "_route_one_program_kernel"]
    rows = int(theirs.rows_used)
    assert rows > 0 and int(ours.rows_used) == rows
    assert torch.equal(ours.sorted_ids, theirs.sorted_ids)  # every row, the empty ones past rows_used too
    assert torch.equal(ours.block_key[: rows // block_m], theirs.block_key[: rows // block_m])


@pytest.mark.parametrize("num_pairs", [1, 6, 13, 4096 + 3])
def test_every_routing_buffer_starts_on_16_bytes_whatever_the_batch(num_pairs):
    """Triton specializes each kernel on its pointers' alignment: buffers that moved with the pair count
    would compile another variant of each kernel as batches change."""
    scratch = lora_moe._Scratch.of(num_pairs, num_keys=5 * 13, block_m=16, device="cpu")
    views = dataclasses.astuple(scratch)
    assert [v.data_ptr() % 16 for v in views] == [0] * len(views)
    rows = lora_moe.max_rows(num_pairs, 5 * 13, 16)
    assert [v.numel() for v in views] == [65, num_pairs, num_pairs, 65, 1, rows, rows // 16]
    ends = sorted((v.data_ptr(), v.data_ptr() + 4 * v.numel()) for v in views)
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))  # no two overlap


@pytest.mark.parametrize("one_kernel", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["two-launches", "one-kernel"])
def test_dynamo_compiles_the_fast_hooks_in_one_graph(runners, monkeypatch, one_kernel):
    """A caller compiled with ``fullgraph=True`` builds and runs the fast hooks (the builder a plain
    function on the module, the routing and both GEMMs custom ops) and adds what an eager caller adds."""
    import torch._dynamo

    problem, info = make_case("mixed-ranks-top2")
    if one_kernel:
        plan = tuning.Plan(16, ONE_KERNEL, ONE_KERNEL)
        monkeypatch.setattr(tuning, "_plan", lambda *args: plan)  # behind plan's assume_constant_result
        launches, launch = [], lora_moe.one_kernel
        monkeypatch.setattr(lora_moe, "one_kernel", lambda *a, **k: launches.append(1) or launch(*a, **k))
    calls, fast_builder = [], lora_path.build_hooks
    monkeypatch.setattr(lora_path, "build_hooks", lambda *args: calls.append(args) or fast_builder(*args))
    tokens, topk = problem.topk_ids.shape
    gen = torch.Generator().manual_seed(5)
    c1 = torch.randn(tokens, topk, info.gate_up_lora_b_weights.shape[2], generator=gen).half()
    act = torch.randn(tokens * topk, problem.w2.shape[2], generator=gen).half()
    c3 = torch.randn(tokens, topk, problem.w2.shape[1], generator=gen).half()

    def caller(hidden, c1, act, c3, weights, ids):
        hooks = runners.build_lora_hooks(hidden, info, ids)
        hooks.after_gate_up(hidden, c1, weights, ids)
        hooks.after_down(act, c3, weights, ids)
        return c1, c3

    args = (problem.hidden_states, problem.topk_weights, problem.topk_ids)
    try:
        lora_path.activate(lora_path.Mode.FAST)
        torch._dynamo.reset()
        eager = caller(args[0], c1.clone(), act, c3.clone(), *args[1:])
        compiled = torch.compile(caller, backend="eager", fullgraph=True)(args[0], c1.clone(), act, c3.clone(),
                                                                          *args[1:])
        assert len(calls) == 2, "the compiled caller stepped around the fast builder"
    finally:
        lora_path.deactivate()
        torch._dynamo.reset()
    assert not torch.equal(eager[0], c1) and not torch.equal(eager[1], c3), "the hooks added nothing"
    for ours, theirs in zip(compiled, eager):
        assert torch.equal(ours, theirs)  # the same kernels on the same inputs: bit-identical
    if one_kernel:
        assert len(launches) == 4  # one a hook, eager and compiled


@pytest.mark.parametrize("value, mode", [("fast", "fast"), pytest.param("1", "correct", marks=pytest.mark.slow),
                                         pytest.param("plain", "correct", marks=pytest.mark.slow),
                                         pytest.param("0", None, marks=pytest.mark.slow)])
def test_switch_and_check_say_which_lora_moe_hooks_a_server_builds(runners, value, mode):
    from sglang_lora_tma_guard import check
    from sglang_lora_tma_guard.settings import ENV_VAR, read_switch

    switch = read_switch({ENV_VAR: value})
    assert switch.fast == (value == "fast") and switch.enabled == (mode is not None)
    found = check.lora_path_report(switch)
    # SGLang 0.5.16's own virtual-experts path has no per-half A (fixed upstream in 0.5.23).
    assert (found.mode, found.builder, found.virtual_experts_fixed_upstream) == (mode, lora_path.TARGET, False)


def test_status_does_not_claim_the_fast_path_where_sglangs_own_lora_moe_engine_runs(monkeypatch):
    """0.5.23's --lora-backend triton_v2 with a lora_* MoE runner never calls build_lora_hooks."""
    from sglang_lora_tma_guard import serving

    engine = SimpleNamespace(lora_backend="triton_v2", moe_runner_backend="lora_triton")
    assert "SGLang's own LoRA MoE engine" in lora_path.bypassed_by(engine)
    assert lora_path.bypassed_by(SimpleNamespace(lora_backend="triton_v2", moe_runner_backend="auto")) is None
    monkeypatch.setattr(serving, "server_args_here", lambda: engine)
    state = lora_path.status()
    assert state.installed is False and state.bypassed and "no LoRA MoE hooks are built" in state.describe()


def test_checks_fast_path_line_names_the_down_gemm_widths_the_fused_launch_is_placed_at(monkeypatch):
    from sglang_lora_tma_guard import fused_lora
    from sglang_lora_tma_guard.lora_path import Mode, PathStatus

    fast = PathStatus(mode=Mode.FAST, installed=True, virtual_experts_fixed_upstream=False)
    for table, where in (
            ({768: ((32, 1),), 256: ((16, 1),), 384: ((32, 1),)}, "up to rank 16 at a down GEMM K of 256, "
                                                                    "up to rank 32 at a down GEMM K of 384 or 768"),
            ({768: ((32, 1), (64, 2)), 256: ((8, 1), (32, 1)), 384: ((32, 1),)},
             "up to rank 32 at a down GEMM K of 256 or 384, up to rank 64 at a down GEMM K of 768"),
            ({256: ((16, 1),)}, "up to rank 16 at a down GEMM K of 256")):
        monkeypatch.setattr(fused_lora, "FASTER_FROM_ROUTES", table)
        assert fast.describe().endswith(f"large block-fp8 batches {where})")
    # A GPU's own rows in place of the table's at their K, on that GPU only (an H100 at K 256 takes rank 64).
    from sglang_lora_tma_guard import tuning

    monkeypatch.setattr(fused_lora, "FASTER_FROM_ROUTES_ON", {"GPU A": {256: ((64, 2),)}})
    monkeypatch.setattr(tuning, "_gpu", lambda: "GPU A")
    assert fast.describe().endswith("large block-fp8 batches up to rank 64 at a down GEMM K of 256)")
    monkeypatch.setattr(tuning, "_gpu", lambda: "GPU B")
    assert fast.describe().endswith("large block-fp8 batches up to rank 16 at a down GEMM K of 256)")
    from sglang_lora_tma_guard import fused_act

    assert fused_act.BY_FAST and "the gate-up expand in the SiLU activation;" in fast.describe()
    monkeypatch.setattr(fused_act, "BY_FAST", False)
    assert "activation" not in fast.describe()


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :half]) * gate_up[..., half:]


def one_kernel(problem, info):
    """``run(out, gate_up_rows, tile)``: :func:`lora_moe.expand_silu_and_mul` on ``problem``'s batch (its routing in
    blocks of 16 and the gate-up ranks of the fast shrink at the planned tile) at ``fused_act.TILE`` updated by
    ``tile``; and the batch's adapter slots."""
    tokens, topk = problem.topk_ids.shape
    r = int(info.max_lora_rank)
    ranks, enabled = info.lora_ranks.to(torch.int32), info.adapter_enabled.to(torch.int32)
    slots = lora_path.token_adapters(info, tokens)
    experts = info.gate_up_lora_b_weights.shape[1]
    config = tuning.plan(tokens * topk, problem.hidden_states.shape[1], info.down_lora_a_weights.shape[3], experts,
                         ranks.numel(), r).gate_up
    routing = lora_moe.route(problem.topk_ids, slots, enabled, ranks, experts, 16)
    t = lora_moe.shrink(problem.hidden_states, info.gate_up_lora_a_weights, routing, topk=topk, max_rank=r, halves=2,
                        config=config)

    def run(out, gate_up, tile):
        lora_moe.expand_silu_and_mul(out, gate_up, t, info.gate_up_lora_b_weights, routing, topk_ids=problem.topk_ids,
                                     token_lora=slots, enabled=enabled, ranks=ranks, max_rank=r,
                                     tile={**fused_act.TILE, **tile})

    return run, slots


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT_RUN else pytest.mark.slow) for n in CASES
                                  if CASES[n].gated])
@pytest.mark.parametrize("tile", [{}, {"BLOCK_R": 16}, {"BLOCK_N": 16, "N_TILES": 2, "BLOCK_MAJOR": True},
                                  {"BLOCK_N": 16, "N_TILES": 3, "PREFETCH": True}],
                         ids=["ranks-in-one-tile", "rank-tiles-of-16", "block-major-groups-of-two-column-tiles",
                              "three-column-tiles-each-loaded-a-tile-ahead"])
def test_the_gate_up_expand_with_the_activation_is_the_activation_of_the_float32_delta(runners, name, tile):
    """:func:`lora_moe.expand_silu_and_mul` against ``silu(gate) * up`` of the gate-up rows plus the float32
    reference delta, in float32; every pair (those without a delta too). Tolerance: the fast hook's rows through the
    same activation, plus one fp16 step (the result is rounded once to fp16 where the hook path rounds the rows with
    their delta, then the activation: each within one step, neither always the closer)."""
    problem, info = make_case(name)
    tokens, topk = problem.topk_ids.shape
    gen = torch.Generator().manual_seed(7)
    gate_up = torch.randn(tokens, topk, info.gate_up_lora_b_weights.shape[2], generator=gen).half()
    reference = gate_up.float()
    ReferenceLoRAHooks(info).after_gate_up(problem.hidden_states, reference, problem.topk_weights, problem.topk_ids)
    expected = silu_and_mul_reference(reference).view(tokens * topk, -1)

    run, slots = one_kernel(problem, info)
    out = torch.full((tokens * topk, gate_up.shape[2] // 2), float("nan"), dtype=gate_up.dtype)
    before = gate_up.clone()
    run(out, gate_up.view(tokens * topk, -1), tile)
    assert torch.equal(gate_up, before)  # read only
    error = float((out.float() - expected).abs().max() / expected.abs().max())
    hooked = silu_and_mul_reference(run_hooks_gate_up(gate_up, problem, info)).view(tokens * topk, -1)
    hook_error = float((hooked.float() - expected).abs().max() / expected.abs().max())
    assert error <= hook_error + ONE_FP16_STEP, (error, hook_error)  # measured 2.6e-4 to 6.3e-4
    # One rounding fewer than the hook path (its rows rounded with their delta, then its activation's output): each
    # adapter's pairs on average at least as close (a rank tail dropped or a delta rounded early would show here
    # first; measured 15-20% closer at every rank, 8 to 64).
    served = hooked.to(out.dtype).float()
    pair_slot = slots.repeat_interleave(topk)
    for slot in (pair_slot[pair_slot >= 0]).unique().tolist():
        pairs = pair_slot == slot
        mean_error, hook_mean_error = ((y[pairs] - expected[pairs]).abs().mean().item() for y in (out.float(), served))
        assert mean_error <= hook_mean_error, (slot, mean_error, hook_mean_error)
    plain = silu_and_mul_reference(gate_up.float()).view(tokens * topk, -1)
    assert not torch.allclose(out.float(), plain, atol=1e-2)  # the delta is there
    if not tile:  # the benchmarks' rows-only variant: every pair's plain activation, in the same order of programs
        run(out, gate_up.view(tokens * topk, -1), {"ROWS_ONLY": True})
        torch.testing.assert_close(out.float(), plain, atol=ONE_FP16_STEP * plain.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", ["mixed-ranks-top2", pytest.param("shared-outer", marks=pytest.mark.slow)])
def test_the_one_kernels_program_order_and_prefetch_leave_its_output_bit_for_bit(runners, name):
    """Block by block or group by group, rows loaded a tile ahead or not: the same programs do the same arithmetic,
    so the one kernel's output is the same to the bit (``fused_act.tile`` switches the order by batch size)."""
    problem, info = make_case(name)
    tokens, topk = problem.topk_ids.shape
    gate_up = torch.randn(tokens * topk, info.gate_up_lora_b_weights.shape[2],
                          generator=torch.Generator().manual_seed(3)).half()
    run, _ = one_kernel(problem, info)
    outs = []
    for major, prefetch in ((False, False), (True, False), (False, True), (True, True)):
        out = torch.full((tokens * topk, gate_up.shape[1] // 2), float("nan"), dtype=gate_up.dtype)
        run(out, gate_up, {"BLOCK_N": 16, "N_TILES": 2, "BLOCK_MAJOR": major, "PREFETCH": prefetch})
        outs.append(out)
    assert not outs[0].isnan().any()
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def run_hooks_gate_up(gate_up, problem, info):
    """The fast gate-up hook's rows, in fp16 (the hook path's activation input)."""
    from sglang.srt.lora import lora_moe_runners

    cache1 = gate_up.clone()
    hooks = lora_path.build_hooks(inspect_unwrap(lora_moe_runners.build_lora_hooks), problem.hidden_states, info,
                                  problem.topk_ids)
    hooks.after_gate_up(problem.hidden_states, cache1, problem.topk_weights, problem.topk_ids)
    return cache1.float()


def inspect_unwrap(fn):
    import inspect

    return inspect.unwrap(fn)


def torch_silu_and_mul(calls):
    """SGLang's CUDA ``silu_and_mul(input, out)`` contract in PyTorch (the CPU has no CUDA kernel), its calls counted."""
    def silu_and_mul(rows, out, **kwargs):
        calls.append(kwargs)
        out.copy_(silu_and_mul_reference(rows.float()).to(out.dtype))

    return silu_and_mul


@pytest.mark.parametrize("activation, block_major", [("silu_and_mul", False), ("silu_and_mul", True),
                                                     ("portable", False)],
                         ids=["silu_and_mul", "silu_and_mul-block-major", "portable"])
def test_the_gate_up_delta_is_added_by_the_activation_in_sglangs_runner(sglang_plugins, runners, monkeypatch,
                                                                       activation, block_major):
    """``=fast`` through ``load_plugins()``, the gate-up work offered to the activation (``fused_act``): in SGLang's
    runner the call is as right against the float32 reference MoE as the hooks' (tolerance as above) and the hook
    adds nothing into the gate-up rows. Where SGLang's sequence calls
    its CUDA ``silu_and_mul`` (``_is_cuda``; PyTorch's math in its place here) the one kernel runs instead of it;
    where it runs its portable activation (SGLang on the CPU) the down launch writes the activation again, delta
    included. Without the guard's wrapper (which reads the call's activation) nothing is offered. Block-major: the
    one kernel's programs in the order it takes from ``fused_act.BLOCK_MAJOR_FROM_ROUTES`` routes on (lowered here
    to this batch's)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    from sglang_lora_tma_guard import fused_act, lora_moe

    orders, one_kernel = [], lora_moe.expand_silu_and_mul
    monkeypatch.setattr(fused_act, "BLOCK_MAJOR_FROM_ROUTES", 1 if block_major else fused_act.BLOCK_MAJOR_FROM_ROUTES)
    monkeypatch.setattr(lora_moe, "expand_silu_and_mul",
                        lambda *a, tile, **k: orders.append(tile["BLOCK_MAJOR"]) or one_kernel(*a, tile=tile, **k))

    problem, info = make_case("mixed-ranks-top2", seed=1)
    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    sglang_plugins("fast")
    hooked = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)

    calls, kernels, in_place = [], [], []
    if activation == "silu_and_mul":
        fused_act.deactivate()
        monkeypatch.setattr(fused_moe, "_is_cuda", True)
        monkeypatch.setattr(fused_moe, "silu_and_mul", torch_silu_and_mul(calls), raising=False)
    run, add = fused_act.ActWork.activation, fused_act.ActWork.add_in_place
    monkeypatch.setattr(fused_act.ActWork, "activation", lambda self, out: kernels.append(out.shape) or run(self, out))
    monkeypatch.setattr(fused_act.ActWork, "add_in_place", lambda self: in_place.append(1) or add(self))
    try:
        fused_act.activate()
        assert fused_act.PATCH.status().installed == (activation == "silu_and_mul")
        orders.clear()
        fused = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
    finally:
        fused_act.deactivate()  # off SGLang's attribute before monkeypatch takes it away
    pairs = TOKENS * CASES["mixed-ranks-top2"].topk
    assert kernels == [(pairs, problem.w2.shape[2])] and not in_place and not calls
    assert orders == [block_major]
    fused_err, hooked_err = tiny_moe.rel_err(fused, reference), tiny_moe.rel_err(hooked, reference)
    assert fused_err < 1e-2 and fused_err <= hooked_err + ONE_FP16_STEP, (fused_err, hooked_err)
    assert tiny_moe.rel_err(fused, expected_moe(problem, None)) > 0.05

    from sglang_lora_tma_guard import guard as tma_guard

    tma_guard.deactivate()  # no wrapper to read the activation: the hook adds the delta itself
    fused_act.activate()
    kernels.clear()
    unguarded = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=False)
    fused_act.deactivate()
    assert not kernels and tiny_moe.rel_err(unguarded, reference) < 1e-2


@pytest.mark.parametrize("activation", ["silu_and_mul", "portable"])
def test_a_gate_up_kernel_that_fails_is_served_the_hooks_way_and_turned_off(sglang_plugins, runners, monkeypatch,
                                                                            caplog, activation):
    """The one kernel raising (out of a GPU's resources, say) where SGLang's ``silu_and_mul`` would take the offer,
    or at the down launch: the call is still right (the delta into the rows as the hook adds it, then SGLang's
    activation or its PyTorch form), the error is logged and no later batch is offered."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    from sglang_lora_tma_guard import fused_act

    problem, info = make_case("mixed-ranks-top2", seed=1)
    reference = expected_moe(problem, ReferenceLoRAHooks(info))
    sglang_plugins("fast")
    calls = []
    if activation == "silu_and_mul":
        monkeypatch.setattr(fused_moe, "_is_cuda", True)
        monkeypatch.setattr(fused_moe, "silu_and_mul", torch_silu_and_mul(calls), raising=False)

    def out_of_resources(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(lora_moe, "expand_silu_and_mul", out_of_resources)
    try:
        fused_act.activate()
        with caplog.at_level(logging.ERROR, logger="sglang_lora_tma_guard"):
            out = real_lora.run_runner(problem, real_lora.lora_hooks(problem, info), use_tma=True)
        assert not fused_act._placed
    finally:
        fused_act.deactivate()
    assert tiny_moe.rel_err(out, reference) < 1e-2
    assert any("gate-up LoRA kernel failed" in r.getMessage() for r in caplog.records)
    assert len(calls) == (activation == "silu_and_mul")  # SGLang's own activation, after the delta


def test_only_a_plain_silu_call_has_its_gate_up_work_offered_to_the_activation(runners):
    """The guard's reader of SGLang's own sequence signature: silu, gated, no alpha, limit, clamp or SwiGLU fused
    into the GEMM; any of them, or another activation, and the hook adds the delta itself."""
    import inspect

    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    from sglang_lora_tma_guard import fused_act

    original = inspect.unwrap(fused_moe._fused_moe_kernel_sequence)
    reader = fused_act.plain_silu_reader(original)
    names = list(inspect.signature(original).parameters)
    plain = {"activation": "silu", "is_gated": True, "gemm1_alpha": None, "gemm1_limit": None}
    assert reader((), plain)
    positional = tuple(plain.get(name, None) for name in names[:names.index("gemm1_limit") + 1])
    assert reader(positional, {})
    for change in ({"activation": "gelu"}, {"is_gated": False}, {"gemm1_alpha": 1.7}, {"gemm1_limit": 7.0},
                   {"swiglu_limit": 10.0}):
        assert not reader((), {**plain, **change}), change
    assert not reader((), {k: v for k, v in plain.items() if k != "activation"})  # no default to fall back on
    assert fused_act.plain_silu_reader(lambda hidden_states, activation: None) is None


def test_an_activation_called_on_other_rows_than_offered_adds_the_delta_first():
    """SGLang's ``silu_and_mul`` as placed: an offer it cannot take (other rows, more arguments) is the hook's own
    work first, then SGLang's function as called; with no offer, SGLang's function alone."""
    from sglang_lora_tma_guard import fused_act
    from sglang_lora_tma_guard.patching import Engaged

    seen = []
    wrapper = fused_act._make(lambda *a, **k: seen.append(("sglang", a, k)), Engaged())
    work = SimpleNamespace(fits=lambda rows, out: False, add_in_place=lambda: seen.append("in place"),
                           activation=lambda out: seen.append("kernel"))
    fused_act.offer(work)
    wrapper("rows", "out")
    assert seen == ["in place", ("sglang", ("rows", "out"), {})]
    seen.clear()
    wrapper("rows", "out", expert_ids="e")  # no offer
    assert seen == [("sglang", ("rows", "out"), {"expert_ids": "e"})]
    seen.clear()
    work.fits = lambda rows, out: True
    fused_act.offer(work)
    wrapper("rows", "out", expert_ids="e")
    assert seen[0] == "in place"
    fused_act.offer(work)
    seen.clear()
    wrapper("rows", "out")
    assert seen == ["kernel"] and not fused_act.pending()


@pytest.mark.parametrize("by_fast", [False, True])
def test_fast_places_the_gate_up_delta_in_the_activation_only_once_it_is_switched_on(runners, monkeypatch, by_fast):
    from sglang_lora_tma_guard import fused_act

    monkeypatch.setattr(fused_act, "BY_FAST", by_fast)
    lora_path.activate(lora_path.Mode.FAST)
    try:
        assert fused_act.PATCH.status().wanted == by_fast and fused_act._placed == by_fast
    finally:
        lora_path.deactivate()
    assert not fused_act.PATCH.status().wanted and not fused_act._placed


def test_a_gate_up_offer_left_at_the_end_of_the_sequence_or_unfit_for_the_down_input_turns_it_off_loudly(caplog):
    """Neither happens in SGLang 0.5.11-0.5.23 (the down launch follows every activation, its input the activation's
    output): if either did, the delta of that call would be missing, so the error is logged and no later batch is
    offered (the hook adds its delta itself)."""
    from sglang_lora_tma_guard import fused_act

    work = fused_act.ActWork(torch.zeros(2, 2, 8), None, None, SimpleNamespace(num_pairs=4), None, None, None, None,
                             16, None)
    work.activation = lambda out: pytest.fail("finished into an input of another shape")
    for leave in ("at the sequence's end", "to a down input of another shape"):
        fused_act._placed = True
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sglang_lora_tma_guard"):
            with fused_act.sequence(True):
                fused_act.offer(work)
                if leave != "at the sequence's end":
                    fused_act.finish(torch.zeros(4, 3))  # the activation of 8-wide rows is 4 wide
        assert not fused_act._placed and not fused_act.pending(), leave
        assert any(r.levelno == logging.ERROR for r in caplog.records), leave
    assert not fused_act.ready()
