"""The in-place race made deterministic: SGLang's own dual-stream DeepSeek MoE block in a CUDA graph.

    python -m benchmarks.inplace_race.dual_stream [--out DIR] [--sleep-cycles N]      (a CUDA GPU)

``DeepseekV2MoE`` of a tiny DeepSeek-V3-class config (16 routed experts + 1 shared, top-4, bf16), its
experts wrapped for LoRA by SGLang's own ``FusedMoEWithLoRA`` (two adapters and base-model tokens in the
batch, SGLang's own LoRA hooks), captured in a CUDA graph in SGLang's capture mode: with the shared
expert not fused, SGLang takes ``forward_normal_dual_stream``, the routed experts on the current
stream and the shared expert on the alternate one, with no edge between the shared expert's read of
``hidden_states`` and the routed experts' in-place write of it. A test-only delay
(``torch.cuda._sleep``) at the start of the shared expert's stream makes that read come after the
write, every replay. Each replay's output is compared with a float32 PyTorch reference of the block
(routing taken from SGLang's own router, then routed experts with the adapters, and the shared
expert, all from the module's weights):

- ``unguarded``: the layer as SGLang wraps it (``inplace=True`` on 0.5.11-0.5.16);
- ``guarded``: after the guard's scheduler step (``serving.after_lora_modules``, what runs after
  ``LoRAManager.init_lora_modules``): the layer runs out of place;
- each with and without the delay, so that the delay is shown to be what decides, not noise.

On 0.5.17+ SGLang sets ``inplace=False`` itself, and ``unguarded`` is right too. Prints a table and
writes ``dual_stream.json``.
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

REPO = Path(__file__).resolve().parents[2]

TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 24, 1024, 512, 16, 4
OWNERS = [0] * 8 + [1] * 8 + [-1] * 8  # adapter 0, adapter 1, the base model


def config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, intermediate_size=4 * HIDDEN,
        n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=TOPK, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        num_hidden_layers=1, vocab_size=1024, hidden_act="silu",
    )


def build_block(seed: int, device: str, dtype: torch.dtype):
    """SGLang's DeepseekV2MoE with random weights, its experts wrapped by FusedMoEWithLoRA."""
    from types import SimpleNamespace

    from sglang.srt.lora.layers import FusedMoEWithLoRA
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

    from harness import sglang_cpu

    torch.set_default_dtype(dtype)
    with torch.device(device):
        block = DeepseekV2MoE(config(), layer_id=0, quant_config=None, prefix="model.layers.0.mlp",
                              alt_stream=torch.cuda.Stream() if device == "cuda" else None)
    torch.set_default_dtype(torch.float32)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            if param.dtype.is_floating_point:
                param.copy_(torch.randn(param.shape, generator=gen, device=device) * (0.5 / param.shape[-1] ** 0.5))
    assert block.num_fused_shared_experts == 0, "shared-experts fusion must be off (as the guard makes it)"
    # The LoRA backend as far as the wrapper reads it (the batch's LoRA info is given by replay_errors).
    block.experts = FusedMoEWithLoRA(block.experts, SimpleNamespace(is_moe_lora=False, batch_info=SimpleNamespace()))
    return block, sglang_cpu


def lora_batch(block, harness, seed: int, device: str, dtype: torch.dtype):
    """Two adapters on the experts (ranks 16 and 8), the batch's tokens split among them and the base model;
    SGLang's CUDA-graph LoRA buffers on a GPU (the hooks are built inside the captured graph)."""
    adapters = [harness.ExpertAdapter.random(EXPERTS, HIDDEN, INTERMEDIATE, rank, seed=seed + i, scale=0.05)
                for i, rank in enumerate((16, 8))]
    adapters = [dataclasses.replace(a, **{f.name: getattr(a, f.name).to(device, dtype) for f in dataclasses.fields(a)})
                for a in adapters]
    info = harness.lora_info_for(block.experts, adapters, OWNERS)
    info = dataclasses.replace(info, **{f.name: getattr(info, f.name).to(device) for f in dataclasses.fields(info)
                                        if isinstance(getattr(info, f.name), torch.Tensor)})
    if device == "cuda":
        info = dataclasses.replace(info, cg_buffers=cg_buffers(len(adapters)))
    return adapters, info


def cg_buffers(loras: int) -> dict:
    from types import SimpleNamespace

    from benchmarks._lora_setup import cg_buffers as sized

    return sized(SimpleNamespace(topk_ids=torch.zeros(TOKENS, TOPK, dtype=torch.int32, device="cuda"),
                                 num_experts=EXPERTS), loras)


