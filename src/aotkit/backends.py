"""``torch.compile`` backends, registered through the ``torch_dynamo_backends`` entry point so
``torch.compile(model, backend="aotkit")`` works right after ``pip install aotkit``."""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from aotkit import compat, compilers, counters
from aotkit.aot import aot_module_simplified
from aotkit.aot.api import Partitioner
from aotkit.aot.boxing import Compiler, make_boxed_func
from aotkit.aot.frames import region
from aotkit.compat import FakeTensor
from aotkit.errors import ArgumentError
from aotkit.partition import default_partition, min_cut_rematerialization_partition

log = logging.getLogger("aotkit.backends")


def _no_dynamo(compiler: Compiler) -> Compiler:
    """Compiled graphs run outside Dynamo: the backward may run while a frame is being traced."""

    def wrapped(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        compiled = make_boxed_func(compiler(gm, example_inputs))
        disabled = torch._dynamo.disable(compiled)
        disabled._boxed_call = True  # type: ignore[attr-defined]
        return disabled

    wrapped.__name__ = getattr(compiler, "__name__", "compiler")
    wrapped.returns_views = getattr(compiler, "returns_views", True)  # type: ignore[attr-defined]
    return wrapped


_PARTITIONS = {"default": default_partition, "min_cut": min_cut_rematerialization_partition}


def partition_from(options: Mapping[str, Any] | None, default: str = "default") -> Partitioner:
    """The partitioner ``torch.compile(..., options={...})`` asks for: ``"partition"``
    (``"default"`` or ``"min_cut"``) and ``"activation_memory_budget"`` (0..1, min-cut only).

    Example::

        >>> import torch
        >>> f = torch.compile(lambda x: x.sin().sin(), backend="aotkit",
        ...                   options={"partition": "min_cut", "activation_memory_budget": 0.5})
        >>> f(torch.zeros(2, requires_grad=True)).sum().backward()
    """
    options = dict(options or {})
    unknown = sorted(set(options) - {"partition", "activation_memory_budget"})
    name = options.get("partition", default)
    if unknown or not isinstance(name, str) or name not in _PARTITIONS:
        problem = (f"unknown aotkit backend option(s) {unknown}" if unknown else
                   f"unknown partition {name!r} in the aotkit backend's options")
        raise ArgumentError(
            f"{problem}.\nFix: accepted "
            f"are partition ({' or '.join(map(repr, _PARTITIONS))}) and activation_memory_budget "
            "(a number in [0, 1], with partition='min_cut')."
        )
    if "activation_memory_budget" not in options:
        return _PARTITIONS[name]
    budget = options["activation_memory_budget"]
    if name != "min_cut" or isinstance(budget, bool) or not isinstance(budget, numbers.Real) \
            or not 0 <= budget <= 1:
        raise ArgumentError(
            f"activation_memory_budget={budget!r} with partition={name!r}.\nFix: give a number "
            "in [0, 1] together with options={'partition': 'min_cut'}."
        )
    return functools.partial(min_cut_rematerialization_partition,
                             activation_memory_budget=float(budget))


# Note [Backend errors Dynamo suppresses]
# With torch._dynamo.config.suppress_errors, Dynamo runs a frame eagerly when its backend
# raises, and says so only in a warning a program may have quieted: explain() would show no
# trace of the fallback. Each backend records it as a "fallback" decision with the error.
def _fallback_recorded(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Backend ``name``'s function, recording the eager fallbacks of Note [Backend errors Dynamo
    suppresses]."""
    return functools.partial(_recording_fallbacks, name=name)


def _recording_fallbacks(backend: Callable[..., Callable[..., Any]], name: str
                         ) -> Callable[..., Callable[..., Any]]:
    @functools.wraps(backend)
    def run(gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any,
            **kwargs: Any) -> Callable[..., Any]:
        try:
            return backend(gm, example_inputs, *args, **kwargs)
        except Exception as exc:
            if torch._dynamo.config.suppress_errors and not compat.dynamo_compiles_one_graph() \
                    and not isinstance(exc, compat.dynamo_fallback_errors()) \
                    and not type(exc).__module__.startswith("torch._dynamo"):  # its own signals
                counters.record(
                    "fallback", f"torch.compile(backend={name!r}, {region(gm)})",
                    f"the backend raised {type(exc).__name__}: {str(exc).splitlines()[0]}; "
                    "torch._dynamo.config.suppress_errors is on, so Dynamo runs this frame "
                    "eagerly. Fix: the error's own fix, or suppress_errors=False to see it raised.",
                    logger=log)
            raise

    return run


def _check_mode(mode: str | None, backend: str) -> None:
    """``torch.compile(mode=...)`` names Inductor presets (CUDA graphs, autotuning) that these
    backends do not implement: only the default is accepted, never silently ignored."""
    if mode not in (None, "default"):
        raise ArgumentError(
            f"torch.compile(backend={backend!r}, mode={mode!r}): backend {backend!r} has no "
            f"{mode!r} mode.\nFix: leave mode unset (or 'default'); choose the partitioner "
            "with options={'partition': ...} instead."
        )


def _aot(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler: Compiler,
         options: Mapping[str, Any] | None) -> Callable[..., Any]:
    """AOT autograd with one compiler for every graph, each run outside Dynamo."""
    compiled = _no_dynamo(compiler)
    return aot_module_simplified(gm, example_inputs, fw_compiler=compiled, bw_compiler=compiled,
                                 partition_fn=partition_from(options))


@_fallback_recorded('aotkit')
def aotkit_nop(gm: fx.GraphModule, example_inputs: Sequence[Any],
               options: Mapping[str, Any] | None = None,
               mode: str | None = None) -> Callable[..., Any]:
    """``backend="aotkit"``: AOT autograd with the ``nop`` compiler (graphs run as Python).
    ``options`` picks the partitioner (:func:`partition_from`).

    Example::

        >>> import torch
        >>> f = torch.compile(lambda x: x.sin() + 1, backend="aotkit")
        >>> f(torch.zeros(2))
        tensor([1., 1.])
    """
    _check_mode(mode, "aotkit")
    return _aot(gm, example_inputs, compilers.nop, options)


@_fallback_recorded('aotkit_debug')
def aotkit_debug(gm: fx.GraphModule, example_inputs: Sequence[Any],
                 options: Mapping[str, Any] | None = None,
                 mode: str | None = None) -> Callable[..., Any]:
    """``backend="aotkit_debug"``: AOT autograd with ``debug_nop``, which runs every graph node
    by node and checks each result's dtype, shape and strides against the traced values.

    Example::

        >>> import torch
        >>> f = torch.compile(lambda x: x.sin() + 1, backend="aotkit_debug")
        >>> f(torch.zeros(2))
        tensor([1., 1.])
    """
    _check_mode(mode, "aotkit_debug")
    return _aot(gm, example_inputs, compilers.debug_nop, options)


@_fallback_recorded('aotkit_inductor')
def aotkit_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    options: Mapping[str, Any] | None = None,
                    mode: str | None = None) -> Callable[..., Any]:
    """``backend="aotkit_inductor"``: aotkit's AOT autograd and min-cut partitioner, Inductor as
    the code generator of the forward, backward and inference graphs. ``options`` as for
    :func:`partition_from` (default ``{"partition": "min_cut"}``).

    Graphs are traced with Inductor's decompositions (``inductor.decompositions``), as
    ``backend="inductor"`` does. Dropout draws from Inductor's RNG, so its masks differ from
    eager's for the same seed unless ``torch._inductor.config.fallback_random`` is set.

    Example::

        >>> import torch
        >>> f = torch.compile(lambda x: x.sin() + 1, backend="aotkit_inductor")
        >>> f(torch.zeros(2))  # doctest: +SKIP
        tensor([1., 1.])
    """
    _check_mode(mode, "aotkit_inductor")
    inductor = compilers.inductor
    with _items_read_from_data(example_inputs):
        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=_no_dynamo(inductor.forward),
            bw_compiler=_no_dynamo(inductor.backward),
            inference_compiler=_no_dynamo(inductor.inference),
            partition_fn=partition_from(options, default="min_cut"),
            decompositions=inductor.decompositions,
            keep_inference_input_mutations=True,
        )


# Note [Items of Dynamo's inputs]
# For ``n.item()`` of a scalar input, Dynamo makes a symbol it guards on (``s33`` for
# ``L['n'].item()``) and remembers it on the fake input (``item_memo``), so tracing ``n.item()``
# again answers that symbol. Our graphs are not handed it: nothing they receive binds it, and
# the joint pass, whose ``item()`` on a functional tensor makes a fresh data-dependent symbol,
# had to be told its tangent's size ``s33`` equals its own ``u0``, a check Inductor's code for the
# forward could not evaluate ("name 's33' is not defined"). So under aotkit_inductor, integer
# inputs have no remembered item while our passes trace: every ``item()`` is read from data, as
# PyTorch's own AOT autograd reads it (ops that must decide on the value while tracing, such as
# ``x.repeat(n.item())``, then fail as with ``backend="inductor"``). The nop compilers run on
# real sizes and keep Dynamo's symbol, which such ops can decide on. Reading from data needs a
# ShapeEnv that allows data-dependent scalars (``fullgraph=True`` or ``capture_scalar_outputs``);
# without one, and for floats (Note [Float arguments from Dynamo]), the remembered symbol stays.
@contextlib.contextmanager
def _items_read_from_data(example_inputs: Sequence[Any]) -> Iterator[None]:
    """See Note [Items of Dynamo's inputs]. Dynamo hands real tensors; their fakes, which
    aot_module_simplified finds the same way, hold the remembered items."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    fakes = [mode.from_tensor(x) if mode is not None and type(x) is torch.Tensor else x
             for x in example_inputs]
    remembered = [(f, f.item_memo) for f in fakes
                  if isinstance(f, FakeTensor) and getattr(f, "item_memo", None) is not None
                  and not f.dtype.is_floating_point and f.fake_mode.shape_env is not None
                  and f.fake_mode.shape_env.allow_scalar_outputs]
    for fake, _ in remembered:
        fake.item_memo = None
    try:
        yield
    finally:
        for fake, memo in remembered:
            fake.item_memo = memo
