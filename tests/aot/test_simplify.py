"""drop_noop_views: view chains that end where they started are read from their start."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import aotkit
from aotkit.aot.simplify import drop_noop_views

aten = torch.ops.aten


def ops(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_chains_that_undo_themselves_are_dropped() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x.t().t()                                   # t undone
        b = x.transpose(0, 1).transpose(1, 0)           # transpose undone, dims swapped
        c = x.view(3, 2).view(2, 3)                     # reshaped back
        d = x.unsqueeze(0).squeeze(0).expand(2, 3)      # expand to its own shape
        return a + b + c + d

    gm = make_fx(f)(torch.randn(2, 3))
    assert drop_noop_views(gm) == 9
    assert ops(gm) == [aten.add.Tensor] * 3
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(x), f(x))


def test_views_that_change_the_tensor_stay() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().t() + x.view(3, 2).t() + x[:, :2].sum()

    x = torch.randn(2, 3)
    gm = make_fx(f)(x)
    before = ops(gm)
    assert drop_noop_views(gm) == 0
    assert ops(gm) == before


def test_conjugate_view_is_not_its_base() -> None:
    def f(z: torch.Tensor) -> torch.Tensor:
        return z.conj().view(4) * 2 + z._neg_view().view(4)

    z = torch.randn(4, dtype=torch.complex64)
    gm = make_fx(f)(z)
    drop_noop_views(gm)
    torch.testing.assert_close(gm(z), f(z))


def test_kept_outputs_keep_their_view_nodes() -> None:
    gm = make_fx(lambda x: [x.t().t(), x.t().t() * 2])(torch.randn(2, 3))
    assert drop_noop_views(gm, keep_outputs=1) == 2  # the second chain and its first t
    assert ops(gm) == [aten.t.default, aten.t.default, aten.mul.Tensor]


def test_symbolic_sizes_are_compared_without_guards() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.t().t() + x.view(x.shape[0] * x.shape[1]).view(x.shape)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 5))
    assert drop_noop_views(gm) >= 3
    x = torch.randn(3, 7)
    torch.testing.assert_close(gm(x), f(x))


def test_linear_backward_reads_the_weight_itself() -> None:
    """Linear's backward took t(t(weight)): now it uses the weight (a free input), so the
    forward saves no transposed weight views and the backward runs no transpose pairs."""
    graphs: dict[str, fx.GraphModule] = {}

    def keep(kind: str) -> aotkit.aot.boxing.Compiler:
        def compiler(gm: fx.GraphModule, inputs: list[object]) -> object:
            graphs[kind] = gm
            return aotkit.compilers.nop(gm, inputs)
        return compiler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    compiled = aotkit.aot_module(model, keep("fw"), keep("bw"))
    x = torch.randn(5, 8)
    compiled(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(got, [p.grad for p in model.parameters()])

    # The second layer's weight (primals_3) is needed for the first layer's output grad.
    assert "primals_3" in {n.name for n in graphs["bw"].graph.find_nodes(op="placeholder")}
    for node in graphs["bw"].graph.nodes:
        if node.target == aten.t.default:
            assert node.args[0].target != aten.t.default, graphs["bw"].code


def test_output_that_is_an_input_view_chain_stays_a_view() -> None:
    f = aotkit.aot_function(lambda x, w: (x.t().t(), w.t().t() * 2), aotkit.compilers.nop)
    x, w = torch.randn(2, 3), torch.randn(2, 3, requires_grad=True)
    out, scaled = f(x, w)
    assert out._base is x
    out.add_(1)
    torch.testing.assert_close(x, out)
    scaled.sum().backward()
    torch.testing.assert_close(w.grad, torch.full_like(w, 2))
