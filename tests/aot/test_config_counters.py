"""aotkit.config and aotkit.counters basics: patch, environment overrides, helpful errors,
counters, recorded decisions and explain()."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import aotkit
from aotkit import compilers, config, counters
from aotkit.errors import AotkitError, ArgumentError, ConfigError


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AOTKIT_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=300)


# --- config ----------------------------------------------------------------------------------


def test_patch_sets_and_restores():
    before = config.recompile_limit
    with config.patch(recompile_limit=before + 5, log_graphs=True):
        assert config.recompile_limit == before + 5
        assert config.log_graphs is True
    assert config.recompile_limit == before
    assert config.log_graphs is False


def test_patch_restores_after_an_exception():
    before = config.recompile_limit
    with pytest.raises(KeyError), config.patch(recompile_limit=1):
        raise KeyError("boom")
    assert config.recompile_limit == before


def test_patch_restores_only_what_it_patched():
    before = (config.recompile_limit, config.max_decisions)
    try:
        with config.patch(recompile_limit=3):
            config.max_decisions = 7  # set directly, not patched: kept after the block
            config.recompile_limit = 4  # patched: restored
        assert (config.recompile_limit, config.max_decisions) == (before[0], 7)
    finally:
        config.max_decisions = before[1]


def test_patch_with_a_bad_value_restores_what_it_had_set():
    before = config.recompile_limit
    with pytest.raises(ConfigError, match="must be bool"), config.patch(
        recompile_limit=2, log_graphs="yes"
    ):
        pass
    assert config.recompile_limit == before and config.log_graphs is False


def test_patches_ending_out_of_order_restore_the_value_before_the_first():
    """Two threads' overlapping patches end in the order they began: the first restored the
    default, the second then restored the first's value, which stayed for the process."""
    before = config.recompile_limit
    first, second = config.patch(recompile_limit=20), config.patch(recompile_limit=30)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert config.recompile_limit == 30  # the second is still active
    second.__exit__(None, None, None)
    assert config.recompile_limit == before


