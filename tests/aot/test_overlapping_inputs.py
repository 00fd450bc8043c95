"""Inputs whose memory overlaps while the function mutates one of them (Note [Overlapping
mutated inputs]): outputs, the caller's tensors, aliasing and gradients match eager's."""

from __future__ import annotations

import pytest
import torch
from tests.aot.eager_check import AccumulateInBackward, check_against_eager, rand

import aotkit
from aotkit import compilers
from aotkit.errors import RecompileLimitError, UnsupportedError


def halves(args, kwargs):
    (x,) = args
    return (x[:6], x[4:10]), {}


def three_ways(args, kwargs):
    x = args[0].view(3, 4)
    return (x[:, :2], x[1:], x[:, 3]), {}


def through_product(args, kwargs):  # views of a non-leaf: mutations are differentiable
    y = args[0] * 1
    return (y[:6], y[4:10]), {}


CASES = {
    "write one, read the other": (lambda a, b: (a.add_(1), b * 2)[1], halves),
    "write both": (lambda a, b: (a.add_(1), b.mul_(2), a + b)[2], halves),
    "return the written input": (lambda a, b: (a.mul_(2), a, b), halves),
    "return views of both": (lambda a, b: (b.mul_(2), a[1:], b[:1])[1:], halves),
    "three views, one written": (lambda a, b, c: (b.add_(10), a.sum() + c.sum())[1],
                                 three_ways),
    "same tensor twice": (lambda a, b: (a.add_(1), b * 2)[1], lambda args, _: (args * 2, {})),
}


@pytest.mark.parametrize("case", CASES)
def test_overlapping_inputs_match_eager(case):
    fn, prepare = CASES[case]
    check_against_eager(fn, torch.arange(12.0), prepare=prepare, backward=False)


@pytest.mark.parametrize("case", ["write one, read the other", "write both",
                                  "return the written input", "return views of both"])
def test_overlapping_inputs_gradients_match_eager(case):
    fn, _ = CASES[case]
    check_against_eager(fn, rand(12, grad=True), prepare=through_product)


def windows(args, kwargs):  # unfold: each window overlaps the next
    y = args[0] * 1
    return (y.unfold(0, 3, 1),), {}


