"""The guard on the installed SGLang's own server arguments and LoRA seam, in a fresh interpreter.

    SGLANG_LORA_TMA_GUARD=1 python scripts/release_probe.py [--layers]     (prints one JSON object)

First the catalogue (:func:`catalogue_check`): each defect's presence, read from this release's files,
and what the launcher does with this release's own ``ServerArgs`` where a defect is decided from the
server arguments: the fields it sets for a LoRA server, and the deployments it refuses (a local
``config.json`` of a DeepSeek-V3-class MoE, so the launcher knows the model has experts).

The plugin is loaded by SGLang's ``load_plugins()``; then ``ServerArgs`` records are built and
resolved as the launcher does (``model_path="dummy"``: no model, no GPU) for each way of asking for
LoRA, and sent to a spawned child process (how SGLang hands them to its schedulers), which reports
``disable_shared_experts_fusion`` as it received it. A record built *before*
``load_plugins()`` (``sglang.Engine(server_args=...)``) goes through what the launcher does with it
before it starts the schedulers: ``resolve_once()`` (0.5.19+) and ``check_server_args()``.

Then two defects shown on this release's own code (``scripts/defect_probes.py``): the csgmv backend's
segments on the MoE path, and the DP-attention mapping.

Then the LoRA MoE seam of the same release (:func:`lora_path_check`): SGLang's runner looks up
``build_lora_hooks`` when it runs, the guard's wrapper is in its place, the release's virtual-experts
path is judged from its code, and the fast hooks, built through the release's own ``build_lora_hooks``
from its own ``LoRAInfo``, are checked against a float32 reference on Triton's CPU interpreter.
With ``--layers``, then SGLang's own MoE layers on the same release, unguarded and guarded
(``harness/layer_probe.py``, started as a fresh interpreter would start it: the guard taken off and the
switch unset), and the two reports as ``{"fusion": ..., "layers": ...}``: one SGLang import a release.
Used by ``scripts/version_matrix.py``.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import sys
import warnings

import defect_probes  # scripts/defect_probes.py, beside this file

CASES = {
    "lora_paths": {"lora_paths": ["a=/adapters/a"]},
    "enable_lora": {"enable_lora": True},
    "enable_lora_false_with_paths": {"enable_lora": False, "lora_paths": ["a=/adapters/a"]},
    "no_lora": {},
    "lora_forced_fusion": {"enable_lora": True, "enforce_shared_experts_fusion": True},
}


def build(model_path="dummy", **kwargs):
    from sglang.srt.server_args import ServerArgs

    record = ServerArgs(model_path=model_path, **kwargs)
    if hasattr(record, "resolve_once"):  # 0.5.19+: the launcher resolves explicitly
        record.resolve_once()
    return record


def child_reads(records, fields=None):
    """What a spawned process receives (SGLang pickles the record into each scheduler): one field each,
    ``disable_shared_experts_fusion`` unless ``fields`` says which."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_fields, (records, fields or ["disable_shared_experts_fusion"] * len(records)))


def _fields(records, fields):
    return [getattr(record, field) for record, field in zip(records, fields)]