def reference(block, harness, x, adapters):
    """The block in float32: SGLang's routing, then the routed experts with LoRA and the shared expert."""
    with torch.no_grad():
        topk = block.topk(x, block.gate(x))
        shared = block.shared_experts
        gate_up = shared.gate_up_proj.weight.float() @ x.float().T
        gate, up = gate_up.chunk(2)
        shared_out = (shared.down_proj.weight.float() @ (torch.nn.functional.silu(gate) * up)).T
        routed = harness.reference(block.experts.base_layer, x, topk, adapters, OWNERS)
    return routed + shared_out  # routed_scaling_factor is 1 here


def delayed(block, cycles: int):
    """Test-only: the shared expert's stream sleeps first, so its read comes after the routed write."""
    original = block._forward_shared_experts

    def shared_after_a_delay(*args, **kwargs):
        if cycles:
            torch.cuda._sleep(cycles)
        return original(*args, **kwargs)

    block._forward_shared_experts = shared_after_a_delay


def replay_errors(block, info, x, want, replays: int) -> list[float]:
    from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

    block.experts._get_lora_info = lambda: info  # the batch's LoRA info, as SGLang's backend would give it
    static = x.clone()
    with model_capture_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                static.copy_(x)
                block(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(static)
    errors = []
    for _ in range(replays):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        errors.append(float((out.float() - want).abs().max() / want.abs().max()))
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"), type=Path)
    parser.add_argument("--sleep-cycles", type=int, default=20_000_000)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--cpu-check", action="store_true",
                        help="no GPU: build the block on the CPU (fp16, Triton's interpreter) and check one eager "
                             "forward against the reference; what the GPU run relies on, without streams")
    args = parser.parse_args(argv)
    import sglang

    from harness import sglang_cpu
    from sglang_lora_tma_guard import serving

    device, dtype = ("cpu", torch.float16) if args.cpu_check else ("cuda", torch.bfloat16)
    sglang_cpu.scheduler(disable_shared_experts_fusion=True, device=device)
    if args.cpu_check:
        block, harness = build_block(seed=0, device=device, dtype=dtype)
        adapters, info = lora_batch(block, harness, seed=10, device=device, dtype=dtype)
        x = (torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.5).to(dtype)
        want = reference(block, harness, x, adapters)
        block.experts._get_lora_info = lambda: info
        with sglang_cpu.cpu_kernels():
            got = block(x.clone())
        print(json.dumps({"sglang": sglang.__version__, "eager_rel_error": float((got.float() - want).abs().max()
                                                                                / want.abs().max())}))
        return 0
    rows = []
    for guarded in (False, True):
        for cycles in (0, args.sleep_cycles):
            block, harness = build_block(seed=0, device=device, dtype=dtype)
            if guarded:
                serving.arm()
                serving.after_lora_modules(SimpleManager(block.experts))
                serving.disarm()
            adapters, info = lora_batch(block, harness, seed=10, device=device, dtype=dtype)
            x = (torch.randn(TOKENS, HIDDEN, generator=torch.Generator(device=device).manual_seed(3),
                             device=device) * 0.5).to(dtype)
            want = reference(block, harness, x, adapters)
            delayed(block, cycles)
            errors = replay_errors(block, info, x, want, args.replays)
            rows.append(dict(sglang=sglang.__version__, guarded=guarded, inplace=block.experts.moe_runner_config.inplace,
                             sleep_cycles=cycles, replays=len(errors), wrong_replays=sum(e > 0.05 for e in errors),
                             max_rel_error=max(errors), min_rel_error=min(errors)))
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dual_stream.json").write_text(json.dumps(rows, indent=1))
    print()
    table = tables.Table(["sglang", "guard", "inplace", "delay (cycles)", "wrong replays", "max rel. error"])
    for r in rows:
        table.add(r["sglang"], "on" if r["guarded"] else "off", r["inplace"], f"{r['sleep_cycles']:,}",
                  f"{r['wrong_replays']}/{r['replays']}", f"{r['max_rel_error']:.2e}")
    return 0


class SimpleManager:
    """What the guard's scheduler step reads of a LoRA manager: the wrapped layers, per decoder layer."""

    def __init__(self, experts):
        self.lora_modules = [{"model.layers.0.mlp.experts": experts}]


if __name__ == "__main__":
    sys.exit(main())
