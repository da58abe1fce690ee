"""The shared-expert fix on the installed SGLang's own server arguments, in a fresh interpreter.

    SGLANG_LORA_TMA_GUARD=1 python scripts/fusion_probe.py      (prints one JSON object)

The plugin is loaded by SGLang's ``load_plugins()``; then ``ServerArgs`` records are built and
resolved as the launcher does (``model_path="dummy"``: no model, no GPU) for each way of asking for
LoRA, and sent to a spawned child process (how SGLang hands them to its schedulers), which reports
``disable_shared_experts_fusion`` as it received it. A record built *before*
``load_plugins()`` (``sglang.Engine(server_args=...)``) goes through what the launcher does with it
before it starts the schedulers: ``resolve_once()`` (0.5.19+) and ``check_server_args()``.
Used by ``scripts/version_matrix.py``.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import sys
import warnings

CASES = {
    "lora_paths": {"lora_paths": ["a=/adapters/a"]},
    "enable_lora": {"enable_lora": True},
    "enable_lora_false_with_paths": {"enable_lora": False, "lora_paths": ["a=/adapters/a"]},
    "no_lora": {},
    "lora_forced_fusion": {"enable_lora": True, "enforce_shared_experts_fusion": True},
}


def build(**kwargs):
    from sglang.srt.server_args import ServerArgs

    record = ServerArgs(model_path="dummy", **kwargs)
    if hasattr(record, "resolve_once"):  # 0.5.19+: the launcher resolves explicitly
        record.resolve_once()
    return record


def child_reads(records):
    """What a spawned process receives: SGLang pickles the record into each scheduler."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_flags, (records,))


def _flags(records):
    return [r.disable_shared_experts_fusion for r in records]


def main() -> None:
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
    from sglang_lora_tma_guard import fusion

    records = {name: build(**kwargs) for name, kwargs in CASES.items()}
    if hasattr(early, "resolve_once"):
        early.resolve_once()
    early_before_check = early.disable_shared_experts_fusion
    try:
        early.check_server_args()
        early_error = None
    except Exception as exc:  # a dummy model may trip an unrelated check; the hook ran first
        early_error = f"{type(exc).__name__}: {exc}"[:300]
    received = child_reads([*records.values(), early])
    result = {
        "version": getattr(sglang, "__version__", None),
        "hooked": f"ServerArgs.{fusion.resolution_method(ServerArgs)}",
        "fix_active": fusion.active(),
        **dict(zip(records, received)),
        "resolved_before_plugins": {"before_check": early_before_check, "child": received[-1],
                                    "check_error": early_error},
        "warnings": [line for line in log.getvalue().splitlines() if "sglang-lora-tma-guard" in line],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
