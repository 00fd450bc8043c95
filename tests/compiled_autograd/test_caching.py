"""When the engine replays, when we capture again, and what is refused."""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from tests.compiled_autograd.helpers import counts, nop
from torch import fx

import aotkit
from aotkit.compiled_autograd import passes, runtime


def _step(w: torch.Tensor, batch: int) -> None:
    (torch.randn(batch, 3) * w).sin().sum().backward()


def test_batch_size_change_recaptures_with_reason_then_is_dynamic() -> None:
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    with aotkit.compiled_autograd.enable(nop, dynamic=False):
        _step(w, 2)
        _step(w, 4)
        _step(w, 7)
    # Batch 4 is captured again; the engine replays that capture for batch 7, which its lowered
    # graph was not traced for: lowered again (Note [Lowering captured backwards]).
    assert counts() == (2, 3)
    (recapture,) = aotkit.explain().of_kind("recapture")
    assert "(4, 3)" in recapture.why
    # The dynamic replay (batch 7 was not captured) still computes eager's gradients.
    eager = torch.randn(3, requires_grad=True)
    compiled = eager.detach().clone().requires_grad_()
    compiled.grad, eager.grad = torch.zeros(3), torch.zeros(3)
    torch.manual_seed(0)
    _step(eager, 5)
    torch.manual_seed(0)
    with aotkit.compiled_autograd.enable(nop, dynamic=False):
        _step(compiled, 5)
    torch.testing.assert_close(compiled.grad, eager.grad)


def test_dynamic_true_replays_new_batch_sizes() -> None:
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    with aotkit.compiled_autograd.enable(nop):
        for batch in (2, 4, 9):
            _step(w, batch)
    # One capture; batches 4 and 9 run the captured graph, compiled once besides the graph
    # lowered for batch 2.
    assert counts() == (1, 2)


class Counting:
    def __init__(self) -> None:
        self.compiles = 0
        self.calls = 0

    def __call__(self, gm: fx.GraphModule) -> Any:
        self.compiles += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm(*args)

        return run


def test_switching_compiler_never_runs_the_old_graph() -> None:
    first, second = Counting(), Counting()
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    with aotkit.compiled_autograd.enable(first):
        _step(w, 2)
        _step(w, 2)
    assert (first.compiles, first.calls) == (1, 2)
    with aotkit.compiled_autograd.enable(second):
        _step(w, 2)
        _step(w, 2)
    assert (first.compiles, first.calls) == (1, 2)
    assert (second.compiles, second.calls) == (1, 2)
    assert aotkit.explain().of_kind("cache_clear")


def test_nested_enable_raises() -> None:
    with (aotkit.compiled_autograd.enable(nop),
          pytest.raises(aotkit.errors.UnsupportedError, match="nested"),
          aotkit.compiled_autograd.enable(nop)):
        pass


@pytest.mark.parametrize(("compiler", "dynamic", "message"), [
    (aotkit.compilers.nop, True, r"calls its compiler as compiler\(gm\), but 'nop' takes"),
    ("nop", True, "takes a compiler function, got 'nop'"),
    (nop, "False", "takes True or False, got 'False'"),
    (nop, None, "takes True or False, got None"),
])
def test_enable_refuses_what_would_fail_at_the_first_backward(compiler: Any, dynamic: Any,
                                                              message: str) -> None:
    """AOT autograd's nop failed at the first backward with a missing argument and a hint to try
    lambda gm: gm; ``dynamic="False"`` meant dynamic, None static."""
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(aotkit.errors.ArgumentError, match=message), \
            aotkit.compiled_autograd.enable(compiler, dynamic=dynamic):
        (w * 2).sum().backward()
    assert w.grad is None


def test_enable_in_a_second_thread_raises_and_its_backward_is_captured_exactly() -> None:
    """The engine's compiler slot is one per process (Note [Backwards in other threads]): a
    block in another thread is refused (not called nested), and that thread's backward is
    captured by the active block, with eager's gradient and decisions saying so."""
    first_counts, w = Counting(), torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)  # both steps accumulate into an existing .grad: one structure
    v = torch.randn(3, requires_grad=True)
    seen: dict[str, Any] = {}

    def other_thread() -> None:
        try:
            with aotkit.compiled_autograd.enable(nop):
                pass
        except aotkit.errors.UnsupportedError as exc:
            seen["error"] = str(exc)
        (v * v).sum().backward()

    with aotkit.compiled_autograd.enable(first_counts):
        _step(w, 2)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        _step(w, 2)
    assert "another thread" in seen["error"] and "nested" not in seen["error"]
    assert torch.equal(v.grad, 2 * v.detach())
    assert (first_counts.compiles, first_counts.calls) == (2, 3)
    assert aotkit.counters.counters["compiled_autograd"]["captures"] == 2
    [thread] = aotkit.explain().of_kind("thread")
    assert "Thread" in thread.why and "MainThread" in thread.why
    assert "another thread" in aotkit.explain().of_kind("hook_order")[0].why


