"""Tracing against eager PyTorch: tensors a function closes over, sizes the backward needs under
dynamic shapes, data-dependent ops, generators and activation checkpointing. Each test runs the
program eagerly too; where aotkit refuses a program, the test shows what eager does with it and
that aotkit changed nothing before refusing."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from eager_check import RecordingCompiler, check_against_eager, rand
from torch import nn
from torch.utils.checkpoint import checkpoint

import aotkit
from aotkit import compilers
from aotkit.errors import TraceError, UnsupportedError

# --- closed-over tensors (Note [Closed-over tensors]) ----------------------------------------


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda buf: buf.add_(1), id="add_"),
    pytest.param(lambda buf: buf[1].mul_(2).add_(1), id="view"),
    pytest.param(lambda buf: torch.add(buf, 1, out=buf), id="out="),
    pytest.param(lambda buf: buf.t_(), id="metadata"),
])
@pytest.mark.parametrize("grad", [True, False])
def test_mutated_closed_over_tensor_is_refused_before_tracing_touches_it(mutate, grad):
    def make():
        buf = torch.zeros(2, 3)

        def fn(x):
            mutate(buf)
            return x * 2

        return buf, fn

    buf, fn = make()
    fn(rand(3, grad=grad))
    assert not torch.equal(buf, torch.zeros(2, 3)), "eager mutates the tensor"

    buf, fn = make()
    compiled = aotkit.aot_function(fn, compilers.nop)
    with pytest.raises(UnsupportedError) as info:
        compiled(rand(3, grad=grad))
    assert torch.equal(buf, torch.zeros(2, 3)) and buf.stride() == (3, 1), "tracing mutated it"
    message = str(info.value)
    assert "shape (2, 3)" in message and "torch.float32" in message
    assert "mutates in place" in message and "test_trace_parity.py" in message  # the user line
    assert "Fix: pass it as an argument; for the parameters of a module" in message


def test_mutated_closed_over_tensor_matches_eager_when_passed_as_argument():
    def fn(x, buf):
        buf.add_(1)
        return x * buf

    check_against_eager(fn, rand(3, grad=True), torch.zeros(3))


def test_closed_over_tensor_that_requires_grad_is_refused():
    c = torch.ones(3, requires_grad=True)

    def fn(x):
        return x * c

    fn(torch.ones(3, requires_grad=True)).sum().backward()
    assert torch.equal(c.grad, torch.ones(3))  # eager gives c a gradient
    c.grad = None
    for x in (rand(3, grad=True), rand(3)):  # the joint graph, and the inference graph
        with pytest.raises(UnsupportedError) as info:
            aotkit.aot_function(fn, compilers.nop)(x)
        message = str(info.value)
        assert "requires grad" in message and "shape (3,)" in message and "x * c" in message
        assert "Fix: pass it as an argument" in message
    assert c.grad is None


def test_closed_over_tensor_that_requires_grad_matches_eager_where_no_grad_flows():
    c = torch.randn(3, requires_grad=True)

    def detached(x):
        return x * c.detach()

    def under_no_grad(x):
        with torch.no_grad():
            scale = c * 2
        return x * scale

    check_against_eager(detached, rand(3, grad=True))
    check_against_eager(under_no_grad, rand(3, grad=True))
    for gradless in (lambda x: x * (c > 0), lambda x: x + torch.zeros_like(c),
                     lambda x: x * c.argmax()):
        check_against_eager(gradless, rand(3, grad=True))
    with torch.no_grad():
        check_against_eager(lambda x: x * c, rand(3), backward=False)
    assert c.grad is None


@pytest.mark.parametrize("dynamic", [False, True])
def test_writes_to_values_computed_from_closed_over_tensors_match_eager(dynamic):
    """Note [Values computed from constants]: a result of ops on closed-over tensors alone
    written with a value the function computed raised PyTorch's internal assert ("mutating a
    non-functional tensor with a functional tensor")."""
    table = torch.arange(6.0)

    def add(x):
        c = table * 2
        c.add_(x)
        return c

    def through_view(x):
        c = table[1:4] * 2
        c[:2] = x[:2] * 3
        return c.sum() * x

    def running_stats(x):  # what InstanceNorm's update does with a repeated running mean
        mean = table[:4].repeat(2)
        torch.ops.aten.native_batch_norm(x, None, None, mean, mean.clone(), True, 0.1, 1e-5)
        return mean * x.sum()

    check_against_eager(add, rand(6, grad=True), aot_kwargs={"dynamic": dynamic})
    check_against_eager(through_view, rand(3, grad=True), aot_kwargs={"dynamic": dynamic})
    check_against_eager(running_stats, rand(2, 8, 3, grad=True), aot_kwargs={"dynamic": dynamic})
    assert torch.equal(table, torch.arange(6.0))


