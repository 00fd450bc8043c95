"""Inductor as aotkit's code generator: ``torch.compile(backend="aotkit_inductor")`` trains the
MLP and the TinyTransformer like eager, runs inference under no_grad and serves several batch
sizes with ``dynamic=True``; ``aotkit.compilers.inductor`` works with ``aot_function`` directly.

Every Inductor compile costs seconds here, so the models are small and the tests few. Dropout:
Inductor draws random numbers with its own generator, so the Transformer test sets
``torch._inductor.config.fallback_random`` (random ops run ATen's kernels, eager's numbers for
the same seed) and keeps dropout on.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch
from tests.aot.eager_check import RecordingCompiler, check_compiled
from tests.compilers.compiler_check import train_like_eager
from torch._inductor import config as inductor_config

import aotkit
from aotkit.compilers import inductor
from aotkit.counters import counters
from aotkit.errors import ArgumentError, CompilerError
from aotkit.models import (
    MLP,
    MLPConfig,
    TinyTransformer,
    TransformerConfig,
    make_mlp_batch,
    make_token_batch,
)

# The module (``aotkit.compilers.inductor`` the attribute is the compiler object).
compilers_inductor = importlib.import_module("aotkit.compilers.inductor")

MLP_CFG = MLPConfig(width=32, depth=3, batch=8)
TRANSFORMER_CFG = TransformerConfig(vocab=16, d_model=16, heads=2, layers=1, seq=6, batch=2,
                                    dropout=0.1)


def aotkit_inductor(model: torch.nn.Module, **kwargs: object) -> torch.nn.Module:
    return torch.compile(model, backend="aotkit_inductor", **kwargs)


def test_mlp_training_steps_equal_eager() -> None:
    train_like_eager(lambda: MLP(MLP_CFG), aotkit_inductor, make_mlp_batch(0, MLP_CFG)[0])
    assert counters["aot"]["traces"] == 1
    assert counters["aot"]["bw_compiles"] == 1


def test_transformer_training_steps_with_dropout_equal_eager() -> None:
    tokens = make_token_batch(0, TRANSFORMER_CFG)[0]
    with inductor_config.patch(fallback_random=True):
        train_like_eager(lambda: TinyTransformer(TRANSFORMER_CFG), aotkit_inductor, tokens)
    partitions = aotkit.explain().of_kind("partition")
    assert partitions and "min_cut" in str(partitions[0])


def test_inference_under_no_grad() -> None:
    model = MLP.from_seed(0, MLP_CFG)
    x = make_mlp_batch(1, MLP_CFG)[0]
    with torch.no_grad():
        out = aotkit_inductor(model)(x)
        expected = model(x)
    torch.testing.assert_close(out, expected)
    assert not out.requires_grad
    assert counters["aot"]["inference_compiles"] == 1
    assert counters["aot"]["fw_compiles"] == 0


def test_dynamic_shapes_one_trace_serves_several_batch_sizes() -> None:
    model = MLP.from_seed(0, MLP_CFG)
    compiled = aotkit_inductor(model, dynamic=True)
    for batch in (3, 5, 9):
        x = make_mlp_batch(batch, MLP_CFG, batch=batch)[0]
        out = compiled(x)
        out.square().sum().backward()
        grad = model.net[0].weight.grad
        model.zero_grad()
        expected = model(x)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad, model.net[0].weight.grad, rtol=1e-4, atol=1e-4)
        model.zero_grad()
    assert counters["aot"]["traces"] == 1
    assert counters["aot"]["bw_compiles"] == 1


def test_inductor_compiler_with_aot_function() -> None:
    """``inductor`` alone tells forward, backward and inference graphs apart."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w).sin().sum(1)

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    compiled = aotkit.aot_function(f, inductor, num_params_buffers=1,
                                   decompositions=inductor.decompositions)
    out = compiled(x, w)
    out.sum().backward()
    expected = f(x2, w2)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), expected)