def main(argv=None) -> None:
    warnings.simplefilter("ignore")
    log = io.StringIO()
    logging.basicConfig(stream=log, level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    import sglang
    from sglang.srt.server_args import ServerArgs

    # Built before any plugin, as for sglang.Engine(server_args=ServerArgs(...)): up to 0.5.18 the
    # constructor resolves it there and then; from 0.5.19 the launcher resolves it later.
    early = ServerArgs(model_path="dummy", enable_lora=True)
    import sglang.srt.plugins as plugins

    plugins.load_plugins()
    from sglang_lora_tma_guard import serving

    records = {name: build(**kwargs) for name, kwargs in CASES.items()}
    if hasattr(early, "resolve_once"):
        early.resolve_once()
    early_before_check = early.disable_shared_experts_fusion
    try:
        early.check_server_args()
        early_error = None
    except Exception as exc:  # a dummy model may trip an unrelated check; the hook ran first
        early_error = f"{type(exc).__name__}: {exc}"[:300]
    warned = [line for line in log.getvalue().splitlines() if "sglang-lora-tma-guard" in line]  # by the cases
    lora_path = lora_path_check()
    catalogue, changes = catalogue_check()
    # One spawned child reads every record (a spawn costs an SGLang import): the cases', the early one's
    # and the catalogue's launcher changes.
    fields = ["disable_shared_experts_fusion"] * (len(records) + 1) + [field for _, field in CHANGES.values()]
    received = child_reads([*records.values(), early, *changes], fields)
    received, changed = received[:len(records) + 1], received[len(records) + 1:]
    catalogue["changes"] = dict(zip(CHANGES, changed))
    result = {
        "version": getattr(sglang, "__version__", None),
        "hooked": f"ServerArgs.{serving.resolution_method(ServerArgs)}",
        "fix_active": serving.active(),
        **dict(zip(records, received)),
        "resolved_before_plugins": {"before_check": early_before_check, "child": received[-1],
                                    "check_error": early_error},
        "warnings": warned,
        "lora_path": lora_path,
        "catalogue": catalogue,
        "probes": {"csgmv_segments": defect_probes.csgmv_segments(),
                   "dp_attention_mapping": defect_probes.dp_attention_mapping()},
    }
    if "--layers" in (sys.argv[1:] if argv is None else argv):
        result = {"fusion": result, "layers": layers_unguarded_then_guarded(serving)}
    print(json.dumps(result))


def layers_unguarded_then_guarded(serving) -> dict:
    """``harness/layer_probe.py`` in this interpreter (an SGLang import saved a release), from where a
    fresh one starts it: every patch of the guard off and the switch unset."""
    import os

    serving.deactivate()
    os.environ.pop("SGLANG_LORA_TMA_GUARD", None)
    from harness import layer_probe

    return layer_probe.probe()


MOE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 16,
    "n_shared_experts": 1, "num_experts_per_tok": 4, "hidden_size": 256, "moe_intermediate_size": 64,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000,
}
CHANGES = {  # a LoRA server's flag -> the field to read back, as a spawned child receives it
    "fused_sum_all_reduce": ({"enable_fused_moe_sum_all_reduce": True}, "enable_fused_moe_sum_all_reduce"),
    "csgmv": ({"lora_backend": "csgmv"}, "lora_backend"),
}
REFUSALS = {
    "dp_attention": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True},
    "eplb": {"tp_size": 2, "ep_size": 2, "enable_eplb": True},
    "redundant_experts": {"tp_size": 2, "ep_size": 2, "ep_num_redundant_experts": 2},
    "ngram": {"speculative_algorithm": "NGRAM"},
    "plain_lora_server": {},
}


def catalogue_check() -> tuple[dict, list]:
    """Each defect's presence in this release and the deployments the launcher refuses on its own
    ServerArgs; with the LoRA server records whose changed fields (``CHANGES``) a spawned child reads."""
    import json as json_module
    import tempfile
    from pathlib import Path

    from sglang_lora_tma_guard import catalogue, defects

    presence = {d.id: dataclass_dict(d.present()) for d in defects.DEFECTS}
    records = [build(enable_lora=True, **flags) for flags, _ in CHANGES.values()]
    refused = {}
    with tempfile.TemporaryDirectory() as model:
        (Path(model) / "config.json").write_text(json_module.dumps(MOE_CONFIG))
        for name, flags in REFUSALS.items():
            try:
                build(model_path=model, enable_lora=True, device="cpu", **flags)
                refused[name] = None
            except catalogue.RefusedDeployment as refusal:
                refused[name] = str(refusal)
            except Exception:  # SGLang's own checks after the guard's (no GPU here): not refused by us
                refused[name] = None
    return {"presence": presence, "refused": refused}, records


def dataclass_dict(record) -> dict:
    import dataclasses

    return dataclasses.asdict(record)


RUNNER_LOOKUP = "from sglang.srt.lora.lora_moe_runners import build_lora_hooks"


