"""What a trace cannot capture (aotkit.aot.untraceable): autograd bookkeeping inside a compiled
function and gradients through sparse tensors made inside are refused with their fix, where
PyTorch's aot_function silently computes something else; PyTorch's own saved-tensor hooks,
sparse tensors without gradients and torch.compile still run. Also inputs autograd saved after
the function wrote them (Note [Inputs saved after a write])."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from eager_check import check_against_eager, rand
from torch import nn
from torch.utils.checkpoint import checkpoint

import aotkit
from aotkit import compilers
from aotkit.errors import UnsupportedError


def _with_grads() -> tuple[torch.Tensor, torch.Tensor]:
    p, q = torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)
    p.grad, q.grad = torch.full((4,), 2.0), torch.full((4,), 3.0)
    return p, q


def _clip(p, q):
    return torch.nn.utils.clip_grad_norm_([p, q], max_norm=1.0)


def _step(p, q):
    with torch.no_grad():
        for t in (p, q):
            if t.grad is not None:
                t.add_(t.grad, alpha=-0.1)
    return p * 1


def _set_grad(p, q):
    p.grad = q * 2
    return q


@pytest.mark.parametrize(("fn", "verb"), [(_clip, "reads"), (_step, "reads"),
                                          (_set_grad, "sets")])
def test_grad_of_an_input_inside_is_refused(fn, verb):
    """The trace saw .grad as None: clip_grad_norm_ returned 0 and clipped nothing, the step
    moved nothing, and p.grad stayed None (PyTorch's aot_function does all three)."""
    p, q = _with_grads()
    with pytest.raises(UnsupportedError, match=rf"{verb} \.grad of args\[0\] \(at (.|\n)*"
                       rf"test_untraceable.py:\d+ in {fn.__name__}(.|\n)*Fix: pass the gradient as an argument"):
        aotkit.aot_function(fn, compilers.nop)(p, q)
    torch.testing.assert_close(p.grad, torch.full((4,), 2.0))  # nothing ran


def test_grad_of_a_parameter_read_by_an_aot_module_forward_is_refused():
    class Scaled(nn.Linear):
        def forward(self, x):
            scale = 1.0 if self.weight.grad is None else 0.5
            return super().forward(x) * scale

    model = aotkit.aot_module(Scaled(3, 2), compilers.nop)
    with pytest.raises(UnsupportedError, match=r"reads \.grad of weight"):
        model(torch.randn(4, 3))


def test_grad_of_a_closed_over_parameter_is_refused():
    """An optimizer's zero_grad(set_to_none=True) cleared .grad once, while tracing (gradients
    piled up from the second step); a gradient norm read then became a graph constant; a
    .grad set was left holding a tracing tensor."""
    lin = nn.Linear(3, 2)
    lin(torch.randn(4, 3)).sum().backward()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for fn, verb in ((lambda: opt.zero_grad(set_to_none=True), "reads"),
                     (lambda x: x * lin.weight.grad.norm(), "reads"),
                     (lambda x: setattr(lin.bias, "grad", x * 2) or x, "sets")):
        with pytest.raises(UnsupportedError, match=rf"{verb} \.grad of a tensor that it does not"):
            aotkit.aot_function(fn, compilers.nop)(*([torch.ones(2)] if fn.__code__.co_argcount
                                                     else []))
    assert lin.weight.grad is not None and type(lin.bias.grad) is torch.Tensor
    from torch.testing._internal.two_tensor import TwoTensor

    constant = torch.ones(3)  # .grad of what is made inside from it is None, as in eager
    check_against_eager(lambda x: x * (TwoTensor(constant, constant).grad is None)
                        + torch.vmap(lambda r: r * (r.grad is None))(constant * x)
                        + x * (constant.grad is None), rand(3))


def test_grad_work_under_torch_compile_matches_eager():
    torch._dynamo.reset()
    results = []
    for run in (_clip, torch.compile(_clip, backend="aotkit")):
        p, q = _with_grads()
        norm = run(p, q)
        results.append((norm, p.grad, q.grad))
    torch.testing.assert_close(results[1], results[0])


def test_grad_of_a_tensor_made_inside_reads_none_as_in_eager():
    def fn(x):
        y = x * 2
        return y if y.grad is None else y * 0

    with pytest.warns(UserWarning, match="non-leaf Tensor"):
        check_against_eager(fn, rand(3, grad=True))


@pytest.mark.parametrize(("call", "what"), [
    (lambda x: x.retain_grad(), r"retain_grad\(\)"),
    (lambda x: x.register_post_accumulate_grad_hook(lambda p: None),
     r"register_post_accumulate_grad_hook\(\)"),
    (lambda x: (x * 2).sum().backward(), r"backward\(\)"),
    (lambda x: torch.autograd.backward([(x * 2).sum()]), r"backward\(\)"),
])
def test_autograd_calls_inside_are_refused(call, what):
    """retain_grad and the hook were silently lost; backward() failed with PyTorch's "Cannot
    backprop through mirrored meta"; the post-accumulate hook said the leaf was no leaf."""
    def fn(x, w):
        y = x * w
        call(x if "post_accumulate" in what else y)
        return y

    with pytest.raises(UnsupportedError, match=rf"calls {what} \(at \S+test_untraceable.py"):
        aotkit.aot_function(fn, compilers.nop)(rand(3, grad=True), rand(3, grad=True))


def _halve(t):
    return t * 0.5


def test_saved_tensor_hooks_entered_inside_are_refused():
    """They do not run while tracing: a pack hook halving activations changed eager's weight
    gradient and not aotkit's (PyTorch's aot_function the same)."""
    def fn(x, w):
        with torch.autograd.graph.saved_tensors_hooks(_halve, lambda t: t):
            return (x @ w).tanh().sum()

    with pytest.raises(UnsupportedError, match=r"saved-tensor hooks of its own \(pack hook "
                       r"'_halve'(.|\n)*Fix: enter torch.autograd.graph.saved_tensors_hooks "
                       r"around the call"):
        aotkit.aot_function(fn, compilers.nop)(rand(2, 3), rand(3, 4, grad=True))


def test_saved_tensor_hooks_around_the_call_still_run():
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    compiled = aotkit.aot_function(lambda x, w: (x @ w).tanh().sum(), compilers.nop)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(rand(2, 3), rand(3, 4, grad=True))
    out.backward()
    assert packed  # the compiled forward's saved tensors went through the hook


def test_pytorch_checkpoint_and_save_on_cpu_inside_still_match_eager():
    def fn(x, w):
        with torch.autograd.graph.save_on_cpu():
            h = checkpoint(lambda a: (a @ w).tanh(), x, use_reentrant=False)
        return (h * h).sum()

    check_against_eager(fn, rand(2, 3, grad=True), rand(3, 4, grad=True))


def _sine(x, w):
    return (x * w).sin()


class _RoundStraightThrough(torch.autograd.Function):
    """Rounds; its own jvp and backward pass the tangent and gradient straight through."""

    @staticmethod
    def forward(x):
        return x.round()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad

    @staticmethod
    def jvp(ctx, tangent):
        return tangent


def _straight_through(x, w):
    return _RoundStraightThrough.apply(x * 3.0) * w


def _reads_its_tangent(x, w):
    primal, tangent = fwAD.unpack_dual(x)
    return primal * w + (tangent if tangent is not None else 0)


@pytest.mark.parametrize("fn", [_sine, _straight_through, _reads_its_tangent],
                         ids=["sine", "custom_jvp", "unpack_dual"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("compiler", ["nop", "inductor"])
def test_forward_mode_ad_runs_eagerly_with_eagers_tangents(fn, grad, compiler):
    """Note [Forward-mode AD runs eagerly]: Inductor's kernels dropped the tangents, a custom
    Function's jvp was traced away (zeros) and unpack_dual inside saw none (PyTorch's
    aot_function the same); with inputs requiring grad the call was refused."""
    kwargs = ({"decompositions": compilers.inductor.decompositions}
              if compiler == "inductor" else {})
    compiled = aotkit.aot_function(fn, getattr(compilers, compiler), **kwargs)
    x, w, tangent = rand(4, grad=grad), rand(4, grad=grad), rand(4)
    with fwAD.dual_level():
        expected = fwAD.unpack_dual(fn(fwAD.make_dual(x, tangent), w))
        actual = fwAD.unpack_dual(compiled(fwAD.make_dual(x, tangent), w))
    torch.testing.assert_close((actual.primal, actual.tangent),
                               (expected.primal, expected.tangent))
    [decision] = aotkit.explain().of_kind("fallback")
    assert "forward-mode AD dual tensors: it runs eagerly" in decision.why
    torch.testing.assert_close(compiled(x, w), fn(x, w))  # without duals: compiled


def test_forward_mode_ad_under_torch_compile_gives_eagers_tangents():
    """aotkit_inductor's kernels dropped the tangent (PyTorch's inductor backend does too)."""
    compiled = torch.compile(_sine, backend="aotkit_inductor")
    x, w, tangent = rand(4), rand(4), rand(4)
    with fwAD.dual_level():
        expected = fwAD.unpack_dual(_sine(fwAD.make_dual(x, tangent), w))
        actual = fwAD.unpack_dual(compiled(fwAD.make_dual(x, tangent), w))
    torch.testing.assert_close((actual.primal, actual.tangent),
                               (expected.primal, expected.tangent))


def test_a_closed_over_dual_tensor_is_refused():
    """Its tangent was silently dropped when an input required grad (the compiled Function's
    jvp runs only for dual arguments)."""
    x = rand(3, grad=True)
    with fwAD.dual_level():
        w = fwAD.make_dual(rand(3), torch.ones(3))
        with pytest.raises(UnsupportedError, match=r"forward-mode AD dual tensor(.|\n)*its "
                                                   r"tangent would be lost(.|\n)*Fix: pass it"):
            aotkit.aot_function(lambda x: x * w, compilers.nop)(x)


@pytest.mark.parametrize("how", ["aot_function", "torch.compile"])
def test_a_dual_tensor_made_inside_and_returned_is_refused(how):
    """fwAD.make_dual at the caller's level inside the function: the graph returned the primal
    without its tangent (None, silently; PyTorch's aot_function and aot_eager too)."""
    def fn(x, t):
        return fwAD.make_dual(x, t).sin()

    compiled = (aotkit.aot_function(fn, compilers.nop) if how == "aot_function"
                else torch.compile(fn, backend="aotkit"))
    x, t = rand(3), rand(3)
    with fwAD.dual_level():
        assert fwAD.unpack_dual(fn(x, t)).tangent is not None  # eager's carries it
        with pytest.raises(Exception, match=r"returns a forward-mode AD dual tensor it made(.|\n)*"
                                            r"Fix: return the tangent itself") as info:
            compiled(x, t)
    assert isinstance(getattr(info.value, "inner_exception", info.value), UnsupportedError)


def test_a_tangent_computed_inside_at_the_callers_level_is_returned():
    def fn(x, t):
        out = fwAD.unpack_dual(fwAD.make_dual(x, t).sin())
        return out.primal, out.tangent

    x, t = rand(3), rand(3)
    with fwAD.dual_level():
        expected = fn(x, t)
        actual = aotkit.aot_function(fn, compilers.nop)(x, t)
    torch.testing.assert_close(actual, expected)


def _write_and_save(x, w):
    x.mul_(2)
    return x * w, x.view(-1)


def _write_then_exp(x, w):
    x.mul_(2)
    return x.exp() * w, x.view(-1)


def _backward_after(fn, caller_write, two_calls=False):
    """Eager's or the compiled ``fn``'s outcome when the caller writes x before backward()."""
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    out, view = fn(x, w)
    if two_calls:
        out = out + fn(x, w)[0]
    if caller_write:
        view.add_(1)
    try:
        out.sum().backward()
    except RuntimeError as exc:
        return str(exc).split(":")[0]
    return "ran"


@pytest.mark.parametrize("entry", ["aot_function", "torch.compile"])
@pytest.mark.parametrize(("fn", "caller_write", "two_calls"), [
    (_write_and_save, True, False),   # eager raises: x was saved after the write
    (_write_and_save, False, True),   # the second call writes x again: eager raises too
    (_write_and_save, False, False),  # nothing written since: runs
    (_write_then_exp, True, False),   # eager saved exp(x), not x: runs
])
def test_the_caller_writing_an_input_saved_after_the_functions_write_raises_as_in_eager(
        fn, caller_write, two_calls, entry):
    """Note [Inputs saved after a write]: the graph saved its own new value of x, and the
    caller's write went unnoticed (PyTorch's aot_function and aot_eager the same)."""
    torch._dynamo.reset()
    compiled = aotkit.aot_function(fn, compilers.nop) if entry == "aot_function" else \
        torch.compile(fn, backend="aotkit")
    torch.manual_seed(0)
    expected = _backward_after(fn, caller_write, two_calls)
    torch.manual_seed(0)
    assert _backward_after(compiled, caller_write, two_calls) == expected
    if caller_write and fn is _write_and_save:
        assert expected.startswith("one of the variables needed for gradient computation")


def test_batch_norm_statistics_written_twice_before_backward_do_not_raise():
    """BatchNorm's kernel updates its running statistics without moving their version, and
    eager saves them: two forwards before one backward must still run."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = aotkit.aot_module(copy.deepcopy(eager), compilers.nop)
    x1, x2 = torch.randn(8, 3), torch.randn(8, 3)
    for run in (eager, model):
        (run(x1).pow(2).sum() + run(x2).pow(3).sum()).backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize(("fn", "op"), [
    (lambda x, w: x.to_sparse().to_dense() * w, "to_dense"),  # x's gradient was lost
    (lambda x, w: torch.sparse.mm(x.to_sparse(), w), "_sparse_mm"),
    (lambda x, w: x.to_sparse_csr().to_dense() * w, "to_sparse_csr"),  # aborted the process
    (lambda x, w: torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), x[0, :2], (3, 3)),
     "sparse_coo_tensor"),  # failed in the backward
])
def test_gradients_through_sparse_tensors_made_inside_are_refused(fn, op):
    """Note [Sparse tensors made inside]."""
    with pytest.raises(UnsupportedError, match=rf"sparse or mkldnn tensor that autograd must "
                       rf"differentiate \({op}, at (.|\n)*Fix: do this part outside"):
        aotkit.aot_function(fn, compilers.nop)(rand(3, 3, grad=True), rand(3, 3, grad=True))


def test_sparse_tensors_without_gradients_and_sparse_outputs_still_match_eager():
    index = torch.tensor([[0, 1, 2], [1, 2, 0]])

    def message_passing(h, w):
        adjacency = torch.sparse_coo_tensor(index, torch.ones(3), (3, 3))
        return torch.sparse.mm(adjacency, h @ w), (h * 2).to_sparse().to_dense()

    if torch.__version__ < "2.13":  # its fake tensors run sparse conversions outside the trace
        with pytest.raises(UnsupportedError, match="lost track of"):
            aotkit.aot_function(message_passing, compilers.nop)(rand(3, 4), rand(4, 2, grad=True))
        return
    check_against_eager(message_passing, rand(3, 4), rand(4, 2, grad=True))
    out = aotkit.aot_function(lambda x: (x * 2).to_sparse(), compilers.nop)(rand(3, grad=True))
    assert out.layout is torch.sparse_coo and out.requires_grad


def _aux_unused(x, w, v):
    x.mul_(2)
    return (v.sin() * 2).sum(), (x * w).sum()  # (loss, auxiliary output that saves x)


def _data_saved(x, w, v):
    x.mul_(2)
    return (x.data * w).sum() + v.sum(), x.sum()  # .data: a version counter of its own


def _outcome(fn, backward):
    torch.manual_seed(0)
    x, w, v = torch.randn(3), torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    loss, _ = fn(x, w, v)
    x.zero_()  # the caller reuses the input's memory before backward
    try:
        grads = backward(loss, (w, v))
    except RuntimeError as exc:
        return str(exc).split(":")[0]
    return [g.tolist() for g in grads]


@pytest.mark.parametrize("fn", [_aux_unused, _data_saved])
@pytest.mark.parametrize("backward", [
    lambda loss, params: torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True),
    lambda loss, params: torch.autograd.grad(loss, params[1:]),  # the node saving x is pruned
])
def test_a_written_input_is_checked_only_where_eager_would_check_it(fn, backward):
    """Note [Inputs saved after a write]: backward raised "modified by an inplace operation"
    where eager never runs the node that saved x (an unused auxiliary output, autograd.grad
    with respect to other inputs) or saved x.data, which has a version counter of its own."""
    expected = _outcome(fn, backward)
    actual = _outcome(aotkit.aot_function(fn, compilers.nop), backward)
    assert not isinstance(expected, str) and not isinstance(actual, str)  # both run
    if fn is _aux_unused:  # eager's x.data * w reads the memory as the caller left it
        assert actual == expected


def test_retain_grad_on_a_leaf_input_and_torch_hooks_wrapped_in_partial_still_run():
    """retain_grad() on a leaf does nothing in eager; PyTorch's tensor parallelism wraps its
    saved-tensor hooks in functools.partial, whose module is functools."""
    import functools

    def fn(x, w):
        x.retain_grad()
        keep = functools.partial(nn.Identity())  # of a torch submodule, as TP's hooks are
        with torch.autograd.graph.saved_tensors_hooks(keep, keep):
            return (x * w).tanh().sum()

    check_against_eager(fn, rand(3, grad=True), rand(3, grad=True))


def test_autograd_grad_of_parameters_through_a_block_writing_its_input_matches_eager():
    """PyTorch cannot tell whether autograd.grad runs a leaf's AccumulateGrad: asking raised
    "A leaf node was passed to _will_engine_execute_node" (ReLU(inplace=True) saves its input)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 2))
    compiled = aotkit.aot_module(copy.deepcopy(block), compilers.nop)
    x = torch.randn(3, 4)
    grads = [torch.autograd.grad(run(x * 1).sum(), list(run.parameters()))
             for run in (block, compiled)]
    torch.testing.assert_close(grads[1], grads[0])


def test_an_input_saved_through_detach_is_checked_as_in_eager():
    """x.detach() shares x's version counter (x.data does not)."""
    def fn(x, w):
        x.mul_(2)
        return x.detach() * w

    expected = _backward_after(lambda x, w: (fn(x, w), x.view(-1)), caller_write=True)
    assert expected.startswith("one of the variables needed for gradient computation")
    compiled = aotkit.aot_function(fn, compilers.nop)
    assert _backward_after(lambda x, w: (compiled(x, w), x.view(-1)), caller_write=True) == expected


def test_sparse_tensors_made_under_no_grad_or_detached_still_match_eager():
    def fn(x, w):
        with torch.no_grad():
            a = x.to_sparse()
        return torch.sparse.mm(a, w).sum() + (x.to_sparse().detach().to_dense() * x).sum()

    if torch.__version__ < "2.13":  # its fake tensors run sparse conversions outside the trace
        with pytest.raises(aotkit.errors.AotkitError):
            aotkit.aot_function(fn, compilers.nop)(rand(3, 3, grad=True), rand(3, 2, grad=True))
        return
    check_against_eager(fn, rand(3, 3, grad=True), rand(3, 2, grad=True))


def test_torch_ops_used_as_saved_tensor_hooks_are_refused_wrapped_or_not():
    """torch.round changes values; only hooks of torch's submodules (checkpoint, save_on_cpu,
    tensor parallelism's) are known to keep them."""
    import functools

    def fn(x, w):
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(torch.round, decimals=1),
                                                      lambda t: t):
            return (x * w).tanh().sum()

    with pytest.raises(UnsupportedError, match="saved-tensor hooks of its own"):
        aotkit.aot_function(fn, compilers.nop)(rand(3, grad=True), rand(3, grad=True))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_strided_nested_tensor_argument_is_refused_naming_jagged():
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    with pytest.raises(UnsupportedError, match=r"layout=torch.strided(.|\n)*Fix: .*layout=torch.jagged"):
        aotkit.aot_function(lambda n: n * 2, aotkit.compilers.nop)(nt)


