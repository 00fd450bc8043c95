"""print_compile, draw_graph_compile and debug_nop: each runs real models exactly as eager
does, and debug_nop catches a node whose real layout differs from its traced one."""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from tests.aot.eager_check import check_against_eager
from tests.compilers.compiler_check import TRANSFORMER_CFG, check_model

import aotkit
from aotkit.compilers import debug_nop, draw_graph_compile, print_compile
from aotkit.errors import CompilerError, MetadataMismatchError
from aotkit.models import TinyTransformer, make_token_batch

needs_graphviz = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz not installed")


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("compiler", ["print_compile", "debug_nop"])
def test_compiler_runs_models_like_eager(compiler: str, model: str, capsys: Any) -> None:
    check_model(model, {"print_compile": print_compile, "debug_nop": debug_nop}[compiler])
    printed = capsys.readouterr().out
    if compiler == "print_compile":
        assert printed.count("def forward(self, primals_1") == 1  # the forward, printed once
        assert "def forward(self, " in printed.split("def forward(self, primals_1")[1]  # backward
        assert "torch.ops.aten.mm.default" in printed
    else:
        assert printed == ""


def test_nop_takes_any_placeholder_names_and_pytree_inputs() -> None:
    """A placeholder named ``args`` (symbolic_trace of ``forward(self, args)``) and a make_fx
    graph of a function of a dict run as they did before Note [Freeing inputs as the graph
    goes]."""
    class TakesArgs(torch.nn.Module):
        def forward(self, args: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return args * x

    gm = torch.fx.symbolic_trace(TakesArgs())
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(aotkit.compilers.nop(gm, [a, b])([a, b]), a * b)
    from torch.fx.experimental.proxy_tensor import make_fx

    tree = make_fx(lambda d: d["a"] * 2)({"a": a})
    torch.testing.assert_close(aotkit.compilers.nop(tree, [])([{"a": a}]), a * 2)


def test_nop_empties_the_list_it_is_given() -> None:
    """The boxed convention, as Inductor's compiled graphs: pass a fresh list per call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    run = aotkit.compilers.nop(make_fx(torch.sin)(torch.zeros(2)), [])
    args = [torch.zeros(2)]
    torch.testing.assert_close(run(args), torch.zeros(2))
    assert args == []


def test_print_compile_prints_readable_code(capsys: Any) -> None:
    f = aotkit.aot_function(lambda x: x.cos() * 2, print_compile)
    assert torch.equal(f(torch.ones(3)), torch.ones(3).cos() * 2)
    printed = capsys.readouterr().out
    assert 'cos: "f32[3]" = torch.ops.aten.cos.default(' in printed


@needs_graphviz
def test_draw_graph_compile_draws_forward_and_backward(tmp_path: Path) -> None:
    check_model("mlp", draw_graph_compile(str(tmp_path / "mlp")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp_0.svg", "mlp_1.svg"]
    forward = (tmp_path / "mlp_0.svg").read_text()
    assert forward.startswith("<?xml") and "<svg" in forward
    assert ">primals_1<" in forward and ">aten.addmm.default<" in forward
    assert ">float32[4, 16]<" in forward
    assert "tangents_1" in (tmp_path / "mlp_1.svg").read_text()


def test_two_draw_graph_compilers_of_one_name_draw_apart(tmp_path: Path) -> None:
    """Numbered per compiler, the backward's drawing replaced the forward's."""
    prefix = str(tmp_path / "g.dot")
    f = aotkit.aot_function(torch.exp, fw_compiler=draw_graph_compile(prefix),
                            bw_compiler=draw_graph_compile(prefix))
    f(torch.zeros(2, requires_grad=True)).sum().backward()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g_0.dot", "g_1.dot"]
    assert "tangents_1" not in (tmp_path / "g_0.dot").read_text()


def test_draw_graph_compile_without_graphviz_writes_dot_and_records_why(
        tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    f = aotkit.aot_function(lambda x: x.sin(), draw_graph_compile(str(tmp_path / "sin")))
    f(torch.ones(2, requires_grad=True)).sum().backward()
    assert sorted(p.name for p in tmp_path.glob("sin_*")) == ["sin_0.dot", "sin_1.dot"]
    assert (tmp_path / "sin_0.dot").read_text().startswith("digraph")
    fallbacks = aotkit.explain().of_kind("fallback")
    assert len(fallbacks) == 2 and "apt-get install graphviz" in fallbacks[0].why
    assert aotkit.counters.counters["fallback"][f"draw_graph_compile({tmp_path / 'sin'})"] == 2


# --- debug_nop -------------------------------------------------------------------------------


def planting(change: Callable[[fx.Node], None], target: Any) -> Callable[..., Any]:
    """A compiler that changes the traced value of the first ``target`` node, then runs debug_nop."""

    def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        change(next(n for n in gm.graph.nodes if n.target == target))
        return debug_nop(gm, example_inputs)

    return compiler


def transpose_layout(node: fx.Node) -> None:
    """The same shape with column-major strides: ``(4, 6)`` strides ``(6, 1)`` -> ``(1, 4)``."""
    node.meta["val"] = node.meta["val"].t().contiguous().t()


def matmul_gelu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w)


def test_debug_nop_catches_a_planted_stride_mismatch() -> None:
    f = aotkit.aot_function(matmul_gelu, planting(transpose_layout, torch.ops.aten.mm.default))
    with pytest.raises(MetadataMismatchError) as caught:
        f(torch.randn(4, 5, requires_grad=True), torch.randn(5, 6))
    message = str(caught.value)
    assert message.startswith("debug_nop: node 'mm' (aten.mm.default) gave strides")
    assert "While executing" not in message  # no second copy of the node from fx.Interpreter
    assert "strides (6, 1), traced (1, 4)" in message and "dims [0, 1] differ" in message
    assert "Fix:" in message and "register_fake" in message
    assert isinstance(caught.value, CompilerError)


def test_debug_nop_catches_a_planted_dtype_and_shape_mismatch() -> None:
    def half(node: fx.Node) -> None:
        node.meta["val"] = node.meta["val"].half()

    def wider(node: fx.Node) -> None:
        node.meta["val"] = node.meta["val"].new_empty((4, 7))

    for change, expected in ((half, "dtype torch.float32, traced torch.float16"),
                             (wider, "shape (4, 6), traced (4, 7)")):
        f = aotkit.aot_function(matmul_gelu, planting(change, torch.ops.aten.mm.default))
        with pytest.raises(MetadataMismatchError, match=re.escape(expected)):
            f(torch.randn(4, 5), torch.randn(5, 6))


def test_debug_nop_ignores_strides_of_size_one_dims() -> None:
    def other_unit_stride(node: fx.Node) -> None:  # (1, 6) with stride (6, 1) -> (99, 1)
        val = node.meta["val"]
        node.meta["val"] = val.new_empty_strided(val.shape, (99, 1))

    f = aotkit.aot_function(matmul_gelu, planting(other_unit_stride, torch.ops.aten.mm.default))
    x, w = torch.randn(1, 5), torch.randn(5, 6)
    torch.testing.assert_close(f(x, w), matmul_gelu(x, w))


def test_debug_nop_allows_layouts_chosen_from_an_input_with_size_one_dims() -> None:
    """Note [Strides that differ in dims of size 1]: the gradient of a one-channel output is
    both contiguous and channels_last; pixel_unshuffle's backward laid its result out by the
    real one's strides, and debug_nop blamed pixel_unshuffle's fake kernel."""
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
    eager_x = x.detach().clone().requires_grad_()
    out = aotkit.aot_function(lambda t: F.pixel_shuffle(t, 2), aotkit.compilers.debug_nop)(x)
    out.backward(torch.ones_like(out))  # laid out as the output: channels_last strides
    want = F.pixel_shuffle(eager_x, 2)
    want.backward(torch.ones_like(want))
    assert torch.equal(x.grad, eager_x.grad) and x.grad.stride() == eager_x.grad.stride()


@torch.library.custom_op("aotkit_test::column_major_copy", mutates_args=())
def column_major_copy(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


@column_major_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # wrong: real is column-major


class ScaleColumnMajor(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_major_copy(x) * 2  # the line the error must point at


def test_debug_nop_names_the_user_line_of_an_op_whose_fake_strides_are_wrong() -> None:
    with aotkit.config.patch(record_stack_traces=True):
        f = aotkit.aot_module(ScaleColumnMajor(), debug_nop)
        with pytest.raises(MetadataMismatchError) as caught:
            f(torch.randn(3, 4))
    message = str(caught.value)
    assert "node 'column_major_copy' (aotkit_test.column_major_copy.default)" in message
    assert "strides (1, 3), traced (4, 1)" in message
    assert "column_major_copy(x) * 2  # the line the error must point at" in message
    assert os.path.basename(__file__) in message


def test_debug_nop_dynamic_aot_function_resolves_sizes() -> None:
    check_against_eager(matmul_gelu, torch.randn(4, 5, requires_grad=True),
                        torch.randn(5, 6, requires_grad=True), compiler=debug_nop,
                        aot_kwargs={"dynamic": True})
    f = aotkit.aot_function(matmul_gelu, debug_nop, dynamic=True)
    for rows in (3, 7):
        x, w = torch.randn(rows, 5, requires_grad=True), torch.randn(5, 6, requires_grad=True)
        f(x, w).sum().backward()
        expected = torch.func.grad(lambda x, w: matmul_gelu(x, w).sum())(x.detach(), w.detach())
        torch.testing.assert_close(x.grad, expected)
    assert f.num_entries == 1

    planted = aotkit.aot_function(
        matmul_gelu, planting(transpose_layout, torch.ops.aten.mm.default), dynamic=True)
    with pytest.raises(MetadataMismatchError) as caught:
        planted(torch.randn(7, 5), torch.randn(5, 6))
    message = str(caught.value)
    assert re.search(r"strides \(6, 1\), traced \(1, (s\d+)\) = \(1, 7\)", message), message
    assert re.search(r"resolved from the inputs: .*s\d+=7", message), message


def aotkit_backend(compiler: Any) -> Any:
    return lambda gm, inputs: aotkit.aot_module_simplified(gm, inputs, compiler)


def test_debug_nop_dynamic_torch_compile_resolves_sizes() -> None:
    f = torch.compile(matmul_gelu, backend=aotkit_backend(debug_nop), dynamic=True)
    for rows in (3, 5, 8):
        x, w = torch.randn(rows, 5, requires_grad=True), torch.randn(5, 6)
        out = f(x, w)
        out.sum().backward()
        expected_x = x.detach().requires_grad_()
        expected = matmul_gelu(expected_x, w)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, expected_x.grad)

    torch._dynamo.reset()
    planted = torch.compile(
        matmul_gelu, backend=aotkit_backend(planting(transpose_layout, torch.ops.aten.mm.default)),
        dynamic=True)
    with pytest.raises(MetadataMismatchError, match=r"traced \(1, s\d+\) = \(1, 9\)"):
        planted(torch.randn(9, 5), torch.randn(5, 6))


def test_debug_nop_trains_a_transformer_with_dropout_like_eager_through_torch_compile() -> None:
    cfg = replace(TRANSFORMER_CFG, dropout=0.1)
    eager, compiled = TinyTransformer.from_seed(0, cfg), TinyTransformer.from_seed(0, cfg)
    backend = aotkit_backend(debug_nop)
    step = torch.compile(lambda tokens, targets: compiled.loss(tokens, targets), backend=backend)
    for seed in range(2):
        tokens, targets = make_token_batch(seed, cfg)
        torch.manual_seed(seed)
        want = eager.loss(tokens, targets)
        want.backward()
        torch.manual_seed(seed)
        got = step(tokens, targets)
        got.backward()
        torch.testing.assert_close(got, want)
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"grad of {n}: {m}")


# --- what a compiler's callable returns ------------------------------------------------------


def returning(result: Callable[[Sequence[Any], fx.GraphModule], Any]) -> Callable[..., Any]:
    """A compiler whose boxed callable returns ``result(args, gm)`` instead of the graph's
    outputs."""
    def compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aotkit.make_boxed_func(lambda *args: result(args, gm))
    return compiler


def _scaled_sine(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


_WRONG_RESULTS = {
    "None": (lambda args, gm: None, r"returned NoneType, not a list or tuple"),
    "a tensor": (lambda args, gm: gm(*args)[0], r"returned Tensor, not a list or tuple"),
    "too few": (lambda args, gm: list(gm(*args))[1:], r"returned (\d+) value\(s\)"),
    "too many": (lambda args, gm: [*gm(*args), args[0]], r"returned (\d+) value\(s\)"),
}


@pytest.mark.parametrize("wrong", list(_WRONG_RESULTS))
@pytest.mark.parametrize("graph", ["forward", "backward", "inference"])
def test_a_callable_returning_the_wrong_outputs_is_a_compiler_error(graph: str,
                                                                   wrong: str) -> None:
    result, said = _WRONG_RESULTS[wrong]
    bad = returning(result)
    nop = aotkit.compilers.nop
    compilers = {"forward": (bad, nop), "backward": (nop, bad), "inference": (nop, nop)}[graph]
    f = aotkit.aot_function(_scaled_sine, *compilers,
                            inference_compiler=bad if graph == "inference" else None)
    x = torch.randn(3, requires_grad=graph != "inference")
    with pytest.raises(CompilerError) as caught:
        f(x).sum().backward() if graph != "inference" else f(x)
    message = str(caught.value)
    shape = rf"the callable compiler 'compiler' made for the {graph} graph {said}; the {graph} "
    match = re.match(shape + r"graph has (\d+) output\(s\)\.\nFix: ", message)
    assert match, message
    if wrong.startswith("too"):
        got, expected = int(match[1]), int(match[2])
        assert got == (expected - 1 if wrong == "too few" else expected + 1)


@pytest.mark.parametrize("graph", ["forward", "backward", "inference"])
def test_a_callable_returning_nones_for_tensors_is_a_compiler_error(graph: str) -> None:
    bad = returning(lambda args, gm: [None] * len(gm(*args)))  # the right count, no values
    nop = aotkit.compilers.nop
    compilers = {"forward": (bad, nop), "backward": (nop, bad), "inference": (nop, nop)}[graph]
    f = aotkit.aot_function(_scaled_sine, *compilers,
                            inference_compiler=bad if graph == "inference" else None)
    x = torch.randn(3, requires_grad=graph != "inference")
    with pytest.raises(CompilerError, match=rf"the callable compiler 'compiler' made for the "
                                            rf"{graph} graph returned NoneType as output 0"):
        f(x).sum().backward() if graph != "inference" else f(x)


@pytest.mark.parametrize("compiler", [
    lambda gm: gm, draw_graph_compile, aotkit.compilers.memory_efficient_fusion])
def test_a_compiler_that_cannot_take_a_graph_and_inputs_is_refused_up_front(compiler: Any) -> None:
    for role in ("fw_compiler", "bw_compiler", "inference_compiler"):
        kwargs = {"fw_compiler": aotkit.compilers.nop, role: compiler}
        with pytest.raises(aotkit.errors.ArgumentError,
                           match=rf"{role} '\S+' cannot be called as compiler\(gm, "
                                 r"example_inputs\): its signature is .*\nFix: "):
            aotkit.aot_function(_scaled_sine, **kwargs)


def test_compiler_factories_called_wrongly_say_how_to_call_them(tmp_path: Path) -> None:
    from aotkit.compilers import graph_dumper_aot

    with pytest.raises(aotkit.errors.ArgumentError, match=r"current_name was a GraphModule"):
        aotkit.aot_function(_scaled_sine, graph_dumper_aot)(torch.randn(2))
    with pytest.raises(aotkit.errors.ArgumentError, match=r"folder_name must be a path"):
        graph_dumper_aot("model", None)
    for name in ("a/b", ""):  # wrote into a/b/a/b_inference_0, or an unnamed _inference_0
        with pytest.raises(aotkit.errors.ArgumentError, match=r"without path separators"):
            graph_dumper_aot(name, tmp_path)
    with pytest.raises(aotkit.errors.ArgumentError, match=r"cannot draw '\.pdf' files"):
        draw_graph_compile(str(tmp_path / "graph.pdf"))
    assert list(tmp_path.iterdir()) == []
    aotkit.aot_function(_scaled_sine, draw_graph_compile(str(tmp_path / "resnet.layer1")))(
        torch.randn(2))  # a dot in a name is no extension
    assert [p.stem for p in tmp_path.iterdir()] == ["resnet.layer1_0"]


def test_make_boxed_compiler_of_a_compiler_returning_none_is_named() -> None:
    def gives_none(gm: fx.GraphModule, example_inputs: Any) -> None:
        return None

    f = aotkit.aot_function(_scaled_sine, aotkit.make_boxed_compiler(gives_none))
    with pytest.raises(CompilerError, match=r"compiler 'gives_none' returned NoneType for the "
                                            r"forward graph\.\nFix: return a callable"):
        f(torch.randn(3, requires_grad=True))


def test_make_boxed_compiler_of_a_one_argument_function_is_refused() -> None:
    with pytest.raises(aotkit.errors.ArgumentError, match=r"its signature is <lambda>\(gm\)"):
        aotkit.make_boxed_compiler(lambda gm: gm)

    def configured(gm: fx.GraphModule, inputs: Any, option: str) -> Any:
        return gm.forward

    @functools.wraps(configured)  # its own signature counts, not the wrapped one's
    def wrapper(gm: fx.GraphModule, inputs: Any) -> Any:
        return configured(gm, inputs, "x")

    f = aotkit.aot_function(_scaled_sine, aotkit.make_boxed_compiler(wrapper))
    x = torch.randn(3)
    torch.testing.assert_close(f(x), _scaled_sine(x))


def test_not_callable_compilers_and_functions_are_argument_errors() -> None:
    with pytest.raises(aotkit.errors.ArgumentError, match="fw_compiler must be callable"):
        aotkit.aot_function(_scaled_sine, None)  # type: ignore[arg-type]
    with pytest.raises(aotkit.errors.ArgumentError, match="fw_compiler must be callable"):
        aotkit.aot_module(torch.nn.Linear(2, 2), None)  # type: ignore[arg-type]
    with pytest.raises(aotkit.errors.ArgumentError, match="make_boxed_func wraps a callable"):
        aotkit.make_boxed_func(3)  # type: ignore[arg-type]
    with pytest.raises(aotkit.errors.ArgumentError, match="make_boxed_compiler wraps a callable"):
        aotkit.make_boxed_compiler(3)  # type: ignore[arg-type]


def test_right_outputs_pass_the_check_as_lists_or_tuples() -> None:
    as_tuple = returning(lambda args, gm: tuple(gm(*args)))
    f = aotkit.aot_function(_scaled_sine, as_tuple, as_tuple)
    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.cos())


@pytest.mark.parametrize("train", [True, False])
def test_debug_nop_lets_batch_norms_known_dtype_difference_through_and_records_it(train) -> None:
    """Note [Mismatches PyTorch is known to have]: under CPU autocast batch norm's saved mean
    comes back float32 where its fake kernel says bfloat16, so every AMP CNN failed the check."""
    import copy

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train(train)
    compiled = torch.compile(copy.deepcopy(eager), backend="aotkit_debug")
    x = torch.randn(2, 3, 6, 6)
    outs = []
    for run in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(run(x))
        outs[-1].float().sum().backward()  # the backward gets the saved mean as an input
    torch.testing.assert_close(outs[1], outs[0])
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    known = aotkit.explain().of_kind("known_mismatch")  # once per node: the op, its getitems
    assert any("_native_batch_norm_legit" in d.why for d in known)
    assert all("dtype torch.float32, traced torch.bfloat16" in d.why for d in known)
    if train:  # the backward's placeholders of the saved mean and inverse deviation
        assert any("(placeholder: output 1 of aten._native_batch_norm_legit" in d.why
                   for d in known)


@pytest.mark.parametrize("norm", [lambda: torch.nn.LayerNorm(8), lambda: torch.nn.GroupNorm(2, 8)])
def test_debug_nop_knows_layer_and_group_norms_statistics_dtype_under_autocast(norm) -> None:
    """A bfloat16 activation into LayerNorm (BERT's prediction head) or GroupNorm: the CPU
    kernels give mean and rstd (and group norm's backward its gradients) in other dtypes than
    their fake kernels, which failed the check although eager and the graph agree."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), norm())
    x = torch.randn(4, 8)
    results = []
    for run in (model, torch.compile(model, backend="aotkit_debug")):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        out.float().sum().backward()
        results.append((out, model[0].weight.grad.clone()))
    torch.testing.assert_close(results[1], results[0])
    assert aotkit.explain().of_kind("known_mismatch")


def test_compiler_factories_and_compilers_misused_are_argument_errors() -> None:
    """draw_graph_compile(123) and debug_compile called as a wrapper raised Python's own
    TypeError and AttributeError."""
    with pytest.raises(aotkit.errors.ArgumentError, match="file name prefix, got int"):
        draw_graph_compile(123)  # type: ignore[arg-type]
    with pytest.raises(aotkit.errors.ArgumentError, match="takes an FX GraphModule and example inputs, got function"):
        aotkit.compilers.debug_compile(lambda x: x, [])  # type: ignore[arg-type]


def test_the_recompile_limit_error_states_the_limit() -> None:
    f = aotkit.aot_function(lambda x: x * 2, aotkit.compilers.nop)
    with aotkit.config.patch(recompile_limit=2):
        f(torch.ones(1)), f(torch.ones(2))
        with pytest.raises(aotkit.errors.RecompileLimitError,
                           match=r"compiled for 2 input signature\(s\), and aotkit.config."
                                 r"recompile_limit is 2"):
            f(torch.ones(3))


@pytest.mark.parametrize("name", ["nop", "print_compile", "debug_nop", "ts_compile",
                                  "simple_ts_compile", "debug_compile", "inductor"])
def test_a_compiler_called_on_a_function_says_it_is_a_compiler(name: str) -> None:
    """Taken for a decorator (as nnc_jit is): raw AttributeErrors came ('graph', 'named_modules'),
    or a callable that failed later."""
    from aotkit.errors import ArgumentError

    with pytest.raises(ArgumentError, match=rf"{name} is a compiler(.|\n)*Fix: pass it as a "):
        getattr(aotkit.compilers, name)(torch.sin, [torch.zeros(2)])


def test_a_boxed_graph_called_twice_with_one_list_says_to_pass_a_fresh_one() -> None:
    """A wrapper calling nop's callable twice with one list got a raw ValueError ("not enough
    values to unpack"): the first call empties the list."""
    def twice(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        inner = aotkit.compilers.nop(gm, example_inputs)

        def run(args: list[Any]) -> Any:
            inner(args)
            return inner(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    with pytest.raises(aotkit.errors.ArgumentError, match=r"got a list of 0(.|\n)*fresh list"):
        aotkit.aot_function(torch.sin, twice)(torch.randn(3))
