"""aot_module and the module's state: aliased submodules, layouts that change after compiling,
buffers assigned in forward (Note [Module state as graph inputs]). Each test runs the same model
eagerly and through aot_module and compares outputs, gradients and the module's tensors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import aotkit
from aotkit import compilers
from aotkit.errors import ArgumentError, RecompileLimitError, UnsupportedError


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.pow(2).sum().backward()
    return out.detach()


def _assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    got = dict(actual.named_parameters(remove_duplicate=False))
    for name, p in expected.named_parameters(remove_duplicate=False):
        assert type(got[name]) is nn.Parameter, name
        torch.testing.assert_close(got[name], p, msg=name)
        torch.testing.assert_close(got[name].grad, p.grad, msg=f"{name}.grad")
    got_buffers = dict(actual.named_buffers(remove_duplicate=False))
    for name, b in expected.named_buffers(remove_duplicate=False):
        assert type(got_buffers[name]) is type(b), name  # no tracing value left behind
        torch.testing.assert_close(got_buffers[name], b, msg=name)


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module, aotkit.AotModule]:
    twin = copy.deepcopy(model)
    return model, twin, aotkit.aot_module(twin, compilers.nop)


class _AliasedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2), nn.BatchNorm1d(2))
        self.head = self.body[2]  # the same submodule under a second name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_submodule_registered_under_two_names():
    eager, twin, compiled = _pair(_AliasedHead())
    for _ in range(3):
        x = torch.randn(5, 4)
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        _assert_same_state(twin, eager)
    assert compiled.num_entries == 1


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.relu(self.a(x)))
        return out * self.scale if hasattr(self, "scale") else out


_CHANGES = {
    # re-registering a layer moves its parameters behind b's: same names and shapes, new order
    "reregistered": lambda m, new: (delattr(m, "a"), setattr(m, "a", new)),
    "replaced": lambda m, new: setattr(m, "a", new),
    "bias_removed": lambda m, new: setattr(m.b, "bias", None),
    "parameter_added": lambda m, new: setattr(m, "scale", nn.Parameter(torch.full((4,), 2.0))),
}


@pytest.mark.parametrize("change", _CHANGES.values(), ids=_CHANGES.keys())
def test_layout_change_after_compiling_recompiles(change):
    torch.manual_seed(0)
    eager, twin, compiled = _pair(_TwoLayers())
    x = torch.randn(3, 4)
    torch.testing.assert_close(_step(compiled, x), _step(eager, x))
    torch.manual_seed(1)
    new = nn.Linear(4, 4)
    change(eager, new)
    change(twin, copy.deepcopy(new))
    for _ in range(2):
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        _assert_same_state(twin, eager)
    # One recompile; an entry whose submodule was freed is dropped (see the id-reuse test).
    (decision,) = aotkit.explain().of_kind("recompile")
    assert decision.what == "aot_module(_TwoLayers)"


def test_recompile_reason_names_added_and_removed_state():
    model = _TwoLayers()
    compiled = aotkit.aot_module(model, compilers.nop)
    compiled(torch.randn(3, 4))
    model.b.bias = None
    model.scale = nn.Parameter(torch.ones(4))
    compiled(torch.randn(3, 4))
    (decision,) = aotkit.explain().of_kind("recompile")
    assert decision.why == "parameters/buffers changed: added ['scale']; removed ['b.bias']"


def test_untying_weights_recompiles():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.out = nn.Linear(4, 6, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx))

    eager, twin, compiled = _pair(Tied())
    idx = torch.tensor([[0, 3, 5]])
    torch.testing.assert_close(_step(compiled, idx), _step(eager, idx))
    for m in (eager, twin):
        m.out.weight = nn.Parameter(m.emb.weight.detach() * 2)
    torch.testing.assert_close(_step(compiled, idx), _step(eager, idx))
    _assert_same_state(twin, eager)
    assert compiled.num_entries == 2
    (decision,) = aotkit.explain().of_kind("recompile")
    assert decision.why == "weights untied: ['out.weight'] now hold tensors of their own"


def test_recompile_reasons_count_the_callers_arguments_and_name_none_slots():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            return self.lin(x) if scale is None else self.lin(x) * scale

    model = Scaled()
    compiled = aotkit.aot_module(model, compilers.nop)
    x = torch.randn(2, 4)
    compiled(x)
    compiled(x, scale=torch.tensor(2.0))
    model.register_parameter("unused", None)
    compiled(x)
    first, second = (d.why for d in aotkit.explain().of_kind("recompile"))
    assert first == ("the structure of the arguments changed: 1 positional tensor(s) -> "
                     "1 positional argument(s) (1 leaves) and keywords scale=")
    assert "registered as or set to None" in second


class _Ema(nn.Module):
    """Buffers assigned anew in forward, as EMA and step counters are often written."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        self.steps = self.steps + 1
        return y - self.ema


def test_buffer_assigned_in_forward():
    eager, twin, compiled = _pair(_Ema())
    for _ in range(3):
        x = torch.randn(5, 4)
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        _assert_same_state(twin, eager)
    assert twin.steps.item() == 3
    assert compiled.num_entries == 1