@pytest.mark.parametrize("fn", [
    lambda w: (w[0].mul_(10), w.sum())[1],
    lambda w: (w[2].mul_(10), w[:, 1].add_(100), w * w)[2],
], ids=["one window", "a window and a column"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_written_input_overlapping_itself_matches_eager(fn, grad):
    """A write to one window of ``x.unfold(0, 3, 1)`` shows in the windows that overlap it. A
    graph with autograd computes on a copy of the input, which missed that: 57 for 102, and
    the caller's tensor lost the write."""
    aotkit.counters.reset()
    check_against_eager(fn, rand(6, grad=grad), prepare=windows, backward=grad)
    rebased = [d.why for d in aotkit.explain().of_kind("recompile")]
    # without autograd, the graph writes a copy laid out as the input, with its overlaps
    assert rebased == (["input 0 shares memory between its own elements and the function "
                        "writes that memory: traced again with each shared storage as one "
                        "input (Note [Overlapping mutated inputs])"] if grad else [])


@pytest.mark.parametrize("grad", [False, True])
def test_a_write_into_an_expanded_input_is_refused_before_anything_is_written(grad):
    """Eager writes the one element an expanded row is made of; a graph cannot, and PyTorch's
    copy back raised its raw overlap error after writing the inputs before it."""
    def fn(z, x):
        z.add_(1)
        x[0].add_(1)
        return x * 2

    z, base = torch.zeros(3), torch.zeros(4, requires_grad=grad)
    compiled = aotkit.aot_function(fn, compilers.nop)
    with pytest.raises(UnsupportedError, match=r"(?s)input 1 is an expanded tensor .* pass "
                       r"the tensor before expand\(\)"):
        compiled(z, (base * 1).expand(3, 4))
    assert torch.equal(z, torch.zeros(3))


@pytest.mark.parametrize("returned", ["the written input", "a view of it"])
def test_overlapping_inputs_requiring_grad_written_under_no_grad(returned):
    """The bases' views were made under no_grad, and autograd refused their grad_fn once
    written (a raw error); eager's were made in grad mode."""
    def fn(a, b):
        a.mul_(2)
        return a if returned == "the written input" else a[1:]

    check_against_eager(fn, rand(12, grad=True), prepare=through_product, backward=False,
                        context=torch.no_grad)


def test_overlapping_inputs_beside_a_separate_input():
    def fn(a, z, b):
        a.mul_(z)
        return b * z

    def prepare(args, kwargs):
        w, z = args
        y = w * 1
        return (y[:3], z, y[1:4]), {}

    check_against_eager(fn, rand(6, grad=True), rand(3, grad=True), prepare=prepare)


def test_overlapping_inputs_under_no_grad_and_in_the_graph():
    fn, prepare = CASES["write one, read the other"]
    check_against_eager(fn, rand(12, grad=True), prepare=prepare, backward=False,
                        context=torch.no_grad)
    check_against_eager(fn, torch.arange(12.0), prepare=prepare, backward=False,
                        context=torch.no_grad, aot_kwargs={"keep_inference_input_mutations": True})
    # Views of a leaf requiring grad: the trace read is_leaf of a view its own earlier pass
    # had written through the base, which PyTorch refuses ("A view was created in no_grad mode").
    check_against_eager(fn, rand(12, grad=True), prepare=prepare, backward=False,
                        context=torch.no_grad, aot_kwargs={"keep_inference_input_mutations": True})


def test_a_leaf_view_written_under_grad_raises_like_eager():
    fn, prepare = CASES["write one, read the other"]
    for run in (fn, aotkit.aot_function(fn, compilers.nop)):
        with pytest.raises(RuntimeError, match="view of a leaf Variable"):
            run(*prepare((rand(12, grad=True),), {})[0])


def test_one_entry_per_layout_and_each_recorded():
    aotkit.counters.reset()
    f = aotkit.aot_function(lambda a, b: (a.add_(1), b * 2)[1], compilers.nop)
    x = torch.zeros(8)
    f(x[:4], x[2:6])
    f(x[:4], x[2:6])
    f(x[1:5], x[3:7])  # another place in the storage
    torch.testing.assert_close(x, torch.tensor([2.0, 3, 3, 3, 1, 0, 0, 0]))
    reasons = aotkit.explain().of_kind("recompile")
    assert len(reasons) == 2
    assert "inputs 0, 1 share memory" in reasons[0].why
    with aotkit.config.patch(recompile_limit=2), pytest.raises(RecompileLimitError, match="share memory"):
        f(x[2:6], x[4:8])


def test_overlapping_inputs_through_torch_compile():
    def fn(a, b):
        a.mul_(3)
        return a, b * b

    results = []
    for run in (fn, torch.compile(fn, backend="aotkit")):
        w = torch.arange(6.0, requires_grad=True)
        y = w * 1
        a, b = y[:4], y[2:]
        out_a, out = run(a, b)
        out.sum().backward()
        assert out_a is a
        results.append((y.detach(), out.detach(), w.grad))
    for compiled, eager in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("make, why", [
    (lambda x: (x[:4], x[2:].view(torch.int32)), "different dtypes"),
    (lambda x: (x[:4], torch._neg_view(x)[2:6]), "negative view"),  # as_strided drops the bit
    (lambda x: (x.detach()[:4], x.detach()[2:].requires_grad_()), "not views of one common"),
])
def test_refused_layouts_say_why(make, why):
    f = aotkit.aot_function(lambda a, b: (a.add_(1), b * 2)[1], compilers.nop)
    with pytest.raises(UnsupportedError, match=why):
        f(*make(torch.zeros(6)))


def test_changing_the_shape_of_an_overlapping_input_is_refused():
    f = aotkit.aot_function(lambda a, b: (a.unsqueeze_(0), b * 2)[1], compilers.nop)
    x = torch.zeros(6)
    with pytest.raises(UnsupportedError, match="shape, strides or memory changed in place"):
        f(x[:4], x[2:])


def test_a_layout_change_under_torch_compile_runs_the_right_graph():
    """PyTorch's aot_eager runs the first layout's graph again here (b * 2 == [2, 2, 0, 0])."""

    def fn(a, b):
        a.add_(1)
        return b * 2

    compiled = torch.compile(fn, backend="aotkit")
    for split in (lambda x: (x[:4], x[2:6]), lambda x: (x[:4], x[4:8]), lambda x: (x[:4], x[2:6])):
        x, expected = torch.zeros(8), torch.zeros(8)
        torch.testing.assert_close(compiled(*split(x)), fn(*split(expected)))
        torch.testing.assert_close(x, expected)


def test_views_returned_under_no_grad_are_views_of_the_callers_tensor():
    """Under no_grad the base was a detached tensor, so an output's _base was not eager's."""

    def fn(a, b):
        a.mul_(2)
        return b[1:]

    x = torch.arange(8.0)
    out = aotkit.aot_function(fn, compilers.nop)(x[:4], x[2:6])
    assert out._base is x
    torch.testing.assert_close(out, torch.tensor([6.0, 4.0, 5.0]))


@pytest.mark.parametrize("first", ["same tensor", "two tensors"])
def test_one_tensor_passed_twice_then_two_tensors(first):
    """Note [One tensor passed twice]: traced for f(s, s), the graph read its second input for
    both (a * 2 + b gave b * 2 + b) and was run again for f(a, b) (PyTorch's aot_function is
    right here)."""

    def fn(a, b):
        return a * 2 + b

    compiled = aotkit.aot_function(fn, compilers.nop)
    s, a, b = rand(3, grad=True), rand(3, grad=True), rand(3, grad=True)
    calls = [(s, s), (a, b)] if first == "same tensor" else [(a, b), (s, s)]
    for args in calls * 2:
        out = compiled(*args)
        torch.testing.assert_close(out, fn(*args))
        out.sum().backward()
    torch.testing.assert_close(s.grad, torch.full((3,), 6.0))
    torch.testing.assert_close(a.grad, torch.full((3,), 4.0))
    torch.testing.assert_close(b.grad, torch.full((3,), 2.0))
    assert compiled.num_entries == 2
    [reason] = [d.why for d in aotkit.explain().of_kind("recompile") if d.what == compiled.name]
    expected = "args[0] is args[1] -> none" if first == "same tensor" else \
        "none -> args[0] is args[1]"
    assert reason.endswith(f"the tensors passed more than once changed: {expected}")


def test_a_module_called_with_one_tensor_twice_then_two():
    class Mix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, a, b):
            return self.lin(a) - b

    model = Mix()
    compiled = aotkit.aot_module(model, compilers.nop)
    s, a, b = rand(2, 3), rand(2, 3), rand(2, 3)
    for args in [(s, s), (a, b)]:
        torch.testing.assert_close(compiled(*args), model(*args))


def test_the_function_sees_one_tensor_passed_twice_as_one():
    """Note [One tensor passed twice]: each position was traced as its own tensor, so
    ``a is b`` was False (a silently other branch; PyTorch's aot_function too)."""

    def fn(a, b):
        return a * 2 if a is b else a * 3

    compiled = aotkit.aot_function(fn, compilers.nop)
    s, t = rand(3, grad=True), rand(3, grad=True)
    for args in [(s, s), (s, t), (s, s)]:
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)
    compiled(s, s).sum().backward()
    torch.testing.assert_close(s.grad, torch.full((3,), 2.0))