def test_an_instance_norm_tracking_stats_under_aot_function_is_refused_clearly():
    model = nn.InstanceNorm1d(4, track_running_stats=True)
    with pytest.raises(UnsupportedError, match="mutates in place") as info:
        aotkit.aot_function(model, compilers.nop)(torch.randn(2, 4, 8))
    assert "aot_module" in str(info.value)
    assert torch.equal(model.running_mean, torch.zeros(4))


def test_read_only_closed_over_tensor_is_a_live_constant():
    mask = torch.tensor([1.0, 0.0, 1.0])
    table = torch.arange(6.0).reshape(2, 3)

    def fn(x):
        return x * mask + table[1], (mask > 0).sum()

    check_against_eager(fn, rand(3, grad=True))
    compiled = aotkit.aot_function(fn, compilers.nop)
    x = rand(3, grad=True)
    compiled(x)
    mask.fill_(3.0)  # the graph keeps a reference, as eager reads the tensor at each call
    out, count = compiled(x)
    expected, expected_count = fn(x)
    torch.testing.assert_close(out, expected)
    assert count == expected_count


def test_aot_module_reads_plain_tensor_attributes_and_updates_buffers():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)
            self.scale = torch.tensor(0.5)  # a plain attribute: neither parameter nor buffer

        def forward(self, x):
            return self.bn(self.lin(x)) * self.scale

    torch.manual_seed(0)
    eager, ours = Net(), Net()
    ours.load_state_dict(eager.state_dict())
    compiled = aotkit.aot_module(ours, compilers.nop)
    for _ in range(2):
        x = rand(5, 4)
        eager(x).sum().backward()
        compiled(x).sum().backward()
    for (name, a), b in zip(eager.state_dict().items(), ours.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, msg=lambda m, n=name: f"{n}: {m}")
    for a, b in zip(eager.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def test_torch_compile_lifts_closed_over_tensors_to_inputs():
    def run(compile_fn):
        c = torch.ones(3, requires_grad=True)
        buf = torch.zeros(3)

        def fn(x):
            buf.add_(1)
            return x * c

        torch._dynamo.reset()
        fn = compile_fn(fn)
        x = torch.arange(3.0, requires_grad=True)
        fn(x).sum().backward()
        fn(x)
        return buf, c.grad, x.grad

    eager = run(lambda f: f)
    ours = run(lambda f: torch.compile(f, backend="aotkit"))
    for a, e in zip(ours, eager, strict=True):
        torch.testing.assert_close(a, e)


def test_aot_module_simplified_keeps_graph_tensor_attributes_as_constants():
    class WithConstant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3))
            self.offset = torch.tensor([1.0, 2.0, 3.0])  # traced as a get_attr constant

        def forward(self, x):
            return x * self.weight + self.offset

    module = WithConstant()
    gm = torch.fx.symbolic_trace(module)
    x = rand(3, grad=True)
    compiled = aotkit.aot_module_simplified(gm, [x], compilers.nop)
    x_ref = x.detach().clone().requires_grad_()
    expected = module(x_ref)
    expected.sum().backward()
    eager_grads = (x_ref.grad, module.weight.grad.clone())
    module.weight.grad = None
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((x.grad, module.weight.grad), eager_grads)


# --- dynamic shapes: the backward gets sizes, not tensors ------------------------------------


