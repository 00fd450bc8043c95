"""Compiled graphs free their inputs after the last use, as eager's engine frees what a node
saved once its backward ran (Note [Freeing inputs as the graph goes])."""

import weakref

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import aotkit
from aotkit.aot.boxing import run_boxed

_refs: list[weakref.ref] = []
_seen: list[list[bool]] = []


def _record_dead() -> None:
    _seen.append([ref() is None for ref in _refs])


def _check_before_output(gm: fx.GraphModule) -> None:
    """Insert a call of ``_record_dead`` just before the graph's output."""
    with gm.graph.inserting_before(gm.graph.output_node()):
        gm.graph.call_function(_record_dead, ())
    gm.recompile()


def test_run_boxed_empties_the_list_and_drops_inputs_after_last_use() -> None:
    gm = make_fx(lambda a, b: a.sin() + b)(torch.ones(3), torch.ones(3))
    _check_before_output(gm)
    run = run_boxed(gm)
    args = [torch.randn(3), torch.randn(3)]
    expected = args[0].sin() + args[1]
    _refs[:] = [weakref.ref(a) for a in args]
    _seen.clear()
    out = run(args)
    assert args == []
    assert _seen == [[True, True]]  # both inputs were freed before the graph returned
    torch.testing.assert_close(out, expected)
    assert "args.clear()" not in gm.code  # the caller's graph is not changed


def test_backward_frees_saved_activations_before_it_returns() -> None:
    def bw_compiler(gm: fx.GraphModule, example_inputs: list) -> object:
        _check_before_output(gm)
        run = aotkit.compilers.nop(gm, example_inputs)

        def watched(args: list) -> object:
            _refs[:] = [weakref.ref(a) for a in args if isinstance(a, torch.Tensor)]
            return run(args)

        watched._boxed_call = True
        return watched

    x = torch.randn(8, requires_grad=True)
    f = aotkit.aot_function(lambda t: t.exp().sin().cos(), aotkit.compilers.nop, bw_compiler)
    _seen.clear()
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(x.exp().sin().cos().sum(), x)[0])
    [dead] = _seen
    # Saved: exp(x) and sin(exp(x)) (x itself is the caller's), and the incoming gradient.
    assert sum(dead) >= 2, dead


def test_retain_graph_keeps_saved_activations_for_the_second_backward() -> None:
    x = torch.randn(8, requires_grad=True)
    f = aotkit.aot_function(lambda t: t.exp().sin().cos(), aotkit.compilers.nop)
    out = f(x).sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * first)
