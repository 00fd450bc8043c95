"""Note [Values a function captures]: globals, closed-over values, defaults, partial arguments
and the attributes of the object a method runs on are keyed with aot_function's arguments; a
change recompiles (naming it), and values the function changes itself do not."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import gc
import types
import weakref
from typing import Any

import pytest
import torch
from torch.nn.utils import prune

import aotkit
from aotkit import compilers, counters
from aotkit.aot import reads


def _reasons() -> list[str]:
    return [d.why for d in aotkit.explain().of_kind("recompile")]


def _same(compiled, fn, *args) -> None:
    torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)


LEARNING_RATE = 1.0


def test_values_a_function_reads_besides_its_arguments_are_keyed():
    """Note [Values a function captures]: a global, a closed-over number, a default value and
    the attributes of a bound method's object, changed after compiling, kept the traced value
    silently (PyTorch's aot_function too)."""
    global LEARNING_RATE

    class Sampler:
        def __init__(self) -> None:
            self.temperature = 1.0

        def logits(self, x: torch.Tensor) -> torch.Tensor:
            return x / self.temperature

    def step(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x - LEARNING_RATE * x.sin() * scale * shift

    shift = 1.0
    sampler, x = Sampler(), torch.randn(3)
    compiled = {fn: aotkit.aot_function(fn, compilers.nop) for fn in (step, sampler.logits)}
    changes = [lambda: None, lambda: globals().__setitem__("LEARNING_RATE", 0.1),
               lambda: setattr(step, "__defaults__", (3.0,)),
               lambda: setattr(sampler, "temperature", 0.5)]
    try:
        for change in changes:
            change()
            shift += 1.0
            for fn, run in compiled.items():
                torch.testing.assert_close(run(x), fn(x), rtol=0, atol=0)
    finally:
        LEARNING_RATE = 1.0
    reasons = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert reasons == [
        "the global LEARNING_RATE changed: float 1.0 -> float 0.1; the closed-over shift "
        "changed: float 2.0 -> float 3.0",
        "the closed-over shift changed: float 3.0 -> float 4.0; the default value of scale "
        "changed: float 2.0 -> float 3.0",
        "the closed-over shift changed: float 4.0 -> float 5.0",
        "self.temperature changed: float 1.0 -> float 0.5"]
    with aotkit.config.patch(recompile_limit=1), pytest.raises(
            aotkit.errors.RecompileLimitError, match="besides its arguments changes at every call"):
        shift += 1.0
        compiled[step](x)


COUNTER = 0
t = 0  # a global sharing its name with the attribute .t()


def test_captured_values_are_loads_of_plain_values_by_repr():
    """Attribute names are no globals (x @ w.t() with a global t keyed t), a global the function
    assigns itself is its own doing, a tuple is keyed by its repr ((0.0,) == (-0.0,)), and a
    NumPy bool, a decorated function's globals and a global defined after compiling count."""
    import functools

    import numpy as np

    w = torch.randn(4, 4)

    def counted(x):
        global COUNTER
        COUNTER += 1
        return x @ w.t()

    compiled, x = aotkit.aot_function(counted, compilers.nop), torch.randn(2, 4)
    for value in range(4):
        globals()["t"] = value
        compiled(x)
    assert counters.counters["aot"]["traces"] == 1  # its own global counter is no key

    def decorate(fn):  # the wrapper's own globals count too
        @functools.wraps(fn)
        def wrapper(*args):
            return fn(*args) * WRAPPER_SCALE  # noqa: F821 - set below
        return wrapper

    @decorate
    def scaled(x):
        return x * SIGNS[0] if FLAG else x * LATE  # noqa: F821 - set below, LATE later

    g = globals()
    g.update(SIGNS=(0.0,), FLAG=np.True_, WRAPPER_SCALE=1.0)
    compiled = aotkit.aot_function(scaled, compilers.nop)
    try:
        for change in ({}, {"SIGNS": (-0.0,)}, {"FLAG": np.False_, "LATE": 3.0},
                       {"WRAPPER_SCALE": 2.0}):
            g.update(change)
            torch.testing.assert_close(compiled(torch.ones(2)), scaled(torch.ones(2)))
            assert torch.equal(compiled(torch.ones(2)).signbit(), scaled(torch.ones(2)).signbit())
    finally:
        for name in ("SIGNS", "FLAG", "LATE", "WRAPPER_SCALE"):
            g.pop(name, None)
    assert len(aotkit.explain().of_kind("recompile")) == 3


def test_captured_globals_of_two_modules_and_objects_are_told_apart():
    """A decorator from another module reading a global of the function's global's name hid
    it (keyed by name alone); a non-plain value was keyed by a text a string could equal."""
    import types

    lib = types.ModuleType("mylib")
    exec("import functools\nSCALE = 1.0\ndef deco(fn):\n    @functools.wraps(fn)\n"
         "    def wrapper(x):\n        return fn(x) * SCALE\n    return wrapper\n", lib.__dict__)
    g = globals()
    g["SCALE"] = 2.0
    try:
        scaled = lib.deco(lambda x: x * SCALE)  # noqa: F821 - set above
        compiled, x = aotkit.aot_function(scaled, compilers.nop), torch.ones(2)
        for change in (lambda: None, lambda: g.update(SCALE=5.0),
                       lambda: setattr(lib, "SCALE", 3.0)):
            change()
            torch.testing.assert_close(compiled(x), scaled(x), rtol=0, atol=0)
        reasons = [d.why for d in aotkit.explain().of_kind("recompile")]
        assert reasons == ["the global SCALE changed: float 2.0 -> float 5.0",
                           "the global mylib.SCALE changed: float 1.0 -> float 3.0"]

        def kind(x):
            return x - 100 if isinstance(SCALE, str) else x * 2  # noqa: F821
        compiled = aotkit.aot_function(kind, compilers.nop)
        for value in ([1.0], "an object of type list"):
            g["SCALE"] = value
            torch.testing.assert_close(compiled(x), kind(x), rtol=0, atol=0)
    finally:
        g.pop("SCALE", None)


class _Scaler:
    """A method compiled onto its own object, which also holds a counter it does not read."""

    def __init__(self) -> None:
        self.scale = 2.0
        self.steps = 0
        self.calls = 0
        self.f = aotkit.aot_function(self.apply, compilers.nop)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # its own doing: not keyed
        return self._scaled(x)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:  # a method it names: its reads count
        return x * self.scale


def test_only_the_attributes_a_method_names_are_keyed():
    """Keying every attribute of a bound method's object recompiled at every call on an
    attribute the method never reads (the aot_function stored on it, a step counter) until
    RecompileLimitError; one named by a method it calls is seen."""
    s, x = _Scaler(), torch.ones(3)
    for step in range(12):
        s.steps = step
        _same(s.f, s.apply, x)
    assert counters.counters["aot"]["traces"] == 1
    s.scale = 3.0
    _same(s.f, s.apply, x)
    assert _reasons() == ["self.scale changed: float 2.0 -> float 3.0"]
    twin = copy.deepcopy(s)  # its method is bound to the copy, not to the original
    twin.scale = 5.0
    _same(twin.f, twin.apply, x)
    assert twin.f.fn.__self__ is twin
    original = weakref.ref(s)  # its argument check held the original (an EMA teacher's copy)
    del s
    gc.collect()
    assert original() is None


def test_values_a_function_assigns_itself_are_not_keyed():
    """A nonlocal counter (the function's or a counting decorator's) changed at every call: a
    recompile each time, until RecompileLimitError (a global it assigns never was)."""
    def counting(fn):
        calls = 0

        @functools.wraps(fn)
        def wrapper(x):
            nonlocal calls
            calls += 1
            return fn(x)
        return wrapper

    def make():
        count = 0

        @counting
        def f(x):
            nonlocal count
            count += 1
            return x * 2
        return f

    compiled = aotkit.aot_function(make(), compilers.nop)
    for _ in range(12):
        compiled(torch.randn(3))
    assert counters.counters["aot"]["traces"] == 1


MASK = None


def test_a_captured_tensor_is_keyed_by_identity():
    """A global that was None and then held tensors was keyed by its type: a second mask ran
    the graph of the first, silently; a closed-over tuple of tensors rebound too."""
    global MASK

    def masked(x):
        return x if MASK is None else x.masked_fill(MASK, 0.0)

    compiled, x = aotkit.aot_function(masked, compilers.nop), torch.arange(4.0)
    try:
        for mask in (None, [True, False, False, False], [False, False, False, True]):
            MASK = None if mask is None else torch.tensor(mask)
            _same(compiled, masked, x)
    finally:
        MASK = None
    assert _reasons() == ["the global MASK changed: NoneType None -> a Tensor object",
                          "the global MASK is another Tensor object"]

    weights = (torch.ones(4),)

    def weighted(x):
        return x * weights[0]

    compiled = aotkit.aot_function(weighted, compilers.nop)
    _same(compiled, weighted, x)
    weights = (torch.full((4,), 3.0),)
    _same(compiled, weighted, x)


class _Temperature:
    def __init__(self) -> None:
        self.t = 2.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.t

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.t

    scale = 2.0

    @classmethod
    def scaled(cls, x: torch.Tensor) -> torch.Tensor:
        return x * cls.scale


def _base(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


class _Decorator:
    """A class-based decorator (functools.update_wrapper)."""

    def __init__(self, fn) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.factor = fn, 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) * self.factor


def test_what_wraps_a_function_is_looked_into():
    """A partial's arguments, a callable object's and a class-based decorator's attributes, a
    method under torch.no_grad(), a classmethod's class and the function inside another
    aot_function were not keyed: their changes ran the old graph, silently."""
    temperature, x = _Temperature(), torch.ones(2)
    partial = functools.partial(_base, k=1.0)
    decorated = _Decorator(temperature.logits)
    cases = [(partial, lambda: partial.keywords.update(k=2.0)),
             (temperature, lambda: setattr(temperature, "t", 4.0)),
             (torch.no_grad()(temperature.logits), lambda: setattr(temperature, "t", 8.0)),
             (decorated, lambda: setattr(decorated, "factor", 3.0)),
             (_Temperature.scaled, lambda: setattr(_Temperature, "scale", 5.0)),
             (aotkit.aot_function(functools.partial(_base, k=1.0), compilers.nop),
              lambda: cases[-1][0].fn.keywords.update(k=6.0))]
    try:
        for fn, change in cases:
            compiled = aotkit.aot_function(fn, compilers.nop)
            _same(compiled, fn, x)
            change()
            _same(compiled, fn, x)
    finally:
        _Temperature.scale = 2.0
    assert len(_reasons()) == len(cases) + 1  # the inner aot_function's own too


def test_a_modules_forward_attributes_are_keyed():
    """aot_function(model.forward) kept the training-mode graph after model.eval() (forward
    reads self.training itself); aot_function(model) missed a plain attribute changed."""
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(x, 0.5, training=self.training) * self.scale

    model, x = Scaled(), torch.ones(8)
    for fn in (model.forward, model):
        model.train()
        compiled = aotkit.aot_function(fn, compilers.nop)
        compiled(x)
        model.eval()
        _same(compiled, fn, x)
        model.scale = 3.0
        _same(compiled, fn, x)
        model.scale = 2.0


FORMAT, WINDOW, ITEMS = torch.contiguous_format, slice(0, 2), tuple(range(20))


def test_captured_immutable_values_of_every_kind_are_keyed():
    """A memory format, a slice and a tuple of more than 16 items were not keyed."""
    global FORMAT, WINDOW, ITEMS

    def f(x):
        return x.contiguous(memory_format=FORMAT)[WINDOW] * len(ITEMS) + ITEMS[-1]

    compiled, x = aotkit.aot_function(f, compilers.nop), torch.randn(2, 3, 4, 5)
    try:
        for change in (lambda: None, lambda: globals().update(FORMAT=torch.channels_last),
                       lambda: globals().update(WINDOW=slice(0, 1)),
                       lambda: globals().update(ITEMS=tuple(range(21)))):
            change()
            out, expected = compiled(x), f(x)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            assert out.stride() == expected.stride()
    finally:
        FORMAT, WINDOW, ITEMS = torch.contiguous_format, slice(0, 2), tuple(range(20))
    assert len(_reasons()) == 3


class _Unprintable(float):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class _Proxy:
    @property
    def __class__(self):  # type: ignore[override]
        raise RuntimeError("proxy not bound")


@dataclasses.dataclass(slots=True)
class _Slotted:
    t: float

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.t


HUGE, ODD, PROXY = (10 ** 5000,), _Unprintable(2.0), _Proxy()


def test_captured_values_that_defy_inspection():
    """A float whose repr raises, a proxy whose __class__ raises, an int past Python's repr
    limit (in a tuple and changed: its reason) and defaults longer than the parameters were raw
    crashes; a slotted object's attribute was not seen."""
    global HUGE

    def f(x, y=1.0):
        return x * ODD + (HUGE[0] % 7 if PROXY is not None else 0) + y

    f.__defaults__ = (5.0, 1.0)  # Python takes the last ones
    compiled, x = aotkit.aot_function(f, compilers.nop), torch.ones(2)
    try:
        _same(compiled, f, x)
        HUGE = (10 ** 5000 + 1,)
        _same(compiled, f, x)
    finally:
        HUGE = (10 ** 5000,)
    assert _reasons() == ["the global HUGE[0] changed: int of 16610 bits -> int of 16610 bits"]
    slotted = _Slotted(2.0)
    compiled = aotkit.aot_function(slotted.logits, compilers.nop)
    _same(compiled, slotted.logits, x)
    slotted.t = 4.0
    _same(compiled, slotted.logits, x)


def test_a_reason_names_a_bounded_number_of_bounded_changes():
    """A changed tuple of 5000 numbers made a reason of 220 000 characters, a 100 KB string
    one of 200 KB, in explain(), the logs and RecompileLimitError."""
    compiled, x = aotkit.aot_function(lambda x, cfg: x * len(cfg[0]), compilers.nop), torch.ones(2)
    compiled(x, tuple(map(str, range(5000))))
    compiled(x, tuple(map(str, range(1, 5001))))
    compiled(x, ("a" * 100_000,))
    compiled(x, ("b" * 100_000,))
    first, _, last = _reasons()
    assert first.endswith("; and 4992 more") and first.count("; ") == 8
    assert len(last) < 400 and "-> str 'bbbb" in last


class _Base:
    def __init__(self) -> None:
        self.temperature = 1.0

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.temperature


class _ThroughSuper(_Base):
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return super().logits(x) + 1


class _ByName(_Base):
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        noted = types.SimpleNamespace()
        noted.temperature = self.temperature  # stored on another object: still read
        return x / self.temperature


class _Late:
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.temperature if hasattr(self, "temperature") else x


class _Aliased(_Base):
    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:  # decorated in its class
        this = self
        return x / (lambda m: m.temperature)(this) / vars(self)["temperature"]


def test_attributes_read_through_super_getattr_or_set_later_are_keyed():
    """An attribute read in the parent's method (super()), by getattr(self, "name"), stored on
    another object of the same name, set after compiling, or read through an alias, a lambda,
    vars(self) or in a method decorated in its class ran the old graph, silently."""
    x = torch.ones(2)
    for owner in (_ThroughSuper(), _ByName(), _Late(), _Aliased()):
        compiled = aotkit.aot_function(owner.logits, compilers.nop)
        _same(compiled, owner.logits, x)
        owner.temperature = 4.0
        _same(compiled, owner.logits, x)


class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.stats = {"calls": 0}
        self.mean = 0.0  # a statistic the loop updates; forward reads x.mean(), not it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # its own doing: not keyed
        self.stats["calls"] += 1  # bookkeeping in a container: not a setting
        return x - x.mean()


def test_a_module_called_as_the_function_compiles_once_for_state_it_does_not_compute_with():
    """aot_function(model) keys a module's settings (plain values) only: a pruned weight made
    anew by a pre-hook at every call, a dict counting calls, a counter forward assigns and a
    float sharing its name with x.mean() recompiled at every call, until RecompileLimitError."""
    pruned = prune.l1_unstructured(torch.nn.Linear(4, 4), "weight", amount=0.5)
    counted = _Counted()
    for model in (pruned, counted):
        compiled = aotkit.aot_function(model, compilers.nop)
        with torch.no_grad():
            for _ in range(12):
                _same(compiled, model, torch.randn(3, 4))
                counted.mean += 0.5
    assert counters.counters["aot"]["traces"] == 2


class _Anything:
    """Answers every attribute (``__wrapped__`` too) with a new object."""

    def __getattr__(self, name: str) -> _Anything:
        return _Anything()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _NoDict:
    @property
    def __dict__(self):  # type: ignore[override]
        raise RuntimeError("no dict")

    k = 2.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def test_odd_callables_compile():
    """One answering every attribute looped forever looking for __wrapped__; one whose
    __dict__ raises crashed with the user's error."""
    for fn in (_Anything(), _NoDict()):
        _same(aotkit.aot_function(fn, compilers.nop), fn, torch.ones(2))


class _Weighted:
    """A callable object holding a tensor and a setting named like a tensor method."""

    def __init__(self) -> None:
        self.w = torch.full((3,), 2.0)
        self.t = 2.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w * self.t

    def aliased(self, x: torch.Tensor) -> torch.Tensor:
        this = self
        return x * this.t


class _Activated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act, self.dims = torch.relu, [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x.sum(self.dims))


def test_settings_of_other_kinds_are_keyed_by_identity():
    """A callable object's tensor, a module's function or list replaced, and a bound method's
    attribute named like a tensor method read through an alias ran the old graph, silently
    (73a82e2); a container changed in place is bookkeeping, not a setting."""
    weighted, activated = _Weighted(), _Activated()
    cases = [(weighted, lambda: setattr(weighted, "w", torch.full((3,), 3.0))),
             (weighted.aliased, lambda: setattr(weighted, "t", 4.0)),
             (activated, lambda: setattr(activated, "act", torch.sigmoid)),
             (activated, lambda: setattr(activated, "dims", [0, 1]))]
    for fn, change in cases:
        x = -torch.ones(3) if fn is not activated else -torch.ones(3, 1)
        compiled = aotkit.aot_function(fn, compilers.nop)
        _same(compiled, fn, x)
        change()
        _same(compiled, fn, x)


def test_a_method_replaced_on_the_instance_after_compiling_is_keyed():
    """The mentioned name of a method was dropped for good: an override set on the instance
    later (model.act = torch.sigmoid) ran the old graph."""
    class Block(torch.nn.Module):
        def act(self, x):
            return torch.nn.functional.gelu(x)

        def forward(self, x):
            return self.act(x) * 2

    m, x = Block(), torch.randn(4)
    compiled = aotkit.aot_function(m, compilers.nop)
    _same(compiled, m, x)
    m.act = torch.sigmoid
    _same(compiled, m, x)
    assert compiled.num_entries == 2


BOUNDS = tuple(float(i) for i in range(65))


def test_a_tuple_beyond_the_key_limits_is_keyed_by_identity():
    """65 plain items: not keyed at all (README says parts past the limits go by identity)."""
    global BOUNDS

    def bucketize(x):
        return torch.bucketize(x, torch.tensor(BOUNDS))

    compiled, x = aotkit.aot_function(bucketize, compilers.nop), torch.tensor([3.5, 10.2, 40.7])
    _same(compiled, bucketize, x)
    BOUNDS = tuple(float(2 * i) for i in range(65))
    _same(compiled, bucketize, x)


@pytest.mark.parametrize("read", ["type(self)", "vars(self)"])
def test_tensor_named_settings_read_through_the_class_or_the_dict_are_keyed(read):
    """Names of tensor attributes (dim, T) counted for a module or callable object only when
    read as self.<name>: type(self).dim and vars(self)['T'] ran the old graph."""
    class Pool(torch.nn.Module):
        dim = 0

        def forward(self, x):
            return x.sum(type(self).dim)

    class Distill:
        def __init__(self):
            self.T = 1.0

        def __call__(self, s):
            return (s / vars(self)["T"]).softmax(-1)

    owner, x = (Pool() if read == "type(self)" else Distill()), torch.randn(3, 4)
    compiled = aotkit.aot_function(owner, compilers.nop)
    _same(compiled, owner, x)
    if read == "type(self)":
        Pool.dim = 1
    else:
        owner.T = 4.0
    _same(compiled, owner, x)


def test_odd_values_are_keyed_without_crashing():
    """An Enum with __eq__ but no __hash__ (TypeError at every call), a dead weakref.proxy
    attribute (ReferenceError at aot_function()), a __getattr__ raising KeyError or answering
    every name (the aot_function marker was looked up through it: a crash, or a callable's own
    __call__ not looked into)."""
    import enum
    import gc
    import weakref

    class Mode(enum.Enum):
        TRAIN = "train"

        def __eq__(self, other):
            return self.value == getattr(other, "value", other)

    mode = Mode.TRAIN
    f = aotkit.aot_function(lambda x: x * (2.0 if mode == "train" else 3.0), compilers.nop)
    assert f(torch.ones(2)).tolist() == [2.0, 2.0]

    class Parent:
        k = 2.0

    class Head(torch.nn.Module):
        def __init__(self, parent):
            super().__init__()
            self.parent, self.scale = weakref.proxy(parent), 1.0

        def forward(self, x):
            return x * self.parent.k if self.scale < 0 else x * self.scale

    parent = Parent()
    head = Head(parent)
    del parent
    gc.collect()
    assert aotkit.aot_function(head, compilers.nop)(torch.ones(2)).tolist() == [1.0, 1.0]

    class Scaled:
        def __init__(self, fn, scale):
            self.fn, self.scale = fn, scale

        def __getattr__(self, name):
            return getattr(self.__dict__["fn"], name)

        def __call__(self, x):
            return self.fn(x) * self.scale

    class Raising:
        def __getattr__(self, name):
            raise KeyError(name)

        def __call__(self, x):
            return x * 2

    wrapper, x = Scaled(aotkit.aot_function(torch.sin, compilers.nop), 2.0), torch.ones(2)
    compiled = aotkit.aot_function(wrapper, compilers.nop)
    _same(compiled, wrapper, x)
    wrapper.scale = 5.0
    _same(compiled, wrapper, x)
    assert aotkit.aot_function(functools.partial(Raising()), compilers.nop)(x).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("how", ["module", "forward"])
def test_a_tensor_a_module_stores_on_itself_is_put_back_with_a_decision(how):
    """aot_function(model) left a FunctionalTensor in model.last_attn (unusable: "Attempting
    to use FunctionalTensor on its own"); it is put back, with a fallback decision naming
    aot_module, which sets it after each call (a refusal broke AWD-LSTM's WeightDrop, whose
    forward sets its module's weight at every call)."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Identity()

        def forward(self, q, k):
            a = (q @ k.T).softmax(-1)
            self.last_attn = a.detach()
            self.inner.seen = a.detach()
            return a @ k

    m, q, k = Attn(), torch.randn(3, 4), torch.randn(5, 4)
    out = aotkit.aot_function(m if how == "module" else m.forward, compilers.nop)(q, k)
    torch.testing.assert_close(out, m(q, k))
    assert [d.what for d in aotkit.explain().of_kind("fallback")] == ["self", "self.inner"]
    assert all("aot_module(model)" in d.why for d in aotkit.explain().of_kind("fallback"))
    del m.last_attn, m.inner.seen
    compiled = aotkit.aot_module(m, compilers.nop)
    out = compiled(q, k)
    torch.testing.assert_close(m.last_attn, (q @ k.T).softmax(-1))
    torch.testing.assert_close(out, m(q, k))


def test_lists_and_dicts_a_module_holds_are_put_back_too():
    """Only a module's attributes were put back: tensors it appended to its own list or
    stored in its dict, and the LSTM's _flat_weights WeightDrop's assignment updates, stayed
    FunctionalTensors (a raw "FunctionalTensor on its own" at the next eager use)."""
    class Keeps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.maps, self.stats = [], {}
            self.lstm = torch.nn.LSTM(4, 4)
            self.raw = torch.nn.Parameter(self.lstm.weight_hh_l0.detach().clone())
            del self.lstm._parameters["weight_hh_l0"]

        def forward(self, x):
            self.lstm.weight_hh_l0 = self.raw * 0.5  # WeightDrop's pattern
            a = self.lstm(x)[0]
            self.maps.append(a.detach())
            self.stats["last"] = a.detach()
            self.kept, self.cache = [a.detach()], {"last": [a.detach()]}  # replaced anew
            self.state = collections.OrderedDict(h=a.detach())
            return a

    m, x = Keeps(), torch.randn(5, 2, 4)
    m.lstm.weight_hh_l0 = m.raw.detach() * 0.5
    with torch.no_grad():
        torch.testing.assert_close(aotkit.aot_function(m, compilers.nop)(x), m(x))
    assert len(m.maps) == 1 and type(m.maps[0]) is torch.Tensor  # eager's call's only
    assert type(m.stats["last"]) is torch.Tensor
    assert all(type(w) in (torch.Tensor, torch.nn.Parameter) for w in m.lstm._flat_weights)
    assert type(m.kept[0]) is torch.Tensor and type(m.cache["last"][0]) is torch.Tensor
    assert type(m.state["h"]) is torch.Tensor
    m.lstm(x)  # usable eagerly
    whats = [d.why for d in aotkit.explain().of_kind("fallback")]
    assert any("maps[0]" in w for w in whats) and not any("_flat_weights" in w for w in whats)
    assert any("into kept, cache" in w for w in whats)


def test_an_rnns_weight_cache_is_set_with_its_weight_quietly():
    """Old-style weight_norm on an RNN weight under aot_module: a fallback warning named the
    RNN's private _flat_weights (a cache its setattr keeps), and the weight aot_module set after
    the call left that cache stale."""
    def gru():
        torch.manual_seed(0)
        return torch.nn.utils.weight_norm(torch.nn.GRU(4, 5), "weight_hh_l0")

    eager, model = gru(), gru()
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(aotkit.aot_module(model, compilers.nop)(x), eager(x))
    assert model._flat_weights[1] is model.weight_hh_l0
    assert not aotkit.explain().of_kind("fallback")


def test_a_tensor_stored_on_a_module_the_function_calls_is_put_back():
    """A forward hook keeping an activation on a module the function closes over (called
    directly or through functional_call), and old-style weight_norm's weight, stayed
    FunctionalTensors or fake tensors on the module (raw errors at the next eager use)."""
    from torch.func import functional_call

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    m[0].register_forward_hook(lambda mod, i, o: setattr(mod, "feat", o.detach()))
    frozen = torch.nn.utils.weight_norm(torch.nn.Linear(4, 3)).requires_grad_(False)
    aotkit.aot_function(lambda p, x: functional_call(m, p, (x,)), compilers.nop)(
        dict(m.named_parameters()), torch.randn(3, 4))
    aotkit.aot_function(lambda x: frozen(x), compilers.nop)(torch.randn(5, 4))
    assert not hasattr(m[0], "feat")
    assert type(frozen.__dict__["weight"]) is torch.Tensor
    frozen.weight.sum()  # usable eagerly
    assert [d.what for d in aotkit.explain().of_kind("fallback")] == ["the closed-over m.0"]

    log = []

    def logs(x):  # a closed-over list the function appends a tensor to
        y = x * 2
        log.append(y.detach())
        return y

    with pytest.raises(aotkit.errors.UnsupportedError, match="closed-over log"):
        aotkit.aot_function(logs, compilers.nop)(torch.ones(2))
    assert log == []


_SPECS = {"scale": 2.0}


def test_what_a_function_only_reads_from_its_globals_and_closures_is_left_alone():
    """A TorchScript module held by a closed-over object (its buffers are no dict: a raw
    TypeError), a fake tensor a global held before the call (taken for a store), and the
    refusal of a global's tensor requiring grad naming an "argument object"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Config:
        def __init__(self):
            self.scale = 2.0
            self.exported = torch.jit.script(torch.nn.Linear(4, 4))

    cfg, x = Config(), torch.randn(3, 4)
    _SPECS["example"] = FakeTensorMode().from_tensor(torch.randn(2, 4))
    try:
        _same(aotkit.aot_function(lambda x: x * cfg.scale + _SPECS["example"].shape[1],
                                  compilers.nop), lambda x: x * cfg.scale + 4, x)
    finally:
        del _SPECS["example"]
    _SPECS["w"] = torch.randn(4, 4, requires_grad=True)
    try:
        with pytest.raises(aotkit.errors.UnsupportedError) as info:
            aotkit.aot_function(lambda x: x @ _SPECS["w"], compilers.nop)(x)
    finally:
        del _SPECS["w"]
    assert "reads from the global _SPECS['w'] and" in str(info.value)


def test_aot_module_puts_back_what_forward_appends_to_its_lists():
    """aot_module sets tensors forward assigns to attributes after each call, not ones it puts
    into a list or dict the module holds: those stayed FunctionalTensors."""
    class Keeps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.feats, self.last = torch.nn.Linear(2, 2), [], {}

        def forward(self, x):
            y = self.lin(x)
            self.feats.append(y.detach())
            self.last["y"] = y.detach()
            return y

    model = Keeps()
    compiled, x = aotkit.aot_module(model, compilers.nop), torch.ones(2)
    torch.testing.assert_close(compiled(x), model.lin(x))
    assert model.feats == [] and model.last == {}
    [feats, last] = aotkit.explain().of_kind("fallback")
    assert "feats[0]" in feats.why and "last['y']" in last.why
    assert "aot_module" not in feats.why and "torch.compile" in feats.why


def test_a_refused_trace_records_no_fallback_for_what_it_put_back():
    class Carry(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = torch.zeros(3)

        def forward(self, x):
            self.h = torch.tanh(x + self.h)  # a hidden state carried to the next call
            return self.h * 2

    with pytest.raises(aotkit.errors.UnsupportedError, match="earlier"):
        aotkit.aot_function(Carry(), compilers.nop)(torch.randn(3))
    assert not aotkit.explain().of_kind("fallback")


def test_a_cached_property_overridden_on_the_instance_is_keyed():
    """The cached value lives in the instance's entry, which the first trace fills (one more
    compile), and which the user may override (m.scale = 10.0: skipping that entry ran the
    old graph, silently)."""
    class Scaled(torch.nn.Module):
        @functools.cached_property
        def scale(self):
            return 2.0

        def forward(self, x):
            return x * self.scale

    m = Scaled()
    compiled = aotkit.aot_function(m, compilers.nop)
    for _ in range(3):
        _same(compiled, m, torch.ones(2))
    m.scale = 10.0
    _same(compiled, m, torch.ones(2))
    assert compiled.num_entries == 3


def test_descriptors_of_ones_own_and_a_class_alias_are_keyed():
    """A descriptor reading obj._scale, one reading obj.__dict__[self.key] (the name
    __set_name__ gave it) and a tensor-named class setting read through cls = type(self) ran
    the old graph."""
    class Doubled:
        def __get__(self, obj, objtype=None):
            return 2 * obj._scale

    class Head(torch.nn.Module):
        scale = Doubled()

        def __init__(self):
            super().__init__()
            self._scale = 1.0

        def forward(self, x):
            return x * self.scale

    class Stored:
        def __set_name__(self, owner, name):
            self.key = "_" + name

        def __get__(self, obj, objtype=None):
            return obj.__dict__[self.key]

    class Temperature(torch.nn.Module):
        temperature = Stored()

        def __init__(self):
            super().__init__()
            self._temperature = 1.0

        def forward(self, x):
            return x / self.temperature

    class Centered(torch.nn.Module):
        mean = 1.0

        def forward(self, x):
            cls = type(self)
            return x - cls.mean

    x = torch.ones(3)
    for m, change in ((Head(), lambda m: setattr(m, "_scale", 5.0)),
                      (Temperature(), lambda m: setattr(m, "_temperature", 4.0)),
                      (Centered(), lambda m: setattr(Centered, "mean", 3.0))):
        compiled = aotkit.aot_function(m, compilers.nop)
        _same(compiled, m, x)
        change(m)
        _same(compiled, m, x)


def test_what_forward_puts_deeper_into_a_module_is_put_back_and_counters_there_refused():
    """Containers one level inside what a module holds (a cache per layer, a dict of lists),
    a list of over 1024 items, and a refused trace: FunctionalTensors stayed there (a raw
    error at the next eager use), with no decision; a warm-up counter in an object the module
    holds ran the second tracing pass's graph at every call."""
    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.cache, self.by_name = [[], []], {"k": []}
            self.bank = [torch.zeros(4) for _ in range(2000)]

        def forward(self, x):
            y = self.lin(x)
            self.cache[0].append(y.detach())
            self.by_name["k"].append(y.detach())
            self.bank.append(y[0].detach())
            return y

    model, x = Cached(), torch.randn(2, 4)
    torch.testing.assert_close(aotkit.aot_module(model, compilers.nop)(x), model.lin(x))
    assert model.cache == [[], []] and model.by_name == {"k": []} and len(model.bank) == 2000
    whys = " ".join(d.why for d in aotkit.explain().of_kind("fallback"))
    assert "cache[0][0]" in whys and "by_name['k'][0]" in whys and "bank[2000]" in whys

    class Reads(Cached):
        def forward(self, x):
            self.cache[0].append(self.lin(x).detach())
            return torch.cat(self.cache[0]).sum(0)

    model = Reads()
    with pytest.raises(aotkit.errors.UnsupportedError):
        aotkit.aot_module(model, compilers.nop)(x)
    assert model.cache == [[], []]
    model(x)  # eager use works

    class Warm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.schedule = types.SimpleNamespace(step=0)

        def forward(self, x):
            self.schedule.step += 1
            return x * min(1.0, self.schedule.step / 10)

    warm = Warm()
    with pytest.raises(aotkit.errors.UnsupportedError, match=r"changes args\[0\]\.schedule\.step"):
        aotkit.aot_function(lambda m, x: m(x), compilers.nop)(warm, torch.ones(2))
    assert warm.schedule.step == 0


def test_what_forward_keeps_in_deques_namedtuples_and_new_objects_is_put_back_alone():
    """A deque, a list in a namedtuple, a list three levels down, a new object holding a tensor
    (a cache layer's dataclass): FunctionalTensors stayed there. Only the tensor is put back:
    a flag set in the same object stays set, as eager sets it (the whole object was put back).
    A warm-up step in an object the module holds gets a side_effect decision."""
    Pair = collections.namedtuple("Pair", "k v")

    @dataclasses.dataclass
    class Layer:
        keys: torch.Tensor

    class Keeps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.recent = collections.deque(maxlen=4)
            self.pair, self.deep = Pair([], []), {"a": {"b": []}}
            self.state = types.SimpleNamespace(initialized=False, layers={}, step=0)

        def forward(self, x):
            y = self.lin(x).detach()
            self.recent.append(y)
            self.pair.k.append(y)
            self.deep["a"]["b"].append(y)
            self.state.initialized = True
            self.state.layers["l0"] = Layer(y)
            self.state.step += 1
            return y

    model = Keeps()
    aotkit.aot_module(model, compilers.nop)(torch.randn(2, 4))
    assert not model.recent and model.pair == Pair([], []) and model.deep == {"a": {"b": []}}
    assert model.state.layers == {} and model.state.initialized
    [side_effect] = aotkit.explain().of_kind("side_effect")
    assert "state.step" in side_effect.why


def test_a_sliding_window_a_module_holds_is_put_back_whole_and_a_refusal_changes_nothing():
    """Taking back only the traced items by position left a shifted window duplicated
    ([0, 1, 2] -> [2, 1, 2]); a refused trace left a flag set beside a stored tensor, where
    eager never ran; a third module's cache went unheld once two others' tables had used up
    a walk shared by all."""
    class Window(torch.nn.Module):
        def __init__(self, refuse):
            super().__init__()
            self.lin, self.refuse = torch.nn.Linear(4, 4), refuse
            self.hist = collections.deque([torch.full((4,), float(i)) for i in range(3)], 3)
            self.state = types.SimpleNamespace(initialized=False, last=None)

        def forward(self, x):
            y = self.lin(x)
            self.hist.append(y[0].detach())
            self.state.initialized = True
            self.state.last = y.detach()
            return y * 2 if self.refuse and y.sum() > 0 else y

    for refuse in (False, True):
        model = Window(refuse)
        try:
            aotkit.aot_module(model, compilers.nop)(torch.randn(2, 4))
        except aotkit.errors.TraceError:
            assert refuse
        assert [float(t[0]) for t in model.hist] == [0.0, 1.0, 2.0]
        assert model.state.last is None and model.state.initialized is not refuse

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.meta = [{"id": i, "tags": ["a"]} for i in range(600)]

        def forward(self, x):
            return x

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cache = types.SimpleNamespace(keys=[], by_name={})

        def forward(self, x):
            self.cache.keys.append(x.detach() * 2)
            self.cache.by_name["last"] = x.detach() * 2
            return x * 2

    model = torch.nn.Sequential(Table(), Table(), Cached())
    aotkit.aot_module(model, compilers.nop)(torch.randn(2, 4))
    assert model[2].cache.keys == []

    vocab = Table()  # a big read-only table first: its copy must not leave the cache unheld
    vocab.table = {i: i for i in range(270_000)}
    model = torch.nn.Sequential(vocab, Cached())
    aotkit.aot_module(model, compilers.nop)(torch.randn(2, 4))
    assert model[1].cache.keys == [] and model[1].cache.by_name == {}


def test_a_model_reached_deep_through_a_global_is_held_and_odd_modules_are_passed_over():
    """A module two levels below a global had what it holds left unheld (a FunctionalTensor
    stayed in its dict); a module without __init__ run, or overriding named_modules without a
    prefix, raised raw errors from the walk."""
    class Keeps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.caches = torch.nn.Linear(4, 4).requires_grad_(False), {}

        def forward(self, x):
            y = self.lin(x)
            self.caches["k"] = y.detach()
            return y

    class Listed(torch.nn.Module):
        def named_modules(self):
            return iter(())

    model = Keeps()
    odd = types.SimpleNamespace(n=types.SimpleNamespace(m=model),
                                raw=torch.nn.Module.__new__(torch.nn.Module), listed=Listed())

    def f(x):
        return odd.n.m(x) + (odd.raw is not None) + (odd.listed is not None)

    x = torch.randn(2, 4)
    torch.testing.assert_close(aotkit.aot_function(f, compilers.nop)(x), model.lin(x) + 2)
    assert model.caches == {}


def test_held_values_are_looked_at_without_running_their_code():
    """A dict subclass whose values() raises or imports (a lazy registry), a key whose repr
    raises, a list holding itself given to an op, and a module's list holding one: compiles
    ran them (raw errors, seconds of imports) or looped forever."""
    class Lazy(dict):
        def values(self):
            raise RuntimeError("not loaded")

    class Key:
        def __repr__(self):
            raise RuntimeError("no repr")

    registry = {"models": Lazy(a=1), Key(): 1, "scale": 2.0}
    loop: list[Any] = [1.0]
    loop.append(loop)

    def f(x):
        return x * registry["scale"] if (x == loop) is False else x

    class Holds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.sources = torch.nn.Linear(2, 2), [Lazy(), loop]

        def forward(self, x):
            return self.lin(x)

    x = torch.randn(3)
    _same(aotkit.aot_function(f, compilers.nop), f, x)
    model = Holds()
    _same(aotkit.aot_module(model, compilers.nop), model, torch.randn(2))


def test_aot_module_refuses_torchscript_submodules_naming_them():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.jit.script(torch.nn.Linear(4, 4))

        def forward(self, x):
            return self.inner(x)

    with pytest.raises(aotkit.errors.UnsupportedError, match=r"\['inner'\] are TorchScript"):
        aotkit.aot_module(Holder(), compilers.nop)


def test_the_walk_stays_bounded_past_its_limits():
    """An empty list met after the walk's item budget raised a raw IndexError; modules chained
    through lists (``self.prev = [prev]``) re-armed the walk at each link, its paths growing
    with the chain (16000 links: 3.8 s, 3.4 GB); every link is held, named from its class."""
    bank = [list(torch.randn(700, 2).unbind()) for _ in range(99)] + [[]]

    def f(x):
        return x + bank[0][0]

    x = torch.randn(2)
    _same(aotkit.aot_function(f, compilers.nop), f, x)

    class Link(torch.nn.Module):
        def __init__(self, prev):
            super().__init__()
            self.lin, self.prev = torch.nn.Linear(2, 2), [prev] if prev else []

        def forward(self, x):
            self.last = x.detach()
            return self.prev[0](self.lin(x)) if self.prev else self.lin(x)

    def chain(n):
        link = None
        for _ in range(n):
            link = Link(link).requires_grad_(False)
        return link

    held = reads.module_containers([("m", chain(3000))])
    assert len(held) > 4 * 3000 and max(len(where) for where, _, _ in held) < 40  # not paths
    link = chain(40)  # called down the chain: eager's stack is as deep
    _same(aotkit.aot_module(link, compilers.nop), link, x)
    while link is not None:  # every link put back, none left holding a tracing tensor
        assert type(link.__dict__.get("last")) is torch.Tensor
        link = link.prev[0] if link.prev else None


def test_numbers_in_a_dict_keyed_by_tensors_are_put_back():
    """Two numbers changed in a dict keyed by tensors (``lr[p] *= 0.5``) raised a raw
    RuntimeError (keys compared with ==), leaving the values twice changed."""
    w, b = torch.randn(3, 3), torch.randn(3)
    state = types.SimpleNamespace(lr={w: 1.0, b: 1.0})

    def step(x, state):
        for p in state.lr:
            state.lr[p] *= 0.5
        return x @ w + b

    with pytest.raises(aotkit.errors.UnsupportedError, match=r"args\[1\]\.lr\[<Tensor>\]"):
        aotkit.aot_function(step, compilers.nop)(torch.randn(3), state)
    assert list(state.lr.values()) == [1.0, 1.0]


KEPT: list[torch.Tensor] = []


def test_aot_module_holds_its_forwards_globals_and_its_class_lists():
    """A list the module's class defines (``maps = []`` in the class body) and a global its
    forward appends to were left holding tracing tensors, with no decision."""
    class Keeps(torch.nn.Module):
        maps: list[torch.Tensor] = []

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.lin(x)
            self.maps.append(y.detach())
            return y

    class Logs(Keeps):
        def forward(self, x):
            y = self.lin(x)
            KEPT.append(y.detach())
            return y

    model, x = Keeps(), torch.randn(2)
    _same(aotkit.aot_module(model, compilers.nop), model, x)
    assert len(Keeps.maps) == 1 and type(Keeps.maps[0]) is torch.Tensor  # eager's call only
    assert any("maps[0]" in d.why for d in aotkit.explain().of_kind("fallback"))
    with pytest.raises(aotkit.errors.UnsupportedError, match="the global KEPT"):
        aotkit.aot_module(Logs(), compilers.nop)(x)
    assert KEPT == []


TABLE = torch.ones(4)


def test_a_constant_changed_in_place_compiles_anew():
    """Note [Constants changed in place]: ``T.data = ...`` and ``T.resize_`` keep the tensor
    object, so the graph went on with the size it read (``x * T.shape[0]``), a cast it dropped
    as a no-op (``T.float()``) or a reshape for the old size (a raw error), silently."""
    def f(x):
        return x * TABLE.shape[0] + TABLE.float().sum()

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.mask = torch.nn.Linear(3, 3), torch.ones(8)

        def forward(self, x):
            return self.lin(x) + self.mask.float().reshape(-1, 4)[:, :1].sum()

    model = Masked()
    compiled, module = aotkit.aot_function(f, compilers.nop), aotkit.aot_module(model, compilers.nop)
    x = torch.randn(3)
    _same(compiled, f, x)
    _same(module, model, x)
    for change in (lambda t: setattr(t, "data", torch.full((12,), 2.0)),
                   lambda t: setattr(t, "data", t.data.double()),
                   lambda t: t.resize_(4)):
        for t in (TABLE, model.mask):
            change(t)
        _same(compiled, f, x)
        _same(module, model, x)
    assert all("changed in place" in why for why in _reasons()) and len(_reasons()) == 6


def test_forward_replaced_on_the_class_after_compiling_traces_again():
    """``Net.forward = ...`` patched after compiling: aot_module and aot_function(model) ran
    the old graph, with no decision."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).relu()

    net, x = Net().requires_grad_(False), torch.randn(2, 4)
    compiled = [aotkit.aot_module(net, compilers.nop), aotkit.aot_function(net, compilers.nop)]
    for c in compiled:
        _same(c, net, x)
    Net.forward = lambda self, x: self.fc(x).tanh() * 10
    for c in compiled:
        _same(c, net, x)
    assert len(_reasons()) == 2 and "Net.forward = ..." in _reasons()[0]


def test_a_partialmethod_forward_compiles_once_and_its_replacement_again():
    """A forward defined with functools.partialmethod is a new function at each class access:
    keyed on that, every call compiled anew until the recompile limit refused it."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def _forward(self, x, scale):
            return self.fc(x) * scale

        forward = functools.partialmethod(_forward, scale=2.0)

    net, x = Net().requires_grad_(False), torch.randn(2, 4)
    compiled = [aotkit.aot_module(net, compilers.nop), aotkit.aot_function(net, compilers.nop)]
    for _ in range(10):
        for c in compiled:
            _same(c, net, x)
    assert _reasons() == []
    Net.forward = functools.partialmethod(Net._forward, scale=-3.0)
    for c in compiled:
        _same(c, net, x)
    assert len(_reasons()) == 2 and "Net.forward = ..." in _reasons()[0]


def test_stores_into_private_lists_of_pytorch_modules_and_size_reads_are_not_missed():
    """A list a user keeps on an nn.Linear (``fc._acts``) was put back without a decision (only
    an RNN's weights cache is PyTorch's own); a buffer of a called module read only for its
    size, and a tensor-subclass parameter swapped by ``m.double()``, kept the old graph."""
    from torch.testing._internal.two_tensor import TwoTensor

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)
            self.fc._acts = []

        def forward(self, x):
            y = self.fc(x)
            self.fc._acts.append(y.detach())
            return y

    net = Net()
    aotkit.aot_module(net, compilers.nop)(torch.randn(2, 3))
    assert net.fc._acts == [] and aotkit.explain().of_kind("fallback")
    table = torch.nn.Module()
    table.register_buffer("rows", torch.zeros(4))
    table.forward = lambda x: x * table.rows.shape[0]
    lin = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
    lin.weight = torch.nn.Parameter(TwoTensor(torch.ones(4, 4), torch.ones(4, 4)), False)

    def f(x):
        return table(x).sum() + lin(x.to(lin.weight.dtype)).a

    compiled, x = aotkit.aot_function(f, compilers.nop), torch.ones(1, 4)
    _same(compiled, f, x)
    table.rows.data = torch.zeros(10)
    lin.double()
    _same(compiled, f, x)
    assert len(_reasons()) == 1 and "changed in place" in _reasons()[0]


def test_a_called_modules_tensor_attribute_the_graph_reads_replaced_traces_again():
    """A called module's plain tensor attribute replaced (``m.table = ...``) kept the old
    constant, silently."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.ones(4)

        def forward(self, x):
            return x * self.table.sum()

    model, x = M(), torch.ones(3)
    compiled = aotkit.aot_function(lambda x: model(x), compilers.nop)
    _same(compiled, model, x)
    model.table = torch.full((6,), 2.0)
    _same(compiled, model, x)
    assert "the tensor attribute 'table' (4,) of M" in _reasons()[-1]
    with pytest.raises(aotkit.errors.RecompileLimitError, match=r"pass it as an argument, load "
                       r"checkpoints without assign=True .* or compile the module with aot_module"):
        for _ in range(10):  # a hidden state set at every step
            model.table = compiled(x).detach()


def test_subclass_parts_swapped_for_the_same_memory_compile_once_and_jagged_constants_trace():
    """A no-op ``module.to()`` swaps new parts viewing the same memory into tensor-subclass
    parameters: each call compiled anew until the recompile limit. A closed-over jagged tensor
    reduced over its ragged size raised a raw AssertionError (no ShapeEnv), and one swapped
    with ``swap_tensors`` kept the old graph (its parts were not watched)."""
    from torch.testing._internal.two_tensor import TwoTensor

    lin = torch.nn.Linear(3, 3, bias=False).requires_grad_(False)
    lin.weight = torch.nn.Parameter(TwoTensor(torch.ones(3, 3), torch.ones(3, 3)), False)
    compiled, x = aotkit.aot_function(lambda x: lin(x).a, compilers.nop), torch.ones(2, 3)
    for _ in range(10):
        lin.to("cpu")
        _same(compiled, lambda x: lin(x).a, x)
    assert _reasons() == []
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(3, 3)], layout=torch.jagged)

    def f(x):
        return x + nested.sum(dim=1)[0]

    compiled = aotkit.aot_function(f, compilers.nop)
    _same(compiled, f, torch.ones(3))
    torch.utils.swap_tensors(nested, torch.nested.nested_tensor(
        [torch.full((2, 3), 2.0), torch.full((3, 3), 3.0)], layout=torch.jagged))
    _same(compiled, f, torch.ones(3))
    assert len(_reasons()) == 1 and "inner tensors" in _reasons()[0]


def test_the_layout_check_stays_in_cpp_after_requires_grad_changes():
    """Once requires_grad of a watched tensor changed (gradual unfreezing), every later call
    compared each watched layout in Python (13-22x the check's cost at 2000 tensors)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)])

    @torch.no_grad()
    def evaluate(x):
        return model(x)

    compiled, x = aotkit.aot_function(evaluate, compilers.nop), torch.randn(2, 2)
    model.requires_grad_(False)
    _same(compiled, evaluate, x)
    model.requires_grad_(True)
    _same(compiled, evaluate, x)
    (entry,) = [e for entries in compiled._entries.values() for e in entries]
    assert entry.reads.layout_check.check(*entry.reads.plain) and _reasons() == []


def test_a_parameter_subclass_read_as_a_constant_is_refused_naming_it():
    """``class MyParam(nn.Parameter)`` read as a constant raised a raw TypeError from
    PyTorch's tracing modes."""
    class MyParam(torch.nn.Parameter):
        pass

    w = MyParam(torch.randn(3, 3), requires_grad=False)
    with pytest.raises(aotkit.errors.UnsupportedError, match="MyParam, a Python subclass of Par"):
        aotkit.aot_function(lambda x: x @ w, compilers.nop)(torch.randn(2, 3))


def test_a_list_in_a_dict_of_a_module_met_deep_in_the_walk_is_put_back():
    """A module reached through a list or an object (a chain link, ``trainer.model``) whose
    forward appends to ``self.state["hist"]`` left that list holding tracing tensors."""
    class Link(torch.nn.Module):
        def __init__(self, prev=None):
            super().__init__()
            self.lin, self.prev = torch.nn.Linear(2, 2), [prev] if prev else []
            self.state = {"hist": []}

        def forward(self, x):
            y = self.lin(x)
            self.state["hist"].append(y.detach())
            return self.prev[0](y) if self.prev else y

    first = Link().requires_grad_(False)
    head = Link(first).requires_grad_(False)
    trainer = types.SimpleNamespace(model=Link().requires_grad_(False))
    x = torch.randn(2)
    aotkit.aot_module(head, compilers.nop)(x)
    aotkit.aot_function(lambda x: trainer.model(x), compilers.nop)(x)
    assert first.state["hist"] == [] and trainer.model.state["hist"] == []
    assert len(aotkit.explain().of_kind("fallback")) >= 2


JAGGED = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)


class _ReadsJagged(torch.nn.Module):
    def forward(self, x):
        return JAGGED * x


def test_a_jagged_global_read_by_forward_traces_and_one_read_further_is_refused():
    """A jagged tensor read as a global by a compiled module's forward, or by a module the
    function calls, raised PyTorch's raw 'shape_env must not be None'."""
    x, model = torch.tensor(2.0), _ReadsJagged()
    torch.testing.assert_close(aotkit.aot_module(model, compilers.nop)(x).values(),
                               model(x).values())
    with pytest.raises(aotkit.errors.UnsupportedError, match="jagged nested tensor"):
        aotkit.aot_function(lambda x: model(x), compilers.nop)(x)


MODEL = torch.nn.Linear(3, 3)


def test_a_module_global_or_closure_rebound_traces_again():
    """``model = Net()`` for the next fold: the first model's graph (its weights constants) ran
    on, whether the old model was freed or kept."""
    global MODEL
    compiled = aotkit.aot_function(lambda x: MODEL(x), compilers.nop)
    inner = torch.nn.Linear(3, 3)
    closed = aotkit.aot_function(lambda x: inner(x), compilers.nop)
    x = torch.randn(2, 3)
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), MODEL(x), rtol=0, atol=0)
            torch.testing.assert_close(closed(x), inner(x), rtol=0, atol=0)
        MODEL, inner = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    assert "the global MODEL changed: a Linear object since freed -> a Linear object" \
        in str(aotkit.explain())
    folds = []  # the key does not hold a fold's model: a freed one's entry goes with it
    for _ in range(2 * aotkit.config.recompile_limit):
        MODEL = torch.nn.Linear(3, 3)
        folds.append(weakref.ref(MODEL))
        with torch.no_grad():
            for _ in range(2):  # a fold runs more than one step (one-call entries count)
                torch.testing.assert_close(compiled(x), MODEL(x), rtol=0, atol=0)
    MODEL = None
    gc.collect()
    assert sum(f() is not None for f in folds) == 0 and compiled.num_entries <= 2