def test_patches_in_threads_leave_the_value_they_found():
    import threading

    before = config.recompile_limit
    barrier = threading.Barrier(4)

    def work(limit: int) -> None:
        with config.patch(recompile_limit=limit):
            barrier.wait()
        barrier.wait()  # every thread is out of its block

    threads = [threading.Thread(target=work, args=(10 + k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert config.recompile_limit == before


def test_a_patch_ended_in_another_thread_restores_the_value():
    import threading

    before = config.recompile_limit
    patch = config.patch(recompile_limit=3)
    patch.__enter__()
    ender = threading.Thread(target=patch.__exit__, args=(None, None, None))
    ender.start()
    ender.join()
    assert config.recompile_limit == before
    with pytest.raises(ConfigError, match="exited more times than it was entered"):
        patch.__exit__(None, None, None)


def test_a_bad_variable_is_reported_again_after_a_patch_of_its_option():
    """The patch replaced the bad value for its block; afterwards the option read its default
    and the error was gone for good."""
    result = _python(
        "import aotkit\n"
        "with aotkit.config.patch(recompile_limit=3):\n"
        "    print(aotkit.config.recompile_limit)\n"
        "try:\n"
        "    aotkit.config.recompile_limit\n"
        "except aotkit.errors.ConfigError as exc:\n"
        "    print('error:', str(exc).splitlines()[0])\n",
        AOTKIT_RECOMPILE_LIMIT="abc")
    assert result.stdout.splitlines() == [
        "3", "error: AOTKIT_RECOMPILE_LIMIT='abc' is not a valid int."], result.stderr


def test_patch_refuses_names_that_are_not_options():
    before = config.recompile_limit
    with pytest.raises(ConfigError, match="has no option '_values'"), config.patch(_values={}):
        pass
    assert config.recompile_limit == before


@pytest.mark.parametrize(("name", "least"), [("recompile_limit", 1), ("max_decisions", 0)])
def test_counts_below_their_least_are_refused(name, least):
    before = getattr(config, name)
    with pytest.raises(ConfigError, match=rf"aotkit.config.{name} must be at least {least}, "
                                          rf"got {least - 1}\.\nFix: "):
        setattr(config, name, least - 1)
    with pytest.raises(ConfigError, match=f"must be at least {least}"), config.patch(**{name: -3}):
        pass
    assert getattr(config, name) == before
    with config.patch(**{name: least}):
        assert getattr(config, name) == least


def test_recompile_limit_one_keeps_one_signature():
    f = aotkit.aot_function(lambda x: x + 1, compilers.nop)
    with config.patch(recompile_limit=1):
        f(torch.zeros(1))
        with pytest.raises(aotkit.errors.RecompileLimitError):
            f(torch.zeros(2))


def test_recompile_limit_reached_by_a_changed_option_names_keeping_it_fixed():
    """Its fix spoke of shapes and Python numbers only."""
    f = aotkit.aot_function(lambda x: x.sin().sum(), compilers.nop,
                            partition_fn=aotkit.min_cut_rematerialization_partition)
    x = torch.randn(4, requires_grad=True)
    with config.patch(recompile_limit=1):
        f(x)
        with config.patch(activation_memory_budget=0.5), pytest.raises(
                aotkit.errors.RecompileLimitError,
                match=r"activation_memory_budget changed(.|\n)*Fix: keep aotkit.config fixed"):
            f(x)


def test_bad_env_values_name_the_variable_and_a_fix():
    for variable, value, why in (("AOTKIT_RECOMPILE_LIMIT", "-2", "at least 1"),
                                 ("AOTKIT_MAX_DECISIONS", "-2", "at least 0"),
                                 ("AOTKIT_RECOMPILE_LIMIT", "abc", "not a valid int")):
        assert _python("import aotkit", **{variable: value}).returncode == 0  # raised at use
        out = _python("import aotkit; aotkit.config.debug_graphs", **{variable: value})
        assert out.returncode != 0
        assert f"ConfigError: {variable}='{value}'" in out.stderr and why in out.stderr
        assert "Fix: " in out.stderr and "direct cause" not in out.stderr


def test_a_patch_can_be_entered_again_and_paths_name_folders(tmp_path):
    import pathlib

    fewer, before = config.patch(recompile_limit=2), config.recompile_limit
    for _ in range(2):
        with fewer:
            assert config.recompile_limit == 2
            with fewer:  # nested
                assert config.recompile_limit == 2
            assert config.recompile_limit == 2
        assert config.recompile_limit == before
    with config.patch(debug_dir=pathlib.Path(tmp_path)):
        assert config.debug_dir == str(tmp_path)
    with pytest.raises(ConfigError, match="must not be empty"):
        config.debug_dir = ""
    with pytest.raises(ConfigError, match="has no option 'patch'"):
        config.patch = 5


def test_unknown_option_suggests_a_close_name():
    with pytest.raises(ConfigError, match="recompile_limit") as info:
        config.recompile_limt = 3
    assert "Did you mean 'recompile_limit'" in str(info.value)
    assert isinstance(info.value, AotkitError)
    with pytest.raises(AttributeError, match="Did you mean 'log_graphs'"):
        _ = config.log_graph
    with pytest.raises(ConfigError, match="Did you mean 'max_decisions'"), config.patch(
        max_decision=3
    ):
        pass


def test_wrong_type_is_refused():
    with pytest.raises(ConfigError, match="must be int"):
        config.recompile_limit = "4"
    with pytest.raises(ConfigError, match="must be int"):
        config.recompile_limit = True
    with pytest.raises(ConfigError, match="must be bool"):
        config.debug_graphs = 1


def test_options_have_type_default_help_and_env_var():
    options = config.options()
    assert "recompile_limit" in options
    for name, option in options.items():
        assert option.name == name
        assert option.help
        assert option.env_var == f"AOTKIT_{name.upper()}"
        assert isinstance(option.default, option.type)
    key = dict(config.cache_key())
    assert set(key) == {n for n, o in options.items() if o.in_cache_key}


def test_mock_patch_of_an_option_restores_it():
    """unittest.mock found no option in the module's namespace, deleted it on exit (an
    AttributeError) and left the patched value."""
    from unittest import mock

    with config.patch(recompile_limit=5):
        with mock.patch.object(config, "recompile_limit", 3):
            assert config.recompile_limit == 3
        assert config.recompile_limit == 5
        with mock.patch("aotkit.config.debug_graphs", not config.debug_graphs) as value:
            assert config.debug_graphs is value
    with pytest.raises(aotkit.errors.ConfigError, match="cannot be deleted"):
        del config.recompile_limit


def test_patch_refuses_to_decorate_generators_and_coroutines():
    def gen():
        yield config.recompile_limit

    async def coroutine():
        return config.recompile_limit

    for fn in (gen, coroutine):
        with pytest.raises(aotkit.errors.ConfigError, match="generator or async"):
            config.patch(recompile_limit=2)(fn)


def test_every_bad_env_value_is_named_and_setting_the_option_fixes_it():
    code = ("import aotkit\n"
            "for fix in ('recompile_limit', 'log_graphs'):\n"
            "    try: aotkit.config.debug_graphs\n"
            "    except aotkit.errors.ConfigError as e: print(repr(str(e)))\n"
            "    setattr(aotkit.config, fix, 2 if fix == 'recompile_limit' else True)\n"
            "print(aotkit.config.debug_graphs, aotkit.config.recompile_limit)\n")
    out = _python(code, AOTKIT_RECOMPILE_LIMIT="abc", AOTKIT_LOG_GRAPHS="maybe")
    assert out.returncode == 0, out.stderr
    first, second, last = out.stdout.splitlines()
    assert "AOTKIT_RECOMPILE_LIMIT='abc'" in first and "AOTKIT_LOG_GRAPHS='maybe'" in first
    assert "AOTKIT_RECOMPILE_LIMIT" not in second and "AOTKIT_LOG_GRAPHS='maybe'" in second
    assert last == "False 2"


def test_env_override_is_parsed_in_a_fresh_process():
    out = _python("import aotkit; c = aotkit.config; print(c.recompile_limit, c.debug_graphs)",
                  AOTKIT_RECOMPILE_LIMIT="3", AOTKIT_DEBUG_GRAPHS="yes")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "True"]


def test_bad_env_value_names_the_variable_at_first_use():
    code = "import torch, aotkit; aotkit.aot_function(torch.sin, aotkit.compilers.nop)(torch.ones(1))"
    out = _python(code, AOTKIT_RECOMPILE_LIMIT="many")
    assert out.returncode != 0
    assert "ConfigError" in out.stderr and "AOTKIT_RECOMPILE_LIMIT='many'" in out.stderr


def test_a_misspelled_env_variable_is_warned_about_once():
    code = "import aotkit; print(aotkit.config.recompile_limit, aotkit.config.recompile_limit)"
    out = _python(code, AOTKIT_RECOMPILE_LIMT="3", AOTKIT_HOME="/opt")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["8", "8"]
    assert out.stderr.count("UserWarning") == 1, out.stderr
    assert "AOTKIT_RECOMPILE_LIMT is set, but aotkit has no such option; did you mean " \
        "AOTKIT_RECOMPILE_LIMIT? (it is ignored)" in out.stderr
    assert "AOTKIT_HOME is set, but aotkit has no such option (it is ignored)" in out.stderr
    assert _python(code, AOTKIT_REPRO_DEVICE="cpu").stderr == ""  # not an option, but ours
    # Under -W error the warning raises once; it raised at every later option read
    code = ("import warnings, aotkit\nwarnings.simplefilter('error')\ntry:\n"
            "    aotkit.config.recompile_limit\nexcept UserWarning:\n    print('warned')\n"
            "print(aotkit.config.recompile_limit)")
    assert _python(code, AOTKIT_HOME="/opt").stdout.split() == ["warned", "8"]


# --- counters and explain -----------------------------------------------------------------


def test_bump_record_reset():
    counters.bump("aot", "thing")
    counters.bump("aot", "thing", 2)
    assert counters.counters["aot"]["thing"] == 3
    decision = counters.record("fallback", "f", "because", node="add", user_stack="x.py:1")
    assert counters.counters["fallback"]["f"] == 1
    assert "(node add)" in str(decision) and "at x.py:1" in str(decision)
    counters.reset()
    assert not counters.counters
    assert len(aotkit.explain()) == 0


def test_explain_lists_decisions_and_counters():
    counters.record("recompile", "f", "shape of x changed")
    counters.record("fallback", "g", "no CUDA")
    report = aotkit.explain()
    assert len(report) == 2
    assert [d.why for d in report.of_kind("recompile")] == ["shape of x changed"]
    assert [d.what for d in report] == ["f", "g"]
    text = str(report)
    assert "[recompile] f: shape of x changed" in text
    assert "fallback.g = 1" in text


def test_of_kind_refuses_a_kind_aotkit_never_records():
    with pytest.raises(aotkit.errors.ArgumentError, match="did you mean 'recompile'"):
        aotkit.explain().of_kind("recompiles")
    with pytest.raises(aotkit.errors.ArgumentError, match="takes a kind's name, got None"):
        aotkit.explain().of_kind(None)  # type: ignore[arg-type]
    assert aotkit.explain().of_kind("recompile") == []
    counters.record("my_kind", "mine", "a kind of the user's own")
    assert [d.why for d in aotkit.explain().of_kind("my_kind")] == ["a kind of the user's own"]


def test_every_kind_aotkit_records_is_listed():
    import re
    from pathlib import Path

    source = "\n".join(p.read_text() for p in Path(aotkit.__file__).parent.rglob("*.py"))
    recorded = set(re.findall(r'counters\.record\(\s*"([a-z_]+)"', source))
    recorded |= {"capture", "recapture"}  # compiled autograd picks one of the two
    assert len(recorded) > 10 and recorded <= set(counters.KINDS)


def test_explain_keeps_at_most_max_decisions():
    with config.patch(max_decisions=3):
        for i in range(5):
            counters.record("recompile", "f", f"reason {i}")
    assert [d.why for d in aotkit.explain()] == ["reason 2", "reason 3", "reason 4"]
    assert aotkit.explain().counters["recompile"]["f"] == 5


def test_compiles_are_counted():
    f = aotkit.aot_function(lambda x: x.sin(), compilers.nop)
    x = torch.ones(2, requires_grad=True)
    f(x).sum().backward()
    f(x).sum().backward()
    with torch.no_grad():
        f(x)
    aot = counters.counters["aot"]
    assert (aot["traces"], aot["fw_compiles"], aot["bw_compiles"], aot["inference_compiles"]) == (
        2, 1, 1, 1)
    (reason,) = aotkit.explain().of_kind("recompile")
    assert "grad mode changed: True -> False" in reason.why


def test_recompile_reason_names_every_difference_from_the_closest_signature():
    f = aotkit.aot_function(lambda x: x * 2, compilers.nop)
    a = torch.randn(3, requires_grad=True)
    f(a)
    f(torch.randn(4))
    with torch.no_grad():
        f(a)  # differs from the first signature in grad mode only, from the last in three ways
    whys = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert whys == [
        "requires_grad of args[0] changed: True -> False; shape of args[0] changed: (3,) -> (4,)",
        "grad mode changed: True -> False",
    ]


def test_recompile_reason_prefers_a_signature_of_the_same_structure():
    """Against the latest signature, a keyword call, the reason named the structure where the
    call missed the first signature by its strides only."""
    f = aotkit.aot_function(lambda x, y=None: x * 2 if y is None else x * y, compilers.nop)
    a = torch.randn(4, 4)
    f(a)
    f(a, y=a)
    f(a.t())
    assert aotkit.explain().of_kind("recompile")[-1].why == \
        "stride of args[0] changed: (4, 1) -> (1, 4)"


def test_a_new_default_dtype_is_a_new_signature():
    f = aotkit.aot_function(lambda x: torch.ones(2) * x.sum(), compilers.nop)
    x = torch.ones(3, dtype=torch.float16)
    assert f(x).dtype == torch.float32
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert f(x).dtype == torch.float64  # traced anew (a generated kernel bakes the dtype in)
    finally:
        torch.set_default_dtype(before)
    (reason,) = aotkit.explain().of_kind("recompile")
    assert reason.why == "the default dtype changed: torch.float32 -> torch.float64"


def test_conjugate_and_negative_views_are_new_signatures():
    """The graph reads a conjugated input's storage as it is: a graph traced for a plain complex
    tensor gave z.conj()[0:1] unconjugated, and z.conj().real raised."""
    z = torch.tensor([1 + 2j, 3 - 1j])
    for fn, view in [(lambda x: x[0:1], torch.conj), (lambda x: x.real, torch.conj),
                     (lambda x: x * 2, torch._neg_view)]:
        f = aotkit.aot_function(fn, compilers.nop)
        f(z)
        torch.testing.assert_close(f(view(z)), fn(view(z)))
    whys = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert whys[0] == "conjugate bit of args[0] changed: False -> True"
    assert whys[2] == "negative bit of args[0] changed: False -> True"


@pytest.mark.parametrize("kind", [float, "float32"])
def test_floats_that_compare_equal_but_differ_are_new_signatures(kind):
    """NumPy's float32 (not a float subclass) was keyed by ==: -0.0 reused 0.0's graph, and
    every nan traced anew until the recompile limit."""
    import numpy as np

    make = float if kind is float else np.float32
    x = torch.ones(2)
    divide = aotkit.aot_function(lambda x, s: x / float(s), compilers.nop)
    assert divide(x, make(0.0)).tolist() == [float("inf")] * 2
    assert divide(x, make(-0.0)).tolist() == [float("-inf")] * 2
    (reason,) = aotkit.explain().of_kind("recompile")
    assert reason.why == ("args[1] changed: float 0.0 -> float -0.0" if kind is float else
                          "args[1] changed: float32 np.float32(0.0) -> float32 np.float32(-0.0)")
    add = aotkit.aot_function(lambda x, s: x + float(s), compilers.nop)
    for _ in range(config.recompile_limit + 1):  # nan != nan: one entry all the same
        assert add(x, make("nan")).isnan().all()
    assert add.num_entries == 1


def test_a_new_rank_under_dynamic_shapes_is_named_as_such():
    f = aotkit.aot_function(lambda x: x * 2, compilers.nop, dynamic=True)
    f(torch.randn(3, 4))
    f(torch.randn(3))
    (reason,) = aotkit.explain().of_kind("recompile")
    assert reason.why == "number of dimensions of args[0] changed: 2 -> 1"


def test_options_of_other_parts_do_not_recompile():
    """The min-cut budget and compiled autograd's options were in every entry's key: changing
    them recompiled default-partition functions (and used up their recompile limit)."""
    x = torch.randn(3, requires_grad=True)
    plain = aotkit.aot_function(lambda x: x.sin(), compilers.nop)
    min_cut = aotkit.aot_function(lambda x: x.sin(), compilers.nop,
                                  partition_fn=aotkit.min_cut_rematerialization_partition)
    for budget in (1.0, 0.5, 0.25):
        with config.patch(activation_memory_budget=budget,
                          compiled_autograd_lower=budget == 1.0):
            plain(x)
            min_cut(x)
    assert (plain.num_entries, min_cut.num_entries) == (1, 3)
    assert config.cache_key("aot") == (("bind_aten_calls", True),)


def _scaled_sine(x):
    y = x.sin()
    return y * 2


@pytest.mark.parametrize("record", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        not hasattr(torch.fx.proxy, "_register_stack_trace_anchor"),
        reason="this torch's make_fx keeps stack frames of module forwards only")),
])
def test_record_stack_traces_names_the_lines_of_a_plain_function(record):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    f = aotkit.aot_function(_scaled_sine, keep)
    with config.patch(record_stack_traces=record):
        f(torch.ones(2, requires_grad=True))
    traces = {str(n.target): n.meta.get("stack_trace") for n in graphs[0].graph.nodes
              if n.op == "call_function"}
    if record:
        assert "in _scaled_sine\n    y = x.sin()" in traces["aten.sin.default"]
        assert "return y * 2" in traces["aten.mul.Tensor"]
    else:
        assert set(traces.values()) == {None}