def test_self_attention_called_with_one_tensor_is_eagers_bit_for_bit():
    """MultiheadAttention projects ``q is k is v`` with one packed matmul (and ``k is v`` with
    two): traced as separate tensors, three matmuls rounded otherwise (outputs and gradients
    about 1e-7 off)."""
    torch.manual_seed(0)
    model = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    compiled = aotkit.aot_module(model, compilers.nop)
    q = torch.randn(2, 5, 16, requires_grad=True)
    k = q.detach().clone()
    for args in [(q, q, q), (q, k, k)]:
        expected, got = model(*args)[0], compiled(*args)[0]
        assert torch.equal(got, expected)
        wrt = [q, model.in_proj_weight]
        grads = torch.autograd.grad(got.sum(), wrt), torch.autograd.grad(expected.sum(), wrt)
        assert all(map(torch.equal, *grads))


class _WriteBothInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(a, b)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        a.add_(1)
        b.add_(10)
        return grad * 2, None, None


@pytest.mark.parametrize("split", ["same tensor", "overlapping views", "separate views"])
def test_inputs_the_backward_writes_that_share_memory(split):
    """Written by the backward (Note [Inputs the backward writes]) through two inputs of one
    memory, each write was made on its own copy and one was lost."""

    def fn(x, a, b):
        return _WriteBothInBackward.apply(x, a, b)

    views = {"same tensor": lambda s: (s, s), "overlapping views": lambda s: (s[:4], s[2:6]),
             "separate views": lambda s: (s[:3], s[3:])}[split]
    compiled = aotkit.aot_function(fn, compilers.nop)
    for _ in range(2):
        results = []
        for f in (fn, compiled):
            x, s = torch.ones(3, requires_grad=True), torch.zeros(6)
            a, b = views(s)
            f(x, a, b).sum().backward()
            results.append((s, x.grad))
        torch.testing.assert_close(results[1], results[0])