def test_enable_left_open_by_an_ended_thread_says_so() -> None:
    """The refusal named the dead thread as active and told the caller to serialize blocks."""
    left_open = aotkit.compiled_autograd.enable(nop)
    thread = threading.Thread(target=left_open.__enter__, name="opener")
    thread.start()
    thread.join()
    try:
        with pytest.raises(aotkit.errors.UnsupportedError,
                           match=r"entered in thread opener, which ended without leaving it"), \
                aotkit.compiled_autograd.enable(nop):
            pass
    finally:
        left_open.__exit__(None, None, None)
    with aotkit.compiled_autograd.enable(nop):  # the fix the message names ended it
        pass


def test_a_block_ending_while_another_thread_traces_leaves_no_compiler_behind() -> None:
    """Note [The engine's compiler slot]: the trace's off window used to put the ended block's
    compiler back, and every later backward replayed into a dead session."""
    in_trace = threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        in_trace.set()
        time.sleep(0.3)  # the block below ends meanwhile
        return x.sin()

    def trace_in_another_thread() -> None:
        x = torch.randn(3, requires_grad=True)
        aotkit.aot_function(slow, aotkit.compilers.nop)(x).sum().backward()

    thread = threading.Thread(target=trace_in_another_thread)
    w = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        (w * 2).sum().backward()
        thread.start()
        in_trace.wait()
    thread.join()
    v = torch.randn(3, requires_grad=True)
    (v * v).sum().backward()  # raised "replayed ... outside enable()" before the fix
    assert torch.equal(v.grad, 2 * v.detach())
    assert counts() == (1, 1)


def test_create_graph_raises_typed_error_with_workaround() -> None:
    w = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        with pytest.raises(aotkit.errors.UnsupportedError, match="disable"):
            (w**3).sum().backward(create_graph=True)
        with aotkit.compiled_autograd.disable():
            (w**3).sum().backward(create_graph=True)
    torch.testing.assert_close(w.grad, 3 * w.detach() ** 2)


def test_torch_func_transforms_inside_enable_run_eagerly_with_a_decision() -> None:
    """torch.func opens PyTorch's own off window around its autograd.grad(create_graph=True);
    enable() set its compiler again there and failed the call as a double backward."""
    x = torch.randn(4)
    w = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        grad = torch.func.grad(lambda t: t.sin().sum())(x)
        _, vjp_fn = torch.func.vjp(torch.sin, x)
        (cotangent,) = vjp_fn(torch.ones(4))
        jacobian = torch.func.jacrev(torch.sin)(x)
        (w * w).sum().backward()  # the compiler is installed again afterwards
    torch.testing.assert_close(grad, x.cos())
    torch.testing.assert_close(cotangent, x.cos())
    torch.testing.assert_close(jacobian, torch.diag(x.cos()))
    torch.testing.assert_close(w.grad, 2 * w.detach())
    assert counts() == (1, 1)
    [fallback] = aotkit.explain().of_kind("fallback")  # one decision, three eager backwards
    assert "torch.func" in fallback.why
    assert aotkit.counters.counters["fallback"][fallback.what] == 3


def test_enable_inside_pytorchs_off_window_captures_without_a_fallback_decision() -> None:
    """enable() sets its compiler, so its backwards are captured: no "runs eagerly" decision."""
    w = torch.ones(3, requires_grad=True)
    with torch._dynamo.compiled_autograd._disable(), aotkit.compiled_autograd.enable(nop):
        for _ in range(2):
            w.grad = None
            (w * w).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
    assert counts() == (1, 1)
    assert aotkit.explain().of_kind("fallback") == []


def test_batched_grad_outputs_raise_typed_error_with_workaround() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    with aotkit.compiled_autograd.enable(nop):
        with pytest.raises(aotkit.errors.UnsupportedError, match=r"batched by vmap.*disable"):
            torch.autograd.grad(y, x, torch.eye(3), retain_graph=True, is_grads_batched=True)
        with aotkit.compiled_autograd.disable():
            (jacobian,) = torch.autograd.grad(y, x, torch.eye(3), is_grads_batched=True)
    torch.testing.assert_close(jacobian, torch.diag(x.detach().exp()))