def test_not_callable_arguments_are_argument_errors():
    with pytest.raises(aotkit.errors.ArgumentError, match="compiles a callable"):
        aotkit.aot_function(3, compilers.nop)
    with pytest.raises(aotkit.errors.ArgumentError, match="partition_fn must be callable"):
        aotkit.aot_function(torch.sin, compilers.nop, partition_fn="min_cut")


def _drop_one_saved(joint, inputs, *, num_fwd_outputs):
    """A partitioner whose forward saves less than its backward takes (a raw ValueError in the
    backward)."""
    forward, backward = aotkit.default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs)
    output = forward.graph.output_node()
    output.args = (output.args[0][:-1],)
    forward.recompile()
    return forward, backward


@pytest.mark.parametrize(("partition_fn", "match"), [
    (lambda joint: None, "failed on the joint graph"),
    (lambda joint, inputs, *, num_fwd_outputs: None, "returned NoneType"),
    (lambda joint, inputs, *, num_fwd_outputs: (joint,), "returned tuple"),
    (lambda joint, inputs, *, num_fwd_outputs: (joint, joint), "takes the joint graph's tangents"),
    (_drop_one_saved, r"saving 0 value\(s\) and a backward graph taking 1"),
])
def test_a_broken_partition_fn_is_named_in_a_compiler_error(partition_fn, match):
    f = aotkit.aot_function(torch.sin, compilers.nop, partition_fn=partition_fn)
    with pytest.raises(aotkit.errors.CompilerError, match=match) as info:
        f(torch.ones(2, requires_grad=True))
    assert "Fix: a partitioner is partition_fn(joint_gm, joint_inputs" in str(info.value)