class _Trainer:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(3, 3)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _HooksItsChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        self.body.register_forward_hook(self.scaled)  # its own method: a reference cycle

    def scaled(self, module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).relu())


class _WeightNormed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 3))
        torch.nn.utils.parametrizations.weight_norm(self, "weight")  # a class of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


@pytest.mark.parametrize("fold", ["method_of_a_trainer", "hook_is_its_own_method",
                                  "parametrized", "new_head", "new_head_of_a_closed_over_model",
                                  "argument", "argument_trained"])
def test_models_of_earlier_folds_are_freed_with_their_entries(fold: str) -> None:
    """A model replaced for each fold (or task) was kept alive by the entries, whose count
    reached recompile_limit at the ninth: held by the key of an attribute of the object whose
    method is compiled, by the traced submodules (one hooked by its model's own method), by a
    parametrized module's class (which holds the module), by the traced function's constants
    (a module argument, a distillation's teacher, where the function is differentiated)."""
    make = _WeightNormed if fold == "parametrized" else _HooksItsChild
    model, trainer = make(), _Trainer()
    f = aotkit.aot_function(
        trainer.step if fold == "method_of_a_trainer" else model if fold == "new_head"
        else (lambda m, x: m(x)) if fold.startswith("argument") else lambda x: model(x),
        compilers.nop)
    x, old = torch.randn(2, 3), []
    w = torch.ones(3, requires_grad=fold == "argument_trained")
    for _ in range(2 * aotkit.config.recompile_limit):
        if fold == "method_of_a_trainer":
            trainer.model = torch.nn.Linear(3, 3)
        elif fold.startswith("new_head"):
            model.head = torch.nn.Linear(3, 3)
        else:
            model = make().requires_grad_(fold != "argument_trained")  # a frozen teacher
        now = trainer.model if fold == "method_of_a_trainer" else model
        old.append(weakref.ref(now.head if fold.startswith("new_head") else now))
        with torch.set_grad_enabled(w.requires_grad):
            for _ in range(2):  # a fold runs more than one step (one-call entries count)
                got = f(now, x * w) if fold.startswith("argument") else f(x)
                torch.testing.assert_close(got, now(x * w), rtol=0, atol=0)
    del now, got
    gc.collect()
    assert sum(r() is not None for r in old[:-1]) == 0