def test_a_size_that_changes_the_structure_names_the_size_and_the_fix() -> None:
    """``w.split(k, 1)``: PyTorch's engine keys the captured backward on the structure only and
    passes ``k`` as a dynamic size, so a new ``k`` replays a graph made for other chunks."""
    def grad(k: int) -> torch.Tensor:
        w = torch.arange(20.0).reshape(4, 5).requires_grad_()
        w.split(k, 1)[1].pow(2).sum().backward()
        return w.grad

    expected = grad(2)
    with aotkit.compiled_autograd.enable(nop):
        grad(1)
        with pytest.raises(aotkit.errors.UnsupportedError,
                           match=r"(?s)not captured for \(sizes\[\d+\] is 2, captured for 1\).*"
                                 r"dynamic=False") as info:
            grad(2)
    assert isinstance(info.value.__cause__, RuntimeError)
    with aotkit.compiled_autograd.enable(nop, dynamic=False):  # the fix the error names
        torch.testing.assert_close(grad(1), 2 * torch.arange(20.0).reshape(4, 5) * (
            torch.arange(5) == 1))
        torch.testing.assert_close(grad(2), expected)
        # A third value: the engine made the size dynamic at the second, so it replays again.
        with pytest.raises(aotkit.errors.UnsupportedError,
                           match=r"(?s)sizes\[\d+\] is 3.*first new value only.*disable\(\).*"
                                 r"reset\(\) outside") as info:
            grad(3)
    (cleared,) = aotkit.explain().of_kind("cache_clear")
    assert "dynamic changed from True to False" in cleared.why
    aotkit.compiled_autograd.reset()  # the other fix the error names
    with aotkit.compiled_autograd.enable(nop, dynamic=False):
        torch.testing.assert_close(grad(3), 2 * torch.arange(20.0).reshape(4, 5) * (
            torch.arange(5) >= 3))


