"""Three defects of the catalogue on a GPU, with SGLang's own LoRA-wrapped MoE layer and its CUDA path.

    python -m benchmarks.defects_h200 [--out DIR]          (a CUDA GPU; SGLang from the server kit)

One ``FusedMoE`` of SGLang's own (16 experts, top-4, hidden 1024, intermediate 512, bf16), wrapped for
LoRA by SGLang's own ``FusedMoEWithLoRA`` (two adapters and base-model tokens in the batch), its own
forward, scored against the float32 PyTorch reference of ``harness/sglang_cpu.py``:

- ``fused-sum-all-reduce``: with ``--enable-fused-moe-sum-all-reduce`` the down GEMM writes straight
  into the output and the down LoRA delta goes into a buffer nobody reads. Shown by comparing the
  output with the reference and with the reference *without the down LoRA*; then with the flag off,
  as the guard makes a LoRA server.
- ``gate-up-layout``: a MiniMax-M3 layer (``gemm1_alpha``, ``gate_up_interleaved=False``), without and
  with the guard's scheduler step (on the CPU only the interpreter ran it).
- ``router-weight-on-input``: a Llama-4 layer (top-1): the adapter rows wrong, the base rows right.

Prints a table and writes ``defects_h200.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from harness import tables

REPO = Path(__file__).resolve().parents[1]

EXPERTS, HIDDEN, INTERMEDIATE = 16, 1024, 512
OWNERS = [0] * 8 + [1] * 8 + [-1] * 8


def on_gpu(obj):
    """A dataclass or named tuple with its tensors moved to the GPU."""
    fields = obj._asdict() if hasattr(obj, "_asdict") else {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    moved = {name: value.cuda() for name, value in fields.items() if isinstance(value, torch.Tensor)}
    return obj._replace(**moved) if hasattr(obj, "_replace") else dataclasses.replace(obj, **moved)


def layer_and_batch(cpu, guarded: bool, topk: int, **options):
    from sglang_lora_tma_guard import serving

    (serving.arm if guarded else serving.deactivate)()
    layer = cpu.moe_layer(EXPERTS, topk=topk, hidden=HIDDEN, intermediate=INTERMEDIATE, device="cuda",
                          dtype=torch.bfloat16, **options)
    manager = cpu.lora_manager([layer])
    manager.init_lora_modules()
    [module] = cpu.wrapped(manager)
    adapters = [on_gpu(cpu.ExpertAdapter.random(EXPERTS, HIDDEN, INTERMEDIATE, rank, seed=10 + i, scale=0.05))
                for i, rank in enumerate((16, 8))]
    adapters = [dataclasses.replace(a, **{f.name: getattr(a, f.name).bfloat16() for f in dataclasses.fields(a)})
                for a in adapters]
    info = on_gpu(cpu.lora_info_for(module, adapters, OWNERS))
    x = (torch.randn(len(OWNERS), HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16().cuda()
    topk_output = on_gpu(cpu.routing(len(OWNERS), EXPERTS, topk, seed=4))
    return layer, module, adapters, info, x, topk_output


def errors(cpu, layer, module, adapters, info, x, topk_output) -> dict:
    out = module._forward_with_lora(x.clone(), topk_output, info)
    want = cpu.reference(layer, x, topk_output, adapters, OWNERS)
    adapter_rows, base_rows = slice(0, 16), slice(16, None)
    return {"adapter_rel_error": cpu.relative_error(out[adapter_rows], want[adapter_rows]),
            "base_rel_error": cpu.relative_error(out[base_rows], want[base_rows]), "out": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"), type=Path)
    args = parser.parse_args(argv)
    import sglang

    from harness import sglang_cpu as cpu

    cpu.scheduler(device="cuda")
    rows = []
    for flag in (True, False):  # True: SGLang's flag as passed; False: what the guard makes of a LoRA server
        cpu.scheduler(enable_fused_moe_sum_all_reduce=flag)
        layer, module, adapters, info, x, topk_output = layer_and_batch(cpu, False, 4)
        found = errors(cpu, layer, module, adapters, info, x, topk_output)
        no_down = [dataclasses.replace(a, down_b=torch.zeros_like(a.down_b)) for a in adapters]
        want_no_down = cpu.reference(layer, x, topk_output, no_down, OWNERS)
        rows.append({"case": "fused-sum-all-reduce", "flag": flag, **{k: v for k, v in found.items() if k != "out"},
                     "rel_error_vs_reference_without_down_lora": cpu.relative_error(found["out"][:16], want_no_down[:16])})
    cpu.scheduler(enable_fused_moe_sum_all_reduce=False)
    with torch.compiler.set_stance("force_eager"):
        for guarded in (False, True):
            found = errors(cpu, *layer_and_batch(cpu, guarded, 2, gemm1_alpha=1.702, gemm1_clamp_limit=7.0,
                                                 gate_up_interleaved=False))
            rows.append({"case": "gate-up-layout (MiniMax-M3)", "guarded": guarded,
                         **{k: v for k, v in found.items() if k != "out"}})
    found = errors(cpu, *layer_and_batch(cpu, False, 1, apply_router_weight_on_input=True))
    rows.append({"case": "router-weight-on-input (Llama-4)", "guarded": False, **{k: v for k, v in found.items() if k != "out"}})
    for row in rows:
        row["sglang"] = sglang.__version__
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "defects_h200.json").write_text(json.dumps(rows, indent=1))
    print()
    table = tables.Table(["case", "setting", "adapter rows", "base rows", "vs the reference without the down LoRA"])
    for row in rows:
        setting = (f"flag {'on' if row['flag'] else 'off (the guard)'}" if "flag" in row
                   else ("guard on" if row["guarded"] else "guard off"))
        extra = row.get("rel_error_vs_reference_without_down_lora")
        table.add(row["case"], setting, f"{row['adapter_rel_error']:.2e}", f"{row['base_rel_error']:.2e}",
                  f"{extra:.2e}" if extra is not None else "–")
    return 0


if __name__ == "__main__":
    sys.exit(main())