class _Block(torch.nn.Module):
    """A module comparing by configuration (``==`` of its own), as some libraries' do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Block) and other.lin.in_features == self.lin.in_features

    __hash__ = object.__hash__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_modules_comparing_equal_by_configuration_keep_their_own_graphs() -> None:
    """A module argument was keyed by its class's ``==`` (another with the same configuration
    reused the first one's graph, weights included), and a replaced child was compared with
    ``==`` too (stale; a ``==`` reading the other's attributes raised on None)."""
    compiled, x = aotkit.aot_function(lambda m, x: m(x), compilers.nop), torch.randn(2, 3)
    with torch.no_grad():
        for block in (_Block(), _Block()):
            torch.testing.assert_close(compiled(block, x), block(x), rtol=0, atol=0)
        model = torch.nn.Sequential(_Block(), torch.nn.ReLU())
        closed = aotkit.aot_function(lambda x: model(x), compilers.nop)
        for child in (_Block(), _Block(), torch.nn.Identity()):
            torch.testing.assert_close(closed(x), model(x), rtol=0, atol=0)
            model[0] = child
        torch.testing.assert_close(closed(x), model(x), rtol=0, atol=0)


def test_a_module_made_anew_at_every_call_reaches_the_recompile_limit() -> None:
    """Entries of freed modules are dropped; those no later call ran still count: a loss
    module made for every call (or a submodule replaced at every step) recompiled forever."""
    compiled = aotkit.aot_function(lambda x, loss: loss(x, x * 2), compilers.nop)
    with pytest.raises(aotkit.errors.RecompileLimitError, match="freed after one call"):
        for _ in range(2 * aotkit.config.recompile_limit):
            compiled(torch.randn(3), torch.nn.MSELoss())


def test_checkpoints_evaluated_in_turn_on_a_short_last_batch_stay_under_the_limit() -> None:
    """Each model's short last batch runs once: counted as made anew at every call, the tenth
    checkpoint reached the recompile limit (a model's entries are dropped together)."""
    model = torch.nn.Linear(3, 3)
    compiled = aotkit.aot_function(lambda x: model(x), compilers.nop)
    with torch.no_grad():
        for _ in range(2 * aotkit.config.recompile_limit):
            model = torch.nn.Linear(3, 3)
            for rows in (4, 4, 1):
                x = torch.randn(rows, 3)
                torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_an_argument_object_holding_a_dead_weak_proxy_is_keyed() -> None:
    """A back-reference (weakref.proxy) whose referent is gone raised a raw ReferenceError
    while the object was keyed, though the function never reads it."""
    owner = torch.nn.Linear(2, 2)
    cfg = types.SimpleNamespace(scale=2.0, owner=weakref.proxy(owner))
    del owner
    gc.collect()
    compiled, x = aotkit.aot_function(lambda x, cfg: x * cfg.scale, compilers.nop), torch.ones(2)
    torch.testing.assert_close(compiled(x, cfg), x * 2)


class _Config:
    scale = 2.0


def test_weak_proxy_arguments_are_keyed_by_what_they_read() -> None:
    """A ``weakref.proxy`` argument was keyed by identity alone: an attribute changed through
    it ran the old graph (silently), and a dead one raised a raw ReferenceError though the
    function never reads it."""
    config = _Config()
    proxy, x = weakref.proxy(config), torch.ones(2)
    scaled = aotkit.aot_function(lambda x, c: x * c.scale, compilers.nop)
    doubled = aotkit.aot_function(lambda x, c: x * 2, compilers.nop)
    nested, holder = aotkit.aot_function(lambda x, h: x * h.c.scale, compilers.nop), \
        types.SimpleNamespace(c=proxy)  # a back-reference
    for scale in (2.0, 3.0):
        config.scale = scale
        torch.testing.assert_close(scaled(x, proxy), x * scale, rtol=0, atol=0)
        torch.testing.assert_close(nested(x, holder), x * scale, rtol=0, atol=0)
    torch.testing.assert_close(doubled(x, proxy), x * 2)
    del config
    gc.collect()
    torch.testing.assert_close(doubled(x, proxy), x * 2)
    with pytest.raises(ReferenceError):  # eager's read raises too
        scaled(x, proxy)


def test_a_subclass_parameter_read_by_its_part_replaced_traces_again() -> None:
    """A called module's TwoTensor weight read by a part (``self.w.a``, as quantized weights'
    forwards read their data and scale) was not watched: replaced, the old part ran on."""
    from torch.testing._internal.two_tensor import TwoTensor

    def weight() -> torch.nn.Parameter:
        return torch.nn.Parameter(TwoTensor(torch.randn(3), torch.randn(3)), requires_grad=False)

    class ReadsPart(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = weight()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w.a

    model, x = ReadsPart(), torch.randn(2, 3)
    compiled = aotkit.aot_function(lambda x: model(x), compilers.nop)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
        model.w = weight()


def test_a_frozen_parameters_grad_read_inside_is_refused_once_it_requires_grad() -> None:
    """``.grad`` of a frozen parameter (None) read inside is let be, as eager reads None; once
    unfrozen and trained, the graph kept the None branch (a gradient norm of 0)."""
    backbone = torch.nn.Linear(3, 3).requires_grad_(False)

    def grad_norm(x: torch.Tensor) -> torch.Tensor:
        grads = [p.grad for p in backbone.parameters() if p.grad is not None]
        return x * sum((g.pow(2).sum() for g in grads), x.new_zeros(()))

    compiled, x = aotkit.aot_function(grad_norm, compilers.nop), torch.ones(2)
    torch.testing.assert_close(compiled(x), grad_norm(x))
    inside = aotkit.aot_function(lambda x: (y := x * 2) * (y.grad is None), compilers.nop)
    for _ in range(3):  # .grad of a tensor made inside: not watched (it recompiled each call)
        torch.testing.assert_close(inside(x.requires_grad_()), x * 2)
    assert inside.num_entries == 1
    backbone.requires_grad_(True)
    backbone(torch.randn(4, 3)).sum().backward()
    with pytest.raises(aotkit.errors.UnsupportedError, match=r"reads \.grad of a tensor"):
        compiled(x)


def test_a_hook_that_is_a_method_of_an_object_without_weak_references_runs() -> None:
    """A module hook bound to an object with ``__slots__`` (no ``__weakref__``) raised
    TypeError: cannot create weak reference."""

    class Scale:
        __slots__ = ("factor",)

        def __init__(self) -> None:
            self.factor = 3.0

        def hook(self, module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            return out * self.factor

    lin, scale = torch.nn.Linear(3, 3), Scale()
    lin.register_forward_hook(scale.hook)
    x = torch.randn(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(aotkit.aot_function(lambda x: lin(x), compilers.nop)(x), lin(x))


def test_a_subclass_parameter_replaced_or_made_to_require_grad_traces_again():
    """A TwoTensor parameter of a called module was noted by its parts, so replacing it (or
    unfreezing it) left the old graph running on the old parts (or without its gradient)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def two(*shape):
        return torch.nn.Parameter(TwoTensor(torch.randn(*shape), torch.randn(*shape)), False)

    lin = torch.nn.Linear(3, 3)
    lin.weight, lin.bias = two(3, 3), two(3)
    compiled = aotkit.aot_function(lambda x: lin(x), compilers.nop)
    x = TwoTensor(torch.randn(2, 3), torch.randn(2, 3))
    compiled(x)
    lin.weight = two(3, 3)
    out, expected = compiled(x), lin(x)
    torch.testing.assert_close(out.a, expected.a, rtol=0, atol=0)
    torch.testing.assert_close(out.b, expected.b, rtol=0, atol=0)
    lin.weight.requires_grad_()
    with pytest.raises(aotkit.errors.UnsupportedError, match="requires grad"):
        compiled(x)
    pair = TwoTensor(torch.ones(3), torch.ones(3))  # its parts' memory, after a write
    write = aotkit.aot_function(lambda a: a.add_(1) * 1 + pair.a, compilers.nop)
    torch.testing.assert_close(write(torch.ones(3)), torch.full((3,), 3.0))
    with pytest.raises(aotkit.errors.UnsupportedError, match="shares memory"):
        write(pair.a)


class _Adapted(torch.nn.Module):
    """Blocks and heads a training loop grows; adapters empty at first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.adapters = torch.nn.ModuleList()
        self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2)})

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        for block in [*self.blocks, *self.adapters]:
            x = block(x)
        return [head(x) for head in self.heads.values()]


class _GrowingTrainer:
    def __init__(self) -> None:
        self.layers = torch.nn.ModuleList()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * 2


@pytest.mark.parametrize("how", ["closure", "bound_forward"])
@pytest.mark.parametrize("change", ["append_to_empty", "replace_block", "add_head"])
def test_containers_a_function_loops_over_are_watched(how: str, change: str) -> None:
    """A ModuleList empty at the first call (no flag: it led to no called module), and every
    container below a bound method's object (``aot_function(model.forward)``: only modules
    closed over were roots), were not watched: what was appended, replaced or added never ran."""
    model = _Adapted().requires_grad_(False)
    compiled = aotkit.aot_function(model.forward if how == "bound_forward"
                                   else lambda x: model(x), compilers.nop)
    x = torch.randn(3, 4)
    compiled(x)
    new = torch.nn.Linear(4, 4).requires_grad_(False)
    if change == "append_to_empty":
        model.adapters.append(new)
    elif change == "replace_block":
        model.blocks[0] = new
    else:
        model.heads.update({"b": torch.nn.Linear(4, 3).requires_grad_(False)})
    got, want = compiled(x), model(x)
    assert len(got) == len(want)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_empty_container_of_a_trainer_is_watched() -> None:
    trainer = _GrowingTrainer()
    compiled, x = aotkit.aot_function(trainer.step, compilers.nop), torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), x * 2)
    trainer.layers.append(torch.nn.Linear(4, 4).requires_grad_(False))
    torch.testing.assert_close(compiled(x), trainer.step(x), rtol=0, atol=0)


