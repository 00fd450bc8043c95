"""Ops whose fake kernels lay results out otherwise than their real CPU kernels, for inputs and
gradients that are dense but not contiguous (Note [Kernels whose fake strides differ]). Each
function views a flat leaf into a transposed or channels_last layout, applies the op and
returns its result flattened twice (as laid out, and permuted back): a graph that traced a
``view`` on the fake strides fails at run time in the forward, and the flat leaf's gradient
goes back through a ``view`` in the backward, which fails where the backward op's fake strides
were wrong."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from eager_check import check_against_eager

import aotkit

# (shape the flat leaf is viewed as, permutation giving the layout)
_TRANSPOSED = ((3, 8, 5), (0, 2, 1))  # (3, 5, 8) with strides (40, 1, 5)
_CHANNELS_LAST = ((2, 5, 6, 4), (0, 3, 1, 2))  # (2, 4, 5, 6), channels_last


def _other(x: torch.Tensor) -> torch.Tensor:
    """A contiguous second operand with x's values, for binary ops of mixed layouts."""
    return x.detach().abs().contiguous() + 0.5


_OPS: dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], Callable[..., torch.Tensor]]] = {
    "batch_norm_transposed": (_TRANSPOSED, lambda x: F.batch_norm(x, None, None, training=True)),
    "batch_norm_channels_last_contiguous_grad": (
        _CHANNELS_LAST, lambda x: F.batch_norm(x, None, None, training=True).contiguous()),
    "layer_norm_transposed": (_TRANSPOSED, lambda x: F.layer_norm(x, x.shape[-1:])),
    "log_softmax_channels_last": (_CHANNELS_LAST, lambda x: F.log_softmax(x, 1).contiguous()),
    "logsigmoid_channels_last": (_CHANNELS_LAST, F.logsigmoid),
    "pow_of_scalar_channels_last": (_CHANNELS_LAST, lambda x: torch.pow(2.0, x)),
    "mse_loss_channels_last": (_CHANNELS_LAST, lambda x: F.mse_loss(x, _other(x)) * x),
    "smooth_l1_loss_channels_last": (_CHANNELS_LAST, lambda x: F.smooth_l1_loss(x, _other(x)) * x),
    "huber_loss_channels_last": (_CHANNELS_LAST, lambda x: F.huber_loss(x, _other(x)) * x),
    "dropout_transposed": (_TRANSPOSED, lambda x: F.dropout(x * 1, 0.5, training=True)),
    "channel_shuffle_channels_last": (_CHANNELS_LAST, lambda x: F.channel_shuffle(x, 2)),
    "reflection_pad_channels_last": (_CHANNELS_LAST, lambda x: F.pad(x, (1, 1, 1, 1), "reflect")),
    "replication_pad_channels_last": (
        _CHANNELS_LAST, lambda x: F.pad(x, (1, 1, 1, 1), "replicate")),
    "max_unpool_channels_last": (
        _CHANNELS_LAST, lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2)),
    "xlogy_channels_last": (_CHANNELS_LAST, lambda x: torch.xlogy(x, _other(x))),
    "copysign_channels_last": (_CHANNELS_LAST, lambda x: torch.copysign(x, _other(x))),
    "floor_divide_channels_last": (
        _CHANNELS_LAST, lambda x: torch.div(x, _other(x), rounding_mode="floor") + x),
    "binary_cross_entropy_channels_last": (
        _CHANNELS_LAST,
        lambda x: F.binary_cross_entropy(x.sigmoid(), _other(x).sigmoid(), reduction="none")),
    "logaddexp_channels_last": (_CHANNELS_LAST, lambda x: torch.logaddexp(x, _other(x))),
    "normal_channels_last": (_CHANNELS_LAST, lambda x: torch.normal(x, _other(x))),
    "rrelu_eval_transposed": (_TRANSPOSED, lambda x: F.rrelu(x, training=False)),
    "logit_transposed": (_TRANSPOSED, lambda x: torch.logit(x, eps=1e-6)),
    "glu_channels_last": (_CHANNELS_LAST, lambda x: F.glu(x, 1)),
    # Inputs with gaps: the fake kernels keep their stride order, the real ones do not.
    "batch_norm_with_gaps": (_TRANSPOSED, lambda x: F.batch_norm(x[:, :, ::2], None, None,
                                                                 training=True)),
    "pow_of_scalar_with_gaps": (_TRANSPOSED, lambda x: torch.pow(2.0, x[:, ::2])),
    "logsigmoid_with_gaps": (_TRANSPOSED, lambda x: F.logsigmoid(x[:, ::2])),
}