def lora_path_check(tokens: int = 6, topk: int = 2, experts: int = 4, hidden: int = 64, inter: int = 32) -> dict:
    """The LoRA MoE seam on this release (guard on, as loaded by ``load_plugins()``), then in fast mode."""
    import dataclasses
    import importlib.util
    import inspect
    from pathlib import Path

    import torch
    from sglang.srt.lora import lora_moe_runners as runners

    from sglang_lora_tma_guard import lora_path

    # Looked up inside the runner's method (indented), so the module attribute is the seam. Read from
    # the runner's file: importing the runner costs seconds a release and proves nothing more.
    runner_file = Path(importlib.util.find_spec("sglang.srt.layers.moe.moe_runner.runner").origin)
    looked_up = any(line.strip() == RUNNER_LOOKUP and line.startswith(" ")
                    for line in runner_file.read_text().splitlines())
    placed = lora_path.status()
    lora_path.activate(lora_path.Mode.FAST)
    g = torch.Generator().manual_seed(0)
    ranks, halves, r = [8, 16, 0], 2, 16
    loras = len(ranks)

    def weights(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(torch.float16)

    ga, gb = weights(loras, experts, halves * r, hidden), weights(loras, experts, halves * inter, r)
    da, db = weights(loras, experts, r, inter), weights(loras, experts, hidden, r)
    for slot, rank in enumerate(ranks):  # padded ranks are zero, as in SGLang's buffers
        ga[slot, :, rank:r] = ga[slot, :, r + rank:] = 0
        gb[slot, :, :, rank:] = da[slot, :, rank:] = db[slot, :, :, rank:] = 0
    owners = [0, 1, -1]  # segments of 2 tokens: adapter 0, adapter 1, the base model
    fields = {f.name for f in dataclasses.fields(runners.LoRAInfo)}
    values = dict(
        gate_up_lora_a_weights=ga, gate_up_lora_b_weights=gb, down_lora_a_weights=da, down_lora_b_weights=db,
        seg_indptr=torch.tensor([0, 2, 4, 6], dtype=torch.int32), req_to_lora=torch.tensor(owners, dtype=torch.int32),
        lora_ranks=torch.tensor(ranks, dtype=torch.int32), adapter_enabled=torch.tensor([1, 1, 0], dtype=torch.int32),
        token_lora_mapping=torch.tensor([0, 0, 1, 1, -1, -1], dtype=torch.int32), max_lora_rank=r,
        num_experts=experts, has_active_lora=True,
    )
    info = runners.LoRAInfo(**{k: v for k, v in values.items() if k in fields})
    x = weights(tokens, hidden)
    ids = torch.randint(0, experts, (tokens, topk), generator=g, dtype=torch.int32)
    w = torch.rand(tokens, topk, generator=g)
    act = weights(tokens * topk, inter)
    c1 = torch.zeros(tokens, topk, halves * inter, dtype=torch.float16)
    c3 = torch.zeros(tokens, topk, hidden, dtype=torch.float16)
    hooks = runners.build_lora_hooks(x, info, ids)  # the module attribute, as the runner calls it
    hooks.after_gate_up(x, c1, w, ids)
    hooks.after_down(act, c3, w, ids)
    ref1, ref3 = torch.zeros(c1.shape), torch.zeros(c3.shape)
    for t in range(tokens):
        a = owners[t // 2]
        if a < 0 or not ranks[a]:
            continue
        for j, e in enumerate(ids[t].tolist()):
            A, B = ga[a, e].float(), gb[a, e].float()
            ref1[t, j] = torch.cat([B[:inter] @ (A[:r] @ x[t].float()), B[inter:] @ (A[r:] @ x[t].float())])
            ref3[t, j] = w[t, j] * (db[a, e].float() @ (da[a, e].float() @ act[t * topk + j].float()))
    error = max(float((c1.float() - ref1).abs().max() / ref1.abs().max()),
                float((c3.float() - ref3).abs().max() / ref3.abs().max()))
    lora_path.deactivate()
    return {
        "runner_looks_up_at_call_time": looked_up,
        "wrapper_placed": placed.installed,
        "mode_with_guard_on": placed.mode,
        "virtual_experts_fixed_upstream": placed.virtual_experts_fixed_upstream,
        "token_lora_mapping_given": "token_lora_mapping" in fields,
        "fast_hooks_used": getattr(hooks.after_gate_up, "__module__", None) == "sglang_lora_tma_guard.lora_path",
        "fast_max_rel_error": error,
        "restored": runners.build_lora_hooks is inspect.unwrap(runners.build_lora_hooks),
    }


if __name__ == "__main__":
    sys.exit(main())
