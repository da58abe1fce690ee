"""Each defect of the catalogue that a CPU can show, on the installed SGLang's own code: unguarded, guarded.

    python -m scripts.demo_defects       (scripts/demo.sh runs it after the TMA demo)

One row per defect: what SGLang does without the guard, and with it (``serving.arm()``: the launcher's
step on SGLang's own ``ServerArgs``, and each scheduler's step after SGLang's own
``LoRAManager.init_lora_modules``). Layers are SGLang's own ``FusedMoE`` wrapped by its own
``FusedMoEWithLoRA``, run on the CPU through Triton's interpreter against a float32 PyTorch reference
(``harness/sglang_cpu.py``). What only a GPU can show (the race itself, the fused sum-all-reduce's
dropped down delta) is in ``benchmarks/inplace_race`` and ``benchmarks/defects_h200.py``; what only
another release has (csgmv on 0.5.11), in ``scripts/version_matrix.py``. Exit 0 when every row shows
the defect unguarded and its fix or refusal guarded.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
REPO = Path(__file__).resolve().parents[1]

RIGHT, WRONG = 5e-3, 0.1
MOE_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 16,
              "n_shared_experts": 1, "num_experts_per_tok": 4, "hidden_size": 256, "moe_intermediate_size": 64,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}


def launcher(guarded: bool, model: str | None = None, **flags):
    """SGLang's own ServerArgs of a LoRA server: the record, or the guard's refusal (a string)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_lora_tma_guard import serving
    from sglang_lora_tma_guard.catalogue import RefusedDeployment

    (serving.arm if guarded else serving.disarm)()
    try:
        return ServerArgs(model_path=model or "dummy", enable_lora=True, device="cpu", **flags)
    except RefusedDeployment as refused:
        return "refused: " + str(refused).split(": ", 2)[-1][:70] + "..."
    except Exception as error:  # SGLang's own checks after the guard's step (no GPU here)
        return f"starts (then SGLang: {type(error).__name__})"
    finally:
        serving.disarm()


def layer(cpu, guarded: bool, topk: int = 2, **options):
    """SGLang's FusedMoE wrapped by its own init_lora_modules; its forward's errors, or the refusal."""
    import torch

    from sglang_lora_tma_guard import serving
    from sglang_lora_tma_guard.catalogue import RefusedDeployment

    (serving.arm if guarded else serving.deactivate)()
    base = cpu.moe_layer(4, topk=topk, **options)
    manager = cpu.lora_manager([base])
    try:
        manager.init_lora_modules()
    except RefusedDeployment as refused:
        return {"refused": "refused: " + str(refused).split(": ", 2)[-1][:70] + "..."}
    [module] = cpu.wrapped(manager)
    owners = [0, 0, 0, 1, 1, -1, -1]
    adapters = [cpu.ExpertAdapter.random(4, 64, 32, rank, seed=10 + i) for i, rank in enumerate((8, 4))]
    x = (torch.randn(len(owners), 64, generator=torch.Generator().manual_seed(3)) * 0.5).half()
    topk_output = cpu.routing(len(owners), 4, topk, seed=4)
    given = x.clone()
    out = cpu.forward(module, given, topk_output, cpu.lora_info_for(module, adapters, owners))
    want = cpu.reference(base, x, topk_output, adapters, owners)
    return {"adapter": cpu.relative_error(out[:5], want[:5]), "base": cpu.relative_error(out[5:], want[5:]),
            "overwrote_input": not torch.equal(given, x)}


def rows(cpu, model: str) -> list[tuple[str, str, str, bool]]:
    """(defect, unguarded, guarded, as expected)."""
    import torch

    from scripts import defect_probes

    found = []
    off, on = launcher(False), launcher(True)
    found.append(("fused-shared-expert", f"fusion off: {off.disable_shared_experts_fusion}",
                  f"fusion off: {on.disable_shared_experts_fusion}",
                  not off.disable_shared_experts_fusion and on.disable_shared_experts_fusion))
    off, on = layer(cpu, False), layer(cpu, True)
    found.append(("inplace-race", f"the MoE output overwrites its input: {off['overwrote_input']}",
                  f"overwrites its input: {on['overwrote_input']}; error {on['adapter']:.1e}",
                  off["overwrote_input"] and not on["overwrote_input"] and on["adapter"] < RIGHT))
    with torch.compiler.set_stance("force_eager"):
        minimax = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0, gate_up_interleaved=False)
        off, on = layer(cpu, False, **minimax), layer(cpu, True, **minimax)
    found.append(("gate-up-layout", f"MiniMax-M3 layer error {off['adapter']:.2f} (base rows {off['base']:.2f})",
                  f"error {on['adapter']:.1e} (base rows {on['base']:.1e})",
                  off["base"] > WRONG and on["adapter"] < RIGHT and on["base"] < RIGHT))
    off, on = (launcher(guarded, enable_fused_moe_sum_all_reduce=True) for guarded in (False, True))
    found.append(("fused-sum-all-reduce", f"flag kept: {off.enable_fused_moe_sum_all_reduce}",
                  f"flag kept: {on.enable_fused_moe_sum_all_reduce}",
                  off.enable_fused_moe_sum_all_reduce and not on.enable_fused_moe_sum_all_reduce))
    off, on = layer(cpu, False, topk=1, apply_router_weight_on_input=True), layer(
        cpu, True, topk=1, apply_router_weight_on_input=True)
    found.append(("router-weight-on-input", f"Llama-4 layer: adapter rows error {off['adapter']:.2f}",
                  on.get("refused", "started"), off["adapter"] > WRONG and "refused" in on))
    mapping = defect_probes.dp_attention_mapping()
    on = launcher(True, model, tp_size=2, dp_size=2, enable_dp_attention=True)
    found.append(("dp-attention", f"rank 1's delta lands on gathered tokens {mapping['marked']}, not "
                  f"{mapping['should_be']}", on, mapping["wrong"] and on.startswith("refused")))
    for defect, flags in (("eplb-physical-experts", dict(tp_size=2, ep_size=2, enable_eplb=True)),
                          ("ngram-cuda-graph", dict(speculative_algorithm="NGRAM"))):
        off, on = launcher(False, model, **flags), launcher(True, model, **flags)
        off = off if isinstance(off, str) else "starts"
        found.append((defect, off, on, not off.startswith("refused") and on.startswith("refused")))
    return found


def main() -> int:
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)  # the guard's launcher lines are the point of other demos
    import sglang

    from harness import sglang_cpu

    sglang_cpu.scheduler(lora_backend="triton")
    with tempfile.TemporaryDirectory() as model:
        (Path(model) / "config.json").write_text(json.dumps(MOE_CONFIG))
        found = rows(sglang_cpu, model)
    print(f"\nThe catalogue on SGLang {sglang.__version__}'s own code (CPU): each defect without and with the guard\n")
    width = max(len(row[0]) for row in found)
    for defect, off, on, expected in found:
        print(f"  {defect:<{width}}  {'ok ' if expected else 'ODD'}  without: {off}\n  {'':<{width}}       with:    {on}")
    ok = all(row[3] for row in found)
    print("\n" + ("PASS: every defect shown without the guard, fixed or refused with it" if ok
                  else "FAIL: a row did not show what it should (ODD)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