def test_a_compiler_failing_on_a_dynamic_replay_is_named_with_its_fix() -> None:
    """A sparse weight tied to a dense one: the summed gradient's size is dynamic at the second
    length, and Dynamo, tracing the captured graph again, fails on it. The message blamed a
    formula's structure and named enable(dynamic=False), which covers one new length only."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 6, sparse=True)
    proj = torch.nn.Linear(6, 10, bias=False)
    proj.weight = emb.weight

    def grad(n: int, compiler: Callable[[fx.GraphModule], Any] | None) -> torch.Tensor:
        emb.weight.grad = None
        with aotkit.compiled_autograd.enable(compiler) if compiler else nullcontext():
            proj(torch.tanh(emb(torch.arange(n)))).square().sum().backward()
        return emb.weight.grad.to_dense()

    def dynamic(gm: fx.GraphModule) -> Any:
        return torch.compile(gm, backend="aotkit")

    expected = {n: grad(n, None) for n in (3, 2, 4)}
    torch.testing.assert_close(grad(3, dynamic), expected[3])
    try:  # torch 2.13's Dynamo fails on the sparse sum with a dynamic size
        torch.testing.assert_close(grad(2, dynamic), expected[2])
    except aotkit.errors.UnsupportedError as refused:
        assert "compiler_fn's torch.compile raised it" in str(refused)
        assert "dynamic=False), which compiles again for each new value" in str(refused)
    aotkit.compiled_autograd.reset()
    for n in (3, 2, 4):  # the fix it names
        torch.testing.assert_close(
            grad(n, lambda gm: torch.compile(gm, backend="aotkit", dynamic=False)), expected[n])


def test_failed_captures_do_not_poison_the_engine_cache() -> None:
    """A capture that fails leaves the engine an entry without a graph; the same backward must
    fail the same way again (not with an engine assert), and work once it can."""
    w = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        for _ in range(3):
            with pytest.raises(aotkit.errors.UnsupportedError, match="create_graph"):
                (w**3).sum().backward(create_graph=True)
        w.grad = None
        (w**3).sum().backward()
    torch.testing.assert_close(w.grad, 3 * w.detach() ** 2)

    calls = []

    def fails_once(gm: fx.GraphModule) -> Any:
        calls.append(gm)
        if len(calls) == 1:
            raise ValueError("boom")
        return gm

    x = torch.randn(4, requires_grad=True)
    for _ in range(2):  # within the block, then in a new block (which replays the graph)
        with aotkit.compiled_autograd.enable(fails_once):
            failing = len(calls) == 0
            with pytest.raises(aotkit.errors.CompilerError, match="boom") if failing else nullcontext():
                (x.sin() * 2).sum().backward()
            x.grad = None
            (x.sin() * 2).sum().backward()
            torch.testing.assert_close(x.grad, 2 * x.detach().cos())
            x.grad = None
    assert counts() == (2, 3)  # failed captures are not counted as captures
    captured = [d.why for d in aotkit.explain() if d.kind in ("capture", "recapture")]
    assert len(captured) == 2 and "an entry without a graph" in captured[-1]  # after "boom"


def test_a_backward_reaching_part_of_a_captured_graph_is_captured_with_a_reason() -> None:
    """Note [Cache entries without a graph]: asking for an input the graph never reaches stops
    the engine at an entry an earlier backward passed; it tripped an engine assert, for good."""
    a, unused = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        for _ in range(2):
            assert torch.autograd.grad((a * 2).sum(), [a])[0].tolist() == [2.0] * 3
            assert torch.autograd.grad((a * 2).sum(), [unused], allow_unused=True) == (None,)
    assert counts() == (2, 2)
    (why,) = [d.why for d in aotkit.explain().of_kind("recapture")]
    assert "an earlier backward passed them on its way to more nodes" in why


@pytest.mark.parametrize("result", ["tuple", "numbers", "none", "too few"])
def test_what_a_compiled_callable_returns_is_checked(result: str) -> None:
    """The engine's C++ reads a list of tensors: a tuple tripped an internal assert, numbers
    crashed the process. A tuple is taken as a list; the rest is a CompilerError."""

    def compiler(gm: fx.GraphModule) -> Any:
        def run(*args: Any) -> Any:
            grads = gm(*args)
            return {"tuple": tuple(grads), "numbers": [1] * len(grads), "none": None,
                    "too few": grads[1:]}[result]
        return run

    x = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(compiler):
        if result == "tuple":
            (grad,) = torch.autograd.grad((x.sin() * 2).sum(), [x])
            torch.testing.assert_close(grad, 2 * x.detach().cos())
        else:
            with pytest.raises(aotkit.errors.CompilerError, match="list of 1 gradient"):
                torch.autograd.grad((x.sin() * 2).sum(), [x])


def test_an_identical_compiler_function_per_block_reuses_the_graph() -> None:
    """``enable(lambda gm: gm)`` inside a training loop makes a new but identical function each
    step: the captured graph is kept. A function closing over another object is a new compiler."""
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    for _ in range(3):
        with aotkit.compiled_autograd.enable(lambda gm: gm):
            _step(w, 2)
    assert counts() == (1, 1)
    assert not aotkit.explain().of_kind("cache_clear")
    for scale in (1.0, 2.0):
        with aotkit.compiled_autograd.enable(lambda gm, s=scale: gm):
            _step(w, 2)
    assert counts() == (3, 3)
    assert len(aotkit.explain().of_kind("cache_clear")) == 2


def test_a_compiler_closing_over_an_equal_number_or_string_reuses_the_graph() -> None:
    """Note [Compiler identity]: a factory called each step with a value computed anew (an equal
    float or string, a new object every time) made a new compiler and a recapture per step."""

    def make_compiler(scale: float, name: str) -> Callable[[fx.GraphModule], fx.GraphModule]:
        def compiler(gm: fx.GraphModule) -> fx.GraphModule:
            gm.meta["made_with"] = (scale, name)
            return gm
        return compiler

    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    for step in range(3):
        with aotkit.compiled_autograd.enable(make_compiler(float("0.5"), "name-" + str(step)[:0])):
            _step(w, 2)
    assert counts() == (1, 1)
    with aotkit.compiled_autograd.enable(make_compiler(0.25, "name-")):
        _step(w, 2)
    assert counts() == (2, 2)


def test_a_compiler_made_with_equal_options_reuses_the_graph() -> None:
    """Note [Compiler identity]: ``partial(compile, options={...})`` made each step (a new dict)
    recaptured and recompiled every step; a changed option is a new compiler."""
    import functools

    def compiler(gm: fx.GraphModule, options: dict[str, Any]) -> fx.GraphModule:
        return gm

    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    for _ in range(3):
        levels = ["a", 1]
        with aotkit.compiled_autograd.enable(
                functools.partial(compiler, options={"mode": "default", "levels": levels})):
            _step(w, 2)
    for _ in range(3):
        levels = ["a", 1]
        with aotkit.compiled_autograd.enable(lambda gm: compiler(gm, {"levels": levels})):  # noqa: B023
            _step(w, 2)
    assert counts() == (2, 2)  # one per kind of compiler
    aotkit.counters.reset()
    for mode in ("default", "default", "max"):
        with aotkit.compiled_autograd.enable(functools.partial(compiler, options={"mode": mode})):
            _step(w, 2)
    assert counts() == (2, 2)
    aotkit.counters.reset()
    stats = {"compiles": 0}  # one object, changed by every compile: still one compiler

    def counting(gm: fx.GraphModule) -> fx.GraphModule:
        stats["compiles"] += 1
        return gm

    for _ in range(3):
        with aotkit.compiled_autograd.enable(counting):
            _step(w, 2)
    assert counts() == (1, 1) and stats == {"compiles": 1}
    for _ in range(3):  # a recorder made anew, equal to the last one before it recorded
        graphs: list[fx.GraphModule] = []
        with aotkit.compiled_autograd.enable(lambda gm: graphs.append(gm) or gm):  # noqa: B023
            _step(w, 2)
        assert len(graphs) == 1  # the new recorder compiled the graph it runs


def _graph_with_inputs(vals: list[torch.Tensor], user: Any) -> fx.Graph:
    graph = fx.Graph()
    inputs = graph.placeholder("inputs")
    for i, val in enumerate(vals):
        read = graph.call_function(operator.getitem, (inputs, i))
        read.meta["val"] = val
        graph.call_function(user, (read,))
    return graph


def test_cuda_scalar_move_decision_with_fake_cuda_tensors() -> None:
    with aotkit.compat.FakeTensorMode():
        activation = torch.empty(4, device="cuda")
        scalar = torch.empty((), device="cpu")
    aten = _graph_with_inputs([activation, scalar], torch.ops.aten.mul.Tensor)
    assert passes.cpu_scalars_to_move(aten).moved == [1]
    hook = _graph_with_inputs([activation, scalar], runtime.call_hook)
    plan = passes.cpu_scalars_to_move(hook)
    assert plan.moved == [] and "not an ATen op" in plan.kept[1]
    cpu_only = _graph_with_inputs([scalar], torch.ops.aten.mul.Tensor)
    assert passes.cpu_scalars_to_move(cpu_only).kept == {0: "the graph has no CUDA inputs"}


def test_cuda_scalar_option_on_cpu_graph_records_decision() -> None:
    w = torch.randn(3, requires_grad=True)
    with (aotkit.config.patch(compiled_autograd_cudagraphs=True),
          aotkit.compiled_autograd.enable(nop)):
        (w / 2.0).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 0.5))
    # No CUDA input here, so nothing moves; any CPU scalar kept is explained.
    for decision in aotkit.explain().of_kind("cuda_scalars"):
        assert "moved inputs []" in decision.why


COMPILERS = {"first": Counting(), "second": Counting()}
_chosen = "first"


def test_a_compiler_reading_a_changed_global_is_a_new_compiler() -> None:
    """``enable(lambda gm: COMPILERS[_chosen](gm))`` in a loop over a module-level name: the
    lambdas share code and globals, but the global they read changed."""
    global _chosen
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    for name in ("first", "second", "second"):
        _chosen = name
        with aotkit.compiled_autograd.enable(lambda gm: COMPILERS[_chosen](gm)):  # noqa: B023
            _step(w, 2)
    assert [(c.compiles, c.calls) for c in COMPILERS.values()] == [(1, 1), (1, 2)]
    assert len(aotkit.explain().of_kind("cache_clear")) == 1


def test_recapture_reason_is_only_this_captures() -> None:
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    with aotkit.compiled_autograd.enable(nop, dynamic=False):
        for batch in (2, 2, 4):
            _step(w, batch)
    (capture,) = aotkit.explain().of_kind("capture")
    (recapture,) = aotkit.explain().of_kind("recapture")
    assert "new autograd node" in capture.why
    assert "new autograd node" not in recapture.why and "(4, 3)" in recapture.why


def test_enable_inside_disable_runs_eagerly_and_says_so() -> None:
    w = torch.ones(3, requires_grad=True)
    with aotkit.compiled_autograd.disable(), aotkit.compiled_autograd.enable(nop):
        (w * 2).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
    assert counts() == (0, 0)
    [decision] = aotkit.explain().of_kind("fallback")
    assert "enable() inside disable()" in decision.why


class _Backend:
    def compile(self, gm: fx.GraphModule) -> fx.GraphModule:
        return gm


def test_a_bound_method_or_partial_compiler_per_block_reuses_the_graph() -> None:
    """Note [Compiler identity]: ``backend.compile`` is a new bound method at every access, and
    every block dropped the engine's cache (5 steps, 5 captures)."""
    import functools

    backend = _Backend()
    w = _captured_once_each([lambda: backend.compile,
                             lambda: functools.partial(lambda gm, tag: gm, tag="x")])
    with aotkit.compiled_autograd.enable(_Backend().compile):  # another object: a new compiler
        _step(w, 2)
    assert counts() == (2, 2)


