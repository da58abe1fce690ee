"""The one patch object every fix uses: the order matrix of ddtrace's integrations, other code's
wrappers on top, and failures, against a module written for each test (post-import hooks included).

Then the three lifecycle bugs a review of 0.4.0 reproduced, each on SGLang 0.5.16's own code with the
patch that replaced the hand-written lifecycle: the scheduler check under another wrapper of
``LoRAManager.init_lora_modules``, the LoRA MoE hook builder under another wrapper, and an inspection
error on the already-imported path of the TMA guard.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
import sys
import threading

import pytest
import wrapt

from sglang_lora_tma_guard.patching import Patch

_names = itertools.count()

MODULE_TEXT = """
CALLS = []

def target(x):
    CALLS.append(x)
    return x

class Layer:
    def forward(self, x):
        return x * 2
"""


@pytest.fixture
def target(tmp_path, monkeypatch):
    """A fresh importable module name (``target``'s module text), not yet imported."""
    name = f"patching_target_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(MODULE_TEXT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def plus_one(original, engaged):
    @functools.wraps(original)
    def target(*args, **kwargs):
        result = original(*args, **kwargs)
        return result + 1 if engaged.on else result

    return target


def make_patch(module, attribute="target", make=plus_one):
    return Patch(f"test patch {module}.{attribute}", module, attribute, make)


def depth(func) -> int:
    n = 0
    while hasattr(func, "__wrapped__"):
        func, n = func.__wrapped__, n + 1
    return n


def test_import_then_patch_then_patch_wraps_once(target):
    module = importlib.import_module(target)
    original = module.target
    patch = make_patch(target)
    first = patch.activate()
    second = patch.activate()
    assert first.installed and second.working and not second.inert
    assert module.target(1) == 2 and depth(module.target) == 1 and module.target.__wrapped__ is original


def test_patch_then_import_places_it_on_import(target):
    patch = make_patch(target)
    before = patch.activate()
    assert before.wanted and not before.imported and not before.installed
    module = importlib.import_module(target)
    assert patch.status().working and module.target(1) == 2


def test_patch_unpatch_patch_restores_the_exact_original_each_time(target):
    module = importlib.import_module(target)
    original = module.target
    patch = make_patch(target)
    for _ in range(3):
        patch.activate()
        assert module.target(1) == 2
        off = patch.deactivate()
        assert module.target is original and not off.installed and not off.wanted
    patch.activate()
    assert depth(module.target) == 1


def test_unpatch_before_import_leaves_the_module_alone(target):
    patch = make_patch(target)
    patch.activate()
    patch.deactivate()
    module = importlib.import_module(target)
    assert not hasattr(module.target, "__wrapped__") and module.target(1) == 1


def test_a_method_on_a_class_is_patched_and_restored(target):
    module = importlib.import_module(target)
    original = module.Layer.__dict__["forward"]
    patch = make_patch(target, "Layer.forward")
    patch.activate()
    assert module.Layer().forward(3) == 7
    patch.deactivate()
    assert module.Layer.__dict__["forward"] is original and module.Layer().forward(3) == 6


def test_under_another_wrapt_wrapper_unpatch_splices_ours_out(target):
    module = importlib.import_module(target)
    original = module.target
    patch = make_patch(target)
    patch.activate()
    outer = wrapt.wrap_function_wrapper(module, "target", lambda wrapped, instance, args, kwargs: wrapped(*args) * 10)
    state = patch.deactivate()
    assert module.target is outer and outer.__wrapped__ is original and module.target(1) == 10
    assert not state.installed


def test_under_a_plain_closure_unpatch_leaves_ours_inert_and_patch_revives_it(target, caplog):
    module = importlib.import_module(target)
    patch = make_patch(target)
    patch.activate()
    inner = module.target

    @functools.wraps(inner)
    def tracer(*args):
        return inner(*args) * 10

    module.target = tracer
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        state = patch.deactivate()
    assert state.installed and state.inert and not state.working and module.target(1) == 10  # ours passes through
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "inert" in caplog.messages[0]
    revived = patch.activate()
    assert revived.working and module.target(1) == 20 and module.target is tracer


def test_a_wholesale_replacement_is_left_and_a_new_patch_goes_on_top(target, caplog):
    module = importlib.import_module(target)
    patch = make_patch(target)
    patch.activate()
    module.target = lambda x: -x
    assert not patch.status().installed
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        patch.deactivate()
    assert module.target(1) == -1 and "replaced by other code" in caplog.text
    patch.activate()
    assert module.target(1) == 0  # ours, on top of the replacement


def test_a_builder_that_declines_leaves_the_target_and_says_why(target):
    module = importlib.import_module(target)
    original = module.target
    state = make_patch(target, make=lambda original, engaged: None).activate()
    assert state.wanted and not state.installed and "nothing to change" in state.note
    assert module.target is original
    absent = make_patch(target, "missing", make=lambda original, engaged: None).activate()
    assert "does not exist" in absent.note


def test_a_failing_builder_never_raises_and_never_breaks_the_import(target, caplog):
    def boom(original, engaged):
        raise RuntimeError("builder blew up")

    patch = make_patch(target, make=boom)
    with caplog.at_level(logging.ERROR, "sglang_lora_tma_guard"):
        patch.activate()  # before the import: the hook fails inside it
        module = importlib.import_module(target)
        again = patch.activate()  # after it: the direct path fails
    assert module.target(1) == 1 and not again.installed and "could not be placed" in again.note
    assert len(caplog.records) == 2 and "builder blew up" in caplog.text


def test_replace_rebuilds_where_outermost_and_keeps_ours_under_other_code(target, caplog):
    module = importlib.import_module(target)
    step = {"n": 1}

    def plus_n(original, engaged):
        n = step["n"]

        @functools.wraps(original)
        def target(x):
            return original(x) + n

        return target

    patch = make_patch(target, make=plus_n)
    patch.activate()
    step["n"] = 5
    patch.replace()
    assert module.target(1) == 6 and depth(module.target) == 1
    inner = module.target
    module.target = functools.wraps(inner)(lambda x: inner(x))
    step["n"] = 9
    with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
        patch.replace()
    assert module.target(1) == 6 and "stays as it was built" in caplog.text


def test_concurrent_patching_from_threads_wraps_once(target):
    patch = make_patch(target)
    barrier = threading.Barrier(8)

    def race():
        barrier.wait()
        patch.activate()
        importlib.import_module(target)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    module = sys.modules[target]
    assert depth(module.target) == 1 and module.target(1) == 2


def test_a_reloaded_module_that_makes_its_patch_again_adopts_the_placed_one(target):
    module = importlib.import_module(target)
    first = make_patch(target)
    first.activate()
    placed = module.target
    second = make_patch(target)  # what a reloaded module does at import time
    assert second is first and second.activate().working and module.target is placed


# --- the three bugs of 0.4.0's hand-written lifecycles, on SGLang's own code ---------------------------


@pytest.mark.real
def test_the_scheduler_check_goes_inert_under_another_wrapper_of_init_lora_modules(fm, caplog):
    from sglang.srt.lora.lora_manager import LoRAManager

    from sglang_lora_tma_guard import serving

    original = LoRAManager.__dict__["init_lora_modules"]
    serving.arm()
    ours = LoRAManager.__dict__["init_lora_modules"]
    LoRAManager.init_lora_modules = functools.wraps(ours)(lambda self: ours(self))  # another plugin's
    try:
        with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
            serving.disarm()  # 0.4.0's fusion.deactivate() raised WrapperNotOutermostError here
        state = serving.INIT_LORA_MODULES.status()
        assert state.installed and state.inert and not state.working
        assert not any(r.levelno >= logging.ERROR for r in caplog.records)
        serving.arm()
        assert serving.INIT_LORA_MODULES.status().working
    finally:
        serving.disarm()
        LoRAManager.init_lora_modules = original


@pytest.mark.real
def test_the_lora_moe_builder_goes_inert_under_another_wrapper_and_says_so(fm, caplog):
    from sglang.srt.lora import lora_moe_runners

    from sglang_lora_tma_guard import lora_path

    original = lora_moe_runners.build_lora_hooks
    lora_path.activate(lora_path.Mode.FAST)
    ours = lora_moe_runners.build_lora_hooks
    lora_moe_runners.build_lora_hooks = functools.wraps(ours)(lambda *a: ours(*a))
    try:
        with caplog.at_level(logging.WARNING, "sglang_lora_tma_guard"):
            lora_path.deactivate()  # 0.4.0 logged an ERROR traceback and kept saying "installed"
        assert not lora_path.status().installed and lora_path.PATCH.status().inert
        assert not any(r.levelno >= logging.ERROR for r in caplog.records)
    finally:
        lora_moe_runners.build_lora_hooks = original
        lora_path.PATCH.deactivate()


@pytest.mark.real
def test_an_inspection_error_on_the_imported_path_never_leaves_activate(fm, monkeypatch, caplog):
    from sglang_lora_tma_guard import guard

    def boom(*args, **kwargs):
        raise RuntimeError("inspection blew up")

    monkeypatch.setattr(guard, "inspect_target", boom)
    with caplog.at_level(logging.ERROR, "sglang_lora_tma_guard"):
        state = guard.activate()  # 0.4.0 let this one out of the already-imported path
    assert not state.installed and "inspection blew up" in caplog.text
    guard.deactivate()
