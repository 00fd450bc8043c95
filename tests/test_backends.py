"""``torch.compile(backend="aotkit")``: results and gradients equal eager PyTorch's, and aotkit's
counters show what was traced and compiled."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import aotkit
from aotkit.counters import counters


def test_function_forward_and_backward() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x.sin() * y).relu() + x @ y.t()

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    x2, y2 = (t.detach().clone().requires_grad_() for t in (x, y))
    out = torch.compile(f, backend="aotkit")(x, y)
    out.sum().backward()
    expected = f(x2, y2)
    expected.sum().backward()

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(y.grad, y2.grad)
    assert counters["aot"]["traces"] == 1
    assert counters["aot"]["fw_compiles"] == 1
    assert counters["aot"]["bw_compiles"] == 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def test_module_parameters_are_graph_inputs() -> None:
    """Parameters reach the graph as inputs, so updating them in place needs no recompile."""
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="aotkit")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected)
        for o, m in ((opt, out), (ref_opt, expected)):
            o.zero_grad()
            m.square().mean().backward()
            o.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    assert counters["aot"]["traces"] == 1
    assert not aotkit.explain().of_kind("recompile")


def test_dynamic_shapes_one_trace_serves_several_batch_sizes() -> None:
    model = Net()
    compiled = torch.compile(model, backend="aotkit", dynamic=True)
    for batch in (2, 3, 5, 9):
        x = torch.randn(batch, 8)
        out = compiled(x)
        out.sum().backward()
        compiled_grad = model.fc1.weight.grad.clone()
        model.zero_grad()
        expected = model(x)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(compiled_grad, model.fc1.weight.grad)
        model.zero_grad()
    assert counters["aot"]["traces"] == 1
    assert counters["aot"]["fw_compiles"] == 1
    assert counters["aot"]["bw_compiles"] == 1


def test_input_mutation_reaches_the_caller() -> None:
    def f(buf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        buf.mul_(2).add_(x.detach())
        return (x * buf).sum()

    buf, x = torch.arange(4.0), torch.randn(4, requires_grad=True)
    buf2, x2 = buf.clone(), x.detach().clone().requires_grad_()
    out = torch.compile(f, backend="aotkit")(buf, x)
    out.backward()
    expected = f(buf2, x2)
    expected.backward()

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(buf, buf2)
    torch.testing.assert_close(x.grad, x2.grad)


def test_buffer_mutation_batchnorm_running_stats() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
    reference = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="aotkit")
    for _ in range(2):
        x = torch.randn(10, 6)
        torch.testing.assert_close(compiled(x), reference(x))
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)
    assert model[1].num_batches_tracked.item() == 2


def test_graph_break_results_still_right() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.cos() * 3
        torch._dynamo.graph_break()
        return (y.exp() + x).sum(0)

    x = torch.randn(3, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = torch.compile(f, backend="aotkit")(x)
    out.sum().backward()
    expected = f(x2)
    expected.sum().backward()

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x2.grad)
    assert counters["aot"]["traces"] == 2
    assert counters["aot"]["bw_compiles"] == 2


def test_inference_under_no_grad() -> None:
    model = Net()
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = torch.compile(model, backend="aotkit")(x)
        expected = model(x)
    torch.testing.assert_close(out, expected)
    assert not out.requires_grad
    assert counters["aot"]["inference_compiles"] == 1
    assert counters["aot"]["fw_compiles"] == 0


def test_backend_is_registered_with_dynamo() -> None:
    from aotkit.backends import aotkit_nop

    assert "aotkit" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("aotkit") is aotkit_nop


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter; it must succeed."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_entry_point_works_without_importing_aotkit() -> None:
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: x * 2, backend='aotkit')\n"
        "print(f(torch.ones(2)))\n"
        "print('aotkit' in sys.modules)\n"
    )
    proc = _run_python(code)
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "tensor([2., 2.])"
    assert lines[1] == "True"  # loaded through the entry point, not by the command


def test_debug_backend_runs_like_eager() -> None:
    """``backend="aotkit_debug"``: every graph runs through debug_nop, which checks each node's
    real layout against the traced one, forward and backward."""
    from aotkit.backends import aotkit_debug

    assert torch._dynamo.lookup_backend("aotkit_debug") is aotkit_debug
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 8)
    out = torch.compile(model, backend="aotkit_debug")(x)
    expected = reference(x)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert counters["aot"]["fw_compiles"] == 1
    assert counters["aot"]["bw_compiles"] == 1


def test_options_pick_the_min_cut_partition_and_its_budget() -> None:
    model = Net()
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="aotkit",
                             options={"partition": "min_cut", "activation_memory_budget": 0.0})
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    [decision] = aotkit.explain().of_kind("partition")
    assert decision.why.startswith("min_cut_rematerialization_partition: saved")


def test_a_numpy_budget_is_a_number() -> None:
    """np.float32(0.5) lies in [0, 1]: refused as 'not a number', with a fix asking for what
    was given, by the backend's options, the partitioner and aotkit.config alike."""
    np = pytest.importorskip("numpy")
    model = Net()
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="aotkit", options={
        "partition": "min_cut", "activation_memory_budget": np.float32(0.0)})
    compiled(x).sum().backward()
    assert aotkit.explain().of_kind("partition")[-1].why.startswith("min_cut_rematerialization")
    with aotkit.config.patch(activation_memory_budget=np.float32(0.5), recompile_limit=np.int64(3)):
        assert type(aotkit.config.activation_memory_budget) is float
        assert aotkit.config.activation_memory_budget == 0.5
        assert type(aotkit.config.recompile_limit) is int