class _Configured(torch.nn.Linear):
    """A child whose ``==`` reads an attribute only its own class has."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.cfg = "x"

    def __eq__(self, other: object) -> bool:
        return self.cfg == other.cfg  # type: ignore[attr-defined]

    __hash__ = torch.nn.Module.__hash__


def test_a_child_whose_equality_raises_replaced_traces_again() -> None:
    """The per-call check compared the new child to the traced one with ``==``: its own
    ``__eq__`` raised a raw AttributeError where eager runs."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).requires_grad_(False)
    compiled, x = aotkit.aot_function(lambda x: model(x), compilers.nop), torch.randn(2, 4)
    compiled(x)
    model[0] = _Configured().requires_grad_(False)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_entries_of_a_freed_hook_are_dropped() -> None:
    """A forward hook registered for one evaluation per epoch (a new function each time, freed
    after): every entry traced with a freed hook was kept, and the ninth epoch hit the
    recompile limit though no call could match those entries again."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).requires_grad_(False)
    compiled, x = aotkit.aot_function(lambda x: model(x), compilers.nop), torch.randn(2, 4)
    for _ in range(2 * aotkit.config.recompile_limit):
        compiled(x)

        def clamped(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
            return out.clamp(-0.1, 0.1)

        handle = model[0].register_forward_hook(clamped)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
        handle.remove()
        del clamped, handle
    assert compiled.num_entries <= 2


def test_a_module_argument_freed_before_a_backward_traced_again_is_named() -> None:
    """A frozen module argument dropped by the caller after the forward, then backward() under
    autocast, which traces the function again: the module is held weakly (a model of each
    fold is freed with its graphs; held by the call's graph, one keeping an output on itself
    leaked), so this is refused naming the argument, not an internal AssertionError."""
    def f(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).relu().sum()

    compiled = aotkit.aot_function(f, compilers.nop)
    m, x = torch.nn.Linear(4, 4).requires_grad_(False), torch.randn(3, 4, requires_grad=True)
    loss = compiled(m, x)
    ref = weakref.ref(m)
    m.last = loss  # a module keeping its output: freed all the same
    del m
    gc.collect()
    assert ref() is None
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            aotkit.errors.UnsupportedError, match=r"args\[0\] was freed(.|\n)*Fix: keep a reference"):
        loss.backward()


def test_a_hook_registered_again_with_kwargs_traces_again() -> None:
    """The same hook object registered again with ``with_kwargs=True`` is called with the
    keyword arguments too: compared as objects only, the old graph ran on."""
    m = torch.nn.Linear(4, 2).requires_grad_(False)
    compiled, x = aotkit.aot_function(lambda x: m(x), compilers.nop), torch.randn(3, 4)

    def hook(module: Any, *args: Any) -> torch.Tensor:
        return args[-1] * len(args)

    wrapped = aotkit.aot_module(m, compilers.nop)  # keyed on its modules' layout instead
    handle = m.register_forward_hook(hook)
    for run in (compiled, wrapped):
        torch.testing.assert_close(run(x), m(x), rtol=0, atol=0)
    handle.remove()
    m.register_forward_hook(hook, with_kwargs=True)
    for run in (compiled, wrapped):
        torch.testing.assert_close(run(x), m(x), rtol=0, atol=0)


class _OddDict:
    """A closed-over object whose ``__dict__`` is a property of its own."""

    def __init__(self, model: torch.nn.Module) -> None:
        object.__setattr__(self, "model", model)

    @property
    def __dict__(self) -> list[Any]:  # type: ignore[override]
        return []


def test_hooks_of_a_module_never_called_do_not_count() -> None:
    """``aot_function(model.forward)`` never runs the model's own hooks: one added and removed
    at every step (a new partial each time) traced again at every step, up to the recompile
    limit. And a closed-over object with an odd ``__dict__`` raised a raw AttributeError."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).requires_grad_(False)
    compiled, x = aotkit.aot_function(model.forward, compilers.nop), torch.randn(2, 4)
    for step in range(2 * aotkit.config.recompile_limit):
        handle = model.register_forward_pre_hook(functools.partial(lambda s, m, a: None, step))
        torch.testing.assert_close(compiled(x), model.forward(x), rtol=0, atol=0)
        handle.remove()
    assert not aotkit.explain().of_kind("recompile")
    odd = _OddDict(model)
    closed = aotkit.aot_function(lambda x: odd.model(x) * 2, compilers.nop)
    torch.testing.assert_close(closed(x), model(x) * 2, rtol=0, atol=0)


