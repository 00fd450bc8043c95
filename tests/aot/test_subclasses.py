"""Tensor subclasses (jagged nested tensors, TwoTensor) through aot_function, aot_module and
torch.compile(backend="aotkit"), against eager. See Note [Tensor subclasses]."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import aotkit
from aotkit.errors import UnsupportedError


def jagged(*lengths: int, requires_grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, 4, generator=g) for n in lengths],
                                      layout=torch.jagged, requires_grad=requires_grad)


def two(requires_grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return TwoTensor(torch.randn(3, 4, generator=g),
                     torch.randn(3, 4, generator=g)).requires_grad_(requires_grad)


def data(t: torch.Tensor) -> list[torch.Tensor]:
    """A subclass's plain parts, for comparing values."""
    if t.is_nested:
        return [t.values().detach(), t.offsets()]
    return [t.a.detach(), t.b.detach()] if isinstance(t, TwoTensor) else [t.detach()]


def loss(t: torch.Tensor) -> torch.Tensor:
    return t.values().sum() if t.is_nested else t.sum()


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert type(actual) is type(expected)
    assert actual.shape[0] == expected.shape[0] and actual.dim() == expected.dim()
    for a, e in zip(data(actual), data(expected), strict=True):
        torch.testing.assert_close(a, e)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(nn.functional.gelu(self.lin(x)), dim=-1) * 2


