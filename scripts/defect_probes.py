"""Two LoRA-on-MoE defects, shown with the installed SGLang release's own code on a CPU.

``csgmv_segments``: SGLang 0.5.11's default ``csgmv`` LoRA backend hands the MoE LoRA path its segments
in adapter-sorted order, which the MoE path reads in token order (bug table, dynamic adapters and
batches, finding 2; fixed in 0.5.12). A decode batch of four requests with adapters [A, base, B, A] goes
through each backend's own ``prepare_lora_batch``, ``FusedMoEWithLoRA._get_lora_info`` and the MoE path's
own alignment (``_compute_lora_alignment``, which takes SGLang's ``_naive_moe_lora_align_block_size`` for
a batch this small); the tokens each adapter's expert delta goes to are read off its output.

``dp_attention_mapping``: with ``--enable-dp-attention`` the MoE runs on every DP rank's gathered tokens
while the LoRA mapping is the rank's local batch (bug table, static configurations, F1). Rank 1's local
batch (two tokens of adapter slot 1) is put through the same code with a gathered ``topk_ids`` of five
tokens (rank 0's three base-model tokens first); its expert delta lands on rank 0's tokens. The local
layout does this on every release; 0.5.21+ fixed it upstream by giving the MoE a TP-global layout
(``fixed_upstream``: the MoE layer asks for ``TP_GLOBAL``), and there ``tp_global_marked`` is what that
layout marks, built by SGLang's own ``build_token_lora_batch_info`` from the slots the gather would give.

Pool slots: base model 0 (rank 0, zero weights: tokens marked there get no delta), A 1, B 2. Prints one
JSON object (the last line of stdout):

    PYTHONPATH=~/.cache/sglang-lora-tma-guard/sglang-0.5.11:. TRITON_INTERPRET=1 .venv/bin/python scripts/defect_probes.py
"""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

SLOTS = {0: "base", 1: "A", 2: "B", -1: "base"}  # -1: no adapter (0.5.23's token_lora_mapping for a rank-0 slot)
# 16 experts, top-1: few enough routed tokens that _compute_lora_alignment takes SGLang's Python alignment
# (its CUDA kernel is not imported on a CPU).
EXPERTS, RANK, HIDDEN, INTERMEDIATE = 16, 8, 32, 16


class _NoPinnedMemory(TorchFunctionMode):
    """SGLang's backends stage small host tensors in pinned memory (``pin_memory=True``), which needs a
    GPU driver. Pinning only page-locks the host copy for asynchronous transfer; the values are the
    same, so on a CPU the flag is dropped from every torch call made inside this mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: v for k, v in (kwargs or {}).items() if k != "pin_memory"}
        return func(*args, **kwargs)


def _server_args():
    """SGLang's own ServerArgs (defaults, LoRA on, CPU), published where the release reads them from its
    runtime context (0.5.15+; 0.5.20+ backends read ``get_lora()`` there)."""
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", enable_lora=True, device="cpu")
    try:
        from sglang.srt.runtime_context import _CONTEXT
    except ImportError:  # 0.5.11-0.5.13: the backends are handed the arguments
        return args
    if hasattr(_CONTEXT, "set_server_args"):  # 0.5.14 holds only the parallel state there
        _CONTEXT.set_server_args(args)
    return args


def _moe_layer(backend_cls, slots: list[int], ranks: list[int]):
    """A LoRA MoE layer as ``FusedMoEWithLoRA._get_lora_info`` reads it, its backend prepared for a decode
    batch whose requests use pool ``slots``."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    backend = backend_cls(max_loras_per_batch=len(ranks), device=torch.device("cpu"), server_args=_server_args())
    backend.is_moe_lora = True  # as FusedMoEWithLoRA.__init__ does; 0.5.13+ backends then add moe_lora_info
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(slots))  # what a decode reads
    with _NoPinnedMemory():
        backend.prepare_lora_batch(forward_batch=batch, weight_indices=slots, lora_ranks=ranks,
                                   scalings=[2.0 if r else 0.0 for r in ranks], use_cuda_graph=False)
    backend.batch_info.has_active_lora = any(ranks[s] > 0 for s in slots)  # as LoRAManager sets it
    # What _get_lora_info reads from its module: the backend, the pool's expert buffers (shapes only), the
    # base layer's sizes and the MoE runner backend.
    loras = len(ranks)
    return SimpleNamespace(
        lora_backend=backend, _lora_runner_backend=MoeRunnerBackend.TRITON,
        gate_up_lora_a_weights=torch.zeros(loras, EXPERTS, 2 * RANK, HIDDEN),
        gate_up_lora_b_weights=torch.zeros(loras, EXPERTS, 2 * INTERMEDIATE, RANK),
        down_lora_a_weights=torch.zeros(loras, EXPERTS, RANK, INTERMEDIATE),
        down_lora_b_weights=torch.zeros(loras, EXPERTS, HIDDEN, RANK),
        base_layer=SimpleNamespace(num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN),
        experts_shared_outer_loras=False, lora_use_virtual_experts=False, tp_size=1, tp_rank=0)