class _Growing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        self.register_module("head", None)


def test_an_empty_list_replaced_or_a_head_set_later_traces_again() -> None:
    """A function looping over a model's empty ModuleList, or checking a head registered as
    None, without calling the model: the model had no flag (nothing below it was called), so
    a new list or a head set later never ran."""
    model = _Growing()

    def f(x: torch.Tensor) -> torch.Tensor:
        for layer in model.layers:
            x = layer(x)
        return (model.head(x) if model.head is not None else x) * 1

    compiled, x = aotkit.aot_function(f, compilers.nop), torch.randn(2, 4)
    compiled(x)
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4).requires_grad_(False)])
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)
    model.head = torch.nn.Linear(4, 4).requires_grad_(False)
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)


class _EncoderWithHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 4).requires_grad_(False)
        self.head = torch.nn.Module()
        self.head.register_module("adapter", None)
        self.head.dense = torch.nn.Linear(4, 2)


def test_an_empty_list_below_a_module_never_called_is_watched() -> None:
    """``model.extra.adapters``, empty at the first call, under a module nothing below which
    was called: an append was not seen for one commit (empty containers watched only below
    modules the function calls or holds)."""
    model = torch.nn.Module()
    model.body, model.extra = torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Module()
    model.extra.adapters = torch.nn.ModuleList()

    def f(x: torch.Tensor) -> torch.Tensor:
        x = model.body(x)
        for adapter in model.extra.adapters:
            x = adapter(x)
        return x

    compiled, x = aotkit.aot_function(f, compilers.nop), torch.randn(2, 4)
    compiled(x)
    model.extra.adapters.append(torch.nn.Linear(4, 4).requires_grad_(False))
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)