def test_numpy_bools_are_bools() -> None:
    """np.bool_ is no bool subclass: it passes as True/False wherever aotkit takes a bool."""
    np = pytest.importorskip("numpy")
    with aotkit.config.patch(bind_aten_calls=np.bool_(False)):
        assert aotkit.config.bind_aten_calls is False
    x = torch.randn(3, requires_grad=True)
    compiled = aotkit.aot_function(torch.sin, aotkit.compilers.nop, dynamic=np.bool_(True))
    torch.testing.assert_close(compiled(x), torch.sin(x))
    with aotkit.compiled_autograd.enable(lambda gm: gm, dynamic=np.bool_(False)):
        (x * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
    with pytest.raises(aotkit.errors.ConfigError, match="must be bool"):
        aotkit.config.bind_aten_calls = np.int64(1)


@pytest.mark.parametrize("dynamic", [False, True])
def test_options_changed_after_compiling_recompile_and_say_why(dynamic: bool) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ w).sin().exp() @ w).cos()

    w = torch.randn(16, 16, requires_grad=True)
    compiled = torch.compile(fn, backend="aotkit", options={"partition": "min_cut"},
                             dynamic=dynamic)
    sizes = [4, 5, 6, 4] if dynamic else [4] * 4
    for n, budget, bind in zip(sizes, [1.0, 0.0, 0.0, 1.0], [True, True, False, True], strict=True):
        x = torch.randn(n, 16)
        with aotkit.config.patch(activation_memory_budget=budget, bind_aten_calls=bind):
            out = compiled(x, w)
            out.sum().backward()
        got, w.grad = w.grad, None
        expected = fn(x, w)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(got, w.grad)
        w.grad = None
    saved = [d.why.split("saved ")[1].split(",")[0] for d in aotkit.explain().of_kind("partition")]
    assert saved == ["4 tensor(s) (2 of them inputs)", "2 tensor(s) (2 of them inputs)",
                     "2 tensor(s) (2 of them inputs)"]  # the budget of 1.0 is compiled once
    assert [d.why for d in aotkit.explain().of_kind("recompile")] == [
        "aotkit.config.activation_memory_budget changed: 1.0 -> 0.0",
        "aotkit.config.bind_aten_calls changed: True -> False"]


@pytest.mark.parametrize("options", [
    {"partition": "sideways"}, {"budget": 1.0}, {"activation_memory_budget": 0.5},
    {"partition": ["min_cut"]}, {"partition": "min_cut", "activation_memory_budget": "a"},
    {"partition": "min_cut", "activation_memory_budget": None},
    {"partition": "min_cut", "activation_memory_budget": True},
    {"partition": "min_cut", "activation_memory_budget": 2},
])
def test_bad_options_are_argument_errors(options: dict[str, object]) -> None:
    compiled = torch.compile(Net(), backend="aotkit", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(3, 8))
    assert isinstance(info.value.inner_exception, aotkit.errors.ArgumentError)
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize("backend", ["aotkit", "aotkit_debug", "aotkit_inductor"])
def test_modes_the_backends_lack_are_refused_not_ignored(backend: str) -> None:
    net, x = Net(), torch.ones(3, 8)
    torch.testing.assert_close(torch.compile(net, backend=backend, mode="default")(x), net(x),
                               rtol=1e-4, atol=1e-5)
    compiled = torch.compile(Net(), backend=backend, mode="reduce-overhead")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(3, 8))
    assert isinstance(info.value.inner_exception, aotkit.errors.ArgumentError)
    assert "has no 'reduce-overhead' mode" in str(info.value)


@pytest.mark.parametrize("compiler", ["nop", "ts_compile", "simple_ts_compile"])
def test_a_compiler_used_as_a_backend_says_which_backend_to_use(compiler: str) -> None:
    compiled = torch.compile(Net(), backend=getattr(aotkit.compilers, compiler))
    with pytest.raises(aotkit.errors.ArgumentError, match="backend='aotkit'"):
        compiled(torch.randn(3, 8))


def test_the_inductor_compiler_used_as_a_backend_says_which_backend_to_use() -> None:
    compiled = torch.compile(Net(), backend=aotkit.compilers.inductor)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(3, 8))
    assert isinstance(info.value.inner_exception, aotkit.errors.ArgumentError)
    assert 'backend="aotkit_inductor"' in str(info.value)


def test_decisions_name_the_compiled_region() -> None:
    model = Net()
    torch.compile(model, backend="aotkit")(torch.randn(3, 8)).sum().backward()
    [decision] = aotkit.explain().of_kind("partition")
    assert decision.what == "aot_module_simplified(forward in test_backends.py [0/0])"