def test_dynamic_default_partition_saves_sizes_not_the_input():
    def fn(x):
        return x.sum()

    def run(compiled):
        a = torch.ones(2, 3, requires_grad=True)
        x = a * 1
        s = compiled(x)
        x.mul_(3)  # eager allows it: sum's backward keeps only the size
        s.backward()
        return s.detach(), a.grad

    bw = RecordingCompiler("bw")
    compiled = aotkit.aot_function(fn, compilers.nop, bw_compiler=bw, dynamic=True)
    for (out, grad), (e_out, e_grad) in ((run(compiled), run(fn)), (run(compiled), run(fn))):
        torch.testing.assert_close(out, e_out)
        torch.testing.assert_close(grad, e_grad)
    inputs = bw.example_inputs[0]
    assert [type(v) for v in inputs] == [torch.SymInt, torch.SymInt, aotkit.compat.FakeTensor]
    assert compiled.num_entries == 1


def test_dynamic_default_partition_matches_eager_with_sizes_and_saved_tensors():
    def fn(x, w):
        y = (x @ w).relu()
        return y.reshape(-1).softmax(0).view_as(y) + x.mean(1, keepdim=True)

    for rows in (4, 6):
        check_against_eager(fn, rand(rows, 5, grad=True), rand(5, 5, grad=True),
                            aot_kwargs={"dynamic": True})


# --- data-dependent ops, generators ----------------------------------------------------------


DATA_DEPENDENT = [
    pytest.param(lambda x: x * x.sum().item(), id="item"),
    pytest.param(lambda x: x.nonzero(), id="nonzero"),
    pytest.param(lambda x: x.masked_select(x > 0) * 2, id="masked_select"),
    pytest.param(lambda x: torch.where(x > 0)[0] + 1, id="where"),
    pytest.param(lambda x: x[:, 0] * torch.unique(x.detach().round()).exp().sum(), id="unique"),
    pytest.param(lambda x: x[x > 0].sin().sum() + x.nonzero().shape[0], id="mask_index"),
]


@pytest.mark.parametrize("fn", DATA_DEPENDENT)
@pytest.mark.parametrize("grad", [False, True])
def test_data_dependent_ops_with_static_sizes_raise_trace_error(fn, grad):
    x = rand(4, 3, grad=grad)
    fn(x)  # eager runs it
    with pytest.raises(TraceError) as info:
        aotkit.aot_function(fn, compilers.nop)(x)
    message = str(info.value)
    assert "tensor data" in message and "test_trace_parity.py" in message
    assert "Fix:" in message and "dynamic=True" in message