def test_a_dynamo_reset_inside_enable_keeps_capturing() -> None:
    """Note [Compiler cleared inside enable()]: torch._dynamo.reset() emptied the engine's
    compiler slot and the rest of the block ran eagerly, unrecorded."""
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    with aotkit.compiled_autograd.enable(nop):
        _step(w, 2)
        torch._dynamo.reset()
        _step(w, 2)
        _step(w, 2)
    assert counts() == (2, 2)  # once before the reset, once after
    (decision,) = aotkit.explain().of_kind("cache_clear")
    assert "torch._dynamo.reset()" in decision.why


def test_a_dynamo_reset_inside_an_off_window_keeps_the_engines_reasons() -> None:
    """The off window put the compiler back but not the engine's verbose logger, which
    torch._dynamo.reset() empties too: every later capture said "no reason reported"."""
    w = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        _step(w, 2)
        with aotkit.compiled_autograd.disable():
            torch._dynamo.reset()
        _step(w, 2)
    reasons = [d.why for d in aotkit.explain() if d.kind in ("capture", "recapture")]
    assert len(reasons) == 2 and not any("no reason reported" in why for why in reasons), reasons


def test_each_recording_compiler_compiles_its_own_graph() -> None:
    """Note [Compiler identity]: a compiler appending to a list made for its block. A block whose
    compiler compiled nothing used to stand for all later ones, so blocks after the second
    replayed the second's graph (their lists stayed empty)."""
    w = torch.randn(3, requires_grad=True)
    recorded: list[list[fx.GraphModule]] = []
    for step in range(5):
        graphs: list[fx.GraphModule] = []
        recorded.append(graphs)
        with aotkit.compiled_autograd.enable(lambda gm, graphs=graphs: graphs.append(gm) or gm):
            if step > 0:
                w.grad = None
                (w * 2).sin().sum().backward()
    assert [len(graphs) for graphs in recorded] == [0, 1, 1, 1, 1]
    torch.testing.assert_close(w.grad, 2 * (w * 2).cos().detach())


