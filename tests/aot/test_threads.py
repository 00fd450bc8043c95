"""Compiled functions called from several threads at once (Note [One compile at a time])."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx._symbolic_trace as symbolic_trace
from torch import nn

import aotkit
from aotkit import counters

THREADS = 8

# Fake tensor modes swap the CUDA device guard for a no-op on entry when CUDA is built but no
# device is present; on torch 2.11 that races with ops running in other threads and crashes the
# process (torch.compile(backend="aot_eager") from several threads crashes the same way).
pytestmark = pytest.mark.skipif(
    torch.version.cuda is not None and not torch.cuda.is_available(),
    reason="a CUDA build without a CUDA device: PyTorch's fake-tensor device-guard swap races "
           "with other threads' ops",
)


def run_together(work: Callable[[int], Any]) -> list[Any]:
    """``work(i)`` in THREADS threads released at the same moment; the results, or raises the
    first exception a thread hit."""
    barrier = threading.Barrier(THREADS)
    results: list[Any] = [None] * THREADS
    errors: list[BaseException] = []

    def target(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_first_calls_from_many_threads_trace_each_signature_once() -> None:
    counters.reset()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.cos() * x

    f = aotkit.aot_function(fn, aotkit.compilers.nop)
    xs = [torch.randn(4 + i % 3, requires_grad=True) for i in range(THREADS)]

    def work(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = f(xs[i])
        out.sum().backward()
        return out.detach(), xs[i].grad

    for i, (out, grad) in enumerate(run_together(work)):
        x = xs[i].detach().requires_grad_()
        expected = fn(x)
        expected.sum().backward()
        torch.testing.assert_close(out, expected.detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)
    assert f.num_entries == 3
    assert counters.counters["aot"]["traces"] == 3
    assert counters.counters["aot"]["bw_compiles"] == 3
    assert not symbolic_trace.is_fx_tracing()  # FX's global flag is not left set


def test_modules_and_functions_compiled_in_parallel_threads_match_eager() -> None:
    torch.manual_seed(0)
    modules = [nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 2)) for _ in range(THREADS)]
    x = torch.randn(4, 3)

    def work(i: int) -> list[torch.Tensor]:
        compiled = aotkit.aot_module(modules[i], aotkit.compilers.nop)
        compiled(x).pow(2).sum().backward()
        grads = [p.grad.clone() for p in modules[i].parameters()]
        modules[i].zero_grad()
        modules[i](x).pow(2).sum().backward()  # eager, on the same parameters
        return [*grads, *(p.grad for p in modules[i].parameters())]

    for grads in run_together(work):
        half = len(grads) // 2
        for compiled, eager in zip(grads[:half], grads[half:], strict=True):
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_a_compiled_module_runs_while_another_thread_traces_it() -> None:
    """A trace points the module's parameter slots at its tracing values: another thread's call
    read them ("Attempting to use FunctionalTensor on its own")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    compiled = aotkit.aot_module(model, aotkit.compilers.nop)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        compiled(x)
    done, errors = threading.Event(), []

    def serve() -> None:
        try:
            while not done.is_set():
                with torch.no_grad():
                    torch.testing.assert_close(compiled(x), expected)
        except Exception as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with aotkit.config.patch(recompile_limit=100), torch.no_grad():
            for n in range(3, 9):  # each batch size a new trace
                compiled(torch.randn(n, 8))
    finally:
        done.set()
        thread.join()
    assert not errors, errors[0]


def test_a_module_sharing_submodules_with_one_tracing_waits_for_the_trace() -> None:
    """A trace points every submodule's slots at tracing values: a compiled module over a
    shared submodule, called from another thread meanwhile, read them."""
    import time

    class Slow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.2)  # Python: runs while tracing only, which widens the window
            return x * 2

    shared = nn.Linear(4, 4)
    traced = aotkit.aot_module(nn.Sequential(shared, Slow()), aotkit.compilers.nop)
    other = aotkit.aot_module(nn.Sequential(shared), aotkit.compilers.nop)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = shared(x)
        other(x)
    errors = []

    def serve() -> None:
        try:
            for _ in range(40):
                with torch.no_grad():
                    torch.testing.assert_close(other(x), expected)
                time.sleep(0.01)
        except Exception as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    with torch.no_grad():
        traced(x)
    thread.join()
    assert not errors, errors[0]