@pytest.mark.parametrize("dropout", [
    pytest.param(lambda x: F.dropout(x, 0.5, training=False), id="eval"),
    pytest.param(lambda x: F.dropout(x, 0.0, training=True), id="p0"),
    pytest.param(lambda x: nn.Dropout(0.3).eval()(x), id="module_eval"),
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_dropout_that_drops_nothing_returns_its_input(dropout, dynamic):
    """Eager's dropout in eval mode (or p=0) returns the input itself: a write into the result
    writes the input. Under symbolic sizes, traced with PyTorch's Python decomposition, it was
    a copy, and the input kept its values."""
    def fn(x):
        y = dropout(x)
        y.mul_(2)
        return y

    compiled = aotkit.aot_function(fn, compilers.nop, dynamic=dynamic)
    for rows in (3, 5):
        want, got = torch.ones(rows, 4), torch.ones(rows, 4)
        fn(want)
        out = compiled(got)
        torch.testing.assert_close(got, want)
        assert out.data_ptr() == got.data_ptr()


@pytest.mark.parametrize("fn", [
    pytest.param(lambda x, m: x[m].squeeze(0).sum(0), id="squeeze"),
    pytest.param(lambda x, m: (x[m] @ x.t()).squeeze(0) + 1, id="squeeze_of_matmul"),
])
def test_a_view_of_a_data_dependent_size_of_one_is_kept(fn):
    """The fake kernels take a size read from data for not 1: ``squeeze(0)`` of one row kept
    the row on fake tensors, the view looked like none and was dropped (a (4,) result where
    eager's is a number)."""
    compiled = aotkit.aot_function(fn, compilers.nop, dynamic=True)
    x = torch.arange(12.0).view(3, 4)
    for rows in ([False, True, False], [True, True, False]):
        mask = torch.tensor(rows)
        torch.testing.assert_close(compiled(x, mask), fn(x, mask))


def test_an_expand_to_a_size_dynamo_assumed_for_data_is_kept():
    """Dynamo's graph of ``x[m].expand_as(x)`` gives the row count x's size symbol (an
    assumption it checks in its own graph), so the expand looked like none and was dropped:
    one row came back as (1, 4) where eager broadcasts it to (3, 4)."""
    def fn(x, m):
        return x[m].expand_as(x) * 1

    torch._dynamo.reset()
    x, mask = torch.arange(12.0).view(3, 4), torch.tensor([False, True, False])
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(fn, backend="aotkit", dynamic=True)(x, mask)
    torch.testing.assert_close(got, fn(x, mask))


@pytest.mark.parametrize("fn", DATA_DEPENDENT)
@pytest.mark.parametrize("grad", [False, True])
def test_data_dependent_ops_under_dynamic_match_eager(fn, grad):
    """Note [Data-dependent sizes]: traced as unbacked symbols, computed at every call."""
    compiled = aotkit.aot_function(fn, compilers.nop, dynamic=True)
    for rows in (4, 6, 5):
        check_against_eager(fn, rand(rows, 3, grad=grad), backward=grad, calls=1,
                            aot_kwargs={"dynamic": True})
        x = rand(rows, 3)
        torch.testing.assert_close(compiled(x), fn(x))
    assert compiled.num_entries == 1


def test_zero_dim_input_under_dynamic_is_data_not_a_guarded_constant():
    def window(x, start):
        return x.narrow(0, start, 2).cos()

    compiled = aotkit.aot_function(window, compilers.nop, dynamic=True)
    for rows, start in ((5, 1), (5, 3), (7, 0), (6, 4)):
        check_against_eager(window, rand(rows, 3, grad=True), torch.tensor(start), calls=1,
                            aot_kwargs={"dynamic": True})
        x = rand(rows, 3)
        torch.testing.assert_close(compiled(x, torch.tensor(start)), window(x, torch.tensor(start)))
    assert compiled.num_entries == 1


@pytest.mark.parametrize("start", [4, 10, -1])
def test_checks_on_data_dependent_values_raise_as_in_eager(start):
    """narrow's range check on a value read from data is written into the graph: without it the
    graph's slice clamps and returns a shorter tensor where eager raises."""
    def window(x, start):
        return x.narrow(0, start, 2).cos()

    compiled = aotkit.aot_function(window, compilers.nop, dynamic=True)
    compiled(rand(5, 3, grad=True), torch.tensor(1))
    with pytest.raises((RuntimeError, IndexError), match="start"):
        window(rand(5, 3), torch.tensor(start))
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        compiled(rand(5, 3, grad=True), torch.tensor(start))
    assert compiled.num_entries == 1


def test_python_branch_on_a_data_dependent_value_is_a_trace_error_under_dynamic():
    def branchy(x):
        return x * 2 if x.sum().item() > 0 else x

    with pytest.raises(TraceError, match=r"depends on tensor data(.|\n)*x.sum\(\).item\(\) > 0"
                                         r"(.|\n)*torch.where"):
        aotkit.aot_function(branchy, compilers.nop, dynamic=True)(rand(4, 3))


def test_indexing_with_a_data_dependent_int_is_a_trace_error_naming_select():
    """x[n.item()] under dynamic=True: Python indexing refuses the SymInt (a raw IndexError;
    PyTorch's aot_function too), where x.select(0, n.item()) traces."""
    x, n = torch.arange(8.0), torch.tensor(3)
    with pytest.raises(TraceError, match=r"got SymInt(.|\n)*x\.select\(dim, i\)"):
        aotkit.aot_function(lambda x, n: x[n.item()] * 2, compilers.nop, dynamic=True)(x, n)
    selected = aotkit.aot_function(lambda x, n: x.select(0, n.item()) * 2, compilers.nop,
                                   dynamic=True)
    assert selected(x, n).item() == 6.0


def test_an_op_needing_concrete_sizes_under_dynamic_is_refused_naming_static_sizes():
    """affine_grid's backward (a C++ composite) cannot take symbolic sizes: a raw RuntimeError
    about SymIntArrayRef came through (PyTorch's aot_eager too)."""
    def warp(theta, x):
        grid = F.affine_grid(theta.expand(x.shape[0], 2, 3), list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, align_corners=False)

    theta, x = (torch.eye(2, 3) + 0.1).requires_grad_(), torch.randn(4, 2, 5, 6)
    with pytest.raises(UnsupportedError, match=r"concrete(.|\n)*dynamic=False"):
        aotkit.aot_function(warp, compilers.nop, dynamic=True)(theta, x)
    check_against_eager(warp, theta, x)


def test_a_transformer_mask_without_is_causal_is_a_trace_error_naming_it():
    """nn.Transformer's layers compare a mask's values to tell whether it is causal: the
    generic data-dependent fix (torch.where, torch.cond) did not say to pass is_causal."""
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0), 2)
    decoder.requires_grad_(False)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    tgt, memory = torch.randn(5, 3, 8), torch.randn(7, 3, 8)
    with pytest.raises(TraceError, match="pass is_causal=True"):
        aotkit.aot_function(lambda t, m: decoder(t, m, tgt_mask=mask), compilers.nop)(tgt, memory)
    check_against_eager(lambda t, m: decoder(t, m, tgt_mask=mask, tgt_is_causal=True), tgt, memory)