def _lora_info(layer):
    """The LoRAInfo the MoE layer builds for its batch (SGLang's own ``_get_lora_info``)."""
    from sglang.srt.lora.layers import FusedMoEWithLoRA

    return FusedMoEWithLoRA._get_lora_info(layer)


def _marked(lora_info, topk_ids: torch.Tensor) -> list[int]:
    """The pool slot whose expert delta the default MoE LoRA path adds to each token (0: none), read off
    SGLang's own alignment: the tokens it lists under each slot."""
    from sglang.srt.lora import lora_moe_runners

    sorted_ids, _, counts, _ = lora_moe_runners._compute_lora_alignment(topk_ids, lora_info)
    slot_of = [0] * topk_ids.shape[0]
    for slot, count in enumerate(counts.tolist()):
        for entry in sorted_ids[slot, :count].tolist():
            if entry < topk_ids.numel():  # padding entries hold numel()
                slot_of[entry // topk_ids.shape[1]] = slot
    return slot_of


def _token_mapping(lora_info, tokens: int):
    """The per-token slot the virtual-experts path reads: the LoRAInfo's own (0.5.13+) or SGLang's
    ``_compute_token_lora_mapping`` over ``tokens`` tokens (0.5.11-0.5.12)."""
    from sglang.srt.lora import lora_moe_runners

    if getattr(lora_info, "token_lora_mapping", None) is not None:
        return lora_info.token_lora_mapping.tolist()
    try:
        return lora_moe_runners._compute_token_lora_mapping(torch.empty(tokens, HIDDEN), lora_info).tolist()
    except Exception as error:  # an index past req_to_lora: an out-of-bounds read on a GPU
        return f"{type(error).__name__}: {error}"


def _routing(tokens: int) -> torch.Tensor:
    return (torch.arange(tokens, dtype=torch.int32) % EXPERTS).view(tokens, 1)


def csgmv_segments() -> dict:
    """Per backend: the adapter each request should get, the one the MoE LoRA path applies (default path and
    virtual-experts path), and whether both are right."""
    from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend
    from sglang.srt.lora.backend.triton_backend import TritonLoRABackend

    slots, ranks = [1, 0, 2, 1], [0, RANK, RANK]
    expected = [SLOTS[s] for s in slots]
    result = {}
    for name, backend_cls in (("csgmv", ChunkedSgmvLoRABackend), ("triton", TritonLoRABackend)):
        try:
            info = _lora_info(_moe_layer(backend_cls, slots, ranks))
            applied = [SLOTS[s] for s in _marked(info, _routing(len(slots)))]
            mapping = _token_mapping(info, len(slots))
            virtual = [SLOTS[s] for s in mapping] if isinstance(mapping, list) else mapping
            result[name] = {"expected": expected, "moe_applies": applied, "virtual_experts_applies": virtual,
                            "segments": info.seg_indptr.tolist(), "segment_slots": info.req_to_lora.tolist(),
                            "right": applied == expected and virtual == expected}
        except Exception as error:
            result[name] = {"error": f"{type(error).__name__}: {error}"}
    return result


def dp_attention_mapping() -> dict:
    """Gathered tokens 0-2 are rank 0's (base model), 3-4 rank 1's (slot 1); rank 1's LoRA layout is local."""
    try:
        import sglang.srt.lora.layers as layers
        from sglang.srt.lora.backend import triton_backend

        layer = _moe_layer(triton_backend.TritonLoRABackend, [1, 1], [0, RANK, RANK])  # rank 1's local batch
        info, gathered = _lora_info(layer), _routing(5)
        marked = [t for t, slot in enumerate(_marked(info, gathered)) if slot == 1]
        result = {"marked": marked, "should_be": [3, 4], "wrong": marked != [3, 4],
                  "local_segments": info.seg_indptr.tolist(), "local_segment_slots": info.req_to_lora.tolist(),
                  "virtual_experts_mapping": _token_mapping(info, len(gathered)), "gathered_tokens": len(gathered),
                  "fixed_upstream": "TP_GLOBAL" in inspect.getsource(layers)}
        if hasattr(triton_backend, "build_token_lora_batch_info"):  # 0.5.21+: the TP-global layout
            # What prepare_global_lora_batch installs once dp_gather_replicate (a collective, not run here)
            # has gathered every rank's per-token slots: rank 0's three at the no-LoRA slot 0, then rank 1's.
            backend = layer.lora_backend
            backend.global_batch_info = triton_backend.build_token_lora_batch_info(
                backend.batch_info, torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32))
            backend.global_batch_info.has_active_lora = True
            result["tp_global_marked"] = [t for t, slot in enumerate(_marked(_lora_info(layer), gathered)) if slot == 1]
        return result
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def main() -> None:
    import sglang

    print(f"sglang {sglang.__version__} from {sglang.__path__[0]}")
    print(json.dumps({"csgmv_segments": csgmv_segments(), "dp_attention_mapping": dp_attention_mapping()}))


if __name__ == "__main__":
    main()
