"""What capture and lowering share: a graph under construction whose values are fake tensors
(and, when capturing, symbols), each bound to the FX value that holds it at run time.

The graph's placeholders are the engine's five lists ``inputs, sizes, scalars, hooks,
packed_data``; when capturing, a size or scalar becomes a symbol whose source is its place in
its list, so replays read the new value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    _ProxyTensor,
    fetch_object_proxy,
    fetch_sym_proxy,
    track_tensor_tree,
)
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from aotkit import compat
from aotkit.errors import TraceError, UnsupportedError

PLACEHOLDERS = ("inputs", "sizes", "scalars", "hooks", "packed_data")


def _source(name: str, index: int) -> Any:
    # Imported here: torch._dynamo.source loads all of Dynamo (~1 s), which `import aotkit`
    # must not pay.
    from torch._dynamo.source import GetItemSource, LocalSource

    return GetItemSource(LocalSource(name), index)


class GraphBuilder:
    """A new FX graph with the engine's placeholders, and fake and proxy modes; ``static``: fakes
    have the sizes of the tensors they stand for, no symbols."""

    def __init__(self, static: bool = False) -> None:
        self.stack = contextlib.ExitStack()
        self.shape_env = None if static else ShapeEnv()
        self.fake_mode = compat.new_fake_mode(
            allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=self.shape_env
        )
        self.tracer = PythonKeyTracer()
        self.proxy_mode = ProxyTorchDispatchMode(self.tracer, "symbolic")
        self.sym_proxies: dict[Any, fx.Proxy] = {}
        self.origin = ""  # the autograd node being recorded, for error messages

    def start_graph(self) -> list[fx.Proxy]:
        """A fresh graph; returns the proxies of its placeholders, in ``PLACEHOLDERS`` order."""
        self.tracer.root = torch.nn.Module()
        self.tracer.graph = fx.Graph(tracer_cls=PythonKeyTracer)
        self.tracer.tensor_attrs = {}
        return [self.tracer.create_proxy("placeholder", n, (), {}) for n in PLACEHOLDERS]

    def fake(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """A fake of backward input ``index``, its sizes symbolic unless ``static``."""
        if torch._C._functorch.is_legacy_batchedtensor(x) or torch._C._functorch.is_batchedtensor(x):
            raise UnsupportedError(
                f"compiled autograd cannot capture backward input {index}: it is batched by "
                "vmap (autograd.grad(..., is_grads_batched=True), or a backward inside "
                "torch.func.vmap). Workaround: run this backward under "
                "aotkit.compiled_autograd.disable()."
            )
        try:
            leaf = x if x._base is None else x._base  # a view (a saved weight.t()) fakes its base
            grad = leaf.grad if leaf.is_leaf and leaf.requires_grad else None
            if grad is None or grad.dtype == leaf.dtype:
                return self.fake_mode.from_tensor(x, source=_source("inputs", index))
            return self._fake_with_other_grad_dtype(x, leaf, grad, index)
        except Exception as exc:
            raise UnsupportedError(
                f"compiled autograd cannot fake backward input {index} of type {type(x).__name__}"
                f": {exc}. Workaround: run this backward under aotkit.compiled_autograd.disable()."
            ) from exc

    def _fake_with_other_grad_dtype(self, x: torch.Tensor, leaf: torch.Tensor,
                                    grad: torch.Tensor, index: int) -> torch.Tensor:
        """``x``, or the ``leaf`` it views, has a ``.grad`` of another dtype (``grad_dtype``
        set, or None with a ``.grad`` of its own dtype): faking copies ``.grad`` onto a fake
        that has the default ``grad_dtype``, which refuses it, so the leaf's fake gets its
        ``grad_dtype`` first (the fake mode gives a view's base and the leaf one fake)."""
        leaf.grad = None
        try:
            fake = self.fake_mode.from_tensor(x, source=_source("inputs", index))
        finally:
            leaf.grad = grad
        fake_leaf = fake if fake._base is None else fake._base
        if fake_leaf.grad is None:
            fake_leaf.grad_dtype = leaf.grad_dtype
            fake_leaf.grad = self.fake_mode.from_tensor(grad)
        return fake

    def symbol(self, value: Any, name: str, index: int, placeholder: fx.Proxy) -> Any:
        """A SymInt/SymFloat standing for ``placeholder[index]``, so replays read the new value."""
        assert self.shape_env is not None, "symbols need a ShapeEnv"
        source = _source(name, index)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TraceError(f"compiled autograd: unexpected {name}[{index}] = {value!r}")
        if isinstance(value, int):
            sym = self.shape_env.create_unspecified_symint_and_symbol(
                value, source, DimDynamic.DYNAMIC)
        else:
            symbol = self.shape_env.create_unspecified_symbol(
                value, source=source, dynamic_dim=DimDynamic.DYNAMIC)
            sym = self.shape_env.create_symfloatnode(symbol, hint=value, source=source)
        if isinstance(sym, (torch.SymInt, torch.SymFloat)):
            proxy = placeholder[index]
            self.sym_proxies[sym.node] = proxy
            # C++ code may run ATen ops on these sizes; the proxy mode must know them.
            track_tensor_tree(sym, proxy, constant=None, tracer=self.tracer)
        return sym

    def to_proxy(self, value: Any) -> Any:
        """The graph value holding ``value`` (tensors, symbols; constants pass through)."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.to_proxy(v) for v in value)
        if isinstance(value, (torch.SymInt, torch.SymFloat)):
            if value.node in self.sym_proxies:
                return self.sym_proxies[value.node]
            try:  # a size of a fake input, or arithmetic on symbols: the proxy mode tracks those
                return fetch_sym_proxy(self.tracer)(value)
            except Exception as exc:
                raise TraceError(f"compiled autograd: symbol {value} has no graph value "
                                 f"(in {self.origin or 'the engine'})") from exc
        if not isinstance(value, torch.Tensor):
            return value
        tracked = fetch_object_proxy(self.tracer, value)
        if not isinstance(tracked, _ProxyTensor):
            raise TraceError(f"compiled autograd: a tensor of the backward has no graph value "
                             f"(in {self.origin or 'the engine'})")
        return tracked.proxy

    def bind(self, objects: Sequence[Any], proxies: Any) -> None:
        """Make ``objects[i]`` the value of ``proxies[i]`` (a list proxy is indexed)."""
        if isinstance(proxies, fx.Proxy):
            proxies = [proxies[i] for i in range(len(objects))]
        track_tensor_tree(list(objects), list(proxies), constant=None, tracer=self.tracer)