def test_a_compiler_may_run_a_backward() -> None:
    """A compiler checking what it made with a backward of its own: that backward runs eagerly,
    where the engine refused it as one compiled backward inside another."""
    checked: list[torch.Tensor] = []

    def compiler(gm: fx.GraphModule) -> Callable[..., Any]:
        v = torch.ones(2, requires_grad=True)
        with torch.enable_grad():
            (v * 3).sum().backward()
        checked.append(v.grad)
        return gm

    w = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(compiler):
        for _ in range(3):
            w.grad = None
            (w * 2).sin().sum().backward()
    torch.testing.assert_close(w.grad, 2 * (w * 2).cos().detach())
    assert counts() == (1, 1) and [g.tolist() for g in checked] == [[3.0, 3.0]]


def test_equal_partials_holding_functions_made_every_step_are_one_compiler() -> None:
    """Note [Compiler identity]: a container holding anything but plain values was compared by
    identity, so ``partial(compile_with, passes=(pass_a,))`` made each step cleared the engine's
    cache and captured the backward again at every step."""
    import functools

    def pass_a(gm: fx.GraphModule) -> fx.GraphModule:
        return gm

    def compile_with(gm: fx.GraphModule, passes: Any = (), opts: Any = None) -> fx.GraphModule:
        for p in passes:
            gm = p(gm)
        return gm

    _captured_once_each([lambda: functools.partial(compile_with, passes=(pass_a,)),
                         lambda: functools.partial(compile_with, passes=[pass_a]),
                         lambda: functools.partial(compile_with, opts={"p": pass_a})])


def _captured_once_each(makes: list[Callable[[], Any]]) -> torch.Tensor:
    """Three blocks for each compiler maker, a compiler made anew per block: one capture and
    compile each, no cache clear. Returns the leaf the backwards accumulated into."""
    w = torch.randn(3, requires_grad=True)
    for make in makes:
        aotkit.compiled_autograd.reset()
        aotkit.counters.reset()
        w.grad = torch.zeros(3)
        for _ in range(3):
            with aotkit.compiled_autograd.enable(make()):
                _step(w, 2)
        assert counts() == (1, 1)
        assert not aotkit.explain().of_kind("cache_clear")
    return w