def test_generator_made_inside_the_function_is_refused():
    def fn(x):
        g = torch.Generator().manual_seed(5)
        return x + torch.rand(x.shape, generator=g)

    x = torch.zeros(3)
    assert torch.equal(fn(x), fn(x))  # eager: every call starts from the seed
    for dynamic, why in ((False, "carry over"), (True, "concrete sizes")):
        with pytest.raises(UnsupportedError) as info:
            aotkit.aot_function(fn, compilers.nop, dynamic=dynamic)(x)
        assert why in str(info.value) and "torch.Generator" in str(info.value)
        assert "Fix:" in str(info.value) and "generator=g" in str(info.value)


def test_generator_made_outside_the_function_advances_like_eager():
    gen = torch.Generator()

    def fn(x):
        return x + torch.rand(x.shape, generator=gen)

    if torch.__version__ < "2.13":  # FX before 2.13 cannot hold a generator as a constant
        with pytest.raises(UnsupportedError, match="cannot record a generator"):
            aotkit.aot_function(fn, compilers.nop)(torch.zeros(3))
        return
    for grad in (False, True):
        gen.manual_seed(5)
        expected = [fn(torch.zeros(3)) for _ in range(2)]
        compiled = aotkit.aot_function(fn, compilers.nop)
        gen.manual_seed(5)
        for e in expected:
            torch.testing.assert_close(compiled(rand(3, grad=grad).detach().zero_()
                                                .requires_grad_(grad)), e)


@pytest.mark.parametrize("op", ["exponential_", "geometric_", "cauchy_", "log_normal_"])
def test_a_generator_passed_to_a_sampler_without_generator_support_is_refused(op):
    """Functionalization traces these samplers through references that take no generator: a
    bare AssertionError from inside PyTorch."""
    gen = torch.Generator().manual_seed(0)
    args = (0.3,) if op == "geometric_" else ()

    def fn(x):
        return x * getattr(torch.empty_like(x), op)(*args, generator=gen)

    fn(torch.ones(3))  # eager runs it
    with pytest.raises(UnsupportedError, match=r"torch\.Generator|generator") as info:
        aotkit.aot_function(fn, compilers.nop)(torch.ones(3))
    assert "Fix:" in str(info.value)
    assert "getattr(torch.empty_like(x), op)" in str(info.value)  # the line