def pointwise(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + x.cos()


def two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sin(), x * 2


def compiled(fn, how: str):
    if how == "aot_function":
        return aotkit.aot_function(fn, aotkit.compilers.nop)
    if how == "aot_module":
        return aotkit.aot_module(fn, aotkit.compilers.nop)
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotkit_inductor" if how == "inductor" else "aotkit")


def check(fn, make, how: str, params: list[torch.Tensor] = ()) -> None:
    """Outputs, the input's gradient and ``params``' gradients equal eager's."""
    x_eager, x = make(), make()
    expected = fn(x_eager)
    expected = expected if isinstance(expected, tuple) else (expected,)
    sum(map(loss, expected)).backward()
    eager_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    out = compiled(fn, how)(x)
    out = out if isinstance(out, tuple) else (out,)
    for a, e in zip(out, expected, strict=True):
        assert_same(a, e)
    sum(map(loss, out)).backward()
    assert_same(x.grad, x_eager.grad)
    for p, g in zip(params, eager_grads, strict=True):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("how", ["aot_function", "torch.compile"])
@pytest.mark.parametrize("make", [lambda: jagged(2, 3), two], ids=["jagged", "TwoTensor"])
@pytest.mark.parametrize("fn", [pointwise, two_outputs, lambda x: x], ids=["pointwise", "two_outputs", "identity"])
def test_subclass_inputs_and_outputs_match_eager(fn, make, how: str) -> None:
    check(fn, make, how)


@pytest.mark.parametrize("how", ["aot_module", "torch.compile"])
def test_module_on_jagged_input_trains_like_eager(how: str) -> None:
    block = Block()
    check(block, lambda: jagged(2, 3), how, list(block.parameters()))


def test_jagged_graph_is_reused_across_raggedness_and_recompiles_for_new_sizes() -> None:
    f = aotkit.aot_function(pointwise, aotkit.compilers.nop)
    # Same batch, total, shortest and longest length (which a jagged tensor caches as parts):
    # one entry for both.
    for lengths in [(2, 3), (3, 2)]:
        x = jagged(*lengths)
        assert_same(f(x), pointwise(x))
    assert f.num_entries == 1
    x = jagged(2, 2)
    assert_same(f(x), pointwise(x))
    assert f.num_entries == 2
    why = aotkit.explain().of_kind("recompile")[-1].why
    assert "shape of args[0]'s _values (a NestedTensor part) changed: (5, 4) -> (4, 4)" in why


def test_inference_and_mutation_of_a_subclass_input_show_in_the_caller() -> None:
    def bump(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    x_eager, x = jagged(2, 3, requires_grad=False), jagged(2, 3, requires_grad=False)
    with torch.no_grad():
        expected = bump(x_eager)
        out = aotkit.aot_function(bump, aotkit.compilers.nop)(x)
    assert_same(out, expected)
    assert_same(x, x_eager)


def test_plain_input_with_a_subclass_gradient_is_refused() -> None:
    # linear(TwoTensor, w): eager's w.grad is a TwoTensor, which a graph cannot return for w
    w = torch.randn(4, 4, requires_grad=True)
    f = aotkit.aot_function(lambda x, w: nn.functional.linear(x, w), aotkit.compilers.nop)
    with pytest.raises(UnsupportedError, match=r"gradient of a plain tensor input of shape \(4, 4\) is a TwoTensor"):
        f(two(), w)


class _Unwrapping(torch.Tensor):
    """A wrapper subclass whose ops return plain tensors: eager's .grad of one is plain."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False) -> _Unwrapping:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype,
                                                   requires_grad=requires_grad)

    def __init__(self, data: torch.Tensor, requires_grad: bool = False) -> None:
        self.data_ = data

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["data_"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride) -> _Unwrapping:
        return _Unwrapping(inner["data_"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return _Unwrapping(args[0].data_)
        unwrap = lambda t: t.data_ if isinstance(t, _Unwrapping) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def test_a_subclass_input_whose_gradient_is_plain_is_refused_naming_the_fix() -> None:
    """The message said the gradient arrived as a FunctionalTensor, a type the user never
    sees, and told to fix a backward such a subclass does not have."""
    x = _Unwrapping(torch.arange(6.0).view(2, 3), requires_grad=True)
    grad, = torch.autograd.grad(x.sin().sum(), x)
    assert type(grad) is torch.Tensor  # eager
    with pytest.raises(UnsupportedError, match=r"gradient of a _Unwrapping input is a plain tensor"
                                               r"(.|\n)*Fix: make __torch_dispatch__ wrap"):
        aotkit.aot_function(lambda t: t.sin().sum(), aotkit.compilers.nop)(x)


def test_a_closed_over_jagged_tensor_without_grad_is_a_constant_and_one_with_grad_refused():
    """An intermediate made from it (C * x) shares its offsets, and was blamed as a closed-over
    tensor requiring grad."""
    def jagged(requires_grad: bool) -> torch.Tensor:
        return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(1, 3)],
                                          layout=torch.jagged, requires_grad=requires_grad)

    constant = jagged(False)

    def f(x):
        return (constant * x).values().exp()

    x = torch.randn(3, requires_grad=True)
    out = aotkit.aot_function(f, aotkit.compilers.nop)(x)
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0],
                               torch.autograd.grad(f(x).sum(), x)[0])
    constant = jagged(True)
    with pytest.raises(UnsupportedError, match="requires grad"):
        aotkit.aot_function(f, aotkit.compilers.nop)(x)


def test_dynamic_aot_function_refuses_subclasses() -> None:
    f = aotkit.aot_function(pointwise, aotkit.compilers.nop, dynamic=True)
    with pytest.raises(UnsupportedError, match="dynamic=True .* tensor subclass arguments "
                                               r"\(NestedTensor\)"):
        f(jagged(2, 3))


def attention(x: torch.Tensor) -> torch.Tensor:
    q = x.unflatten(-1, (2, 2)).transpose(1, 2)  # (batch, heads, ragged, 2)
    return nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2)


@pytest.mark.parametrize("how", ["aot_function", "torch.compile", "inductor"])
@pytest.mark.parametrize("fn", [
    lambda x: nn.functional.layer_norm(x, (4,)),  # keeps the input's cached lengths
    lambda x: x.to_padded_tensor(0.0).sin(),       # a plain output
    lambda x: x.values(),                          # a plain view of the input
    lambda x: (x * 2).softmax(dim=-1).values(),    # a plain view of an intermediate
], ids=["layer_norm", "to_padded", "values", "values_of_intermediate"])
def test_jagged_ops_match_eager(fn, how: str) -> None:
    check(fn, lambda: jagged(2, 3), how)


def test_jagged_attention_under_torch_compile_matches_eager() -> None:
    # attention reads the longest length from the offsets' data: aot_function cannot trace
    # it statically (TraceError), torch.compile makes that length a symbol
    check(attention, lambda: jagged(2, 3), "torch.compile")
    with pytest.raises(aotkit.errors.TraceError, match="depends on tensor data"):
        aotkit.aot_function(attention, aotkit.compilers.nop)(jagged(2, 3))


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo group (an in-memory store: no port) and its device mesh."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built into this torch")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("how", ["aot_function", "torch.compile"])
def test_a_partial_dtensor_output_on_one_rank_is_differentiated_as_in_eager(mesh, how) -> None:
    """A Partial output's gradient comes Replicate, which DTensor cannot bring to Partial: on
    one rank it is taken as it comes (every Partial output was refused)."""
    from torch.distributed.tensor import DTensor, Shard

    def loss(x):
        return (x * x).sum()

    grads = []
    for run in (loss, compiled(loss, how)):
        x = DTensor.from_local(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        x.requires_grad_()
        run(x).full_tensor().backward()
        grads.append(x.grad.full_tensor())
    assert torch.equal(grads[1], grads[0])


@pytest.mark.parametrize("how", ["aot_module", "torch.compile"])
def test_dtensor_module_trains_like_eager(mesh, how: str) -> None:
    # DTensor flattens its device mesh with its local tensor: the mesh is a constant of the
    # graph, the local tensor an input
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    def make() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        block = distribute_module(Block(), mesh)  # parameters become replicated DTensors
        x = distribute_tensor(torch.randn(3, 4), mesh, [Shard(0)]).requires_grad_()
        return block, x

    (block_eager, x_eager), (block, x) = make(), make()
    expected = block_eager(x_eager)
    expected.sum().backward()
    out = compiled(block, how)(x)
    out.sum().backward()
    assert type(out) is type(expected) and out.placements == expected.placements
    torch.testing.assert_close(out.to_local(), expected.to_local())
    torch.testing.assert_close(x.grad.to_local(), x_eager.grad.to_local())
    for p, q in zip(block.parameters(), block_eager.parameters(), strict=True):
        assert p.grad.placements == (Replicate(),)
        torch.testing.assert_close(p.grad.to_local(), q.grad.to_local())


def test_dynamic_torch_compile_rebuilds_subclasses_with_runtime_sizes() -> None:
    # Symbolic outer sizes are graph inputs and outputs: a TwoTensor output of size (s0, 4)
    # comes back with each call's size, a jagged one with each call's raggedness
    torch._dynamo.reset()
    f = torch.compile(pointwise, backend="aotkit", dynamic=True)
    for n, lengths in [(3, (2, 3)), (5, (4, 1, 2)), (7, (6, 6))]:
        g = torch.Generator().manual_seed(n)
        x = TwoTensor(torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g))
        pairs = [(x.clone().requires_grad_(), x.clone().requires_grad_()),
                 (jagged(*lengths, seed=n), jagged(*lengths, seed=n))]
        for x_eager, x_compiled in pairs:
            expected, out = pointwise(x_eager), f(x_compiled)
            assert out.shape[0] == expected.shape[0] and out.shape[-1] == expected.shape[-1]
            assert_same(out, expected)
            loss(out).backward()
            loss(expected).backward()
            assert_same(x_compiled.grad, x_eager.grad)


@pytest.mark.parametrize("how", ["aot_function", "torch.compile"])
def test_view_of_a_jagged_input_aliases_it_like_eager(how: str) -> None:
    def split_heads(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (2, 2))

    x_eager, x = jagged(2, 3, requires_grad=False), jagged(2, 3, requires_grad=False)
    with torch.no_grad():
        expected, out = split_heads(x_eager), compiled(split_heads, how)(x)
        assert out.values().untyped_storage().data_ptr() == x.values().untyped_storage().data_ptr()
        out.values().add_(1)
        expected.values().add_(1)
    assert_same(out, expected)
    assert_same(x, x_eager)  # the write through the view reached the input
    check(split_heads, lambda: jagged(2, 3), how)


def _made_inside(x: torch.Tensor) -> torch.Tensor:
    return TwoTensor(x.sin(), x.cos()) * 2


@pytest.mark.parametrize("how", ["aot_function", "torch.compile"])
def test_subclass_made_inside_from_plain_inputs_matches_eager(how: str) -> None:
    """The outputs alone are flattened (no argument is a subclass): the caller gets a real
    TwoTensor, not one holding tracing-time tensors (which failed on first use)."""
    x = torch.randn(3, requires_grad=True)
    expected, out = _made_inside(x), compiled(_made_inside, how)(x)
    assert_same(out, expected)
    assert out.requires_grad == expected.requires_grad  # eager's wrapper does not require grad


@pytest.mark.parametrize("how", ["aot_function", "torch.compile"])
def test_inner_tensors_of_a_subclass_carry_no_grad_as_in_eager(how: str) -> None:
    """``x.a`` of a TwoTensor that requires grad has no history in eager; the traced subclass
    was rebuilt from parts that required grad, so ``x.a * x.b`` got a grad_fn and x a grad."""
    def products(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.a * x.b, x * 2

    x = two()
    expected, out = products(x), compiled(products, how)(x)
    assert [o.requires_grad for o in out] == [e.requires_grad for e in expected] == [False, True]
    torch.testing.assert_close(out[0], expected[0])
    assert_same(out[1], expected[1])


@pytest.mark.parametrize("through", ["aot_function", "torch.compile"])
def test_a_subclass_without_elements_keeps_its_gradient(through: str) -> None:
    """Empty parts were taken for a jagged tensor's cached lengths: no grad, .grad None."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.sin().sum(0) * w

    run = aotkit.aot_function(f, aotkit.compilers.nop) if through == "aot_function" else (
        torch.compile(f, backend="aotkit"))
    grads = []
    for call in (f, run):
        x = TwoTensor(torch.ones(0, 3), torch.ones(0, 3)).requires_grad_(True)
        w = TwoTensor(torch.ones(3), torch.ones(3)).requires_grad_(True)
        out = call(x, w)
        assert out.requires_grad
        out.sum().backward()
        grads.append((x.grad.shape, w.grad.a))
    assert grads[1][0] == grads[0][0] == (0, 3)
    torch.testing.assert_close(grads[1][1], grads[0][1])


def test_mutating_a_subclass_argument_under_autograd_is_refused() -> None:
    """Its parts took the mutation, the subclass not its history: leaf.grad came out 1, not 2."""

    def f(x: torch.Tensor) -> None:
        x.mul_(2)

    leaf = TwoTensor(torch.ones(4), torch.ones(4)).requires_grad_(True)
    with pytest.raises(UnsupportedError, match="mutates a tensor subclass argument"):
        aotkit.aot_function(f, aotkit.compilers.nop)(leaf.clone())
    with torch.no_grad():  # no history to keep
        x = TwoTensor(torch.ones(4), torch.ones(4))
        aotkit.aot_function(f, aotkit.compilers.nop)(x)
    torch.testing.assert_close(x.a, torch.full((4,), 2.0))


class Offset(torch.Tensor):
    """Adds 100 to the result of every out-of-place multiplication it takes part in."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.mul, torch.mul, torch.Tensor.__mul__):
            result = result + 100
        return result


class ScaledParam(nn.Parameter):
    """A weight wrapper that scales itself inside F.linear."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            args = (args[0], args[1].as_subclass(torch.Tensor) * 10, *args[2:])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _times(t, x):
    return x * t


def test_torch_function_subclass_arguments_are_refused_by_aot_function():
    """Note [Subclasses with __torch_function__]: the trace never ran the override, and the
    graph's own calls ran it again (a mul_ left 102 where eager leaves 2; PyTorch raises a
    TypeError)."""
    compiled = aotkit.aot_function(_times, aotkit.compilers.nop)
    compiled(torch.ones(2), torch.ones(2))  # a plain tensor's graph must not serve a subclass
    with pytest.raises(UnsupportedError, match=r"tensor of subclass Offset as args\[0\], which "
                       r"has its own __torch_function__(.|\n)*Fix: use torch.compile"):
        compiled(torch.ones(2).as_subclass(Offset), torch.ones(2))


def test_torch_function_parameter_subclass_is_refused_by_aot_module():
    """Its scaling was silently skipped: output and weight grad of the unscaled weight."""
    model = nn.Linear(3, 2)
    model.weight = ScaledParam(model.weight.detach())
    with pytest.raises(UnsupportedError, match=r"tensor of subclass ScaledParam as weight"):
        aotkit.aot_module(model, aotkit.compilers.nop)(torch.ones(1, 3))


def test_torch_function_subclass_under_torch_compile_matches_eager():
    """Dynamo traces the override; the backward's mul, bound to torch.mul, ran it again on the
    saved subclass input (x.grad 101 where eager gives 1)."""
    results = []
    torch._dynamo.reset()
    for run in (_times, torch.compile(_times, backend="aotkit")):
        t, x = torch.ones(2).as_subclass(Offset).requires_grad_(), torch.ones(2, requires_grad=True)
        out = run(t, x)
        out.sum().backward()
        results.append((out.as_subclass(torch.Tensor).detach(), x.grad))
    torch.testing.assert_close(results[1], results[0])


def test_torch_function_parameter_subclass_under_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.weight = ScaledParam(model.weight.detach())
    results = []
    torch._dynamo.reset()
    for run in (model, torch.compile(model, backend="aotkit")):
        model.zero_grad()
        out = run(torch.ones(1, 3))
        out.sum().backward()
        results.append((out.detach(), model.weight.grad.clone()))
    torch.testing.assert_close(results[1], results[0])


def test_a_python_attribute_of_a_tensor_argument_is_refused_naming_the_fix():
    """The trace's stand-ins carry no attributes: PyTorch's AttributeError named a
    FunctionalTensor the user never made."""
    weight = nn.Parameter(torch.randn(2, 3))
    weight.scale = 3.0

    def fn(x, w):
        return torch.nn.functional.linear(x, w) * w.scale

    with pytest.raises(UnsupportedError, match=r"reads a Python attribute of a tensor argument "
                       r"(.|\n)*'scale'(.|\n)*Fix: pass the value as an argument"):
        aotkit.aot_function(fn, aotkit.compilers.nop)(torch.ones(1, 3), weight)


@pytest.mark.parametrize("entry", ["aot_function", "torch.compile"])
def test_jagged_output_keeps_its_inputs_ragged_size(entry):
    """Note [Parts outputs share with inputs]: the output held an alias of n's offsets and got
    a ragged size of its own, so ``f(n) + n`` raised where eager runs."""
    def fn(n):
        return n.sin() * 2

    torch._dynamo.reset()
    compiled = aotkit.aot_function(fn, aotkit.compilers.nop) if entry == "aot_function" \
        else torch.compile(fn, backend="aotkit")
    results = []
    for run in (fn, compiled):
        n = jagged(2, 4)
        out = run(n)
        assert out.shape == n.shape and out.offsets() is n.offsets()
        loss((out + n) * n).backward()
        results.append((data(out + n), n.grad.values()))
    torch.testing.assert_close(results[1], results[0])


class Tagged(torch.Tensor):
    """A subclass without a __torch_function__ of its own: eager's results keep its type."""


def test_a_subclass_without_an_override_keeps_its_type_through_the_graphs():
    """Dynamo's graphs run with subclass __torch_function__ off; aot_function's must not, or the
    outputs came back as plain tensors."""
    def fn(x, w):
        return x * w

    x = torch.randn(3).as_subclass(Tagged)
    out = aotkit.aot_function(fn, aotkit.compilers.nop)(x, torch.randn(3, requires_grad=True))
    assert type(out) is type(fn(x, torch.randn(3))) is Tagged
    model = nn.Linear(3, 2)
    assert type(aotkit.aot_module(model, aotkit.compilers.nop)(x)) is type(model(x)) is Tagged


def test_subclass_outputs_viewing_an_input_have_parts_of_their_own():
    """Only a jagged tensor's offsets are shared by identity (Note [Parts outputs share with
    inputs]): a detached TwoTensor's parts were the input's, and out.t_() changed the input."""
    x = two(requires_grad=False)
    out = aotkit.aot_function(lambda t: t.detach(), aotkit.compilers.nop)(x)
    assert out.a is not x.a and out.a.data_ptr() == x.a.data_ptr()
    out.t_()
    assert x.shape == x.a.shape == (3, 4)


def test_double_backward_through_subclass_inputs_is_refused():
    """The subclass's gradient was rebuilt detached from the guarded parts: a second backward
    got None (a jagged tensor) or added zeros (TwoTensor) instead of the refusal."""
    f = aotkit.aot_function(lambda t: t.sin() * 2, aotkit.compilers.nop)
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged,
                                    requires_grad=True)
    (g,) = torch.autograd.grad(f(nt).values().sum(), nt, create_graph=True)
    torch.testing.assert_close(g.values(), (nt.values().cos() * 2).detach())
    with pytest.raises(UnsupportedError, match="double backward"):
        torch.autograd.grad(g.values().sum(), nt, allow_unused=True)
    t = TwoTensor(torch.randn(3), torch.randn(3)).requires_grad_()
    f(t).sum().backward(create_graph=True)
    with pytest.raises(UnsupportedError, match="double backward"):
        t.grad.sum().backward()


# Rank 0 of a simulated world of two ranks holding the same data (a sum all-reduce doubles), in
# a process of its own: one rank cannot tell a summand from the sum.
_TWO_RANKS = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.futures import Future
from torch.testing._internal.distributed.fake_pg import FakeStore
import aotkit

class Done(dist._Work):
    def __init__(self, result):
        super().__init__()
        self.future = Future()
        self.future.set_result(result)
    def wait(self, timeout=None):
        return True
    def get_future(self):
        return self.future

class TwinRanks(dist.ProcessGroup):
    group_name = property(lambda self: "0")
    def getBackendName(self):
        return "twin"
    def allreduce(self, tensors, opts=None):
        for t in tensors:
            t.mul_(2)
        return Done(tensors)

dist.Backend.register_backend("twin", lambda *a: TwinRanks(a[1], a[2]), devices=["cpu"])
dist.init_process_group("twin", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))