def _combine_saving_its_carry(carry, x):
    h = carry * x + 1
    return h, h.sin()  # sin's backward saves h, the new carry


def _scan_saving_its_carry(init, xs):
    from torch._higher_order_ops.scan import scan

    return scan(_combine_saving_its_carry, init, xs)


def _plain_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


_UNTRACEABLE_WITH_A_FIX = {  # what PyTorch's aot_function raises raw, and the fix we name
    "scan returning a saved carry": (_scan_saving_its_carry, (3,), (5, 3), "h.clone"),
    "checkpoint with plain contexts": (
        lambda x: checkpoint(torch.sin, x, use_reentrant=False, context_fn=_plain_contexts),
        (3,), None, "create_selective_checkpoint_contexts"),
    "checkpoint with debug=True": (
        lambda x: checkpoint(torch.sin, x, use_reentrant=False, debug=True), (3,), None,
        "drop context_fn or debug"),
    "checkpoint with its default use_reentrant": (
        lambda x: checkpoint(torch.sin, x), (3,), None, "its default where use_reentrant is not"),
    "a quantized tensor": (
        lambda x: torch.quantize_per_channel(x, torch.ones(3), torch.zeros(3, dtype=torch.long),
                                             0, torch.qint8).dequantize() * x,
        (3, 4), None, "backend='aotkit'"),
}


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint")
@pytest.mark.parametrize(("fn", "shape", "second", "fix"), _UNTRACEABLE_WITH_A_FIX.values(),
                         ids=_UNTRACEABLE_WITH_A_FIX.keys())