@pytest.mark.skipif(torch.__version__ < "2.13", reason="FX before 2.13 holds no generator")
def test_a_new_generator_at_each_call_says_to_pass_the_same_one():
    compiled = aotkit.aot_function(lambda x, g: x + torch.rand(x.shape, generator=g),
                                   compilers.nop)
    for seed in range(2):
        compiled(torch.zeros(3), torch.Generator().manual_seed(seed))
    (reason,) = aotkit.explain().of_kind("recompile")
    assert "args[1] is another torch.Generator object" in reason.why
    assert "pass the same one at every call" in reason.why


# --- activation checkpointing ----------------------------------------------------------------


def _checkpointed_dropout(x):
    return checkpoint(lambda a: F.dropout(a, 0.5).sin(), x, use_reentrant=False)


def _checkpointed_block(x, w):
    def block(a, w):
        return F.dropout((a @ w).relu(), 0.3) * a

    return checkpoint(block, x, w, use_reentrant=False).sum(1)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_checkpoint_with_dropout_matches_eager(dynamic, partition):
    partition_fn = aotkit.default_partition if partition == "default" \
        else aotkit.min_cut_rematerialization_partition
    kwargs = {"dynamic": dynamic, "partition_fn": partition_fn}
    check_against_eager(_checkpointed_dropout, rand(4, 4, grad=True), seed=0, aot_kwargs=kwargs)
    check_against_eager(_checkpointed_block, rand(4, 6, grad=True), rand(6, 6, grad=True),
                        seed=1, aot_kwargs=kwargs)


@pytest.mark.parametrize("dynamic", [False, True])
def test_checkpoint_leaves_the_rng_where_eager_does(dynamic):
    compiled = aotkit.aot_function(_checkpointed_dropout, compilers.nop, dynamic=dynamic)
    after = []
    for fn in (_checkpointed_dropout, compiled):
        torch.manual_seed(0)
        out = fn(torch.ones(4, 4, requires_grad=True))
        forward_rng = torch.rand(2)
        out.sum().backward()
        after.append((forward_rng, torch.rand(2)))
    torch.testing.assert_close(after[1], after[0])