def test_parts_of_a_model_the_function_never_reaches_are_not_watched() -> None:
    """An encoder-only function of a model whose unused head has a None child: the head was
    watched, and its dense layer made anew per fold traced again each time (the limit)."""
    model = _EncoderWithHead()
    compiled, x = aotkit.aot_function(lambda x: model.encoder(x), compilers.nop), torch.randn(2, 4)
    for _ in range(2 * aotkit.config.recompile_limit):
        model.head.dense = torch.nn.Linear(4, 2)
        torch.testing.assert_close(compiled(x), model.encoder(x), rtol=0, atol=0)
    assert counters.counters["aot"]["traces"] == 1


class _Ordered(torch.nn.Module):
    """Layers registered as attributes first, then a list giving the order they run in."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.order = torch.nn.ModuleList([self.enc, self.dec])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.order:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("change", ["swap", "append"])
def test_a_list_of_modules_registered_before_it_is_watched(change: str) -> None:
    """The list's entries were seen first as the model's own children: the list was not found
    to lead to called modules, and a swap or an append ran the old graph."""
    model = _Ordered().eval().requires_grad_(False)
    compiled, x = aotkit.aot_function(lambda x: model(x), compilers.nop), torch.randn(3, 4)
    compiled(x)
    if change == "swap":
        model.order[0], model.order[1] = model.dec, model.enc
    else:
        model.order.append(torch.nn.Linear(4, 4).requires_grad_(False))
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_a_list_on_the_way_to_called_modules_is_named_as_such_when_it_changes() -> None:
    """A bookkeeping list over layers the function runs through another list cannot be told
    from one it loops over: its changes trace again, and the reason says what it is."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        [torch.nn.Linear(4, 4).requires_grad_(False) for _ in range(3)])
    model.calibrated = torch.nn.ModuleList([model.layers[0]])

    def f(x: torch.Tensor) -> torch.Tensor:
        for layer in model.layers:
            x = torch.tanh(layer(x))
        return x

    compiled, x = aotkit.aot_function(f, compilers.nop), torch.randn(2, 4)
    compiled(x)
    model.calibrated.append(model.layers[1])
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)
    assert "a list kept for bookkeeping" in aotkit.explain().of_kind("recompile")[-1].why


