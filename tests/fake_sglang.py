"""Small fake SGLang module trees, shaped like real releases, for unit tests of signature shapes.

Each tree has ``sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py`` with a
``_fused_moe_kernel_sequence`` whose parameters are those of the release named (the table of
releases in README.md), a ``sglang-<version>.dist-info`` so that ``importlib.metadata.version("sglang")``
answers, and stand-ins for ``ServerArgs`` and ``HookRegistry`` shaped like 0.5.11-0.5.18's. The fake
function records what it was called with in ``CALLS`` and reads ``hooks`` the way SGLang does, so
a hooks object of another shape fails here as it fails there.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

POSITIONAL = [
    "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "sorted_token_ids", "expert_ids",
    "num_tokens_post_padded", "config", "down_config", "down_moe_use_tma",
]
KW_0511 = [
    "b1", "b2", "use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16",
    "per_channel_quant", "w1_scale", "w2_scale", "w1_zp", "w2_zp", "a1_scale", "a2_scale",
    "block_shape", "activation", "is_gated", "no_combine", "inplace",
    "apply_router_weight_on_input", "routed_scaling_factor", "gemm1_alpha", "gemm1_limit",
    "filter_expert", "hooks",
]
NATIVE_GUARD = (
    "if hooks and (hooks.after_gate_up is not None or hooks.after_down is not None):\n"
    "    down_moe_use_tma = False\n"
)
# A fork that resets the flag, but not for hooked calls: no proof of a native guard.
RESET_ELSEWHERE = (
    "if hooks is None:\n"
    "    down_moe_use_tma = False\n"
)


def _release(version, positional, keyword, native=False, guard=None):
    return {"version": version, "positional": positional, "keyword": keyword,
            "guard": NATIVE_GUARD if native else (guard or "")}


RELEASES = {
    "0.5.11": _release("0.5.11", POSITIONAL, KW_0511),
    "0.5.16": _release("0.5.16", POSITIONAL, KW_0511 + ["swiglu_limit", "gate_up_interleaved"]),
    "0.5.17": _release(
        "0.5.17", POSITIONAL, KW_0511 + ["swiglu_limit", "gate_up_interleaved", "a1_q"], native=True
    ),
    "0.5.23": _release(
        "0.5.23",
        POSITIONAL + ["up_moe_use_tma"],
        KW_0511 + ["swiglu_limit", "gate_up_interleaved", "a1_q", "fuse_swiglu_interleaved",
                   "x_extra", "no_combine_keep_router_weight"],
        native=True,
    ),
    "0.5.16+fork-resets-elsewhere": _release(
        "0.5.16+fork-resets-elsewhere", POSITIONAL, KW_0511 + ["swiglu_limit", "gate_up_interleaved"],
        guard=RESET_ELSEWHERE,
    ),
    # A fork or an in-between source build: the flag was renamed, so there is nothing to set.
    "0.5.16.dev3+renamed": _release(
        "0.5.16.dev3+renamed",
        POSITIONAL[:-1] + ["down_use_tma"],
        KW_0511 + ["swiglu_limit", "gate_up_interleaved"],
    ),
}


def function_source(release: dict) -> str:
    """The fake ``_fused_moe_kernel_sequence`` for one release shape."""
    params = ", ".join(release["positional"]) + ", *, " + ", ".join(
        f"{name}=None" for name in release["keyword"]
    )
    flag = "down_moe_use_tma" if "down_moe_use_tma" in release["positional"] else "down_use_tma"
    guard = release["guard"]
    body = textwrap.indent(
        guard
        + f"CALLS.append({{'tma': {flag}, 'hooks': hooks}})\n"
        # SGLang's own way of reading the hooks (a hooks object without the attribute raises).
        + "if hooks and hooks.after_gate_up:\n"
        + "    hooks.after_gate_up(hidden_states, None, topk_weights, topk_ids)\n"
        + "if hooks and hooks.after_down:\n"
        + "    hooks.after_down(None, None, topk_weights, topk_ids)\n"
        + f"return ('tma' if {flag} else 'plain', hidden_states)\n",
        "    ",
    )
    return f"def _fused_moe_kernel_sequence({params}):\n{body}"


def load_function(release: dict, calls: list):
    """The fake function compiled from a string: no source file, so only its bytecode is there."""
    namespace = {"CALLS": calls}
    exec(compile(function_source(release), "<fake fused_moe>", "exec"), namespace)
    return namespace["_fused_moe_kernel_sequence"]


# Just enough of SGLang's server arguments and hook registry for the shared-expert fix: a dataclass
# resolved in __post_init__ (as up to 0.5.18), and a registry that wraps a target on apply_hooks().
SERVER_ARGS = """
from dataclasses import dataclass


@dataclass
class ServerArgs:
    model_path: str
    enable_lora: object = None
    lora_paths: object = None
    disable_shared_experts_fusion: bool = False
    enforce_shared_experts_fusion: bool = False
    enable_waterfill: bool = False

    def __post_init__(self):
        pass

    def check_server_args(self):
        pass
"""
HOOK_REGISTRY = """
import enum, functools, pkgutil


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"


class HookRegistry:
    _hooks = {}
    _patched = set()

    @classmethod
    def register(cls, target, hook, hook_type=HookType.AFTER):
        cls._hooks.setdefault(target, []).append((hook_type, hook, None))

    @classmethod
    def apply_hooks(cls):
        for target, hooks in cls._hooks.items():
            if target in cls._patched:
                continue
            owner_path, name = target.rsplit(".", 1)
            owner = pkgutil.resolve_name(owner_path)
            function = getattr(owner, name)
            for hook_type, hook, _ in hooks:
                function = cls._wrap(function, hook, hook_type)
            setattr(owner, name, function)
            cls._patched.add(target)

    @staticmethod
    def _wrap(function, hook, hook_type):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if hook_type is HookType.BEFORE:
                hook(*args, **kwargs)
                return function(*args, **kwargs)
            return hook(function(*args, **kwargs), *args, **kwargs)
        return wrapper
"""


def write_tree(root: Path, version: str, shape: str | None = None, with_function: bool = True) -> Path:
    """Write a fake SGLang under ``root`` and return ``root`` (put it on sys.path).

    ``version`` is what its metadata says; ``shape`` names the release whose function it carries
    (default: ``version``).
    """
    package = root / "sglang/srt/layers/moe/moe_runner/triton_utils"
    package.mkdir(parents=True)
    for folder in [package, *package.parents]:
        if folder == root:
            break
        (folder / "__init__.py").touch()
    release = RELEASES[shape or version]
    source = "CALLS = []\n\n"
    if with_function:
        source += function_source(release)
    (package / "fused_moe.py").write_text(source)
    (root / "sglang/srt/server_args.py").write_text(SERVER_ARGS)
    (root / "sglang/srt/plugins").mkdir()
    (root / "sglang/srt/plugins/__init__.py").touch()
    (root / "sglang/srt/plugins/hook_registry.py").write_text(HOOK_REGISTRY)
    dist = root / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return root