def test_selective_checkpoint_matches_eager_and_leaves_no_node_meta_behind():
    """Selective checkpointing tags its ops in torch.fx.traceback's current node meta when it
    sees a trace; left there, the tags broke a later torch.compile's partitioner."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        save = op is torch.ops.aten.mm.default
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    def sac(x):
        return checkpoint(lambda a: (a @ a.T).sin(), x, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy)) + 1

    check_against_eager(sac, rand(4, 3, grad=True))
    assert "recompute" not in torch.fx.traceback.current_meta


@pytest.mark.parametrize("user_mode", [False, True], ids=["", "under_a_user_mode"])
@pytest.mark.parametrize("save", ["aten.addmm.default", "aten.native_layer_norm.default"])
def test_a_selective_checkpoint_around_a_compiled_module_matches_eager(save, user_mode):
    """Traced inside the region, its caching modes kept the trace's tensors for the recompute:
    "FunctionalTensor on its own" (PyTorch's aot_module: a raw TypeError); also with a user's
    dispatch mode entered in the region, above them."""
    import functools

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def region(a, run):
        with Passthrough() if user_mode else contextlib.nullcontext():
            return run(a).relu()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if str(op) == save else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    grads, x0 = [], torch.randn(4, 3)
    for run in (block, aotkit.aot_module(block, compilers.nop)):
        x = x0.clone().requires_grad_()
        checkpoint(region, x, run, use_reentrant=False, context_fn=context).sum().backward()
        grads.append([x.grad, *(p.grad for p in block.parameters())])
        block.zero_grad()
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want)


def test_reentrant_checkpoint_is_refused_with_the_fix():
    f = lambda x: checkpoint(lambda a: a.sin() * 2, x, use_reentrant=True).sum()  # noqa: E731
    with pytest.raises(UnsupportedError, match="use_reentrant=False"):
        aotkit.aot_function(f, compilers.nop)(rand(3, grad=True))


def test_a_view_of_a_detached_closed_over_tensor_stays_detached():
    w = torch.randn(3, requires_grad=True)
    out = aotkit.aot_function(lambda x: (x * 2, w.detach()[1:]), compilers.nop)(rand(3, grad=True))
    expected = w.detach()[1:]
    assert (out[1].requires_grad, out[1].grad_fn) == (expected.requires_grad, None) == (False, None)
    torch.testing.assert_close(out[1], expected)


def _must_be_3(x, s):
    n = s.item()
    torch._check(n == 3, lambda: "n must be 3")
    return x * n


def _checked_only(x, s):
    n = s.item()
    torch._check(n < x.shape[0])
    return x * 2


@pytest.mark.parametrize("fn", [_must_be_3, _checked_only])
@pytest.mark.parametrize("grad", [False, True])
def test_torch_check_on_a_value_the_graph_does_not_use_raises_as_in_eager(fn, grad):
    """The trace made ``n`` a constant (or never used it), so dead-code elimination dropped its
    read and the check went with it: eager raised, the graph returned a value."""
    compiled = aotkit.aot_function(fn, compilers.nop, dynamic=True)
    x = rand(2, grad=grad)
    torch.testing.assert_close(compiled(x, torch.tensor(1 if fn is _checked_only else 3)),
                               fn(x, torch.tensor(1 if fn is _checked_only else 3)))
    with pytest.raises(RuntimeError):
        fn(x, torch.tensor(4))
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        compiled(x, torch.tensor(4))


@pytest.mark.parametrize("fn", [
    pytest.param(lambda x, n: x.sum() * torch.ones(n.item()), id="sized_by_item"),
    pytest.param(lambda x, n: (lambda m: m * m.shape[0])(x[x > 0]), id="masked_and_scaled"),
])
def test_differentiable_output_of_a_data_dependent_size_matches_eager(fn):
    """The checks were written into the joint graph, where they took the size from the output's
    tangent, which the forward does not have: the partitioner failed."""
    for rows in (5, 7):
        check_against_eager(fn, rand(rows, grad=True), torch.tensor(rows - 1), calls=1,
                            aot_kwargs={"dynamic": True})


def test_data_dependent_op_on_overlapping_mutated_inputs_says_why_sizes_were_static():
    def fn(a, b):
        a.add_(1)
        return b[b > 1].sum()

    compiled = aotkit.aot_function(fn, compilers.nop, dynamic=True)
    torch.testing.assert_close(compiled(torch.arange(4.0), torch.arange(4.0)),
                               fn(torch.arange(4.0), torch.arange(4.0)))
    shared = torch.arange(8.0)
    with pytest.raises(TraceError, match=r"share memory and one is mutated(.|\n)*\.clone\(\)"):
        compiled(shared[:4], shared[2:6])


def test_backward_under_autocast_of_a_data_dependent_graph_matches_eager():
    """The backward is traced again under autocast; its forward must match the one that ran,
    compared before the runtime checks, which name each trace's fresh symbols."""
    def fn(x):
        m = x[x > 0]
        return (m * m.shape[0]).sum() + x.sum()

    x = torch.randn(6, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    out, expected = aotkit.aot_function(fn, compilers.nop, dynamic=True)(x), fn(x_eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.backward()
        expected.backward()
    torch.testing.assert_close(x.grad, x_eager.grad)


@pytest.mark.parametrize("make", [lambda x: torch.zeros(3, device="cpu:0") + x,
                                  lambda x: x.to("cpu:0") * 2 + x,
                                  lambda x: torch.ones(3, device=torch.device("cpu", 0)) * x],
                         ids=["factory", "to", "device object"])
def test_a_cpu_device_with_an_index_is_cpu_as_in_eager(make):
    # Note [CPU device indices]
    check_against_eager(make, torch.randn(3, requires_grad=True))


def test_dropout_of_an_empty_tensor_returns_it():
    """Eager's training dropout returns an empty input itself."""
    def fn(x):
        return F.dropout(x, 0.5, training=True)

    x = torch.ones(0, 4)
    assert fn(x) is x and aotkit.aot_function(fn, compilers.nop)(x) is x
