"""Install, removal and idempotence, each in a fresh interpreter over a fake SGLang tree."""

import pytest
import scenario
from fake_sglang import write_tree


@pytest.fixture
def tree(tmp_path):
    return write_tree(tmp_path, "0.5.16")


def test_activate_after_import_wraps_the_module_attribute(tree):
    result = scenario.run(
        """
        m = fm(); original = m._fused_moe_kernel_sequence
        st = g.activate()
        wrapper = m._fused_moe_kernel_sequence
        result = dict(installed=st.installed, strategy=st.strategy, version=st.sglang_version,
                      wraps_original=wrapper.__wrapped__ is original,
                      hooked=wrapper(*ARGS, True, hooks=hooks())[0],
                      plain=wrapper(*ARGS, True)[0])
        """,
        tree,
    )
    assert result == dict(installed=True, strategy="flag", version="0.5.16", wraps_original=True,
                          hooked="plain", plain="tma")


def test_activate_before_import_patches_on_import(tree):
    result = scenario.run(
        """
        st = g.activate()
        before = dict(installed=st.installed, imported=st.target_imported)
        assert TARGET not in sys.modules
        m = fm()
        result = dict(before=before, after=g.status().installed,
                      hooked=m._fused_moe_kernel_sequence(*ARGS, True, hooks=hooks())[0])
        """,
        tree,
    )
    assert result == dict(before=dict(installed=False, imported=False), after=True, hooked="plain")


@pytest.mark.parametrize("import_first", [True, False], ids=["import-first", "plugin-first"])
def test_repeated_activation_never_wraps_twice(tree, import_first):
    result = scenario.run(
        f"""
        if {import_first}: fm()
        g.activate(); plugin.register(); g.activate()
        m = fm(); g.activate()
        inner = m._fused_moe_kernel_sequence.__wrapped__
        result = dict(depth_ok=not hasattr(inner, "__wrapped__"),
                      log_lines=log().count("strategy FLAG"))
        """,
        tree,
        env={"SGLANG_LORA_TMA_GUARD": "1"},
    )
    assert result == dict(depth_ok=True, log_lines=1)


def test_activate_deactivate_activate_restores_the_exact_original(tree):
    result = scenario.run(
        """
        m = fm(); original = m._fused_moe_kernel_sequence
        states = []
        for _ in range(2):
            g.activate(); states.append(m._fused_moe_kernel_sequence is not original)
            st = g.deactivate(); states.append(m._fused_moe_kernel_sequence is original)
        result = dict(states=states, installed=st.installed, active=st.active,
                      after=m._fused_moe_kernel_sequence(*ARGS, True, hooks=hooks())[0])
        """,
        tree,
    )
    assert result == dict(states=[True] * 4, installed=False, active=False, after="tma")


def test_deactivate_before_import_leaves_the_module_alone(tree):
    result = scenario.run(
        """
        g.activate(); g.deactivate()
        m = fm()
        result = g.status().installed or hasattr(m._fused_moe_kernel_sequence, "__wrapped__")
        """,
        tree,
    )
    assert result is False


def test_concurrent_activation_from_threads_wraps_once(tree):
    result = scenario.run(
        """
        m = fm(); original = m._fused_moe_kernel_sequence
        barrier = threading.Barrier(8)
        def worker():
            barrier.wait(); g.activate()
        threads = [threading.Thread(target=worker) for _ in range(8)]
        [t.start() for t in threads]; [t.join() for t in threads]
        result = dict(wraps_original=m._fused_moe_kernel_sequence.__wrapped__ is original,
                      log_lines=log().count("strategy FLAG"))
        """,
        tree,
    )
    assert result == dict(wraps_original=True, log_lines=1)


def test_reloaded_package_adopts_the_installed_wrapper(tree):
    result = scenario.run(
        """
        m = fm(); original = m._fused_moe_kernel_sequence
        g.activate(); first = m._fused_moe_kernel_sequence
        importlib.reload(guard)
        st = guard.activate()
        same = m._fused_moe_kernel_sequence is first
        guard.deactivate()
        result = dict(installed=st.installed, same=same,
                      restored=m._fused_moe_kernel_sequence is original)
        """,
        tree,
    )
    assert result == dict(installed=True, same=True, restored=True)


def test_deactivate_splices_out_from_under_another_wrapt_wrapper(tree):
    result = scenario.run(
        """
        import wrapt
        m = fm(); original = m._fused_moe_kernel_sequence
        g.activate()
        def tracer(wrapped, instance, args, kwargs):
            return ("traced",) + tuple(wrapped(*args, **kwargs))
        outer = wrapt.wrap_function_wrapper(m, "_fused_moe_kernel_sequence", tracer)
        g.deactivate()
        result = dict(outer_kept=m._fused_moe_kernel_sequence is outer,
                      now_wraps_original=outer.__wrapped__ is original,
                      hooked=m._fused_moe_kernel_sequence(*ARGS, True, hooks=hooks())[:2])
        """,
        tree,
    )
    assert result == dict(outer_kept=True, now_wraps_original=True, hooked=["traced", "tma"])


def test_deactivate_after_a_wholesale_replacement_warns_and_leaves_it(tree):
    result = scenario.run(
        """
        m = fm(); g.activate()
        def replacement(*a, **k): return "theirs"
        m._fused_moe_kernel_sequence = replacement
        g.deactivate()
        result = dict(kept=m._fused_moe_kernel_sequence is replacement,
                      warned="replaced by other code" in log())
        """,
        tree,
    )
    assert result == dict(kept=True, warned=True)


def test_guarded_function_pickles_by_reference(tree):
    result = scenario.run(
        """
        import pickle
        m = fm(); g.activate()
        result = pickle.loads(pickle.dumps(m._fused_moe_kernel_sequence)) is m._fused_moe_kernel_sequence
        """,
        tree,
    )
    assert result is True


@pytest.mark.parametrize(
    "version, shape, strategy, level, phrase",
    [
        ("0.5.11", "0.5.11", "flag", "INFO", "strategy FLAG"),
        ("0.5.17", "0.5.17", "native", "INFO", "nothing to patch"),
        ("0.5.24", "0.5.23", "native", "INFO", "outside the releases checked"),
        ("0.5.16.dev3+renamed", None, "fallback", "INFO", "strategy FALLBACK"),
    ],
)
def test_each_release_shape_logs_what_was_done(tmp_path, version, shape, strategy, level, phrase):
    result = scenario.run(
        """
        m = fm(); original = m._fused_moe_kernel_sequence
        st = g.activate()
        result = dict(strategy=st.strategy, installed=st.installed,
                      untouched=m._fused_moe_kernel_sequence is original, log=log())
        """,
        write_tree(tmp_path, version, shape),
    )
    assert result["strategy"] == strategy
    assert result["installed"] is (strategy in ("flag", "fallback"))
    assert result["untouched"] is (strategy not in ("flag", "fallback"))
    assert any(line.startswith(level) and phrase in line for line in result["log"].splitlines())


def test_sglang_before_0_5_11_is_left_alone(tmp_path):
    result = scenario.run(
        """
        m = fm(); st = g.activate()
        result = dict(strategy=st.strategy, installed=st.installed,
                      absent=not hasattr(m, "_fused_moe_kernel_sequence"), log=log())
        """,
        write_tree(tmp_path, "0.5.10.post1", "0.5.16", with_function=False),
    )
    assert result["strategy"] == "absent" and result["installed"] is False and result["absent"]
    assert "SGLang before 0.5.11" in result["log"]