class _OwnIteration(torch.nn.ModuleList):
    def __iter__(self):  # not through ModuleList's own methods
        return iter(self._modules.values())


def _loop_modules(x: torch.Tensor, layers: torch.nn.Module) -> torch.Tensor:
    for layer in layers._modules.values():
        x = torch.tanh(layer(x))
    return x


_LAYERS = torch.nn.ModuleList([torch.nn.Linear(4, 4).requires_grad_(False) for _ in range(2)])


def _with_default(x: torch.Tensor, layers: torch.nn.Module = _LAYERS) -> torch.Tensor:
    return _loop_modules(x, layers)


_OWN = _OwnIteration([torch.nn.Linear(4, 4).requires_grad_(False) for _ in range(2)])


def _with_own(x: torch.Tensor) -> torch.Tensor:
    return _loop_modules(x, _OWN)


@pytest.mark.parametrize("how", ["subclass iterating _modules", "default value"])
def test_a_list_of_modules_changed_after_the_first_call_runs_the_new_modules(how: str) -> None:
    """A list held as a default value was no root of the watch: a list the function loops over
    (and never calls) kept the old layers."""
    layers, fn = (_LAYERS, _with_default) if how == "default value" else (_OWN, _with_own)
    compiled, x = aotkit.aot_function(fn, compilers.nop), torch.randn(2, 4)
    compiled(x)
    layers.append(torch.nn.Linear(4, 4).requires_grad_(False))
    torch.testing.assert_close(compiled(x), _loop_modules(x, layers), rtol=0, atol=0)
    layers[0] = torch.nn.Linear(4, 4).requires_grad_(False)
    torch.testing.assert_close(compiled(x), _loop_modules(x, layers), rtol=0, atol=0)
    del layers[-1]  # as long as it was, for another run
