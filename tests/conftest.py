import os

# SGLang's Triton kernels run on CPU through Triton's interpreter; the switch must be set before
# Triton compiles them, that is before anything imports SGLang.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("SGLANG_LORA_TMA_GUARD", None)
os.environ.pop("SGLANG_PLUGINS", None)

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def fm():
    """SGLang 0.5.16's fused-MoE module; fails the module's tests if one left the guard in place."""
    from sglang_lora_tma_guard import installed
    from sglang_lora_tma_guard.inspection import TARGET_NAME

    module = installed.fused_moe_module()
    original = getattr(module, TARGET_NAME)
    yield module
    assert getattr(module, TARGET_NAME) is original, "a test left the guard installed"


@pytest.fixture
def launches(fm):
    """The TMA arguments of every launch of SGLang's ``invoke_fused_moe_kernel`` in the test."""
    from harness import tiny_moe

    with tiny_moe.launch_recorder() as recorded:
        yield recorded


@pytest.fixture
def sglang_plugins(fm, monkeypatch):
    """SGLang's own ``load_plugins()``, as a fresh process would run it; undone afterwards."""
    import sglang.srt.plugins as plugins

    import sglang_lora_tma_guard as guard

    def load(env_value="1", allow_list=None):
        if env_value is None:
            monkeypatch.delenv("SGLANG_LORA_TMA_GUARD", raising=False)
        else:
            monkeypatch.setenv("SGLANG_LORA_TMA_GUARD", env_value)
        if allow_list is not None:
            monkeypatch.setenv("SGLANG_PLUGINS", allow_list)
        monkeypatch.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()
        return guard.status()

    yield load
    # Everything load_plugins() placed: the TMA guard and every fix of the catalogue (the adapter fixes
    # included: left on, they leaked into later tests of the same worker that expect SGLang alone).
    from sglang_lora_tma_guard import fused_act, fused_lora, lora_path, serving

    serving.deactivate()
    guard.deactivate()
    lora_path.deactivate()
    fused_lora.deactivate()
    fused_act.deactivate()