def test_a_trace_in_another_thread_does_not_change_a_compiled_modules_layout():
    """While a trace records the modules it calls (a global forward pre-hook, Note [What a trace
    reads besides its inputs]), compiled modules in other threads took that hook for a user's
    and compiled again, until RecompileLimitError."""
    from aotkit.aot.reads import recording

    model = aotkit.aot_module(torch.nn.Linear(4, 4), aotkit.compilers.nop)
    x = torch.randn(2, 4)
    model(x)
    errors = []

    def serve():
        try:
            for _ in range(3):
                model(x)
        except Exception as exc:  # reported below
            errors.append(exc)

    with recording():
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()
    assert not errors and model.num_entries == 1
    assert not aotkit.explain().of_kind("recompile")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_child_forked_while_another_thread_traces_calls_and_compiles() -> None:
    """A fork copies the trace's locks held; the child's calls waited on them forever (a cached
    aot_module call too). Note in aotkit.locks."""
    model = aotkit.aot_module(nn.Linear(3, 3), aotkit.compilers.nop)
    x = torch.randn(2, 3)
    model(x)
    inside, leave = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def forward(self, y: torch.Tensor) -> torch.Tensor:
            inside.set()
            leave.wait(30)  # the trace holds its locks meanwhile
            return y.sin()

    tracer = threading.Thread(target=lambda: aotkit.aot_module(Waits(), aotkit.compilers.nop)(x))
    tracer.start()
    try:
        assert inside.wait(30)
        child = multiprocessing.get_context("fork").Process(target=_calls_in_child,
                                                            args=(model, x))
        child.start()
        child.join(60)
        hung = child.is_alive()
        if hung:
            child.kill()
    finally:
        leave.set()
        tracer.join()
    assert not hung and child.exitcode == 0


def _calls_in_child(model: nn.Module, x: torch.Tensor) -> None:
    assert torch.equal(model(x), model.orig_module(x))  # a cached call
    f = aotkit.aot_function(lambda a: a.cos(), aotkit.compilers.nop)  # a first compile
    assert torch.equal(f(x), x.cos())


def test_manual_seed_in_another_thread_during_a_trace_is_no_reseed_and_stays() -> None:
    """The function was refused for the other thread's torch.manual_seed, and that thread's seed
    was undone when the trace ended."""
    started, seeded = threading.Event(), threading.Event()

    def f(x: torch.Tensor) -> torch.Tensor:
        started.set()
        seeded.wait(30)  # the other thread seeds while this trace runs
        return x.sin()

    def seeder() -> None:
        started.wait(30)
        for _ in range(3):  # one decision for the thread, not one per reseed
            torch.manual_seed(1234)
        seeded.set()

    thread = threading.Thread(target=seeder, name="seeder")
    thread.start()
    x = torch.randn(3, requires_grad=True)
    counters.reset()
    out = aotkit.aot_function(f, aotkit.compilers.nop)(x)
    thread.join()
    assert torch.equal(out, x.sin())
    assert torch.initial_seed() == 1234
    reseed, = aotkit.explain().of_kind("reseed")  # not silent: a pool thread may be the function's
    assert "torch.manual_seed from thread seeder" in reseed.why
    drawn = torch.rand(2)
    torch.manual_seed(1234)
    assert torch.equal(drawn, torch.rand(2))


def test_a_reseed_on_a_thread_the_function_starts_is_still_refused() -> None:
    """Only threads running before the trace are another's: the function's own helper thread
    reseeding was taken for one, and its graphs drew other numbers than eager's."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        helper = threading.Thread(target=torch.manual_seed, args=(3,))
        helper.start()
        helper.join()
        return torch.nn.functional.dropout(x, 0.5)

    with pytest.raises(aotkit.errors.UnsupportedError, match="reseeds the global random"):
        aotkit.aot_function(fn, aotkit.compilers.nop)(torch.ones(16))