def test_an_input_the_backward_writes_beside_one_it_overlaps_that_requires_grad():
    """Only inputs the backward writes overlapping each other need one base: this one, beside a
    view of a leaf requiring grad with no common base, was refused."""

    def fn(x, stats):
        return AccumulateInBackward.apply(x, stats).sin()

    results = []
    for f in (fn, aotkit.aot_function(fn, compilers.nop)):
        w = torch.arange(4.0, requires_grad=True)
        f(w[:3], w.detach()[1:]).sum().backward()  # statistics kept in the leaf's memory
        results.append((w.detach().clone(), w.grad))
    torch.testing.assert_close(results[1], results[0])


class _WriteThenRead(torch.autograd.Function):
    """Its backward writes ``stats``, then reads ``scale``, which it saved."""

    @staticmethod
    def forward(ctx, x, stats, scale):
        ctx.save_for_backward(stats, scale)
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        stats, scale = ctx.saved_tensors
        stats.add_(1)
        return grad * scale, None, None


@pytest.mark.parametrize("split", ["same tensor", "two views"])
def test_an_input_the_backward_writes_and_one_it_reads_that_share_memory(split):
    """The backward's read sees its write in eager; without one base it read the old value
    (x.grad 0 instead of 1; PyTorch's aot_function the same)."""

    def fn(x, stats, scale):
        return _WriteThenRead.apply(x, stats, scale)

    results = []
    for f in (fn, aotkit.aot_function(fn, compilers.nop)):
        x, buf = torch.ones(3, requires_grad=True), torch.zeros(3)
        stats, scale = (buf, buf) if split == "same tensor" else (buf[:], buf.view(3))
        f(x, stats, scale).sum().backward()
        results.append((x.grad, buf))
    torch.testing.assert_close(results[1], results[0])
    torch.testing.assert_close(results[0][0], torch.ones(3))


def test_aot_module_simplified_given_one_example_tensor_twice():
    """Compiled once for its examples, it ran ``b * 2 + b`` for separate tensors."""

    def fn(a, b):
        return (a * 2 + b,)

    s, a, b = rand(3, grad=True), rand(3, grad=True), rand(3, grad=True)
    compiled = aotkit.aot_module_simplified(torch.fx.symbolic_trace(fn), [s, s], compilers.nop)
    for args in [(s, s), (a, b)]:
        (out,) = compiled(*args)
        torch.testing.assert_close(out, fn(*args)[0])
        out.sum().backward()
    torch.testing.assert_close((s.grad, a.grad, b.grad),
                               (torch.full((3,), 3.0), torch.full((3,), 2.0), torch.ones(3)))