def test_forward_registering_a_buffer_is_refused():
    class Registers(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.register_buffer("seen", x.sum())
            return x * 2

    model = Registers()
    with pytest.raises(UnsupportedError, match=r"registered or removed .*'seen'"):
        aotkit.aot_module(model, compilers.nop)(torch.randn(3))
    assert "seen" not in model._buffers


def test_forward_assigning_a_parameter_is_refused():
    class Assigns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.w = nn.Parameter(self.w * 2)
            return x * self.w

    model = Assigns()
    with pytest.raises(UnsupportedError, match="assigned a new value to parameter 'w'"):
        aotkit.aot_module(model, compilers.nop)(torch.randn(3))
    assert type(model.w) is nn.Parameter and model.w.sum().item() == 3


def test_uninitialized_lazy_module_is_refused():
    """Called by an aot_function (closed over or passed) it raised PyTorch's raw RuntimeError
    reading an uninitialized parameter's shape."""
    model = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(ArgumentError, match="run one eager forward first"):
        aotkit.aot_module(model, compilers.nop)(torch.randn(2, 4))
    for call in (lambda: aotkit.aot_function(lambda x: model(x), compilers.nop)(torch.randn(2, 4)),
                 lambda: aotkit.aot_function(lambda m, x: m(x), compilers.nop)(
                     nn.LazyLinear(3), torch.randn(2, 4))):
        with pytest.raises(ArgumentError, match=r"lazy modules(.|\n)*run one eager forward"):
            call()
    model(torch.randn(2, 4))
    x = torch.randn(2, 4)
    torch.testing.assert_close(aotkit.aot_module(model, compilers.nop)(x), model(x))


def test_aot_module_wants_a_module():
    with pytest.raises(ArgumentError, match="aot_function"):
        aotkit.aot_module(lambda x: x, compilers.nop)
    with pytest.raises(ArgumentError, match=r"TorchScript module(.|\n)*Fix: pass the eager"):
        aotkit.aot_module(torch.jit.script(nn.Linear(2, 2)), compilers.nop)


def test_tensor_attributes_set_in_forward_are_set_after_each_call():
    """A rotary-style cache (and old-style weight_norm's ``module.weight``) set in forward is
    returned by the graph and set on the module as eager sets it, never a tracing value."""

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.cache is None:
                self.cache = torch.arange(4.0).cos()
            return self.lin(x) * self.cache

    for make in (Cached, lambda: torch.nn.utils.weight_norm(nn.Linear(4, 4))):
        torch.manual_seed(0)
        eager = make()
        torch.manual_seed(0)
        twin = make()  # weight_norm's module cannot be deep-copied
        compiled = aotkit.aot_module(twin, compilers.nop)
        for n in (2, 2, 3):  # the second size traces again, reading the cache set by the first
            x = torch.randn(n, 4)
            torch.testing.assert_close(_step(compiled, x), _step(eager, x))
            _assert_same_state(twin, eager)
        attribute = "cache" if isinstance(twin, Cached) else "weight"
        assert type(getattr(twin, attribute)) is torch.Tensor
        torch.testing.assert_close(getattr(twin, attribute), getattr(eager, attribute))


class _GrowingCache(nn.Module):
    """A rotary-style cache grown when a longer sequence arrives, keyed on a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cached_len = 0
        self.cos: torch.Tensor | None = None
        self.last_len: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n > self.cached_len:
            self.cos = torch.arange(float(n)).cos()
            self.cached_len = n
        self.last_len = n
        return self.lin(x) * self.cos[:n, None]


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_cache_keyed_on_a_python_int_grows_as_in_eager(dynamic):
    """Note [Attributes forward assigns]: each tracing pass starts from the call's own state (the
    metadata pass's ``cached_len`` made the joint trace skip the recompute and read the old
    cache), and plain Python values forward assigns are set after each call (a SymInt as each
    call's int)."""
    eager, twin, _ = _pair(_GrowingCache())
    compiled = aotkit.aot_module(twin, compilers.nop, dynamic=dynamic)
    for n in (3, 3, 6, 2, 6, 9):
        x = torch.randn(2, n, 4)
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        _assert_same_state(twin, eager)
        assert (twin.cached_len, twin.last_len) == (eager.cached_len, eager.last_len) == (
            max(eager.cached_len, n), n)
        assert type(twin.last_len) is int and type(twin.cos) is torch.Tensor
        torch.testing.assert_close(twin.cos, eager.cos)


class _MyLSTM(nn.LSTM):
    """A user's subclass: its ``_flat_weights`` is still PyTorch's cache."""


@pytest.mark.parametrize("wrap", ["parametrizations.weight_norm", "prune", "subclass"])
def test_an_rnn_with_computed_weights_trains_as_in_eager(wrap):
    """The RNN rebuilds its ``_flat_weights`` list from the computed weights in forward: a cache
    of a module PyTorch defines, put back after tracing, not a container refused."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        lstm = (_MyLSTM if wrap == "subclass" else nn.LSTM)(3, 4, batch_first=True)
        if wrap == "prune":
            prune.l1_unstructured(lstm, "weight_hh_l0", amount=0.5)
        else:
            lstm = torch.nn.utils.parametrizations.weight_norm(lstm, "weight_ih_l0")
        return lstm

    eager, twin = make(), make()
    compiled = aotkit.aot_module(twin, compilers.nop)
    for _ in range(2):
        x = torch.randn(2, 5, 3)
        with torch.backends.mkldnn.flags(enabled=False):
            out, expected = compiled(x)[0], eager(x)[0]
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
    for p, q in zip(twin.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("grad", [False, True])
def test_a_weight_parametrize_cached_holds_is_computed_in_the_graph(grad):
    """An eager call inside ``parametrize.cached()`` filled the cache before the first compiled
    call: the trace read the cached weight as a constant and kept it after the block (under
    no_grad: stale weights, silently; with grad: refused)."""
    from torch.nn.utils import parametrizations, parametrize

    class Twice(nn.Module):  # opens its own cached(): the eager call's cache was read then
        def __init__(self) -> None:
            super().__init__()
            self.lin = parametrizations.orthogonal(nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with parametrize.cached():
                return self.lin(self.lin(x))

    torch.manual_seed(0)
    for model in (parametrizations.orthogonal(nn.Linear(4, 4)), Twice()):
        weight = model.parametrizations.weight if hasattr(model, "parametrizations") \
            else model.lin.parametrizations.weight
        compiled, x = aotkit.aot_module(model, compilers.nop), torch.randn(2, 4)
        with torch.set_grad_enabled(grad):
            with parametrize.cached():
                model(x)
                torch.testing.assert_close(compiled(x), model(x))
            with torch.no_grad():
                weight.original.copy_(torch.linalg.qr(torch.randn(4, 4))[0])
            torch.testing.assert_close(compiled(x), model(x))


class _ActNorm(nn.Module):
    """Data-dependent initialisation on the first call, guarded by a Python flag."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.zeros(4))
        self.initialized = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            with torch.no_grad():
                self.bias.copy_(-x.mean(0))
            self.initialized = True
        return self.lin(x) + self.bias


def test_a_flag_forward_sets_is_traced_again_from_its_new_value():
    """Note [Attributes forward assigns]: the first graph initialises; replayed at every call it
    re-initialised the bias each step (before: the flag set by the metadata pass made the
    graph skip the initialisation altogether)."""
    eager, twin, compiled = _pair(_ActNorm())
    for model, run in ((eager, eager), (twin, compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(0)
        for _ in range(4):
            opt.zero_grad()
            run(torch.randn(8, 4) + 3).pow(2).mean().backward()
            opt.step()
    _assert_same_state(twin, eager)
    assert twin.initialized is True
    (reason,) = aotkit.explain().of_kind("recompile")
    assert "initialized False -> True" in reason.why


def test_a_value_forward_changes_at_every_call_runs_into_the_limit_naming_it():
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.lin(x)

    model = Counting()
    compiled = aotkit.aot_module(model, compilers.nop)
    with aotkit.config.patch(recompile_limit=3), pytest.raises(
            RecompileLimitError, match=r"calls 2 -> 3(.|\n)*step counter"):
        for _ in range(5):
            compiled(torch.ones(1, 2))
    assert model.calls == 3  # as eager counts, until the limit


def test_forward_assigning_a_container_of_tensors_is_refused():
    """Its tensors would be tracing values left on the module, then constants of the next trace."""

    class KeepsList(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.kept: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.kept = [y.detach()]
            return y

    class SequentialKeepingList(nn.Sequential):  # a subclass of a module PyTorch defines
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.kept = [super().forward(x).detach()]
            return self.kept[0] * 2

    plain, subclass = KeepsList(), SequentialKeepingList(nn.Linear(4, 4))
    for model in (plain, subclass):
        with pytest.raises(UnsupportedError, match="assigned 'kept' a list holding tensors"):
            aotkit.aot_module(model, compilers.nop)(torch.randn(2, 4))
    assert plain.kept == [] and not hasattr(subclass, "kept")  # no tracing value left


def test_tensor_attributes_forward_assigns_are_read_at_every_call():
    """Note [Module state as graph inputs]: once forward is seen assigning a plain tensor
    attribute, later calls read its current value (the graph had the first value baked in)."""

    class Average(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))
            self.ema = torch.zeros(2)
            self.cached = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.ema = 0.5 * self.ema + x
            if self.cached is None:  # computed once, from the weight at the first call
                self.cached = self.w.detach() * 2
            return self.ema * self.w + self.cached

    eager, twin = Average(), Average()
    compiled = aotkit.aot_module(twin, compilers.nop)
    for _ in range(4):
        x = torch.ones(2)
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        for m in (eager, twin):
            with torch.no_grad():
                m.w.add_(1)
        torch.testing.assert_close(twin.ema, eager.ema)
        torch.testing.assert_close(twin.cached, eager.cached)
    (reason,) = aotkit.explain().of_kind("recompile")
    assert reason.why.startswith("plain tensor attribute(s) ['ema', 'cached'] assigned anew")


class _Carried(nn.Module):
    """State carried to the next call on ``self`` without ``.detach()``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        if start != "absent":
            self.hidden = torch.zeros(2, 3) if start == "zeros" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = getattr(self, "hidden", None)
        y = self.lin(x if h is None else x + h)
        self.hidden = y
        return y


@pytest.mark.parametrize("start", ["absent", "none", "zeros"])
def test_a_hidden_state_carried_without_detach_is_read_and_gets_gradients(start: str) -> None:
    """The graph went on taking the branch traced for an absent (or None) attribute, or reading
    the zeros it was traced from, silently: wrong outputs from the second call, wrong grads."""
    torch.manual_seed(0)
    eager = _Carried(start)
    twin = copy.deepcopy(eager)
    compiled = aotkit.aot_module(twin, compilers.nop)
    xs = [torch.randn(2, 3) for _ in range(3)]
    outs = [[model(x) for x in xs] for model in (eager, compiled)]
    for out in outs:
        out[-1].sum().backward()  # through all three calls, as in eager
    torch.testing.assert_close(outs[1], outs[0])
    for got, want in zip(twin.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    assert twin.hidden.grad_fn is not None
    (reason,) = aotkit.explain().of_kind("recompile")
    assert "['hidden'] assigned anew" in reason.why


@pytest.mark.parametrize("start", ["absent", "none"])
def test_an_activation_a_hook_keeps_is_set_after_each_call(start: str) -> None:
    """Note [Module state as graph inputs]: the hook's ``m.act = out`` is set after each call,
    with its gradient; it becomes an input (whether forward reads it cannot be told), which
    needs no gradient edge and ties no graphs together."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    if start == "none":
        model[1].act = None
    model[1].register_forward_hook(lambda m, i, o: setattr(m, "act", o))
    compiled = aotkit.aot_module(model, compilers.nop)
    for batch in (4, 4, 5, 4):
        x = torch.randn(batch, 3)
        out = compiled(x)
        assert out.grad_fn.next_functions[-1] == (None, 0)  # not tied to the last call
        out.sum().backward()
        torch.testing.assert_close(model[1].act, model[:2](x))
        assert model[1].act.requires_grad


class _ReadThroughDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.__dict__.get("h")  # a read the module does not see
        y = self.lin(x if h is None else x + h)
        self.h = y
        return y


def test_a_state_read_through_the_instance_dict_is_an_input() -> None:
    torch.manual_seed(0)
    eager = _ReadThroughDict()
    twin = copy.deepcopy(eager)
    compiled = aotkit.aot_module(twin, compilers.nop)
    xs = [torch.randn(2, 3) for _ in range(3)]
    outs = [[model(x) for x in xs] for model in (eager, compiled)]
    torch.testing.assert_close(outs[1], outs[0])


def test_a_tensor_attribute_replaced_by_one_requiring_grad_is_read_with_its_gradient() -> None:
    torch.manual_seed(0)
    eager = _Scaled()
    twin = copy.deepcopy(eager)
    compiled = aotkit.aot_module(twin, compilers.nop)
    x = torch.randn(2, 3)
    torch.testing.assert_close(compiled(x), eager(x))
    eager.scale = torch.full((3,), 2.0, requires_grad=True)
    twin.scale = torch.full((3,), 2.0, requires_grad=True)
    torch.testing.assert_close(_step(compiled, x), _step(eager, x))
    torch.testing.assert_close(twin.scale.grad, eager.scale.grad)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_tensor_attribute_requiring_grad_at_the_first_call_is_read_with_its_gradient(
        dynamic: bool) -> None:
    """A hypernetwork's output set as a plain attribute before the first call: an input whose
    gradient reaches the hypernetwork, not a constant refused for requiring grad."""
    torch.manual_seed(0)
    hyper = nn.Linear(2, 3)
    eager, twin = _Scaled(), _Scaled()
    twin.load_state_dict(eager.state_dict())
    compiled = aotkit.aot_module(twin, compilers.nop, dynamic=dynamic)
    z, x = torch.randn(2), torch.randn(4, 3)
    twin.scale = hyper(z)
    out = _step(compiled, x)
    grads = [p.grad.clone() for p in hyper.parameters()]
    hyper.zero_grad()
    eager.scale = hyper(z)
    torch.testing.assert_close(out, _step(eager, x))
    for got, expected in zip(grads, [p.grad for p in hyper.parameters()], strict=True):
        torch.testing.assert_close(got, expected)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = torch.ones(3)  # a plain attribute, set from outside between calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_tensor_attributes_replaced_from_outside_are_read_from_then_on():
    """A plain tensor attribute replaced between calls (``model.scale = ...``) kept its traced
    value in the graph: the outputs ignored the new one."""
    torch.manual_seed(0)
    eager = _Scaled()
    twin = copy.deepcopy(eager)
    compiled = aotkit.aot_module(twin, compilers.nop)
    x = torch.randn(2, 3)
    for scale in (None, torch.full((3,), 2.0), torch.full((3,), -1.0)):
        if scale is not None:
            eager.scale, twin.scale = scale, scale.clone()
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
    with torch.no_grad():  # read as an input now: in-place changes show too
        eager.scale.zero_()
        twin.scale.zero_()
    torch.testing.assert_close(_step(compiled, x), _step(eager, x))
    (reason,) = aotkit.explain().of_kind("recompile")
    assert reason.why.startswith("plain tensor attribute(s) ['scale'] assigned anew")


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mask = torch.tensor([1.0, 0.0, 1.0, 0.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        mask = getattr(self, "mask", None)
        return y * mask if mask is not None else y


def test_a_tensor_attribute_set_to_none_a_number_or_deleted_is_traced_again():
    """Only a new tensor counted as a replacement: after ``model.mask = None`` the graph went on
    multiplying by the old mask."""
    torch.manual_seed(0)
    eager = _Masked()
    twin = copy.deepcopy(eager)
    compiled = aotkit.aot_module(twin, compilers.nop)
    x = torch.randn(2, 4)
    changes = [None, 2.0, torch.full((4,), 3.0), None, "delete", torch.ones(4)]
    for value in [*changes, None]:
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        for m in (eager, twin):
            if isinstance(value, str):
                del m.mask
            else:
                m.mask = value.clone() if isinstance(value, torch.Tensor) else value
    whys = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert whys[:2] == [
        "plain attribute(s) set anew (mask a tensor -> None): traced again for that value",
        "plain attribute(s) set anew (mask None -> a float): traced again for that value"], whys
    assert any("(mask None -> (not set))" in why for why in whys), whys


def test_a_number_set_over_a_state_attribute_at_every_step_compiles_once() -> None:
    """A value a loop logs into an attribute forward once assigned a tensor: keyed by its
    value, each step compiled again until RecompileLimitError."""
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.last = y.detach()
            return y

    model = Keeps()
    compiled = aotkit.aot_module(model, compilers.nop)
    for step in range(12):
        compiled(torch.randn(2, 4)).sum().backward()
        model.last = float(step)
    assert len(aotkit.explain().of_kind("recompile")) <= 2


def test_weight_norm_recomputed_by_an_eager_call_between_compiled_ones_still_runs():
    """An eager call recomputes old-style weight_norm's plain ``weight`` attribute (requiring
    grad, never read before its pre-hook sets it): that replacement must not be refused."""
    torch.manual_seed(0)
    eager = nn.utils.weight_norm(nn.Linear(3, 3))
    torch.manual_seed(0)
    twin = nn.utils.weight_norm(nn.Linear(3, 3))  # weight_norm modules cannot be deepcopied
    compiled = aotkit.aot_module(twin, compilers.nop)
    x = torch.randn(2, 3)
    for _ in range(2):
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        twin(x)  # a validation pass on the original module
        eager(x)
    _assert_same_state(twin, eager)


def test_weight_norm_called_under_no_grad_first_then_trained():
    """The no_grad call leaves a weight that does not require grad, so ``weight`` is read as an
    input from then on; each training call's graph ignores it (the pre-hook recomputes it) and
    must not link to the last call's graph, freed by its backward (Note [Inputs without a
    gradient])."""
    torch.manual_seed(0)
    eager = nn.utils.weight_norm(nn.Linear(4, 3))
    torch.manual_seed(0)
    twin = nn.utils.weight_norm(nn.Linear(4, 3))
    compiled = aotkit.aot_module(twin, compilers.nop)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x))
    for _ in range(3):
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
    _assert_same_state(twin, eager)


def test_a_new_submodule_never_gets_a_freed_ones_graph():
    """Python reuses a freed module's id; entries die with their modules."""

    class Act(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(x)

    model = Act()
    compiled = aotkit.aot_module(model, compilers.nop)
    x = torch.tensor([-1.0, 2.0])
    with aotkit.config.patch(recompile_limit=12):
        for kind in [nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.ELU, nn.SiLU] * 2:
            model.act = kind()
            torch.testing.assert_close(compiled(x), model(x), msg=kind.__name__)
    model.act = nn.ReLU()  # a layout per call is a runaway: recompile_limit counts freed ones
    with pytest.raises(RecompileLimitError, match="12 module layouts"):
        compiled(x)


def test_layouts_of_freed_heads_that_ran_do_not_count_to_the_limit():
    """A task's head replaced per task (each training several steps): every layout compiled
    counted, and the ninth head hit the recompile limit with no layout left alive."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled, x = aotkit.aot_module(model, compilers.nop), torch.randn(3, 4)
    for _ in range(2 * aotkit.config.recompile_limit):
        model[2] = nn.Linear(4, 2)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    assert len(compiled._compiled) == 1


def test_weights_tied_to_another_parameter_recompile():
    class Three(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(self.a(x)))

    eager, twin, compiled = _pair(Three())
    x = torch.randn(2, 3)
    for tie in ("a", "c"):  # same number of distinct tensors, tied differently
        for m in (eager, twin):
            m.b.weight = getattr(m, tie).weight
        torch.testing.assert_close(compiled(x), eager(x), msg=tie)
    assert compiled.num_entries == 2


def test_deepcopy_of_a_compiled_module():
    eager, twin, compiled = _pair(_TwoLayers())
    x = torch.randn(3, 4)
    compiled(x)
    copied = copy.deepcopy(compiled)
    assert copied.orig_module is not twin and copied.num_entries == 0
    torch.testing.assert_close(_step(copied, x), _step(eager, x))
    _assert_same_state(copied.orig_module, eager)
    f = aotkit.aot_function(torch.sin, compilers.nop)
    f(x)
    torch.testing.assert_close(copy.deepcopy(f)(x), torch.sin(x))


def _record_call(module: nn.Module, args: Any, out: Any) -> None:
    module.calls = getattr(module, "calls", 0) + 1


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copied_compiled_module_keeps_its_wrapper_state(how):
    """Training flag, hooks and attributes of the aot_module itself (AveragedModel deep-copies
    it; torch.save(model) pickles it, which failed after the first call)."""
    import io

    _, _, compiled = _pair(_TwoLayers())
    compiled.eval()
    compiled.register_forward_hook(_record_call)
    compiled.tag = "v1"
    x = torch.randn(3, 4)
    expected = compiled(x)
    if how == "deepcopy":
        copied = copy.deepcopy(compiled)
    else:
        buffer = io.BytesIO()
        torch.save(compiled, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert copied.num_entries == 0 and copied.orig_module is not compiled.orig_module
    assert (copied.training, copied.orig_module.training, copied.tag) == (False, False, "v1")
    torch.testing.assert_close(copied(x), expected)
    assert copied.calls == 2  # the copied hook ran


def test_which_parameter_is_none_is_part_of_the_layout():
    class Optional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.full((3,), 2.0))
            self.b = nn.Parameter(torch.full((3,), 4.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x
            if self.a is not None:
                y = y * self.a
            if self.b is not None:
                y = y + self.b
            return y

    eager, twin, compiled = _pair(Optional())
    x = torch.full((3,), 1.0)
    for m in (eager, twin):
        m.b = None
    torch.testing.assert_close(compiled(x), eager(x))
    for m in (eager, twin):  # the same count of parameters, in the other slot
        m.b, m.a = nn.Parameter(torch.full((3,), 5.0)), None
    torch.testing.assert_close(compiled(x), eager(x))


def test_tensor_registered_as_parameter_and_buffer():
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((3,), 2.0))
            self.register_buffer("w_copy", self.w)

        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
            return x * self.w + self.w_copy + (0 if y is None else y)

    eager, twin, compiled = _pair(Both())
    x = torch.ones(3)
    torch.testing.assert_close(_step(compiled, x), _step(eager, x))
    _assert_same_state(twin, eager)


def test_renamed_submodules_write_assigned_buffers_to_their_new_names():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = _Ema(), _Ema()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x))

    eager, twin, compiled = _pair(Two())
    x = torch.randn(5, 4)
    torch.testing.assert_close(compiled(x), eager(x))
    for m in (eager, twin):  # swap the names, keep the order
        first, second = m.first, m.second
        del m.first, m.second
        m.second, m.first = first, second
    for _ in range(2):
        torch.testing.assert_close(compiled(x), eager(x))
    _assert_same_state(twin, eager)


def test_forward_hook_keeping_a_feature_on_its_module():
    def keep(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        module.feature = out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[1].register_forward_hook(keep)
    eager, twin, compiled = _pair(model)
    for _ in range(2):
        x = torch.randn(3, 4)
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        assert type(twin[1].feature) is torch.Tensor
        torch.testing.assert_close(twin[1].feature, eager[1].feature)


def test_hooks_with_side_effects_are_named_in_a_warning(caplog):
    """See Note [Module hooks]: a hook's Python side effects happen while tracing only."""
    kept: list[torch.Tensor] = []

    def store(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        kept.append(out)

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model[0].register_forward_hook(store)
    model[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with caplog.at_level("WARNING", logger="aotkit"):
        aotkit.aot_module(model, compilers.nop)(torch.randn(3, 4)).sum().backward()
    (decision,) = aotkit.explain().of_kind("hook")
    assert "forward hook test_hooks_with_side_effects_are_named_in_a_warning.<locals>.store " \
           "on '0' (Linear)" in decision.why
    assert "backward hook" in decision.why and "torch.compile" in decision.why
    assert any(r.levelname == "WARNING" and "store" in r.getMessage() for r in caplog.records)


def test_tensor_hooks_registered_inside_are_named_in_a_warning():
    """Note [Tensor hooks registered inside]: the hook ran once, while tracing, and nothing
    said why; the hooks a module's full backward hook registers are PyTorch's, not named."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            y.register_hook(lambda g: g * 3)
            return y.sum()

    model = Scaled()
    model.lin.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    eager = copy.deepcopy(model)
    compiled = aotkit.aot_module(model, compilers.nop)
    x = torch.randn(2, 3, requires_grad=True)
    compiled(x).backward()
    eager(x).backward()  # the gradient the hook computes is the graph's
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)
    tensor_hooks = [d.why for d in aotkit.explain().of_kind("hook") if d.why.startswith("tensor hook")]
    assert len(tensor_hooks) == 1
    assert "Scaled.forward.<locals>.<lambda> registered at" in tensor_hooks[0]
    assert "y.register_hook(" in tensor_hooks[0]


def test_pytorch_tensor_only_hooks_are_not_reported():
    def model() -> nn.Module:  # built twice: pruned modules cannot be deep-copied
        torch.manual_seed(0)
        m = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Linear(4, 2))
        prune.l1_unstructured(m[1], "weight", amount=0.5)
        return m

    eager, twin = model(), model()
    compiled = aotkit.aot_module(twin, compilers.nop)
    for _ in range(2):
        x = torch.randn(3, 4)
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        _assert_same_state(twin, eager)
    assert not aotkit.explain().of_kind("hook")


def test_quantization_observer_hooks_are_not_reported():
    model = nn.Sequential(torch.ao.quantization.QuantStub(), nn.Linear(4, 4))
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    model = torch.ao.quantization.prepare_qat(model.train())
    model(torch.randn(3, 4))  # an eager call sizes the observers' buffers
    aotkit.aot_module(model, compilers.nop)(torch.randn(3, 4))
    assert not aotkit.explain().of_kind("hook")


def test_global_module_hooks_run_once_per_module_as_in_eager():
    """They ran in the graph on the original's modules and once more on the wrapper: a hook
    doubling outputs doubled the compiled module's output again."""
    from torch.nn.modules import module as nn_module

    torch.manual_seed(0)
    model, calls = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), []

    def double(mod, args, out):
        calls.append(type(mod).__name__)
        return out * 2

    x = torch.randn(3, 4)
    handle = nn_module.register_module_forward_hook(double)
    try:
        expected = model(x)
        compiled = aotkit.aot_module(model, compilers.nop)
        compiled(x)
        calls.clear()
        torch.testing.assert_close(compiled(x), expected)
        assert calls == []  # traced: they ran in the graph, not on the wrapper
        compiled.register_forward_hook(lambda mod, args, out: out + 1)  # its own: both run
        torch.testing.assert_close(compiled(x), 2 * expected + 1)  # global hooks first
        compiled(x)
        told = [d for d in aotkit.explain().of_kind("hook") if "global module hooks" in d.why]
        assert len(told) == 1  # once per set of hooks, not per call
    finally:
        handle.remove()


def test_hooks_forward_registers_on_its_first_call_are_installed_once():
    """transformers installs its output-capturing hooks inside the first forward: every
    tracing pass must see the same hooks, and afterwards the module holds one, as in eager."""
    class Capturing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.captured: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            if not getattr(self, "hooked", False):
                self.lin.register_forward_hook(lambda m, a, out: self.captured.append(out * 2))
                self.hooked = True
            self.captured.clear()
            y = self.lin(x)
            return y, tuple(self.captured)

    torch.manual_seed(0)
    eager = Capturing()
    model = copy.deepcopy(eager)
    compiled = aotkit.aot_module(model, compilers.nop)
    for _ in range(3):
        x = torch.randn(2, 4)
        expected, out = eager(x), compiled(x)
        torch.testing.assert_close(out, expected)
        assert len(model.lin._forward_hooks) == len(eager.lin._forward_hooks) == 1
        assert model.hooked is True


def test_hooks_forward_prepends_or_removes_keep_eagers_order():
    class Registering(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.order: list[str] = []
            self.old = self.lin.register_forward_hook(lambda m, a, o: self.order.append("old"))
            self.gone = self.lin.register_forward_hook(lambda m, a, o: self.order.append("gone"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not getattr(self, "done", False):
                self.lin.register_forward_hook(lambda m, a, o: self.order.append("new"),
                                               prepend=True)
                self.gone.remove()
                self.done = True
            return self.lin(x)

    eager = Registering()
    model = Registering()
    aotkit.aot_module(model, compilers.nop)(torch.randn(1, 2))
    eager(torch.randn(1, 2))
    for m in (eager, model):
        m.order.clear()
        m.lin(torch.randn(1, 2))
    assert model.order == eager.order == ["new", "old"]


@pytest.mark.parametrize("kind", ["forward", "forward pre"])
def test_a_hook_with_kwargs_removing_itself_runs_once_as_in_eager(kind: str) -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4))
        handle = None

        def hook(module, args, kwargs, *out):
            handle.remove()
            return out[0] * 2 if out else ((args[0] * 2,), kwargs)

        register = (model[0].register_forward_hook if kind == "forward"
                    else model[0].register_forward_pre_hook)
        handle = register(hook, with_kwargs=True)
        return model

    eager, model = build(), build()
    compiled = aotkit.aot_module(model, compilers.nop)
    for _ in range(2):
        x = torch.randn(2, 4)
        torch.testing.assert_close(compiled(x), eager(x))
    assert not model[0]._forward_hooks_with_kwargs and not model[0]._forward_pre_hooks_with_kwargs


def test_adding_or_removing_a_hook_after_compiling_recompiles():
    torch.manual_seed(0)
    eager, twin, compiled = _pair(_TwoLayers())
    x = torch.randn(3, 4)
    torch.testing.assert_close(_step(compiled, x), _step(eager, x))
    handles = [m.a.register_forward_hook(lambda module, inputs, out: out * 2)
               for m in (eager, twin)]
    for _ in range(2):
        torch.testing.assert_close(_step(compiled, x), _step(eager, x))
        _assert_same_state(twin, eager)
    (decision,) = aotkit.explain().of_kind("recompile")
    assert decision.why == "module hooks added or removed"
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(_step(compiled, x), _step(eager, x))  # the first entry again
    _assert_same_state(twin, eager)
    assert compiled.num_entries == 2


def test_quantization_aware_training_from_a_fresh_model_matches_eager():
    """A per-channel fake-quant observer resizes its scale from (1,) to the channel count inside
    its kernel; functionalization returned the new size while the buffer kept the old one, and
    writing it back raised a bare RuntimeError (after updating other buffers)."""
    import torch.ao.quantization as quant

    torch.manual_seed(0)
    eager = nn.Sequential(quant.QuantStub(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3),
                          quant.DeQuantStub())
    eager.qconfig = quant.get_default_qat_qconfig("x86")
    quant.prepare_qat(eager, inplace=True)
    twin = copy.deepcopy(eager)
    compiled = aotkit.aot_module(twin, compilers.nop)
    for _ in range(3):
        x = torch.randn(5, 4)
        torch.testing.assert_close(_step(compiled, x), _step(eager, x), rtol=0, atol=0)
        _assert_same_state(twin, eager)
    for (name, got), want in zip(twin.state_dict().items(), eager.state_dict().values(),
                                 strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_an_aot_module_inside_a_compiled_module_is_part_of_its_graph():
    """A compiled block inside a model compiled as a whole, never called before: its own
    bookkeeping (the entries it compiles) was taken for attributes forward assigns, and the
    tracing passes disagreed on the outputs ("zip() argument 2 is longer than argument 1")."""

    class Net(nn.Module):
        def __init__(self, compiled: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3))
            self.block = aotkit.aot_module(block, aotkit.compilers.nop) if compiled else block
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(x))

    eager, inner = Net(compiled=False), Net(compiled=True)
    outer = aotkit.aot_module(inner, aotkit.compilers.nop)
    x = torch.randn(3, 4)
    for step in range(2):
        torch.manual_seed(step)
        expected = eager(x)
        expected.sum().backward()
        torch.manual_seed(step)
        out = outer(x)
        out.sum().backward()
        torch.testing.assert_close(out, expected)
        for (name, a), b in zip(eager.state_dict().items(), inner.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a, msg=name)
        for a, b in zip(eager.parameters(), inner.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad)
    assert inner.block.num_entries == 0  # traced as part of the outer graph only


def test_the_wrapper_reads_as_the_module_it_compiles() -> None:
    model = _Scaled()
    compiled = aotkit.aot_module(model, compilers.nop)
    model.eval()
    assert compiled.training is False  # as torch.compile's wrapper
    compiled.train()
    assert model.training and model.lin.training
    assert compiled.lin is model.lin and compiled.scale is model.scale
    with pytest.raises(AttributeError, match="'AotModule' object has no attribute 'missing'"):
        _ = compiled.missing
    assert copy.deepcopy(compiled).training is True
    compiled.scale = torch.full((3,), 2.0)  # written where it is read
    assert model.scale.eq(2.0).all() and "scale" not in compiled.__dict__
    x = torch.randn(2, 3)
    torch.testing.assert_close(compiled(x), model(x))


def test_a_copy_of_the_wrapper_of_a_parametrized_module_is_a_wrapper() -> None:
    """The original's own __deepcopy__ (parametrize defines one) is not the wrapper's."""
    class Doubled(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    lin = nn.Linear(3, 3)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", Doubled())
    copied = copy.deepcopy(aotkit.aot_module(lin, compilers.nop))
    assert type(copied).__name__ == "AotModule"
    x = torch.randn(2, 3)
    torch.testing.assert_close(copied(x), lin(x))


@pytest.mark.parametrize("convert", ["double", "load_state_dict"])
def test_parameters_can_be_swapped_after_a_call(convert: str) -> None:
    # Note [Fake modes forget the real tensors]: the trace's fake mode kept weak references
    from torch.testing._internal.two_tensor import TwoTensor

    def make() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Linear(4, 4, bias=False)
        m.weight = nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))
        return m

    x = torch.randn(2, 4)
    eager, model = make(), make()
    compiled = aotkit.aot_module(model, compilers.nop)
    compiled(x).sum().backward()
    new_weight = {"weight": TwoTensor(torch.ones(4, 4), torch.ones(4, 4))}
    with _swapping_on_conversion():  # as PyTorch converts subclass parameters anyway
        for m in (eager, model):
            if convert == "double":
                m.double()
            else:
                m.load_state_dict(new_weight)
    dtype = torch.float64 if convert == "double" else torch.float32
    torch.testing.assert_close(compiled(x.to(dtype)), eager(x.to(dtype)))


class _swapping_on_conversion:
    def __enter__(self) -> None:
        self.was = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)

    def __exit__(self, *exc: object) -> None:
        torch.__future__.set_swap_module_params_on_conversion(self.was)


def test_a_tensor_attribute_set_to_require_grad_after_a_call_gets_gradients() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = torch.full((4,), 2.0)  # a plain tensor attribute: a graph constant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    eager = Scaled()
    model = copy.deepcopy(eager)
    compiled = aotkit.aot_module(model, compilers.nop)
    x = torch.randn(3, 4)
    compiled(x)
    for m in (eager, model):
        m.scale.requires_grad_(True)  # it learns from now on
    compiled(x).sum().backward()
    eager(x).sum().backward()
    torch.testing.assert_close(model.scale.grad, eager.scale.grad)
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)


def test_functional_call_on_the_wrapper_takes_prefixed_names_and_explains_unprefixed_ones():
    """An unprefixed top-level parameter reached nn.Module's raw TypeError (a plain tensor
    assigned to a parameter of the wrapped module)."""
    from torch.func import functional_call

    model = nn.Linear(4, 3)
    compiled, x = aotkit.aot_module(model, compilers.nop), torch.randn(2, 4)
    params = {k: v.detach() + 1 for k, v in model.named_parameters()}
    prefixed = {f"orig_module.{k}": v for k, v in params.items()}
    torch.testing.assert_close(functional_call(compiled, prefixed, (x,)),
                               functional_call(model, params, (x,)))
    with pytest.raises(ArgumentError, match=r"'orig_module\.weight'"):
        functional_call(compiled, params, (x,))
    assert all(type(p) is nn.Parameter for p in model.parameters())  # put back


def test_what_forward_assigns_is_set_back_as_forward_set_it():
    """Set back through setattr, a parameter forward stored under another name was registered
    (the next trace then failed assigning it a tracing tensor: raw TypeError), and a read-only
    descriptor refused the write forward made to __dict__ (raw AttributeError)."""
    class ReadOnly:
        def __get__(self, obj, cls):
            if obj is None:
                return self
            return obj.__dict__.setdefault("pos", torch.arange(3.0))

        def __set__(self, obj, value):
            raise AttributeError("read-only")

    class Tied(nn.Module):
        pos = ReadOnly()

        def __init__(self):
            super().__init__()
            self.lin, self.tied = nn.Linear(3, 3), None

        def forward(self, x):
            self.tied = self.lin.weight
            return self.lin(x) @ self.tied + self.pos

    torch.manual_seed(0)
    eager = Tied()
    torch.manual_seed(0)
    model = Tied()
    compiled, x = aotkit.aot_module(model, compilers.nop), torch.randn(2, 3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x))


class _SharedLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 4), nn.Linear(4, 4)
        self.layers = nn.ModuleList([self.enc, self.enc, self.dec])  # ALBERT-style sharing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if layer is not None:
                x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("change", ["share another", "swap", "child set to None"])
def test_which_shared_module_a_slot_holds_is_part_of_the_layout(change: str) -> None:
    """The layout key held the children's names only, and modules() lists a shared module
    once: a slot made to hold another of them (or None) kept the old graph."""
    model = _SharedLayers()
    compiled = aotkit.aot_module(model, compilers.nop)
    compiled(torch.randn(3, 4, requires_grad=True))  # the signature of the call below
    if change == "share another":
        model.layers[1] = model.layers[2]
    elif change == "swap":
        model.layers[0], model.layers[2] = model.dec, model.enc
    else:
        model.layers[1] = None
    x = torch.randn(3, 4, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    out, expected = compiled(x), model(xe)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)