def matmul(x, w):
    return (x @ w).relu()

def partial(d):
    return DTensor.from_local(d.to_local() * 3, mesh, [Partial()])

for fn in (matmul, aotkit.aot_function(matmul, aotkit.compilers.nop)):
    x = DTensor.from_local(torch.arange(12.0).reshape(4, 3) / 5, mesh, [Shard(0)])
    w = DTensor.from_local(torch.arange(6.0).reshape(3, 2) / 7, mesh, [Replicate()])
    w.requires_grad_()
    fn(x, w).to_local().sum().backward()
    print(w.grad.full_tensor().flatten().tolist())
d = DTensor.from_local(torch.ones(2, 2), mesh, [Replicate()]).requires_grad_()
try:
    aotkit.aot_function(partial, aotkit.compilers.nop)(d).full_tensor().sum().backward()
except aotkit.errors.UnsupportedError as exc:
    print(str(exc).splitlines()[0])
dist.destroy_process_group()
"""


def test_a_dtensor_gradient_in_other_placements_than_its_input_keeps_eagers_values() -> None:
    """Note [Gradients in another layout]: a replicated weight's gradient is Partial (each rank
    a summand); rebuilt as Replicate, the summand was taken for the sum (half the values on two
    ranks), silently. A Replicate gradient of a Partial output is refused."""
    pytest.importorskip("torch.distributed.tensor")
    run = subprocess.run([sys.executable, "-c", _TWO_RANKS], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    eager, compiled, refused = run.stdout.splitlines()
    assert eager == compiled
    assert "cannot be brought to it" in refused


def test_a_subclass_input_feeding_only_an_unused_output_gets_no_gradient():
    """A TwoTensor input feeding only the output the loss leaves out: its wrapping Function
    counted as one that materializes zeros, so the leaf behind got a zero ``.grad`` that
    optimizers would apply; eager leaves it None."""
    a = TwoTensor(torch.ones(3), torch.ones(3)).requires_grad_()
    b = torch.ones(3, requires_grad=True)
    compiled = aotkit.aot_function(lambda x, y: (x + 1, y * 2), aotkit.compilers.nop)
    _, out = compiled(a * 2, b)
    out.sum().backward()
    assert a.grad is None and torch.equal(b.grad, torch.full((3,), 2.0))
    seen = []  # a hook on the subclass input itself sees zeros, as a plain input's does
    x = a * 2
    x.register_hook(lambda g: seen.append(g * 2))
    _, out = compiled(x, b)
    out.sum().backward()
    assert len(seen) == 1 and isinstance(seen[0], TwoTensor) and not seen[0].a.any()


def test_a_jagged_tensor_made_inside_or_its_offsets_say_what_to_do():
    """``nested_tensor_from_jagged`` inside raised PyTorch's raw RuntimeError (it refuses FX
    traces), and offsets that made a jagged tensor before could not be faked statically (a
    raw AssertionError)."""
    values, offsets = torch.randn(6, 3), torch.tensor([0, 2, 6])

    def padded(x, off):
        return torch.nested.nested_tensor_from_jagged(x, off).to_padded_tensor(0.0)

    with pytest.raises(aotkit.errors.UnsupportedError, match="make the nested tensor outside"):
        aotkit.aot_function(padded, aotkit.compilers.nop)(values, offsets)
    padded(values, offsets)
    double = aotkit.aot_function(lambda o: o * 2, aotkit.compilers.nop)
    with pytest.raises(aotkit.errors.UnsupportedError, match="offsets of a jagged nested tensor"):
        double(offsets)
    assert torch.equal(aotkit.aot_function(lambda o: o * 2, aotkit.compilers.nop,
                                           dynamic=True)(offsets), offsets * 2)