def test_untraceable_calls_name_their_fix(fn, shape, second, fix):
    args = [rand(*shape, grad=True)] + ([rand(*second, grad=True)] if second else [])
    with pytest.raises(UnsupportedError, match=re.escape(fix)) as refused:
        aotkit.aot_function(fn, compilers.nop)(*args)
    assert "\nFix: " in str(refused.value)


def test_a_dynamically_quantized_layer_names_torch_compile():
    model = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(8, 4)).eval(),
                                                   {nn.Linear}, dtype=torch.qint8)
    x = rand(3, 8)
    with torch.no_grad(), pytest.raises(UnsupportedError, match=r"quantized kernels(.|\n)*"
                                                                r"Fix: use torch.compile"):
        aotkit.aot_module(model, compilers.nop)(x)
    torch.testing.assert_close(torch.compile(model, backend="aotkit")(x), model(x))


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell, nn.LSTM])
def test_dynamically_quantized_recurrent_layers_name_torch_compile(cell):
    """Cells' packed weights were graph constants: load_state_dict's new ones never reached
    the graph (stale outputs, silently); an LSTM's raised a raw NotImplementedError."""
    model = torch.ao.quantization.quantize_dynamic(nn.Sequential(cell(8, 16)).eval(), {cell},
                                                   dtype=torch.qint8)
    x = rand(2, 5, 8) if cell is nn.LSTM else rand(5, 8)
    with torch.no_grad(), pytest.raises(UnsupportedError, match=r"quantized kernels(.|\n)*"
                                                                r"Fix: use torch.compile"):
        aotkit.aot_module(model, compilers.nop)(x)