@pytest.mark.parametrize("name", list(_OPS))
def test_ops_on_non_contiguous_layouts_match_eager(name: str) -> None:
    (shape, perm), op = _OPS[name]
    back = [perm.index(i) for i in range(len(perm))]

    def fn(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = op(flat.view(shape).permute(perm))
        return out.flatten(), out.permute(back).flatten()

    numel = 1
    for size in shape:
        numel *= size
    check_against_eager(fn, torch.randn(numel, requires_grad=True), seed=0)


@pytest.mark.parametrize("act", [F.elu, F.hardtanh, F.softplus, F.hardswish, F.hardsigmoid])
def test_activation_backward_of_a_transposed_gradient_matches_eager(act: Callable[..., torch.Tensor],
                                                                    ) -> None:
    """Activations' backwards lay their result out like the gradient in the real kernels, like
    the input in the fake ones; linear's backward then viewed it."""
    def fn(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (act(F.linear(x, w)).transpose(1, 2) * scale).contiguous()

    check_against_eager(fn, torch.randn(2, 3, 5, requires_grad=True),
                        torch.randn(4, 5, requires_grad=True), torch.randn(2, 4, 3))


def test_nll_loss_with_a_transposed_target_matches_eager() -> None:
    def fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses = F.nll_loss(logits.log_softmax(1), target.transpose(1, 2), reduction="none")
        return losses.transpose(1, 2).flatten()

    check_against_eager(fn, torch.randn(2, 3, 5, 6, requires_grad=True),
                        torch.randint(0, 3, (2, 6, 5)))


@pytest.mark.parametrize("op", [torch.logaddexp, lambda a, b: torch.div(a, b, rounding_mode="floor")],
                         ids=["logaddexp", "div_floor"])
def test_binary_ops_on_inputs_with_gaps_keep_eager_layout(op: Callable[..., torch.Tensor]) -> None:
    """Their fake and real kernels agree on inputs with gaps: made contiguous first, the result
    lost eager's stride order, and a view that eager allows failed."""
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return op(a[:, ::2], b[:, ::2]).transpose(0, 2).view(-1)

    check_against_eager(fn, torch.randn(4, 6, 8).transpose(0, 2),
                        torch.randn(4, 6, 8).transpose(0, 2) + 3, backward=False)


def test_batch_norm_updates_running_statistics_with_gaps_in_place() -> None:
    """Only batch norm's input is relaid: a copy of its running statistics (gapped here) took
    their in-place update, and the caller's stayed as they were."""
    def fn(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x.transpose(1, 2), mean, var, training=True)

    def prepare(args: tuple[torch.Tensor, ...], kwargs: dict[str, Any]) -> Any:
        x, mean, var = args
        return (x, mean[::2], var[::2]), kwargs

    check_against_eager(fn, torch.randn(3, 5, 4, requires_grad=True), torch.zeros(8),
                        torch.ones(8), prepare=prepare)


@pytest.mark.parametrize("layout", ["transposed", "gapped", "channels_last"])
@pytest.mark.parametrize("how", ["aot_module", "torch.compile"])
def test_batch_norm_of_a_non_contiguous_input_is_eagers_bit_for_bit(layout: str, how: str) -> None:
    """Batch norm's input made contiguous first reduced in another order than eager's kernel on
    it: outputs, gradients and running statistics a few ulps off (BatchNorm1d of a transposed
    (batch, time, channels) tensor; PyTorch's aot_function is exact). It now runs on the input
    as it is, its result laid out afterwards (LAID_OUT_AFTER)."""
    import copy

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.BatchNorm2d(4) if layout == "channels_last" \
        else torch.nn.BatchNorm1d(3)
    base, view = {
        "transposed": (torch.randn(4, 10, 3), lambda t: t.transpose(1, 2)),
        "gapped": (torch.randn(4, 3, 20), lambda t: t[:, :, ::2]),
        "channels_last": (torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last),
                          lambda t: t),
    }[layout]
    eager = copy.deepcopy(model)
    compiled = (aotkit.aot_module(model, aotkit.compilers.nop) if how == "aot_module"
                else torch.compile(model, backend="aotkit"))
    outs = []
    for run in (eager, compiled):
        leaf = (base * 3 + 2).requires_grad_()
        out = run(view(leaf))
        out.pow(2).sum().backward()
        outs.append((out, leaf.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for p, q in zip([*eager.parameters(), *eager.buffers()],
                    [*model.parameters(), *model.buffers()], strict=True):
        assert torch.equal(p, q) and (p.grad is None or torch.equal(p.grad, q.grad))


_ONE_LAYOUT = {
    "copysign": lambda a, b: torch.copysign(a, b),
    "logaddexp": lambda a, b: torch.logaddexp(a, b),
    "relu6": lambda a, b: F.relu6(a * b),
    "hardswish": lambda a, b: F.hardswish(a * b),
    "elu": lambda a, b: F.elu(a * b),
}


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
@pytest.mark.parametrize("name", list(_ONE_LAYOUT))
def test_ops_on_inputs_of_one_layout_keep_it_as_eager(name: str, layout: str) -> None:
    """Note [Kernels whose fake strides differ]: these ops' fake kernels differ only for mixed
    layouts, but inputs all channels_last (or transposed alike) were copied contiguous too: the
    result and the inputs' gradients came back contiguous (two copies per activation of a
    channels_last CNN), and a view eager allows on the result was refused."""
    op = _ONE_LAYOUT[name]

    def make() -> torch.Tensor:
        x = torch.randn(2, 4, 5, 6)
        x = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x.transpose(2, 3)
        return x.requires_grad_()

    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = op(a, b)
        flat = out.permute(0, 2, 3, 1) if layout == "channels_last" else out.transpose(2, 3)
        return out, flat.view(-1)  # a view only eager's layout allows

    torch.manual_seed(0)
    a, b, grad = make(), make(), make().detach()  # a gradient laid out as the output
    want = fn(a, b)
    want_grads = torch.autograd.grad(want[0], (a, b), grad, allow_unused=True)
    got = aotkit.aot_function(fn, aotkit.compilers.nop)(a, b)
    got_grads = torch.autograd.grad(got[0], (a, b), grad, allow_unused=True)
    assert got[0].stride() == want[0].stride() and torch.equal(got[1], want[1])
    for g, w in zip(got_grads, want_grads, strict=True):
        if w is not None:
            # A transposed gradient is made contiguous on entry (a tangent keeps its output's
            # memory format only: channels_last, or contiguous): strides (and the rounding of
            # vectorized loops) are eager's for channels_last only.
            exact = {"rtol": 0, "atol": 0} if layout == "channels_last" else {}
            torch.testing.assert_close(g, w, **exact)
            assert g.stride() == w.stride() or layout == "transposed"


@pytest.mark.parametrize("op", [
    lambda x: torch.copysign(x, torch.tensor(-1.0)),
    lambda x: torch.div(x, torch.tensor(2.0), rounding_mode="floor"),
    lambda x: torch.logaddexp(torch.tensor(0.0), x),
    lambda x: torch.ldexp(torch.tensor(2.0), x).permute(0, 2, 3, 1),
], ids=["copysign", "div_floor", "logaddexp", "ldexp"])
def test_a_zero_dim_operand_keeps_the_ops_relaid(op: Callable[..., torch.Tensor]) -> None:
    """With a 0-dim tensor operand the fake and real kernels disagree again: skipping the
    copy there made the graph's reshape a view that failed at run time."""
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    check_against_eager(lambda t: op(t).reshape(-1), x.requires_grad_())


def _pad_then_attend(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Pads a sequence to a multiple of 8, heads first (LongT5's blocked local attention)."""
    b, s, d = x.shape
    h = F.pad(x.view(b, s, 4, d // 4), (0, 0, 0, 0, 0, (-s) % 8)).permute(0, 2, 1, 3)
    return h @ w


def _trim_heads_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Pads (or trims, or neither) a heads-first tensor by a size-dependent amount."""
    s = x.shape[1]
    h = F.pad(x.view(x.shape[0], s, 4, -1).transpose(1, 2), (0, 0, 0, 4 - s % 8))
    return h.reshape(h.shape[0], -1) * w[0, 0]  # a view only in eager's layout


def _pad_channels_last(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A size-dependent pad of a channels_last image (the same in the backward)."""
    s = x.shape[1]
    img = x.view(x.shape[0], s, 4, -1).permute(0, 3, 1, 2)  # channels_last
    return F.pad(img, (0, 0, 0, 3 - s % 4)) * w[0, 0]


@pytest.mark.parametrize("fn", [_pad_then_attend, _trim_heads_first, _pad_channels_last],
                         ids=["pad_then_permute", "trim_transposed", "channels_last"])
def test_pads_of_symbolic_size_keep_eagers_layout(fn: Callable[..., torch.Tensor]) -> None:
    """Note [Kernels whose fake strides differ]: under dynamic shapes a pad's size is
    symbolic, and the fake kernel laid a trim (a pad's backward, or a pad that comes out <= 0)
    out in the input's suggested memory format, where eager keeps the input's stride order: the
    graph's reshape became a view that failed at run time ("view size is not compatible")."""
    torch._dynamo.reset()
    w = torch.randn(16, 16, requires_grad=True)
    compiled = torch.compile(fn, backend="aotkit", dynamic=True)
    for s in (10, 13, 16, 20):  # pads of 6, 3, 0, 4 (trims of 0, -5, 4, 0 in the second)
        x = torch.randn(2, s, 64, requires_grad=True)
        want = fn(x, w)
        got = compiled(x, w)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        grad = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad(got, (x, w), grad),
                                   torch.autograd.grad(want, (x, w), grad))


@pytest.mark.parametrize("dynamic", [False, True])
def test_one_hot_of_a_transposed_index_is_contiguous_as_eager(dynamic: bool) -> None:
    """Eager's one_hot scatters into zeros (contiguous); traced, it compares the indices with an
    arange in their own layout: a view eager allows on the result was refused."""
    def fn(i: torch.Tensor) -> torch.Tensor:
        return F.one_hot(i.t(), 5).view(-1)

    compiled = aotkit.aot_function(fn, aotkit.compilers.nop, dynamic=dynamic)
    for rows in (4, 6):
        i = torch.randint(0, 5, (rows, 3))
        torch.testing.assert_close(compiled(i), fn(i), rtol=0, atol=0)


def test_one_hot_under_vmap_keeps_eagers_layout() -> None:
    """Under vmap one_hot keeps the batch dimension where the input had it (no copy)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda r: F.one_hot(r, 5), in_dims=1)(x)

    x = torch.randint(0, 5, (6, 3))
    got, want = aotkit.aot_function(fn, aotkit.compilers.nop)(x), fn(x)
    assert got.stride() == want.stride() and torch.equal(got, want)


class _CountsCopies:
    """A compiler counting the copies the forward graph makes."""

    def __init__(self) -> None:
        self.copies = 0

    def __call__(self, gm: Any, inputs: Any) -> Any:
        self.copies += sum(n.target in (torch.ops.aten.clone.default, torch.ops.aten.copy.default)
                           for n in gm.graph.nodes)
        return gm


@pytest.mark.parametrize("pad", [
    pytest.param(lambda x: F.pad(x[:, :, 1:, 1:], (0, -(x.shape[3] - 1) % 4, 0, 0)),
                 id="crop_of_channels_last"),
    pytest.param(lambda x: F.pad(x.transpose(2, 3), (1, x.shape[2] % 3)), id="one_pad_positive"),
])
def test_pads_of_symbolic_size_copy_only_where_the_kernels_disagree(pad: Callable[..., Any]) -> None:
    """A channels_last crop keeps its suggested format's order when trimmed, and a pad known
    positive never trims: the fake and real kernels agree, and the input was copied for
    nothing (twice the time of a crop and pad)."""
    counts = _CountsCopies()
    compiled = aotkit.aot_function(pad, counts, dynamic=True)
    for size in (9, 10):
        x = torch.randn(2, 3, size, size).to(memory_format=torch.channels_last)
        got, want = compiled(x), pad(x)
        assert got.stride() == want.stride() and torch.equal(got, want)
    assert counts.copies == 0