def test_a_new_compiler_equal_to_a_changed_one_compiles_again() -> None:
    """Note [Compiler identity]: an options dict changed between blocks is the same compiler
    (its graph stays), but a new compiler made with the new options must not run the graph
    compiled with the old ones (a chain of 'same as the last block' had linked them)."""
    ran: list[int] = []

    def make(opts: dict[str, int]) -> Callable[..., Any]:
        def compiler(gm: fx.GraphModule) -> Callable[..., Any]:
            v = opts["v"]
            return lambda *args: ran.append(v) or gm(*args)
        return compiler

    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    opts = {"v": 1}
    same = make(opts)
    for compiler in (same, same, make({"v": 2})):
        with aotkit.compiled_autograd.enable(compiler):
            _step(w, 2)
        opts["v"] = 2
    assert ran == [1, 1, 2]


FACTOR = 1.0


def _factor_compiler(gm: fx.GraphModule) -> Callable[..., Any]:
    def unrelated() -> Callable[[], int]:
        FACTOR = 0  # a local cell of the nested function, not the global
        return lambda: FACTOR
    factor = FACTOR
    return lambda inputs, *rest: gm([inputs[0] * factor, *inputs[1:]], *rest)  # the loss's grad


def test_a_compiler_counting_its_compiles_in_a_closure_is_one_compiler() -> None:
    """Note [Compiler identity]: a variable the compiler assigns (``nonlocal``) is its state:
    its value made every block another compiler."""
    def make() -> Callable[..., Any]:
        count = 0

        def compiler(gm: fx.GraphModule) -> fx.GraphModule:
            nonlocal count
            count += 1
            return gm
        return compiler

    compiler = make()
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    for _ in range(3):
        with aotkit.compiled_autograd.enable(compiler):
            _step(w, 2)
    assert counts() == (1, 1) and not aotkit.explain().of_kind("cache_clear")


graph = 0  # a global named as an attribute the compiler reads (gm.graph)


def _attribute_reader(gm: fx.GraphModule) -> fx.GraphModule:
    assert gm.graph is not None
    return gm


def test_attribute_names_a_compiler_reads_are_not_globals() -> None:
    """``gm.graph`` named the global ``graph`` in the compiler's identity: changed between
    blocks (a training script's ``for data, target in loader``), the engine's cache was
    cleared and the backward compiled again at every block."""
    global graph
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    for graph in range(3):  # noqa: B007
        with aotkit.compiled_autograd.enable(_attribute_reader):
            _step(w, 2)
    graph = 0
    assert counts() == (1, 1)


def test_a_global_the_compiler_reads_is_compared_though_a_nested_function_assigns_its_name(
) -> None:
    global FACTOR
    w = torch.ones(3, requires_grad=True)
    grads = []
    try:
        for FACTOR in (1.0, 5.0):  # noqa: B007
            w.grad = None
            with aotkit.compiled_autograd.enable(_factor_compiler):
                (w * 2).sum().backward()
            grads.append(w.grad.clone())
    finally:
        FACTOR = 1.0
    assert counts()[1] == 2
    torch.testing.assert_close(grads[1], grads[0] * 5)


def test_a_dynamo_reset_between_blocks_is_no_reset_inside_one() -> None:
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    with aotkit.compiled_autograd.enable(nop):
        _step(w, 2)
    torch._dynamo.reset()
    with aotkit.compiled_autograd.enable(nop):
        _step(w, 2)
    assert counts() == (2, 2)
    assert not aotkit.explain().of_kind("cache_clear")
    assert [d.kind for d in aotkit.explain().of_kind("capture")] == ["capture", "capture"]


def test_a_compiler_resetting_dynamo_is_recorded() -> None:
    """A reset inside an off window (here the compiler's own) left the compiler slot as it
    was: the next backward captured again with no decision saying why."""
    def compiler(gm: fx.GraphModule) -> fx.GraphModule:
        torch._dynamo.reset()
        return gm

    w = torch.randn(3, requires_grad=True)
    w.grad = torch.zeros(3)
    with aotkit.compiled_autograd.enable(compiler):
        for _ in range(3):
            _step(w, 2)
    assert counts() == (3, 3)  # each compile empties the engine's cache
    clears = aotkit.explain().of_kind("cache_clear")
    assert len(clears) == 2 and all("torch._dynamo.reset()" in d.why for d in clears)


