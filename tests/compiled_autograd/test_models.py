"""Whole models: gradients equal eager; one capture per autograd-graph structure."""

import copy
import functools

import pytest
import torch
from tests.compiled_autograd.helpers import check_module, counts

import aotkit


def test_mlp_grads_match_eager_and_capture_once() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    check_module(mlp, [torch.randn(5, 8)])
    assert counts() == (1, 1)


def test_second_backward_reuses_compiled_graph() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    # Step 1 accumulates into .grad=None, steps 2 and 3 into existing grads: two structures.
    check_module(mlp, [torch.randn(5, 8)], steps=3)
    assert counts() == (2, 2)
    decisions = aotkit.explain().of_kind("recapture")
    assert len(decisions) == 1 and "AccumulateGrad" in decisions[0].why


def test_conv_net_grads_match_eager() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3),
    )
    check_module(net, [torch.randn(2, 3, 8, 8)], steps=2)
    assert counts() == (2, 2)


def test_transformer_layer_grads_match_eager() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32,
                                             dropout=0.0, batch_first=True)
    check_module(layer, [torch.randn(2, 5, 16)], steps=2)
    assert counts() == (2, 2)


def test_captured_graph_is_logged_and_explained(caplog: pytest.LogCaptureFixture) -> None:
    w = torch.randn(3, requires_grad=True)
    with (caplog.at_level("INFO", logger="aotkit.compiled_autograd"),
          aotkit.compiled_autograd.enable(lambda gm: gm)):
        (w.sin() * 2).sum().backward()
    assert any("MulBackward0" in r.getMessage() for r in caplog.records)
    (decision,) = aotkit.explain().of_kind("capture")
    assert decision.what == "compiled_autograd"
    torch.testing.assert_close(w.grad, 2 * w.cos())