def test_partitioners_refuse_graphs_that_are_not_joint_graphs():
    gm = torch.fx.symbolic_trace(lambda a, b: (a.sin() * b,))
    for partition in (aotkit.default_partition, aotkit.min_cut_rematerialization_partition):
        with pytest.raises(aotkit.errors.ArgumentError, match="neither primals_"):
            partition(gm, [], num_fwd_outputs=1)


def test_log_graphs_alone_shows_the_graphs():
    """With no logging set up, AOTKIT_LOG_GRAPHS=1 logged the graphs to nowhere."""
    result = _python("import torch, aotkit\n"
                     "f = aotkit.aot_function(torch.sin, aotkit.compilers.nop)\n"
                     "f(torch.ones(2, requires_grad=True))\n", AOTKIT_LOG_GRAPHS="1")
    assert result.returncode == 0, result.stderr
    assert "[aotkit.aot] aot_function(_VariableFunctionsClass.sin) forward graph:" in result.stderr
    lowered = _python("import torch, aotkit\n"  # compiled autograd's lowered graphs said nothing
                      "x = torch.ones(2, requires_grad=True)\n"
                      "with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):\n"
                      "    x.sin().sum().backward()\n", AOTKIT_LOG_GRAPHS="1")
    assert lowered.returncode == 0, lowered.stderr
    assert "[aotkit.compiled_autograd] lowered " in lowered.stderr, lowered.stderr
    quiet = _python("import torch, aotkit\n"
                    "aotkit.aot_function(torch.sin, aotkit.compilers.nop)(torch.ones(2))\n")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    # Logging's configuration is left alone: after the patch, a recompile's INFO decision is
    # not shown, and basicConfig later shows it once.
    after = _python("import logging, sys, torch, aotkit\n"
                    "f = aotkit.aot_function(torch.sin, aotkit.compilers.nop)\n"
                    "with aotkit.config.patch(log_graphs=True):\n"
                    "    f(torch.ones(2))\n"
                    "print('---', file=sys.stderr)\n"
                    "f(torch.ones(3))\n"
                    "logging.basicConfig(level=logging.INFO)\n"
                    "f(torch.ones(4))\n")
    shown = after.stderr.split("---\n")[1]
    assert shown.count("shape of args[0] changed: (3,) -> (4,)") == 1, shown
    assert "(2,) -> (3,)" not in shown, shown