@pytest.mark.parametrize("grad", [False, True])
def test_copies_of_one_value_come_back_apart(grad: bool) -> None:
    """Note [Outputs Inductor merges]: Inductor dropped both clones and returned one tensor
    twice, so changing one output in place changed the other."""

    def two_copies(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y.clone(), y.clone()

    compiled = torch.compile(two_copies, backend="aotkit_inductor")
    for _ in range(2):
        a, b = compiled(torch.ones(3, requires_grad=grad))
        assert a.data_ptr() != b.data_ptr()
        with torch.no_grad():
            a.add_(1)
        torch.testing.assert_close(b, torch.full((3,), 2.0))


def test_copies_come_back_apart_after_a_first_call_with_empty_outputs() -> None:
    """An empty output has no memory to compare: the first call, whose outputs were empty,
    could not show that Inductor merges them."""

    def two_copies(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x[x > 0] * 2
        return y.clone(), y.clone()

    compiled = aotkit.aot_function(two_copies, inductor, decompositions=inductor.decompositions,
                                   dynamic=True)
    assert [t.numel() for t in compiled(-torch.ones(6))] == [0, 0]
    for _ in range(2):
        a, b = compiled(torch.arange(6.0) - 2)
        a.fill_(-1)
        torch.testing.assert_close(b, torch.tensor([2.0, 4.0, 6.0]))


@pytest.mark.parametrize("partition", ["default", "min_cut"])
@pytest.mark.parametrize("pad", [(1, 2), (0, 2), (-1, 0), (1, 1, 2, 0)])
def test_dynamic_constant_pad_backward_binds_the_input_size(pad: tuple[int, ...],
                                                            partition: str) -> None:
    """The backward of F.pad(x, (1, 2)) sees only s0 + 3, the tangent's size; Inductor needs s0
    itself (Note [Binding symbols in the backward])."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, pad).exp()

    compiled = aotkit.aot_function(
        f, inductor, decompositions=inductor.decompositions, dynamic=True,
        partition_fn=aotkit.min_cut_rematerialization_partition if partition == "min_cut"
        else aotkit.default_partition)
    for shape in [(2, 4), (3, 5)]:
        check_compiled(f, compiled, torch.randn(shape, requires_grad=True))
    assert compiled.num_entries == 1


def test_compiled_autograd_gives_leaves_sharing_a_gradient_their_own_grad() -> None:
    """One gradient reaching two leaves (``W + dW``) became both ``.grad``s under Inductor;
    the next step's accumulation then added it twice (Note [Outputs Inductor merges])."""

    def steps(compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w, dw = torch.randn(3, 4, requires_grad=True), torch.zeros(3, 4, requires_grad=True)
        for _ in range(2):
            loss = torch.nn.functional.linear(torch.randn(5, 4), w + dw).pow(2).sum()
            with (aotkit.compiled_autograd.enable(
                    lambda gm: torch.compile(gm, backend="aotkit_inductor"))
                  if compiled else contextlib.nullcontext()):
                loss.backward()
        assert w.grad is not dw.grad
        return [w.grad, dw.grad]

    torch.testing.assert_close(steps(True), steps(False))


def test_two_leaves_one_gradient_reaches_get_grads_of_their_own() -> None:
    """Note [Outputs Inductor merges]: the backward returns one node for both biases (min-cut,
    after CSE); Inductor gave two tensors over one buffer, which autograd took as both
    ``.grad``s: the next accumulation added twice (PyTorch's inductor backend is right)."""

    def f(x, b1, b2):
        return (x + b1 + b2).relu()

    x = torch.tensor([[1.0, -1.0, 2.0], [3.0, 1.0, -2.0]])
    results = []
    for run in (f, torch.compile(f, backend="aotkit_inductor")):
        b1, b2 = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
        for _ in range(2):
            run(x, b1, b2).sum().backward()
        assert b1.grad.data_ptr() != b2.grad.data_ptr()
        results.append((b1.grad, b2.grad))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("grad", [False, True])
def test_an_output_inductor_makes_the_input_itself_comes_back_apart(grad: bool) -> None:
    """Inductor drops ``x + zeros``: the output came back as the input's memory, so a
    caller's in-place change to the output changed the input (PyTorch's inductor too)."""

    def f(x):
        return x + torch.zeros_like(x), x * torch.ones(3)

    compiled = torch.compile(f, backend="aotkit_inductor")
    for _ in range(2):
        x = torch.arange(3.0, requires_grad=grad)
        with torch.no_grad():
            for y in compiled(x):
                y.add_(100)
        torch.testing.assert_close(x.detach(), torch.arange(3.0))


def test_views_of_a_closed_over_tensor_stay_views_of_it() -> None:
    """Its views' traced memory was not the lifted input's (the constant's value is faked
    anew), and a view of the same memory through another tensor was taken for other memory:
    both came back as copies, so a write through them missed the closed-over tensor."""
    table = torch.arange(6.0).view(2, 3)

    def f(x):
        return x * 2, table[0], table.t()

    compiled = aotkit.aot_function(f, aotkit.compilers.inductor,
                                   decompositions=aotkit.compilers.inductor.decompositions)
    _, row, transposed = compiled(torch.ones(3))
    assert row._base is not None and transposed._base is not None
    row.add_(100)
    assert table[0].tolist() == [100.0, 101.0, 102.0] and transposed[1, 0] == 101.0


def test_closed_over_tensors_are_read_as_they_are_at_each_call() -> None:
    """A closed-over tensor with a negative bit was read without its sign; one given another
    dtype or layout through ``.data`` was read as the old one (garbage, or Inductor's raw
    AssertionError; then the backward read a saved one so: garbage gradients): it compiles
    anew, naming the change (Note [Constants changed in place])."""
    signed = torch.tensor([1 - 1j, 2 - 2j, 3 - 3j]).conj().imag
    table = torch.arange(6.0).view(2, 3).clone()

    def f(x):
        return x * signed + x * table

    compiled = aotkit.aot_function(f, aotkit.compilers.inductor,
                                   decompositions=aotkit.compilers.inductor.decompositions)
    x = torch.ones(3, requires_grad=True)
    for data in (None, torch.arange(6, dtype=torch.float64).view(2, 3),
                 torch.arange(6.0).view(3, 2).t()):
        if data is not None:
            table.data = data
        expected = torch.autograd.functional.vjp(f, x, torch.ones(2, 3, dtype=table.dtype))
        out = compiled(x)
        torch.testing.assert_close((out, *torch.autograd.grad(out, x, torch.ones_like(out))),
                                   expected)
    assert [d.why.count("changed in place") for d in aotkit.explain().of_kind("recompile")] \
        == [1, 1]


def test_saved_activations_keep_traced_strides_under_layout_optimization() -> None:
    """On CPU Inductor computes convolutions channels-last; the backward was traced for the
    saved activations' traced (contiguous) strides, so the forward must return them so."""
    torch.manual_seed(0)
    layers = [(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3)) for _ in "ab"]
    model, reference = (torch.nn.Sequential(*ls) for ls in layers)
    reference.load_state_dict(model.state_dict())
    compiled = aotkit.aot_module(model, inductor, decompositions=inductor.decompositions)
    x = torch.randn(2, 3, 10, 10)
    out, expected = compiled(x), reference(x)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


class _AttentionWithDropout(torch.nn.Module):
    """scaled_dot_product_attention's CPU math path computes in float32 under bfloat16 autocast
    and casts back: the graph holds float32 matmuls autocast would cast."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        return self.out(attn.transpose(1, 2).reshape(2, 8, 16))


def test_first_call_under_autocast_compiles_the_traced_dtypes() -> None:
    """The first call compiles under the caller's autocast; Inductor must see the graph's own
    casts only (it planned bfloat16 buffers as float32 and failed with "mat1 and mat2 must have
    the same dtype"). See Note [Compiling outside autocast]."""
    torch.manual_seed(0)
    model, reference = _AttentionWithDropout(), _AttentionWithDropout()
    reference.load_state_dict(model.state_dict())
    compiled = aotkit_inductor(model)
    x, outs = torch.randn(2, 8, 16), []
    with inductor_config.patch(fallback_random=True):  # eager's dropout numbers
        for m in (compiled, reference):
            torch.manual_seed(1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(m(x))
            outs[-1].float().pow(2).sum().backward()
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)


class _TwoSparseTables(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = (torch.nn.Embedding(10, 6, sparse=True) for _ in "ui")

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (self.users(u) * self.items(i)).sum()


@torch.library.custom_op("aotkit_inductor_test::add_and_double_", mutates_args=("a", "b"))
def _add_and_double_(a: torch.Tensor, b: torch.Tensor) -> None:
    a.add_(1)
    b.mul_(2)


@_add_and_double_.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> None:
    return None


def test_a_custom_op_writing_two_views_of_an_intermediate_runs_as_traced() -> None:
    """Inductor's in-place lowering lost the first write where the views share memory (so does
    PyTorch's backend="inductor"): [3, 5, 12, 16, ...] for eager's [3, 5, 14, 18, ...]."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        _add_and_double_(y[:4], y[2:6])
        return y * 1

    x = torch.arange(1.0, 9.0)
    torch.testing.assert_close(torch.compile(fn, backend="aotkit_inductor")(x), fn(x))
    assert any("add_and_double_" in d.why for d in aotkit.explain().of_kind("fallback"))


def _rows_plus_one(y: torch.Tensor) -> torch.Tensor:
    _add_and_double_(y[1:3], y[:, -1:])  # the column's start is symbolic under dynamic=True
    return y * 2


def _two_rows(y: torch.Tensor) -> torch.Tensor:
    _add_and_double_(y[1:2], y[2:3])  # a slice of a base at a symbolic storage offset
    return y * 2


@pytest.mark.parametrize("fn", [_rows_plus_one, _two_rows], ids=["column", "rows"])
@pytest.mark.parametrize("via", ["aot_function", "torch.compile"])
def test_a_custom_op_writing_a_view_at_a_symbolic_offset_runs_as_traced(via: str, fn: Any) -> None:
    """Inductor wrote other rows (or failed with a raw NameError) for a view a custom op writes
    at a symbolic storage offset, or of a base at one (PyTorch's backend="inductor" too)."""
    compiled = aotkit.aot_function(fn, inductor, dynamic=True) if via == "aot_function" \
        else torch.compile(fn, backend="aotkit_inductor", dynamic=True)
    for start, rows in ((2, 6), (3, 6), (1, 7)):
        results = []
        for run in (fn, compiled):
            buf = torch.arange(40.0).reshape(10, 4)
            results.append((run(buf[start:start + rows]), buf))
        torch.testing.assert_close(results[1], results[0])
    assert any("symbolic storage offset" in d.why for d in aotkit.explain().of_kind("fallback"))


def test_graphs_computing_sparse_tensors_run_as_traced() -> None:
    """Inductor reused the memory a sparse gradient's values live in: the second table's
    gradient came out wrong, silently. Such graphs run as traced, a decision says so; a closed-
    over sparse matrix failed inside Inductor. See Note [Sparse values and Inductor]."""
    model, reference = _TwoSparseTables(), _TwoSparseTables()
    reference.load_state_dict(model.state_dict())
    u, i = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    aotkit_inductor(model)(u, i).backward()
    reference(u, i).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad.to_dense(), q.grad.to_dense())
    assert any("sparse tensor" in d.why for d in aotkit.explain().of_kind("fallback"))
    matrix = torch.eye(4).to_sparse() * 2
    f = aotkit.aot_function(lambda x: torch.mm(matrix, x).cos(), inductor.forward,
                            inductor.backward, inference_compiler=inductor.inference)
    x = torch.randn(4, 3)
    torch.testing.assert_close(f(x), torch.mm(matrix, x).cos())


def test_graph_without_inductor_decompositions_is_refused() -> None:
    f = aotkit.aot_function(lambda x: torch.nn.functional.gelu(x), inductor)
    with pytest.raises(CompilerError, match=r"(?s)aten.gelu.default.*decompositions=inductor"):
        f(torch.randn(3))
    # native_dropout has a lowering, one that asserts unless fallback_random is set
    g = aotkit.aot_function(lambda x: torch.nn.functional.dropout(x * 2, 0.5), inductor)
    with pytest.raises(CompilerError, match=r"(?s)native_dropout.*decompositions=inductor"):
        g(torch.randn(3, requires_grad=True))


def test_graph_kinds() -> None:
    recording = RecordingCompiler()
    f = aotkit.aot_function(lambda x: x.sin().sum(), recording)
    f(torch.randn(3, requires_grad=True)).backward()
    with torch.no_grad():
        f(torch.randn(3, requires_grad=True))
    kinds = [compilers_inductor.graph_kind(gm) for gm in recording.graphs]
    assert kinds == ["forward", "backward", "inference"]
    assert [inductor.forward.kind, inductor.backward.kind, inductor.inference.kind] == [
        "forward", "backward", "inference"]
    assert repr(inductor.backward) == "aotkit.compilers.inductor.backward"
    with pytest.raises(ArgumentError, match="forward"):
        compilers_inductor.Inductor("sideways")  # type: ignore[arg-type]


def test_backend_is_registered_with_dynamo() -> None:
    from aotkit.backends import aotkit_inductor as backend

    assert torch._dynamo.lookup_backend("aotkit_inductor") is backend


def test_max_pool_in_a_fresh_process() -> None:
    """Inductor's max_pool decomposition reads torch._inductor.lowering, which nothing has
    imported when aotkit is the first to trace with Inductor's table in a process."""
    import subprocess
    import sys

    script = (
        "import torch, aotkit\n"
        "f = lambda x: torch.nn.functional.max_pool2d(x, 2).sum()\n"
        "x = torch.randn(1, 2, 4, 4, requires_grad=True)\n"
        "out = torch.compile(f, backend='aotkit_inductor')(x)\n"
        "out.backward()\n"
        "g = x.grad.clone(); x.grad = None; f(x).backward()\n"
        "torch.testing.assert_close(g, x.grad)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _incremented(x: torch.Tensor) -> torch.Tensor:
    return x.add_(1)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("fn", [_doubled, _incremented])
@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, dtype=torch.complex64).conj().imag,  # negative bit, strides (2,)
    lambda: torch.randn(4, dtype=torch.complex64).conj(),       # conjugate bit: the graph's own
], ids=["neg", "conj"])
def test_inputs_with_a_sign_bit_read_and_write_as_in_eager(make, fn, keep) -> None:
    """Note [Inputs with a negative bit]: Inductor read a negative view's memory
    without its sign, and wrote the wrong values back (PyTorch's inductor backend the same)."""
    compiled = aotkit.aot_function(fn, aotkit.compilers.inductor,
                                   keep_inference_input_mutations=keep)
    torch.manual_seed(0)
    expected_input = make()
    expected = fn(expected_input).clone()
    torch.manual_seed(0)
    actual_input = make()
    with torch.no_grad():
        actual = compiled(actual_input)
    torch.testing.assert_close(actual.resolve_conj().resolve_neg(),
                               expected.resolve_conj().resolve_neg())
    torch.testing.assert_close(actual_input.resolve_conj().resolve_neg(),
                               expected_input.resolve_conj().resolve_neg())


def test_an_expanded_input_with_a_negative_bit_reads_as_in_eager() -> None:
    """Its resolved copy was made in its own (overlapping) layout: a raw RuntimeError."""
    n = torch.tensor([1 + 2j, 3 - 4j, 5 + 6j]).conj().imag.unsqueeze(0).expand(2, 3)
    compiled = torch.compile(lambda n: n * 2 + 1, backend="aotkit_inductor")
    torch.testing.assert_close(compiled(n), n * 2 + 1)


def test_negative_inputs_with_a_stride_0_dimension_of_size_1_or_0_are_no_expansions() -> None:
    """A size-1 dimension with stride 0 shares no memory: its write was lost (taken for an
    expanded input, whose writes are refused); an empty one's span was negative (a raw
    RuntimeError)."""
    def make():
        return torch.tensor([1 + 2j, 3 - 4j, 5 + 6j]).conj().imag.expand(2, 3)

    def incremented(n):
        n.add_(1)
        return n * 2

    expected_input, actual_input = make()[:1], make()[:1]
    expected = incremented(expected_input)
    actual = torch.compile(incremented, backend="aotkit_inductor")(actual_input)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual_input, expected_input)
    empty = make()[:, :0]
    assert torch.compile(lambda n: n * 2 + 1, backend="aotkit_inductor")(empty).shape == (2, 0)


def test_real_and_imag_of_a_conjugate_input_match_eager() -> None:
    """The graph resolves a conjugate input's bit itself: a resolved copy was conjugated twice
    (view_as_real refused it)."""
    def parts(z: torch.Tensor) -> torch.Tensor:
        return z.real * 2 + z.imag

    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
    torch.testing.assert_close(aotkit.aot_function(parts, aotkit.compilers.inductor)(z), parts(z))


def test_batched_gradients_through_an_inductor_backward_are_refused_naming_the_fix() -> None:
    """is_grads_batched hands the backward legacy batched tensors, which Inductor's kernels
    cannot read: PyTorch's raw "Cannot access data pointer" came through (its inductor backend
    the same). The nop backward takes them."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * x.exp()

    x = torch.randn(3, requires_grad=True)
    want = torch.autograd.grad(f(x), x, torch.eye(3), is_grads_batched=True)[0]
    with pytest.raises(aotkit.errors.UnsupportedError, match=r"batched gradients(.|\n)*Fix: pass "
                                                             r"the gradients one at a time"):
        torch.autograd.grad(torch.compile(f, backend="aotkit_inductor")(x), x, torch.eye(3),
                            is_grads_batched=True)
    got = torch.autograd.grad(aotkit.aot_function(f, aotkit.compilers.nop)(x), x, torch.eye(3),
                              is_grads_batched=True)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("grad", [False, True])
def test_a_view_of_a_mutated_input_with_an_odd_size_one_stride_under_dynamic_shapes(grad):
    """Inductor lays a size-1 dim's stride out its own way: the view's place in the input was
    refused (training) or not found (inference), after the input had been written."""
    def fn(x):
        x.mul_(2)
        return x[:, 0]

    compiled = torch.compile(fn, backend="aotkit_inductor", dynamic=True)
    for n in (3, 5):
        leaf = torch.randn(n, 3, 1, requires_grad=grad)
        x = (leaf * 1).transpose(1, 2)  # strides (3, 1, 1)
        expected = fn(x.detach().clone())
        with torch.set_grad_enabled(grad):
            out = compiled(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(x, expected.unsqueeze(1), rtol=0, atol=0)
        assert out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        if grad:
            out.sum().backward()
            assert leaf.grad.tolist() == torch.full((n, 3, 1), 2.0).tolist()


def test_a_graph_on_meta_tensors_runs_as_traced_with_a_fallback_decision():
    """Inductor generates no kernels for meta tensors: it failed with an FX ordering error."""
    def fn(x, w):
        return (x @ w).relu().sum(0)

    x = torch.empty(4, 3, device="meta", requires_grad=True)
    out = torch.compile(fn, backend="aotkit_inductor")(x, torch.empty(3, 2, device="meta"))
    assert out.device.type == "meta" and out.shape == (2,)
    whys = [d.why for d in aotkit.explain().of_kind("fallback")]
    assert any("meta tensors" in why for why in whys), whys


@pytest.mark.parametrize("grad", [False, True])
def test_a_view_of_a_mutated_input_with_gaps_runs_as_traced_with_a_fallback_decision(grad):
    """Note [Views of inputs with gaps]: Inductor returns no view ops, so such a view was
    refused at run time, after the input had been written (twice on a retry)."""
    def fn(x):
        x.mul_(2)
        return x.t()

    compiled = torch.compile(fn, backend="aotkit_inductor")
    for _ in range(2):
        leaf = torch.ones(3, 6, requires_grad=grad)
        base = leaf * 1
        x = base[:, ::2]
        with torch.set_grad_enabled(grad):
            out = compiled(x)
        assert torch.equal(out, torch.full((3, 3), 2.0)) and out._base is base
        assert torch.equal(base[:, 1::2], torch.ones(3, 3))  # the gaps untouched
        if grad:
            out.sum().backward()
            assert leaf.grad.tolist() == [[2.0, 0.0] * 3] * 3  # eager's: the gaps get none
    assert any("with gaps" in d.why for d in aotkit.explain().of_kind("fallback"))


def test_as_strided_on_a_closed_over_tensor_runs_as_traced() -> None:
    """as_strided's offset counts from the memory's start, Inductor's code from the lifted
    tensor's: a closed-over slice (``arange(12)[2:6]``) read other elements, silently."""
    table = torch.arange(12.0)[2:6]

    def f(x):
        return x + torch.as_strided(table, (2,), (1,), 0)

    compiled = aotkit.aot_function(f, aotkit.compilers.inductor,
                                   decompositions=aotkit.compilers.inductor.decompositions)
    x = torch.zeros(2)
    torch.testing.assert_close(compiled(x), f(x))
    [decision] = aotkit.explain().of_kind("fallback")
    assert "as_strided on a closed-over tensor" in decision.why


def test_inductor_given_a_graph_returning_one_value_says_what_it_compiles() -> None:
    """``fx.symbolic_trace``'s graphs return one value: a raw TypeError."""
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Tanh()))
    with pytest.raises(ArgumentError, match="returns one value"):
        inductor(gm, [torch.randn(3)])