def test_backward_through_aot_function_graph() -> None:
    """aotkit's own compiled backward runs as one opaque call; aotkit's tracing (its own
    autograd.grad on fake tensors) must not be captured as a user backward."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    w_eager = w.detach().clone().requires_grad_()
    x = torch.randn(3, 4)
    f = aotkit.aot_function(lambda x, w: (x @ w).tanh(), aotkit.compilers.nop)
    with aotkit.compiled_autograd.enable(lambda gm: gm):
        for _ in range(2):
            f(x, w).pow(2).sum().backward()
    for _ in range(2):
        (x @ w_eager).tanh().pow(2).sum().backward()
    torch.testing.assert_close(w.grad, w_eager.grad)
    assert counts() == (2, 2)  # step 1, then accumulation into an existing .grad


def test_an_aot_output_without_gradient_under_a_torch_compile_compiler() -> None:
    """Logits and a loss from one compiled forward, only the loss backpropagated (every Hugging
    Face model's output): with compiler_fn = torch.compile, Dynamo traced aotkit's backward
    into a check it refused (InternalTorchDynamoError)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = lin(x)
        return logits, logits.logsumexp(-1).mean()

    want = torch.autograd.grad(f(x)[1], list(lin.parameters()))
    _, loss = torch.compile(f, backend="aotkit")(x)
    with aotkit.compiled_autograd.enable(functools.partial(torch.compile, backend="eager")):
        loss.backward()
    for w, p in zip(want, lin.parameters(), strict=True):
        assert torch.equal(p.grad, w)


def test_captured_graph_compiles_with_torch_compile_fullgraph() -> None:
    """Built-in formulas stay single graph nodes for Dynamo (allow_in_graph), so a compiler
    that is itself torch.compile sees one whole graph."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiler = functools.partial(torch.compile, backend="aotkit", fullgraph=True)
    check_module(mlp, [torch.randn(5, 8)], steps=2, compiler=compiler)
    assert counts() == (2, 2)


class _ParallelBranches(torch.nn.Module):
    """Three gradients for ``h`` (two branches and the residual), summed in ``order`` in the
    forward; a tied weight gets two more (as a language model's shared embedding does)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.pre, self.a, self.b = (torch.nn.Linear(16, 16) for _ in range(3))
        self.norm_a, self.norm_b = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        terms = {"a": self.a(self.norm_a(h)).sin(), "b": self.b(self.norm_b(h)).cos(), "h": h}
        first, second, third = (terms[k] for k in self.order)
        return (first + second + third).pow(2)


@pytest.mark.parametrize("lower", [True, False], ids=["lowered", "captured"])
@pytest.mark.parametrize("order", ["abh", "bah", "hba"])
def test_gradient_sums_add_in_eager_order_bit_for_bit(order: str, lower: bool) -> None:
    """See Note [Gradient sums in eager's order]: float sums depend on their grouping."""
    torch.manual_seed(0)
    model = _ParallelBranches(order)
    eager = copy.deepcopy(model)
    x = torch.randn(64, 16)
    eager(x).sum().backward()
    with aotkit.config.patch(compiled_autograd_lower=lower), \
            aotkit.compiled_autograd.enable(lambda gm: gm):
        model(x).sum().backward()
    for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad), name


@pytest.mark.parametrize("lower", [True, False], ids=["lowered", "captured"])
def test_a_gradient_sum_takes_the_layout_eager_gives_it(lower: bool) -> None:
    """Two gradients of ``h``, one row-major and one column-major, arrive in the order opposite
    to eager's: ``b + a`` has the values of ``a + b`` but ``b``'s layout, which a hook sees and
    the reduction into ``x.grad`` rounds differently for."""

    def step(strides: list[tuple[int, ...]]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        target = torch.randn(64, 48, generator=gen)
        x = torch.randn(48, generator=gen).requires_grad_()
        h = x.expand(64, 48) * 1.0
        h.register_hook(lambda grad: strides.append(grad.stride()))
        column_major = h.t().contiguous().t() * 1.1
        loss = torch.maximum(target, h).sum() + column_major.tanh().sum() \
            + column_major.exp().clamp(max=5).sum()
        loss.backward()
        return x.grad

    eager_strides: list[tuple[int, ...]] = []
    compiled_strides: list[tuple[int, ...]] = []
    expected = step(eager_strides)
    with aotkit.config.patch(compiled_autograd_lower=lower), \
            aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        actual = step(compiled_strides)
    assert compiled_strides == eager_strides == [(48, 1)]
    assert torch.equal(actual, expected)


def test_backward_of_a_forward_compiled_by_pytorchs_aot_autograd_names_the_aotkit_backend() -> None:
    lin = torch.nn.Linear(3, 3)
    out = torch.compile(lin, backend="aot_eager")(torch.randn(2, 3)).sum()
    with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop), pytest.raises(
            aotkit.errors.UnsupportedError, match=r"aot_eager(.|\n)*Fix: (.|\n)*aotkit_inductor"):
        out.backward()
    torch._dynamo.reset()


@pytest.mark.parametrize("lower", [False, True])
def test_sparse_gradient_sums_add_as_eagers_input_buffer(lower: bool) -> None:
    """Eager's input buffer adds a sparse sum so far to the new gradient (new + old: the new
    one's indices first); the graph added old + new, rounding the tied embedding's gradient
    differently."""
    def run() -> torch.Tensor:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 3, sparse=True)
        e1, e2 = emb(torch.tensor([1, 2, 1])), emb(torch.tensor([1]))
        (e1.pow(2).sum() + e2.sum()).backward()
        return emb.weight.grad

    expected = run()
    with aotkit.config.patch(compiled_autograd_lower=lower), \
            aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        actual = run()
    assert torch.equal(actual._indices(), expected._indices())
    assert torch.equal(actual._values(), expected._values())


def test_a_weight_used_hundreds_of_times_is_captured() -> None:
    """An unrolled recurrence reading one weight 600 times: ordering the gradient sums
    recursed once per use (a raw RecursionError)."""
    torch.manual_seed(0)
    w0, x = torch.randn(4, 4) * 0.1, torch.randn(4)

    def run() -> torch.Tensor:
        w = w0.clone().requires_grad_()
        h = x
        for _ in range(600):
            h = torch.tanh(w @ h)
        h.sum().backward()
        return w.grad

    expected = run()
    with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        torch.testing.assert_close(run(), expected)