@pytest.mark.parametrize("reset", [False, True])
def test_a_dynamo_compile_after_pytorchs_off_window_in_the_block(reset: bool) -> None:
    """An evaluation step compiled by aot_eager opens PyTorch's off window; on leaving it set
    PyTorch's compiled-autograd flag, and the training step Dynamo traced next took that flag's
    path: a raw TypeError about BackwardState. Also after torch._dynamo.reset() in the block,
    which drops Dynamo's callbacks."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def train(x: torch.Tensor) -> torch.Tensor:
        y = lin(x).sin()
        y.register_hook(lambda g: g * 3)
        return y.cos().sum()

    evaluate = torch.compile(lambda x: lin(x).relu().sum(), backend="aot_eager")
    x = torch.randn(2, 4)
    train(x).backward()
    expected = lin.weight.grad.clone()
    compiled_train = torch.compile(train, backend="aotkit")
    with aotkit.compiled_autograd.enable(nop):
        if reset:
            torch._dynamo.reset()
            lin.zero_grad()
            train(x).backward()
        for _ in range(2):
            with torch.no_grad():
                evaluate(x)
            lin.zero_grad()
            compiled_train(x).backward()
            torch.testing.assert_close(lin.weight.grad, expected)


@pytest.mark.parametrize("where", ["hook", "block"])
def test_pytorchs_compiled_autograd_flag_stays_off(where: str) -> None:
    """torch.func's transforms open PyTorch's off window, which on leaving sets PyTorch's
    compiled_autograd_enabled when the engine's slot held a compiler (ours): a torch.compile of
    a function with a hook on an intermediate then failed, even after the block."""
    import torch._dynamo.compiled_autograd as pytorch_ca

    def square_grad(g: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda u: (u ** 2).sum())(g)

    w = torch.linspace(-1, 1, 4).requires_grad_()
    with aotkit.compiled_autograd.enable(nop):
        for _ in range(3):
            w.grad = None
            y = w.exp()
            if where == "hook":
                y.register_hook(lambda g: g + square_grad(g))
            y.sum().backward()
            if where == "block":
                square_grad(torch.ones(2))
    assert not pytorch_ca.compiled_autograd_enabled  # set back when the block ends

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2
        y.register_hook(lambda g: g * 3)
        return y.cos().sum()

    x = torch.linspace(-1, 1, 4).requires_grad_()
    f(x).backward()
    expected, x.grad = x.grad, None
    torch.compile(f, backend="aotkit")(x).backward()
    torch.testing.assert_close(x.grad, expected)


def _expanded_grad_backward() -> list[str]:
    """An earlier backward of other sizes, then one whose leaf's .grad is expanded: eager's own
    in-place accumulation into it fails."""
    w0 = torch.randn(2, 5, requires_grad=True)
    w0.grad = torch.zeros(2, 5)
    (w0 * 2).sum().backward()
    w = torch.randn(4, 3, requires_grad=True)
    w.grad = torch.zeros(3).expand(4, 3)
    with pytest.raises(RuntimeError) as info:
        (w * 2).sum().backward()
    return [type(info.value).__name__, str(info.value)]


def test_an_error_eager_raises_too_is_not_blamed_on_a_replay_for_new_sizes() -> None:
    """A replay for other sizes failing for the user's own reason (an expanded .grad) was
    reported as a formula whose structure depends on a size, with an unrelated fix."""
    want = _expanded_grad_backward()
    with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        assert _expanded_grad_backward() == want


def test_anomaly_nan_checks_are_refused_on_a_replay_too() -> None:
    """The engine's cache key leaves anomaly mode out: a backward captured before it was
    turned on replayed without eager's NaN check, leaving NaN in .grad silently."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        (w * torch.ones(3)).sqrt().sum().backward()  # captured outside anomaly mode
        w.grad = None
        with torch.autograd.detect_anomaly(), \
                pytest.raises(aotkit.errors.UnsupportedError, match="check_nan=False"):
            (w * torch.tensor([0.0, -1.0, 1.0])).sqrt().sum().backward()
    assert w.grad is None


def test_a_refused_replay_says_the_forward_must_run_again() -> None:
    """The engine released the graph before the refusal: retrying the same backward outside
    anomaly mode raised "a second time", which the message did not say."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with aotkit.compiled_autograd.enable(nop):
        (w * 2).sum().backward()
        w.grad = None
        loss = (w * 2).sum()
        with torch.autograd.detect_anomaly(), \
                pytest.raises(aotkit.errors.UnsupportedError, match="run the forward again"):
            loss.backward()