@pytest.mark.parametrize("first", ["one tensor twice", "a part also an argument"])
def test_subclass_parts_that_are_one_tensor_then_separate(first):
    """Note [One tensor passed twice], within a subclass: traced for TwoTensor(s, s), the graph
    read one part for both and ran again for separate parts (PyTorch's aot_function too)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def fn(t, y):
        return t * 2 + y

    compiled = aotkit.aot_function(fn, compilers.nop)
    s, a, b, y = torch.tensor([1.0, 2.0]), torch.ones(2), torch.tensor([10.0, 20.0]), \
        torch.full((2,), 100.0)
    compiled(TwoTensor(s, s) if first == "one tensor twice" else TwoTensor(a, y), y)
    out, expected = compiled(TwoTensor(a, b), y), fn(TwoTensor(a, b), y)
    torch.testing.assert_close((out.a, out.b), (expected.a, expected.b))
    reason = aotkit.explain().of_kind("recompile")[-1].why
    assert reason.startswith("the tensors passed more than once changed: part ")


@pytest.mark.parametrize("partition", [aotkit.default_partition,
                                       aotkit.min_cut_rematerialization_partition])
def test_a_value_requiring_grad_written_into_inputs_that_do_not(partition):
    """Inputs sharing memory, none requiring grad, get a value requiring grad written in place
    (``base.add_(w[0])``): the base was viewed under no_grad, and writing it back raised
    autograd's raw 'view created in no_grad mode' error; eager gives base autograd history."""
    def f(a, base, w):
        base.add_(w[0])
        return (a * w[:4]).sum()

    def make():
        base = torch.arange(8.0)
        return base[1:5], base, torch.linspace(-1, 1, 6, requires_grad=True)

    a, base, w = make()
    expected = f(a, base, w)
    expected.backward()
    ca, cbase, cw = make()
    actual = aotkit.aot_function(f, compilers.nop, partition_fn=partition)(ca, cbase, cw)
    actual.backward()
    assert torch.equal(actual, expected) and torch.equal(cw.grad, w.grad)
    assert torch.equal(cbase, base) and cbase.requires_grad == base.requires_grad


@pytest.mark.parametrize("overlap", [None, slice(0, 40), slice(30, 34)])
def test_many_views_of_one_buffer_overlap_only_where_they_do(overlap):
    """Views of one flat buffer (a flat-parameter optimizer's) were compared pair by pair at
    every call (N^2: 115 ms a call for 400 views); the sweep by spans still finds the view
    overlapping a disjoint one far from it in argument order (all of them, or two)."""
    def step(*views):
        for v in views:
            v.mul_(2).add_(1)
        return views[0] * 1

    def arguments():
        flat = torch.arange(40.0)
        views = list(flat.split(2))
        return flat, views if overlap is None else [flat[overlap], *views]

    compiled = aotkit.aot_function(step, compilers.nop)
    (flat, views), (want_flat, want_views) = arguments(), arguments()
    torch.testing.assert_close(compiled(*views), step(*want_views))
    torch.testing.assert_close(flat, want_flat)


@pytest.mark.parametrize("with_row", [False, True])
def test_many_interleaved_columns_are_compared_at_once(with_row):
    """Columns of one matrix span intersecting bytes without sharing an element: each pair was
    compared element by element at every call (1.2 s a call for 200); a row, which shares one
    element with each, still makes them overlapping inputs."""
    def step(*views):
        for v in views:
            v.mul_(2).add_(1)
        return views[-1] * 1

    def arguments():
        m = torch.arange(4.0 * 30).view(4, 30)
        return m, [*m.unbind(1), *([m[2]] if with_row else [])]

    compiled = aotkit.aot_function(step, compilers.nop)
    (m, views), (want_m, want_views) = arguments(), arguments()
    torch.testing.assert_close(compiled(*views), step(*want_views))
    torch.testing.assert_close(m, want_m)


def test_a_view_in_another_dtype_beside_interleaved_columns_is_not_refused():
    """A written column, the column beside it and a half-precision view of the same buffer
    overlapping only the second: the pair of columns was taken to overlap by their spans (a
    refusal for views of different dtypes) where their elements are apart."""
    def f(a, b, c):
        a.mul_(2)
        return b + 1, c * 1

    def make():
        buf = torch.arange(20, dtype=torch.float32)
        pairs = buf[0:8].view(4, 2)
        return buf, [pairs[:, 0], pairs[:, 1], buf.view(torch.float16)[15:20]]

    (buf, args), (want_buf, want_args) = make(), make()
    torch.testing.assert_close(aotkit.aot_function(f, compilers.nop)(*args), f(*want_args))
    torch.testing.assert_close(buf, want_buf)
