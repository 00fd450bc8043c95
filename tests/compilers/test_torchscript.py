"""TorchScript compilers (ts_compile, simple_ts_compile, nnc_jit) and memory_efficient_fusion:
forward and backward equal eager on an MLP and a Transformer block; what ts_compile rewrites for
TorchScript; errors and warnings a user sees."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.fx as fx
from tests.aot.eager_check import RecordingCompiler, check_against_eager, check_compiled
from tests.compilers.compiler_check import check_model, train_like_eager
from torch import nn

import aotkit
from aotkit.compilers import (
    default_decompositions,
    memory_efficient_fusion,
    nnc_jit,
    simple_ts_compile,
    ts_compile,
)
from aotkit.errors import ArgumentError, CompilerError
from aotkit.models import MLP, MLPConfig, make_mlp_batch
from aotkit.partition import min_cut_rematerialization_partition

aten = torch.ops.aten
COMPILERS = {"ts_compile": ts_compile, "simple_ts_compile": simple_ts_compile}


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_compiler_runs_models_like_eager(compiler: str, model: str) -> None:
    # Three calls: TorchScript's profiling executor optimizes the graph after its first runs.
    check_model(model, COMPILERS[compiler], calls=3)


def transformer_block() -> nn.Module:
    return nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1,
                                      batch_first=True)


def mlp() -> nn.Module:
    return MLP(MLPConfig(width=16, depth=3))


@pytest.mark.parametrize("model", ["mlp", "transformer_block"])
def test_memory_efficient_fusion_trains_like_eager(model: str) -> None:
    make, x = {"mlp": (mlp, make_mlp_batch(0, MLPConfig(width=16), batch=4)[0]),
               "transformer_block": (transformer_block, torch.randn(2, 5, 16))}[model]
    train_like_eager(make, memory_efficient_fusion, x)


def test_ts_compile_transformer_block_with_dropout_trains_like_eager() -> None:
    train_like_eager(transformer_block, lambda m: aotkit.aot_module(m, ts_compile),
                     torch.randn(2, 5, 16))


def test_memory_efficient_fusion_of_a_function() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x @ w).sin()

    compiled = memory_efficient_fusion(f)
    assert isinstance(compiled, aotkit.AotFunction)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    compiled(x, w).sum().backward()
    f(x2, w2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_memory_efficient_fusion_defaults_and_overrides() -> None:
    compiled = memory_efficient_fusion(mlp())
    options = compiled._options
    assert options.fw_compiler is ts_compile and options.bw_compiler is ts_compile
    assert options.partition_fn is min_cut_rematerialization_partition
    assert options.decompositions is default_decompositions

    recording = RecordingCompiler()
    f = memory_efficient_fusion(lambda x: nn.functional.gelu(x).sum(), fw_compiler=recording,
                                bw_compiler=recording, dynamic=True)
    assert f.options.fw_compiler is recording and f.options.dynamic
    x = torch.randn(6, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, torch.func.grad(lambda t: nn.functional.gelu(t).sum())(x))
    backward_ops = {n.target for n in recording.graphs[1].graph.nodes}
    assert aten.gelu_backward.default not in backward_ops  # decomposed to pointwise ops


def test_memory_efficient_fusion_unknown_keyword_names_the_valid_ones() -> None:
    with pytest.raises(ArgumentError, match=r"(?s)partition.*Fix: pass only keyword arguments of "
                       r"aot_module: fw_compiler, bw_compiler, partition_fn, decompositions"):
        memory_efficient_fusion(mlp(), partition=min_cut_rematerialization_partition)
    with pytest.raises(ArgumentError, match="num_params_buffers"):
        memory_efficient_fusion(lambda x: x, fw_compilr=ts_compile)


def test_default_decompositions_table() -> None:
    assert aten.gelu_backward.default in default_decompositions
    assert aten.hardswish.default in default_decompositions
    assert all(isinstance(op, torch._ops.OpOverload) for op in default_decompositions)
    # Dropout must draw eager's random numbers; reductions keep their fast kernels.
    for op in (aten.native_dropout.default, aten._softmax.default, aten.native_layer_norm.default):
        assert op not in default_decompositions


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_memory_efficient_fusion_of_logit_matches_eager(dtype: torch.dtype, eps: Any) -> None:
    """logit_backward stays whole: its decomposition gave bfloat16 gradients of 0 where eager's
    are 1000 or inf, and a ``nan`` literal TorchScript cannot read (eps=None)."""
    x0 = torch.tensor([0.0, 0.0005, 0.001, 0.3, 0.5, 0.999, 1.0], dtype=dtype)
    grads = []
    for wrap in (lambda fn: fn, memory_efficient_fusion):
        x = x0.clone().requires_grad_()
        wrap(lambda t: torch.logit(t, eps=eps))(x).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], equal_nan=True)


def test_nnc_jit_decorates_a_function() -> None:
    @nnc_jit
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x.sin() * y + x).relu().sum(0)

    assert isinstance(f, aotkit.AotFunction)
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    x2, y2 = (t.detach().clone().requires_grad_() for t in (x, y))
    for _ in range(3):
        out, expected = f(x, y), f.fn(x2, y2)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(y.grad, y2.grad)


def test_ts_compile_symbolic_sizes_one_entry() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * x.shape[0]).relu().sum(1)

    compared = check_against_eager(f, torch.randn(4, 3, requires_grad=True), compiler=ts_compile,
                                   aot_kwargs={"dynamic": True})
    check_against_eager(f, torch.randn(7, 3, requires_grad=True), compiler=ts_compile,
                        aot_kwargs={"dynamic": True})
    compared.compiled(torch.randn(9, 3, requires_grad=True))
    assert compared.compiled.num_entries == 1


@pytest.mark.parametrize("fn", [
    lambda x: x.std(-1),  # the backward scales by 1 / float(n - 1)
    lambda x: x / x.shape[-1] ** 0.5,  # attention's scale
    lambda x: x * math.sqrt(x.shape[0]) + max(x.shape[0], x.shape[1]),
    lambda x: x * x.shape[0] ** 2,  # TorchScript's int ** int is a float: a raw error
    # builtins TorchScript lacks; round(5 / 2) is 2 (half to even), TorchScript's 3.0
    lambda x: x * round(x.shape[0] / 2) + round(x.shape[1]),
    lambda x: x * abs(x.shape[0] - 7) + abs(x.shape[1] / 2 - 5),
    lambda x: x * math.trunc(x.shape[1] / 4),
], ids=["std", "scale", "sqrt_max", "int_pow", "round", "abs", "trunc"])
@pytest.mark.parametrize("compile_with", ["ts_compile", "memory_efficient_fusion"])
def test_torchscript_compilers_take_size_arithmetic(fn: Any, compile_with: str) -> None:
    compiled = (aotkit.aot_function(fn, ts_compile, dynamic=True) if compile_with == "ts_compile"
                else memory_efficient_fusion(fn, dynamic=True))
    for shape in [(4, 6), (5, 7)]:
        check_compiled(fn, compiled, torch.randn(shape, requires_grad=True))


def _narrowed(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return x.narrow(0, n.item(), 2) * 2  # the graph holds sym_sum and sym_ite of its sizes


def _checked(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    k = n.item()
    torch._check(k >= 0)
    return x * k


def _asserted(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    torch._assert_async((x > -10).all(), "x is at most -10")
    return x * n


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize(("fn", "compiler", "bad"), [
    (_narrowed, "ts_compile", [(0, 4), (0, 5)]),
    (_checked, "ts_compile", [(0, -1)]),
    (_asserted, "ts_compile", [(-20, 1)]),
    (_asserted, "simple_ts_compile", [(-20, 1)]),  # static: simple_ts_compile types no sizes
])
def test_torchscript_keeps_the_graphs_checks(fn: Any, compiler: str, bad: list[tuple[int, int]],
                                             train: bool) -> None:
    """TorchScript drops ATen's asserts as if they computed nothing: x * -1 ran where eager
    raises. Data-dependent sizes (sym_sum, sym_ite) compile. (shift, n) makes a bad call."""
    compiled = aotkit.aot_function(fn, COMPILERS[compiler], dynamic=compiler == "ts_compile")
    x = torch.arange(5.0, requires_grad=train)
    check_compiled(fn, compiled, x, torch.tensor(1))
    for shift, n in bad:
        args = (x + shift, torch.tensor(n))
        with pytest.raises(RuntimeError):
            fn(*args)
        with pytest.raises(RuntimeError):
            compiled(*args)


def test_a_size_rounded_to_digits_is_refused_naming_it() -> None:
    compiled = aotkit.aot_function(lambda x: x * round(x.shape[0] / 3, 2), ts_compile,
                                   dynamic=True)
    with pytest.raises(CompilerError, match=r"rounds a size to digits"):
        compiled(torch.ones(3, 2))


def test_a_size_squared_stays_an_int() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x, dtype=torch.long) * x.shape[0] ** 2

    compiled = aotkit.aot_function(f, ts_compile, dynamic=True)
    for n in (5, 6):
        x = torch.randn(n, 3)
        assert torch.equal(compiled(x), f(x))  # dtype too: int64, not float32


def test_ts_compile_casts_devices_and_none_grads() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float64) @ w + torch.ones(2, device=x.device, dtype=torch.float64)
        return y.float() * n

    check_against_eager(f, torch.randn(4, 3, requires_grad=True),
                        torch.randn(3, 2, dtype=torch.float64, requires_grad=True),
                        torch.randn(4, 2), compiler=ts_compile, calls=3)


def test_ts_compile_leaves_the_graph_it_was_given() -> None:
    recording = RecordingCompiler()
    aotkit.aot_function(lambda x: x.cos().to(torch.float64), recording)(torch.randn(3))
    gm = recording.graphs[0]
    code = gm.code
    compiled = ts_compile(gm, recording.example_inputs[0])
    assert gm.code == code
    assert isinstance(compiled.scripted, torch.jit.ScriptModule) and compiled._boxed_call
    torch.testing.assert_close(compiled([torch.zeros(3)])[0], torch.ones(3, dtype=torch.float64))


def test_torchscript_deprecation_warnings_are_not_shown() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = aotkit.aot_function(lambda x: x.exp().sum(), ts_compile)
        f(torch.randn(3, requires_grad=True)).backward()
    shown = [str(w.message) for w in caught]
    assert not [m for m in shown if "deprecated" in m or "TorchScript" in m], shown


def _untraceable_by_torchscript(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return x + sum(rest)


def test_torchscript_failure_is_a_compiler_error() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output([graph.call_function(_untraceable_by_torchscript, (x, x))])
    gm = fx.GraphModule(nn.Module(), graph)
    for compiler in COMPILERS.values():
        with pytest.raises(CompilerError, match=r"(?s)TorchScript could not compile.*inductor"):
            compiler(gm, [torch.randn(2)])


def test_ts_compile_keeps_the_device_index() -> None:
    # Scripting needs no GPU: the device only has to reach the scripted code intact.
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3)
    moved = graph.call_function(torch.ops.aten._to_copy.default, (x,),
                                {"device": torch.device("cuda", 1)})
    graph.output([moved])
    gm = fx.GraphModule({}, graph)
    code = ts_compile(gm, [torch.empty(3)]).scripted.code
    assert 'device=torch.device("cuda:1")' in code, code
    assert moved.kwargs["device"] == torch.device("cuda", 1)  # the given graph is left alone


@pytest.mark.parametrize("compile_with", ["ts_compile", "simple_ts_compile"])
def test_a_dtype_view_is_refused_before_anything_runs(compile_with: str) -> None:
    """TorchScript reads a dtype as an int: x.view(torch.int32) ran as view(x, [3]), a raw
    error at run time (or a view to the wrong shape)."""
    compiler = getattr(aotkit.compilers, compile_with)

    def fn(x):
        x.mul_(2)
        return x.view(torch.int32)

    x = torch.arange(12.0).view(3, 4)
    with torch.no_grad(), pytest.raises(aotkit.errors.CompilerError,
                                        match=r"reinterprets a tensor's dtype(.|\n)*Fix"):
        aotkit.aot_function(fn, compiler)(x)
    assert torch.equal(x, torch.arange(12.0).view(3, 4))  # nothing written


def test_ts_compile_takes_a_graph_returning_one_value() -> None:
    """``fx.symbolic_trace``'s graphs return one value, not a tuple: a raw TypeError."""
    class M(torch.nn.Module):
        def forward(self, x):
            return x.sin().cos()

    x = torch.randn(3)
    gm = torch.fx.symbolic_trace(M())
    torch.testing.assert_close(ts_compile(gm, [x])([x.clone()]), M()(x))


def test_ts_compile_takes_nan_constants() -> None:
    """FX writes a NaN constant as ``nan``, which TorchScript does not know: every graph with
    one (``torch.where(x > 0, x, nan)``) was refused."""
    def f(t):
        return torch.where(t > 0, t, float("nan")).exp().nan_to_num(-1.0)

    x = torch.linspace(-1, 1, 6, requires_grad=True)
    check_against_eager(f, x, compiler=ts_compile)