def test_cond_inside_a_checkpoint_under_torch_compile_names_aot_function():
    def fn(x, w):
        def body(t, w):
            return torch.cond(t.sum() > 0, lambda t, w: t @ w, lambda t, w: (t - w).relu(), (t, w))
        return checkpoint(body, x, w, use_reentrant=False)

    x, w = rand(3, 3, grad=True), rand(3, 3, grad=True)
    check_against_eager(fn, x, w, compiler=compilers.nop)
    try:  # torch 2.11's checkpoint traces it; 2.13's cannot
        results = []
        for run in (fn, torch.compile(fn, backend="aotkit")):
            a, b = (t.detach().clone().requires_grad_() for t in (x, w))
            out = run(a, b)
            out.sum().backward()
            results.append((out, a.grad, b.grad))
        torch.testing.assert_close(results[1], results[0])
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        assert isinstance(failed.inner_exception, UnsupportedError)
        assert "aotkit.aot_function" in str(failed.inner_exception)


def _checkpointed_like_eager(base: nn.Module, x: torch.Tensor, via: str,
                             early_stop: bool = True) -> nn.Module:
    """One checkpointed step of a copy of ``base`` eagerly and one through ``via``; the
    compiled copy's state must equal eager's bit for bit. Returns the eager copy."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    models = {}
    for name in ("eager", via):
        torch._dynamo.reset()
        model = models[name] = copy.deepcopy(base)
        run = model if name == "eager" else (
            aotkit.aot_module(model, compilers.nop) if via == "aot_module"
            else torch.compile(model, backend="aotkit"))
        with set_checkpoint_early_stop(early_stop):
            checkpoint(run, x, use_reentrant=False).sum().backward()
    for (key, got), want in zip(models[via].state_dict().items(),
                                models["eager"].state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=key)
    return models["eager"]


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("via", ["aot_module", "torch.compile"])
def test_a_checkpoint_around_a_compiled_model_updates_its_statistics_as_eager(via, early_stop):
    """Note [Checkpoint's early stop]: the recompute stopped at the compiled function's saves,
    before its buffer writes, so batch norm's statistics were updated once where eager's
    recompute updates them again."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    _checkpointed_like_eager(base, rand(8, 4, grad=True), via, early_stop)


class _Bookkeeping(nn.Module):
    """Writes a buffer before its last saved tensor (batch norm) and two after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.lin(x)).relu()  # relu saves its result: the last save
        self.calls += 1
        self.ema.mul_(0.5).add_(y.detach().mean(0))
        return y


@pytest.mark.parametrize("via", ["aot_module", "torch.compile"])
def test_checkpoints_early_stop_repeats_only_the_writes_before_the_last_save(via):
    """Note [Checkpoint's early stop]: eager's recompute stops at its last save, so a step
    counter or an EMA written after it is written once; batch norm's statistics, before it,
    twice. Every write used to be repeated."""
    torch.manual_seed(0)
    eager = _checkpointed_like_eager(_Bookkeeping(), rand(8, 4, grad=True), via)
    assert eager.calls.item() == 1


class _DetachedStatistic(nn.Module):
    """The last save is on a branch kept nowhere (pow saves y, the result is detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("norm", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.steps += 1
        self.norm.copy_(y.pow(2).mean().detach())
        return y


class _SavedInABuffer(nn.Module):
    """The last save is in a buffer's own history (mul saves y), not the output's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("last", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        self.steps += 1
        self.last.copy_(y * y)
        return y


class _Observe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, steps):
        y = x * 2
        steps.add_(1)  # in its forward: before its save, which comes after it returns
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return grad * 2 + x * 0, None


class _Reversal(torch.autograd.Function):
    """Saves nothing: not a save, though Dynamo turns it into the same higher-order op."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _CustomLastSaver(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Observe.apply(x.sin(), self.steps)


class _Stash(torch.autograd.Function):
    """Keeps its input on ctx, which checkpoint does not count (Dynamo's higher-order op holds
    it with the saved values all the same)."""

    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.x.cos()


class _Counted(nn.Module):
    """A step counter written between a head and a tail, whose saves place eager's stop."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        self.steps += 1
        return self.tail(h)


class _StashAfterCounter(_Counted):
    def tail(self, h: torch.Tensor) -> torch.Tensor:
        return _Stash.apply(h)


class _ZeroDimLastSave(_Counted):
    """The last save is a 0-dim bool the function made (packed in eager), not a number."""

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(h.sum() > 0, h, 0.0)


class _CounterAfterLastSave(_Counted):
    """Neither y * 2.0 (its 2.0 is a number autograd saves unpacked) nor the reversal saves:
    eager's stop is relu's save, before the counter."""

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        return _Reversal.apply(h * 2.0)


class _ConstantLastSave(_Counted):
    """The last save is a closed-over 0-dim int64 tensor (packed in eager), not a number."""

    def __init__(self) -> None:
        super().__init__()
        self.n = torch.tensor(3)  # a plain attribute: a constant of the graph

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.n


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return 2 * x * grad


class _FunctionOnADetachedBranch(_Counted):
    """The last save is a custom Function's, applied between torch calls on a branch whose
    next op (mean) saves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.zeros(()))

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        self.stat.copy_(_Square.apply(h).mean().detach())
        return h


class _CompositeOnADetachedBranch(_FunctionOnADetachedBranch):
    """einsum returns a view node; the bmm below it saves."""

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        self.stat.copy_(torch.einsum("ij,ij->", h, h).detach())
        return h


class _NoGradCounterAfterFunction(nn.Module):
    """A counter written under no_grad right after a custom Function saved: after eager's
    stop, though no node was made between them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Square.apply(x)
        with torch.no_grad():
            self.steps += 1
        return y


@pytest.mark.parametrize("model", [_DetachedStatistic, _SavedInABuffer, _CustomLastSaver,
                                   _ZeroDimLastSave, _ConstantLastSave,
                                   _FunctionOnADetachedBranch, _CompositeOnADetachedBranch])
@pytest.mark.parametrize("via", ["aot_module", "torch.compile"])
def test_checkpoints_early_stop_finds_saves_outside_the_outputs_history(via, model):
    """Note [Checkpoint's early stop]: saves on a detached branch, in a buffer's history or in
    a custom Function (under Dynamo, whose autograd_function_apply keeps them in a closure) were
    missed, so writes before them were taken as after eager's stop and made once."""
    torch.manual_seed(0)
    assert _checkpointed_like_eager(model(), rand(8, 4, grad=True), via).steps.item() == 2


class _SavesNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(None)  # ``w if ctx.needs_input_grad[0] else None``: not packed
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _CounterBeforeASavedNone(_Counted):
    def tail(self, h: torch.Tensor) -> torch.Tensor:
        return _SavesNone.apply(h)


@pytest.mark.parametrize("model", [_CounterAfterLastSave, _StashAfterCounter,
                                   _NoGradCounterAfterFunction, _CounterBeforeASavedNone])
@pytest.mark.parametrize("via", ["aot_module", "torch.compile"])
def test_checkpoints_early_stop_counts_only_packed_saves(via, model):
    torch.manual_seed(0)
    assert _checkpointed_like_eager(model(), rand(8, 4, grad=True), via).steps.item() == 1


class _WritesAfterSavingItsInputs(nn.Module):
    """addcmul_ saves its tensor arguments before its kernel writes: eager's stop comes
    before the write, so it is made once."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.ones(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        self.acc.addcmul_(y, y)
        return self.acc + 0.0


@pytest.mark.parametrize("via", ["aot_module", "torch.compile"])
def test_checkpoints_early_stop_after_an_op_that_saves_only_its_inputs(via):
    torch.manual_seed(0)
    _checkpointed_like_eager(_WritesAfterSavingItsInputs(), rand(8, 4, grad=True), via)


def test_checkpoints_early_stop_inside_an_input_write_is_refused():
    """A buffer written before and after the last save: eager's stop leaves it half written, a
    value the graph does not have. Without the early stop it matches eager."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("buf", torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.buf.add_(1)
            y = x.sin()
            self.buf.mul_(2)
            return y

    x = rand(3, grad=True)
    with pytest.raises(UnsupportedError, match=r"early_stop=False"):
        checkpoint(aotkit.aot_module(Twice(), compilers.nop), x, use_reentrant=False).sum().backward()
    def keyword(run):  # the fix it names
        return checkpoint(run, x, use_reentrant=False, early_stop=False)

    def around_forward(run):  # the flag is read when the checkpointed forward runs
        with set_checkpoint_early_stop(False):
            return checkpoint(run, x, use_reentrant=False)

    for early_stop_off in (keyword, around_forward):
        eager, model = Twice(), Twice()
        for run in (eager, aotkit.aot_module(model, compilers.nop)):
            early_stop_off(run).sum().backward()
        torch.testing.assert_close(model.buf, eager.buf, rtol=0, atol=0)


def test_reading_the_stored_entries_of_a_sparse_tensor_is_refused():
    """Fake sparse tensors store nothing: ``x * A._nnz()`` gave zeros, and edge weights of
    ``torch.ones(A._nnz())`` failed at run time with PyTorch's raw error."""
    adjacency = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 0]]),
                                        torch.tensor([1.0, 2.0, 3.0]), (3, 3)).coalesce()
    for fn in (lambda x: x * adjacency._nnz(), lambda x: x * adjacency._values().shape[0],
               lambda x: x * adjacency.to_sparse_csr().crow_indices()[-1],
               lambda x: x * x.to_sparse()._nnz()):
        with pytest.raises(UnsupportedError, match="stored entries of a sparse tensor"):
            aotkit.aot_function(fn, compilers.nop)(rand(3, 2))
    check_against_eager(lambda x: torch.sparse.mm(adjacency, x), rand(3, 2, grad=True))
    index = torch.tensor([[0, 1, 2], [1, 2, 0]])  # one made inside has its entries
    check_against_eager(lambda x: x * torch.sparse_coo_tensor(index, x, (3, 3))._nnz()
                        + torch.sparse_coo_tensor(index, x, (3, 3))._values(), rand(3))