def test_decisions_for_a_built_in_module_name_the_module() -> None:
    """Dynamo compiles nn.Sequential through a wrapper of its own; decisions name the module."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    torch.compile(model, backend="aotkit")(torch.randn(3, 8)).sum().backward()
    [decision] = aotkit.explain().of_kind("partition")
    assert decision.what == "aot_module_simplified(Sequential.forward in container.py [0/0])"


def test_decisions_for_a_module_class_without_source_name_its_module() -> None:
    """A class defined in a REPL or ``python -c`` has no source file: inspect raised."""
    namespace: dict[str, type] = {}
    exec("class MySeq(nn.Sequential): pass", {"nn": nn, "__name__": "repl"}, namespace)
    model = namespace["MySeq"](nn.Linear(3, 3), nn.ReLU())
    torch.compile(model, backend="aotkit")(torch.randn(2, 3))
    [decision] = aotkit.explain().of_kind("partition")
    assert decision.what == "aot_module_simplified(MySeq.forward in repl [0/0])"


@pytest.mark.parametrize("torch_logs", ["default", "quiet"])
def test_dynamo_recompiles_and_its_eager_fallback_are_explained(torch_logs: str) -> None:
    """Note [Dynamo's recompiles in explain()]: each recompile with Dynamo's guard failure, and
    the frame Dynamo stops compiling at its recompile limit, also where the program quiets the
    torch loggers (the fallback was read from Dynamo's warning, which then never came)."""
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    compiled = torch.compile(double, backend="aotkit", dynamic=False)
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    if torch_logs == "quiet":
        torch_logger.setLevel(logging.ERROR)
    with torch._dynamo.config.patch(recompile_limit=3):
        for x in (torch.ones(1), torch.ones(2), torch.ones(2, dtype=torch.float64),
                  torch.ones(4), torch.ones(5)):
            torch.testing.assert_close(compiled(x), double(x))
    torch_logger.setLevel(level)
    recompiles = aotkit.explain().of_kind("recompile")
    assert [d.what for d in recompiles] == [
        f"aot_module_simplified(double in test_backends.py [0/{i}])" for i in (1, 2)]
    assert "size mismatch at index 0. expected 1, actual 2" in recompiles[0].why
    assert "dtype mismatch" in recompiles[1].why
    [fallback] = aotkit.explain().of_kind("fallback")
    assert fallback.what.startswith("torch.compile('double'")
    assert "recompile_limit = 3 times and runs it eagerly" in fallback.why
    assert "  " not in fallback.why and "User stack trace" not in fallback.why


def test_dynamo_recompiles_are_explained_after_a_dynamo_reset() -> None:
    """The frame's name repeats after torch._dynamo.reset(); its recompiles were taken for
    restarts of the one already recorded and dropped."""
    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    for _ in range(3):
        torch._dynamo.reset()
        compiled = torch.compile(triple, backend="aotkit", dynamic=False)
        compiled(torch.ones(1))
        compiled(torch.ones(1, dtype=torch.float64))
    recompiles = aotkit.explain().of_kind("recompile")
    assert len(recompiles) == 3 and all("dtype mismatch" in d.why for d in recompiles)


def test_eager_fallback_of_a_backend_error_dynamo_suppresses_is_explained() -> None:
    """Note [Backend errors Dynamo suppresses]: Dynamo ran the frame eagerly and explain()
    showed nothing."""
    from torch.testing._internal.two_tensor import TwoTensor

    def scaled_sum(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (t * w).sum()

    t, w = TwoTensor(torch.randn(3), torch.randn(3)), torch.randn(3, requires_grad=True)
    with torch._dynamo.config.patch(suppress_errors=True):
        out = torch.compile(scaled_sum, backend="aotkit")(t, w)
    torch.testing.assert_close(out, scaled_sum(t, w))
    [fallback] = aotkit.explain().of_kind("fallback")
    assert fallback.what.startswith("torch.compile(backend='aotkit', scaled_sum in")
    assert "UnsupportedError" in fallback.why and "suppress_errors" in fallback.why
    aotkit.counters.reset()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(suppress_errors=True), pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        torch.compile(scaled_sum, backend="aotkit", fullgraph=True)(t, w)  # raises regardless
    assert not aotkit.explain().of_kind("fallback")


def _masked_accumulate(x: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Its backward (nonzero of the mask) sizes a value from data: untraceable statically."""
    return x.index_put((mask,), v, accumulate=True).sum()


def _masked_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True),
            torch.tensor([True, False, True, True]))


def test_graph_break_a_backend_asks_for_is_no_fallback_under_suppress_errors() -> None:
    with torch._dynamo.config.patch(suppress_errors=True):
        torch.compile(_masked_accumulate, backend="aotkit")(*_masked_inputs()).backward()
    assert aotkit.explain().of_kind("graph_break") and not aotkit.explain().of_kind("fallback")


@pytest.mark.parametrize(("text", "tidy"), [
    ("0/2: k == 2" + " " * 40 + "# return x * k  # mp/f.py:9 in fb\nUser stack trace:\n"
     '  File "/tmp/f.py", line 9, in fb\n    return x * k',
     "0/2: k == 2 (from f.py:9 in fb: return x * k)"),
    ("0/0: s == 'a  # b'" + " " * 30 + "# g(x, 'a  # b')  # mp/t.py:3 in f\nUser stack trace:\n"
     '  File "/tmp/t.py", line 3, in f\n    g(x, \'a  # b\')',  # the guard holds "  # "
     "0/0: s == 'a  # b' (from t.py:3 in f: g(x, 'a  # b'))"),
    ("0/0: k == 0" + " " * 40 + '#   # <string>:9 in fb\nUser stack trace:\n'
     '  File "<string>", line 9, in fb', "0/0: k == 0 (from <string>:9 in fb)"),
    ("0/2: tensor 'x' dtype mismatch. expected Double, actual Float",
     "0/2: tensor 'x' dtype mismatch. expected Double, actual Float"),
])
def test_guard_failures_are_tidied_to_one_line(text: str, tidy: str) -> None:
    from aotkit.compat import tidy_guard_failure

    assert tidy_guard_failure(text) == tidy


def test_a_fullgraph_recompile_limit_is_recorded_as_raising() -> None:
    compiled = torch.compile(lambda x: x * 2, backend="aotkit", dynamic=False, fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=2), \
            pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for n in (1, 2, 3):
            compiled(torch.ones(n))
    [fallback] = aotkit.explain().of_kind("fallback")
    assert "recompile_limit = 2 times and raises (fullgraph=True)" in fallback.why


def test_code_dynamo_runs_eagerly_is_listed_by_explain() -> None:
    """Dynamo skips a frame holding an nn.GRU (without allow_rnn) before any backend sees it;
    explain() lists that from Dynamo's own counters."""
    gru, head = nn.GRU(4, 4, batch_first=True), nn.Linear(4, 2)

    def f(x: torch.Tensor) -> torch.Tensor:
        return head(gru(x)[0]).sum()

    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(torch.compile(f, backend="aotkit")(x), f(x))
    report = aotkit.explain()
    assert any("Attempted to wrap RNN, GRU, or LSTM" in reason for reason in report.dynamo)
    assert "Dynamo graph breaks and code it ran eagerly" in str(report)


@torch.compiler.nested_compile_region
def _dropped(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.dropout(x, 0.5) * 3


def _regions_side_by_side(x: torch.Tensor) -> torch.Tensor:
    return _dropped(x) + _dropped(x) * 2


def _regions_in_a_checkpoint(x: torch.Tensor) -> torch.Tensor:
    # Dynamo inlines a single call there, but leaves two as invoke_subgraph in the body
    return checkpoint(lambda t: _dropped(_dropped(t)), x, use_reentrant=False)


def _regions_in_two_checkpoints(x: torch.Tensor) -> torch.Tensor:
    return checkpoint(_dropped, checkpoint(_dropped, x, use_reentrant=False), use_reentrant=False)


@pytest.mark.parametrize("f", [_regions_side_by_side, _regions_in_a_checkpoint,
                               _regions_in_two_checkpoints])
def test_nested_compile_region_with_dropout_called_twice_matches_eager(f) -> None:
    """Note [Nested compile regions are inlined]: the backward reuses each call's mask (it drew
    fresh masks when the region's backward subgraph recomputed it), also inside the body of
    another higher-order op; the random stream after backward is eager's."""
    results = []
    for run in (f, torch.compile(f, backend="aotkit")):
        x = torch.ones(16, requires_grad=True)
        torch.manual_seed(0)
        out = run(x)
        out.sum().backward()
        results.append((out, x.grad, torch.rand(2)))
    torch.testing.assert_close(results[1], results[0])
    assert "nested_compile_region is traced inline" in aotkit.explain().of_kind("inline")[0].why


@torch.compiler.nested_compile_region
def _scaled_sine(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


class _RegionsInADict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": _scaled_sine(x), "b": _scaled_sine(x + 1)}


def test_exported_module_calling_regions_keeps_its_guard_module_and_outputs() -> None:
    """An exported module's graph calls a guard module and rebuilds a dict; the graph with its
    regions inlined lost both."""
    x = torch.randn(4, 3, requires_grad=True)
    gm = torch.export.export(_RegionsInADict(), (x,), strict=True).module()
    out = aotkit.aot_module_simplified(gm, [x], fw_compiler=aotkit.compilers.nop)(x)
    want = gm(x)
    assert isinstance(out, dict) and out.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(out[key], want[key])


def _compiled_train_step(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()  # a graph break: the backward runs under Dynamo's frame callback
        return loss.detach()

    return torch.compile(step, backend="aotkit")


def test_backward_inside_a_compiled_step_runs_aotkit_code_uncompiled() -> None:
    """Note [aotkit's code is not user code to Dynamo]: Dynamo compiled aotkit's backward,
    nop and ATen binding code as user frames (and gave up on them at its recompile limit)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from aotkit.aot.runtime import CompiledFunction
    from aotkit.compilers import bind

    model, eager = Net(), Net()
    eager.load_state_dict(model.state_dict())
    step = _compiled_train_step(model)
    for batch in (4, 3):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(step(x), eager(x).sum().detach())
        eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    for fn in (CompiledFunction.backward, *(f for f in vars(bind).values()
                                             if getattr(f, "__module__", "") == bind.__name__
                                             and hasattr(f, "__code__"))):
        assert _debug_get_cache_entry_list(fn.__code__) == [], fn
    assert not aotkit.explain().of_kind("fallback")


def test_graphs_a_user_compiler_returns_stay_compilable_by_dynamo() -> None:
    """Only aotkit's own code is hidden from Dynamo: a compiler may gm.compile() the graph."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    graphs = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: object) -> torch.fx.GraphModule:
        gm.compile(backend="eager")
        graphs.append(gm)
        return gm

    f = aotkit.aot_function(lambda x: x.sin() * 2, compiler)
    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    assert len(graphs) == 2
    assert all(_debug_get_cache_entry_list(gm.forward.__code__) for gm in graphs)


def test_torch_compile_of_an_aot_function_traces_the_function_once() -> None:
    """Dynamo used to compile the user's function too while aotkit traced it (a nested trace)."""
    import torch._dynamo  # loaded before aot_function, as after any torch.compile

    calls = []

    def f(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x.sin() * 2

    x = torch.randn(3, requires_grad=True)
    aotkit.aot_function(f, aotkit.compilers.nop)(x)
    plain = len(calls)
    calls.clear()
    aotkit.counters.reset()
    compiled = torch.compile(aotkit.aot_function(f, aotkit.compilers.nop), backend="aotkit")
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    assert len(calls) == plain
    assert counters["aot"]["traces"] == 1


def test_a_model_that_reseeds_itself_runs_under_torch_compile() -> None:
    """transformers' Reformer draws a seed and reseeds before its dropout; Dynamo gives
    torch.seed() a graph of its own, which aot_function's reseed refusal must not refuse."""
    import sys

    class Reseeding(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seed = int(torch.seed() % sys.maxsize)
            torch.manual_seed(self.seed)
            return nn.functional.dropout(x, 0.5, training=True) * 1.0

    model = Reseeding()
    compiled = torch.compile(model, backend="aotkit")
    for _ in range(2):
        out = compiled(torch.ones(16))
        torch.manual_seed(model.seed)
        assert torch.equal(out, nn.functional.dropout(torch.ones(16), 0.5, training=True))


def test_a_factory_before_a_default_dtype_switch_keeps_the_callers_dtype() -> None:
    """Dynamo calls the backend in the default dtype its trace left (float64 here): pinning
    factories to their traced dtype made y float64 (Note [Factories follow the default dtype])."""

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x + torch.ones(2)
        torch.set_default_dtype(torch.float64)
        return y

    try:
        assert torch.compile(f, backend="aotkit")(torch.ones(2)).dtype == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_compiled_autograd_around_a_compiled_step_that_calls_backward() -> None:
    """The engine calls compiled autograd's capture under Dynamo's frame callback; Dynamo
    crashed compiling it ("Cannot call numel() on tensor with symbolic sizes")."""
    model, eager = Net(), Net()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(3, 8)
    with aotkit.compiled_autograd.enable(lambda gm: gm):
        _compiled_train_step(model)(x)
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert counters["compiled_autograd"]["captures"] == 1


@pytest.mark.parametrize("backend", ["aotkit", "aotkit_debug", "aotkit_inductor"])
def test_values_read_from_data_with_capture_scalar_outputs(backend: str) -> None:
    """Dynamo hands over .item() values and data-dependent sizes as unbacked symbols."""

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    def count(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.nonzero().shape[0]) + x.sum()

    def select(x: torch.Tensor) -> torch.Tensor:  # Note [Tangents of data-dependent sizes]
        return torch.cat([torch.masked_select(x, x > 0), x]).sin()

    def pad(x: torch.Tensor) -> torch.Tensor:  # Note [Binding symbols in the backward]
        return torch.cat([x[:2], torch.nn.functional.pad(x[x > 0], (2, 3))]) * 2

    def two_sizes(x: torch.Tensor) -> torch.Tensor:  # a tangent of size u0 + u1
        return torch.cat([x[x > 0], (x * 2)[x <= 0]])

    x = torch.randn(5)
    x[1] = 0.0
    with torch._dynamo.config.patch(capture_scalar_outputs=True,
                                    capture_dynamic_output_shape_ops=True):
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(count, backend=backend)(x), count(x))
        for fn in (scale, count, select, pad, two_sizes):  # all but scale: the output's size is data's
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            out = torch.compile(fn, backend=backend, fullgraph=True)(a)
            expected = fn(b)
            torch.testing.assert_close(out, expected)
            (out * torch.arange(out.shape[0])).sum().backward()
            (expected * torch.arange(expected.shape[0])).sum().backward()
            torch.testing.assert_close(a.grad, b.grad)


_RELAID_WITH_UNBACKED_SIZES = {  # ops whose inputs aotkit lays out as their real kernels read
    "hardtanh": lambda x: torch.nn.functional.hardtanh(x.t()),
    "pow of a scalar": lambda x: 2 ** x.t(),
    "mse_loss": lambda x: torch.nn.functional.mse_loss(x.t(), 0 * x.t()),
    "layer_norm": lambda x: torch.nn.functional.layer_norm(x.t(), (x.shape[0],)),
    "masked rows": lambda x: torch.nn.functional.hardtanh(x[x[:, 1] > 0].t()),
}


@pytest.mark.parametrize("fn", _RELAID_WITH_UNBACKED_SIZES.values(), ids=_RELAID_WITH_UNBACKED_SIZES)
def test_layouts_of_tensors_with_unbacked_sizes_are_not_guarded_on(
        fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Laying a transposed input out asked ``size > 1`` of an unbacked size: a guard on data."""
    from torch._dynamo.decorators import mark_unbacked

    x = torch.randn(6, 4)
    x[0, 1] = 1.0  # at least one masked row
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    mark_unbacked(a, 0)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = torch.compile(fn, backend="aotkit", fullgraph=True)(a)
    expected = fn(b)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("capture", [True, False])
@pytest.mark.parametrize("backend", ["aotkit", "aotkit_inductor"])
def test_a_factory_sized_by_an_input_item(backend: str, capture: bool) -> None:
    """Note [Items of Dynamo's inputs]: Dynamo's symbol for ``n.item()`` (``s33``) reached
    Inductor's forward, which cannot bind it ("name 's33' is not defined")."""

    def f(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return torch.ones(n.item(), 3) * x.sum()

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=capture):
        for size in (5, 7, 2):
            x = torch.randn(4, requires_grad=True)
            x_eager = x.detach().clone().requires_grad_()
            n = torch.tensor(size)
            out, expected = compiled(x, n), f(x_eager, n)
            torch.testing.assert_close(out, expected)
            (out * torch.arange(size).unsqueeze(1)).sum().backward()
            (expected * torch.arange(size).unsqueeze(1)).sum().backward()
            torch.testing.assert_close(x.grad, x_eager.grad)


def test_an_op_deciding_on_an_input_item_under_the_nop_backend() -> None:
    """Note [Items of Dynamo's inputs]: backend="aotkit" keeps Dynamo's symbol for ``n.item()``,
    on which ``repeat`` can decide while tracing (read from data, it cannot)."""

    def f(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return x.repeat(n.item()) * 2 + x.tile((n.item(),))

    compiled = torch.compile(f, backend="aotkit", fullgraph=True)
    for size in (2, 3):
        x = torch.randn(3, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, expected = compiled(x, torch.tensor(size)), f(x_eager, torch.tensor(size))
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)


@pytest.mark.parametrize("backend", ["aotkit", "aotkit_inductor"])
def test_backward_reads_symbols_only_inside_expressions(backend: str) -> None:
    """Note [Binding symbols in the backward]: cat's, pad's and split's backwards read sizes
    like s0 + s1; Inductor's backward needs each symbol as an input of its own."""

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.pad(torch.cat([x, y]), (0, 0, 1, 2)) * 2
        return sum(t.sum() * (i + 1) for i, t in enumerate(z.split(2)))

    compiled = torch.compile(f, backend=backend, dynamic=True)
    for n in (2, 3):
        a, b = torch.randn(n, 2, requires_grad=True), torch.randn(n + 1, 2, requires_grad=True)
        a_e, b_e = (t.detach().clone().requires_grad_() for t in (a, b))
        out, expected = compiled(a, b), f(a_e, b_e)
        torch.testing.assert_close(out, expected)
        out.backward()
        expected.backward()
        torch.testing.assert_close((a.grad, b.grad), (a_e.grad, b_e.grad))


@pytest.mark.parametrize("backend", ["aotkit", "aotkit_inductor"])
def test_float_argument_that_changes_between_calls(backend: str) -> None:
    """Dynamo passes a changing float as a tensor plus .item(); see Note [Float arguments from
    Dynamo]. One graph serves every later value, and values and grads are eager's."""

    def f(x: torch.Tensor, lr: float) -> torch.Tensor:
        return (x * lr).sin() * (lr * 2 + 1)

    compiled = torch.compile(f, backend=backend)
    for lr in (0.1, 0.2, 0.3, 0.4):
        x = torch.randn(4, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, expected = compiled(x, lr), f(x_eager, lr)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
    assert counters["aot"]["traces"] == 2  # the first value, then one graph for all others
    assert not aotkit.explain().of_kind("specialize")


def test_an_unused_float_argument_is_not_specialized() -> None:
    """An eval-mode dropout's p reaches the graph as a float read nothing uses; specializing it
    made Dynamo trace the frame twice (a GPU run found two traces where one was expected)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Linear(16, 4)).eval()
    compiled = torch.compile(model, backend="aotkit", dynamic=True)
    for batch in (3, 5, 7):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(x), model(x))
    assert counters["aot"]["traces"] == 1
    assert not aotkit.explain().of_kind("specialize")


@pytest.mark.parametrize("backend", ["aotkit", "aotkit_inductor"])
def test_compiled_optimizer_step_with_a_learning_rate_scheduler(backend: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    eager_model = nn.Linear(4, 4)
    eager_model.load_state_dict(model.state_dict())
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager_model))
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (opt, eager_opt)]
    step = torch.compile(opt.step, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        model(x).sum().backward()
        eager_model(x).sum().backward()
        step()
        eager_opt.step()
        for sched in scheds:
            sched.step()
        torch.testing.assert_close(model.weight, eager_model.weight)
    # SGD passes lr as alpha=, a Scalar a tensor cannot replace: Dynamo specializes it.
    [decision] = aotkit.explain().of_kind("specialize")
    assert "0-d tensor" in decision.why and "float (L['self'].param_groups[0]['lr'])" in \
        decision.why
    recompiles = [d.what for d in aotkit.explain().of_kind("recompile")]
    assert len(recompiles) == len(set(recompiles)) >= 1  # one each, though Dynamo restarts


@pytest.mark.parametrize("backend", ["aotkit", "aot_eager"])
def test_an_untraceable_backward_makes_dynamo_split_the_graph(backend: str) -> None:
    """Note [Graph breaks for Dynamo]: a bool-mask index_put's backward sizes a value from the
    mask's data; Dynamo runs that part eagerly, as for aot_eager."""
    torch.manual_seed(0)
    eager, compiled = _masked_inputs(), _masked_inputs()
    for a, b in zip(eager[:2], compiled[:2], strict=True):
        b.data = a.detach().clone()
    _masked_accumulate(*eager).backward()
    torch.compile(_masked_accumulate, backend=backend)(*compiled).backward()
    torch.testing.assert_close([t.grad for t in compiled[:2]], [t.grad for t in eager[:2]])
    if backend == "aotkit":
        breaks = aotkit.explain().of_kind("graph_break")  # Dynamo retries once before splitting
        assert breaks and all("aten.nonzero" in d.why and "IndexPutBackward0" in d.why
                              for d in breaks)


@pytest.mark.parametrize("backend", ["aotkit", "aotkit_inductor"])
def test_data_assignment_in_a_compiled_forward(backend: str) -> None:
    """Dynamo turns ``p.data = ...`` into ``set_`` on the parameter (MoCo's momentum encoder,
    weight clipping): refused before, now applied as eager applies it (Note [Storage changes
    of inputs])."""

    class Momentum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(4, 4)
            self.k = nn.Linear(4, 4).requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                for pq, pk in zip(self.q.parameters(), self.k.parameters(), strict=True):
                    pk.data = pk.data * 0.9 + pq.data * 0.1
            for p in self.q.parameters():
                p.data = p.data.clamp(-0.3, 0.3)
            return (self.q(x) * self.k(x)).sum()

    torch.manual_seed(0)
    eager = Momentum()
    model = Momentum()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(3, 4)
    for _ in range(2):
        compiled(x).backward()
        eager(x).backward()
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, msg=name)
    for a, b in zip(eager.q.parameters(), model.q.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def test_explain_forgets_dynamos_graph_breaks_at_reset() -> None:
    """Dynamo's counters are process-wide and outlive torch._dynamo.reset(): explain() listed
    graph breaks of functions compiled before aotkit.counters.reset()."""
    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x * 2

    torch._dynamo.reset()
    torch.compile(breaks, backend="aotkit")(torch.randn(3))
    assert aotkit.explain().dynamo
    aotkit.counters.reset()
    torch._dynamo.reset()
    assert not aotkit.explain().dynamo
    torch.compile(breaks, backend="aotkit")(torch.randn(3))
    assert aotkit.explain().dynamo  # new breaks are counted again


@pytest.mark.parametrize("backend", ["aotkit", pytest.param("aotkit_inductor", marks=pytest.mark.xfail(
    torch.__version__ < "2.13", strict=True, raises=pytest.fail.Exception,
    reason="torch 2.11's Inductor drops linalg's error check (its own backend='inductor' too)"))])
def test_linalg_errors_raise_in_the_forward_when_training(backend: str) -> None:
    """Note [Effect tokens do not cross to the backward]: the forward's error check went to the
    backward with the token chain (inv of a singular matrix returned NaNs; cholesky of a
    non-positive-definite matrix garbage), and aotkit_inductor failed on the saved token."""

    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve(a, torch.ones(3, 2)).sum() + torch.linalg.cholesky(a).sum()

    compiled = torch.compile(f, backend=backend)
    good = (torch.eye(3) * 2).requires_grad_()
    good_eager = good.detach().clone().requires_grad_()
    compiled(good).backward()
    f(good_eager).backward()
    torch.testing.assert_close(good.grad, good_eager.grad)
    for bad in (torch.zeros(3, 3), -torch.eye(3)):
        with pytest.raises(torch.linalg.LinAlgError):
            f(bad.clone().requires_grad_())
        with pytest.raises(torch.linalg.LinAlgError):
            compiled(bad.clone().requires_grad_())


def test_aotkit_inductor_dynamic_graphs_compile_again_after_a_reset() -> None:
    """Note [Inductor's graph cache and symbolic sizes]: the second compile found the first's
    backward in Inductor's FX graph cache and failed binding its guards (KeyError: 'x')."""
    conv = torch.nn.Conv1d(3, 8, 3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return conv(x).sum()

    for _ in range(2):
        compiled = torch.compile(f, backend="aotkit_inductor", dynamic=True)
        for n in (4, 5):
            x = torch.randn(n, 3, 10)
            conv.zero_grad()
            compiled(x).backward()
            got = conv.weight.grad.clone()
            conv.zero_grad()
            f(x).backward()
            torch.testing.assert_close(got, conv.weight.grad)
        torch._dynamo.reset()
    assert aotkit.explain().of_kind("fallback")[0].what == "inductor (symbolic sizes)"


def test_a_compiled_training_step_does_not_hand_aotkit_frames_to_dynamo() -> None:
    """Note [aotkit's code is not user code to Dynamo]: under aotkit_inductor the lazy backward
    compile ran inside loss.backward() with Dynamo's frame callback on, and Dynamo tried to
    compile ~1400 frames of aotkit and Inductor (backend='aotkit': 54) where PyTorch's inductor
    tries 13."""
    from torch._dynamo.utils import counters as dynamo_counters

    def frames(backend: str) -> int:
        torch._dynamo.reset()
        dynamo_counters.clear()
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        compiled = torch.compile(step, backend=backend)
        for _ in range(3):
            compiled(torch.randn(5, 4))
        return dynamo_counters["frames"]["total"]

    pytorch = frames("inductor")
    for backend in ("aotkit", "aotkit_inductor"):
        assert frames(backend) <= pytorch + 10, backend


def test_a_failed_trace_leaves_eager_working() -> None:
    """Note [Dispatch keys after a failure]: a trace failing inside inference_mode left the
    fake modes' dispatch keys on, and every later eager op hit an INTERNAL ASSERT."""
    code = (
        "import torch, aotkit\n"
        "def g(x):\n"
        "    y = x.sin()\n"
        "    with torch.inference_mode():\n"
        "        q = y.detach() + 1\n"
        "    return y * 2, q\n"
        "try:\n"
        "    torch.compile(g, backend='aotkit')(torch.randn(4, requires_grad=True))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
        "print((torch.ones(2) + 1).tolist())\n"
    )
    assert _run_python(code).stdout.split() == ["BackendCompilerFailed", "[2.0,", "2.0]"]


def test_a_value_dynamo_captured_from_data_names_the_option() -> None:
    def fn(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x.add(x * 2, alpha=s.item())  # an op wanting a Python number

    with torch._dynamo.config.patch(capture_scalar_outputs=True), pytest.raises(
            Exception, match=r"captured from tensor data(.|\n)*capture_scalar_outputs"
            r"(.|\n)*Fix: turn that option off"):
        torch.compile(fn, backend="aotkit")(torch.randn(6, requires_grad=True), torch.tensor(0.3))


def test_a_failed_trace_leaves_the_callers_exception_alone() -> None:
    """Note [Dispatch keys after a failure]: freeing the failed trace's frames went on into
    the exception the caller was handling when it called, and cleared its locals."""

    def inner() -> None:
        secret = 1  # noqa: F841 - read through the traceback
        raise ValueError

    compiled = torch.compile(lambda y: y.unfold(0, 2, 3).mul_(10), backend="aotkit")
    try:
        inner()
    except ValueError as handled:
        with pytest.raises(Exception, match="windows of unfold"):
            compiled(torch.arange(5.0))
        assert handled.__traceback__.tb_next.tb_frame.f_locals == {"secret": 1}


_PYTORCH_CA_WITH_AOTKIT = """
import torch, aotkit
from torch import nn
from torch._dynamo import compiled_autograd

torch.manual_seed(0)
eager = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
compiled = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
compiled.load_state_dict(eager.state_dict())
frames = []

def backend(gm, example_inputs):
    frames.append(gm)
    return aotkit.aot_module_simplified(gm, example_inputs, aotkit.compilers.nop)

for _ in range(3):  # the first backward finds no .grad, the next ones accumulate
    x = torch.randn(4, 5)
    eager(x).square().sum().backward()
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend=backend)):
        compiled(x).square().sum().backward()
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)
assert len(frames) == 2, len(frames)
w = torch.randn(5, 1, requires_grad=True)
with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aotkit")):
    (torch.ones(3, 5) @ w).sum().backward()
torch.testing.assert_close(w.grad, torch.full((5, 1), 3.0))
"""


def test_pytorchs_compiled_autograd_compiles_its_backward_with_the_aotkit_backend() -> None:
    """Note [Inputs Dynamo passes as a list]: Dynamo hands the backend the captured backward's
    inputs as one list of real tensors, which reached the fake mode (a raw AssertionError). In a
    fresh process: the engine binds its formulas to the first compiled autograd that captures,
    and other tests here run aotkit's."""
    _run_python(_PYTORCH_CA_WITH_AOTKIT)


def test_aot_module_simplified_takes_list_inputs_and_empties_those_it_steals() -> None:
    """Note [Inputs Dynamo passes as a list], on a graph made by hand."""
    import operator

    graph = torch.fx.Graph()
    items, w = graph.placeholder("items"), graph.placeholder("w")
    a, b = (graph.call_function(operator.getitem, (items, i)) for i in range(2))
    scaled = graph.call_function(torch.add, (graph.call_function(torch.mul, (a, w)), b))
    graph.output((graph.call_function(torch.sum, (scaled,)),))
    items.meta["steal_arg"] = True
    gm = torch.fx.GraphModule(nn.Module(), graph)
    x, y, w = torch.randn(3), torch.randn(3), torch.randn(3, requires_grad=True)
    compiled = aotkit.aot_module_simplified(gm, [[x, y], w], aotkit.compilers.nop)
    given = [x, y]
    (out,) = compiled(given, w)
    out.backward()
    assert given == [] and len(list(gm.graph.find_nodes(op="placeholder"))) == 2  # gm kept
    torch.testing.assert_close(out, (x * w + y).sum())
    torch.testing.assert_close(w.grad, x)