def test_explain_while_another_thread_imports_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's utils module is in sys.modules before its counters exist: explain() raised
    AttributeError from a monitoring thread while another thread's first compile imported it."""
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", types.ModuleType("torch._dynamo.utils"))
    assert aotkit.explain().dynamo == {}


def test_decisions_recorded_from_threads_while_explain_reads_them() -> None:
    """explain() copied the counters while another thread added a kind ("dictionary changed
    size during iteration"), and two threads trimming to max_decisions popped an empty deque."""
    import threading

    def record_many(k: int) -> None:
        for i in range(300):
            counters.record(f"kind_{k}_{i}", "t", "why")

    with aotkit.config.patch(max_decisions=0):
        threads = [threading.Thread(target=record_many, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            aotkit.explain()
        for t in threads:
            t.join()
    assert sum(len(v) for k, v in aotkit.explain().counters.items() if k.startswith("kind_")) \
        == 1200


def test_record_names_kinds_with_strings_and_explain_indents_long_reasons() -> None:
    with pytest.raises(ArgumentError, match="kind and a what that are str"):
        counters.record(3, "x", "y")  # type: ignore[arg-type]
    counters.record("mine", "f", "first line\nFix: second line")
    assert "  [mine] f: first line\n    Fix: second line" in str(aotkit.explain())


def test_of_kind_of_a_kind_of_ones_own_whose_decisions_were_dropped_is_empty() -> None:
    """Once max_decisions dropped them it raised "aotkit records no such kind", though the
    counters listed the kind."""
    with aotkit.config.patch(max_decisions=1):
        counters.record("mykind", "f", "why")
        counters.record("recompile", "g", "why")
    assert aotkit.explain().of_kind("mykind") == []
    with pytest.raises(ArgumentError, match="did you mean 'recompile'"):
        aotkit.explain().of_kind("recompil")


def test_two_lambdas_decisions_are_told_apart() -> None:
    """Both were aot_function(<lambda>), their counters merged."""
    first = aotkit.aot_function(lambda x, n: x * n, compilers.nop)
    second = aotkit.aot_function(lambda x, n: x + n, compilers.nop)
    for fn in (first, second):
        fn(torch.ones(2), 1)
        fn(torch.ones(2), 2)
    names = {d.what for d in aotkit.explain().of_kind("recompile")}
    assert len(names) == 2 and all("<lambda> at test_config_counters.py:" in n for n in names)


def test_a_fallback_taken_at_every_call_keeps_one_decision_until_reset() -> None:
    """Forward-mode AD's eager runs, told once per compiled function for good, were counted
    but neither kept nor logged after counters.reset(); torch.compile's path kept a list
    growing by one per call. The decision is now made once per reset, later calls counted."""
    import torch.autograd.forward_ad as fwAD

    f = aotkit.aot_function(lambda x: x.sin() * 2, compilers.nop)
    x = torch.randn(4)
    for _ in range(2):
        counters.reset()
        with fwAD.dual_level():
            for _ in range(50):
                f(fwAD.make_dual(x, torch.ones(4)))
        [decision] = aotkit.explain().of_kind("fallback")
        assert "forward-mode AD" in decision.why
        assert counters.counters["aot"]["forward_ad_eager_calls"] == 50
        assert counters.counters["fallback"][decision.what] == 50


def test_record_once_is_per_kind_what_and_tag() -> None:
    for tag in ("a", "b", "a"):
        counters.record_once("fallback", "mine", f"reason {tag}", once=tag)
    assert [d.why for d in aotkit.explain().of_kind("fallback")] == ["reason a", "reason b"]
    assert counters.counters["fallback"]["mine"] == 3
