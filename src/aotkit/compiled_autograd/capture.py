"""The capture object: the C++ autograd engine calls it node by node to build one FX graph.

See Note [Compiled autograd protocol] in aotkit.compat. The engine walks the autograd graph in
execution order and, for every node, asks us to record a call instead of running it: built-in
formulas (``apply_functional``), custom Function backwards (``proxy_call_backward``), hooks and
gradient accumulation. Tensors it hands us are fake; each is bound to the FX value that will
hold it at run time, and the graph's placeholders are the engine's five lists
``inputs, sizes, scalars, hooks, packed_data``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
)
from torch.fx.experimental.symbolic_shapes import _suppress_guards

from aotkit import compat, config, counters
from aotkit.compiled_autograd import engine_order, passes, runtime
from aotkit.compiled_autograd import session as session_state
from aotkit.compiled_autograd.builder import GraphBuilder
from aotkit.compiled_autograd.lower import Example
from aotkit.compiled_autograd.session import (
    NAN_CHECK_MESSAGE,
    CompiledBackward,
    Session,
    log,
    make_variant,
    refuse_unsupported_modes,
)
from aotkit.errors import UnsupportedError

_ids = itertools.count()


def reset_ids() -> None:
    global _ids
    _ids = itertools.count()


class Capture(GraphBuilder):
    """Records one backward as an FX graph; a fresh one is made for every capture."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self.reasons: list[str] = []
        self.origins: list[str] = []
        self.call_names: dict[int, str] = {}  # NodeCall index -> autograd node name
        self.nodecall = 0
        self.eager_order: list[Any] | None = []

    def close(self) -> None:
        """Leave the fake/proxy modes (the engine calls this when a capture fails too)."""
        self.stack.close()

    # ---- begin ------------------------------------------------------------------------------

    def begin_capture(self, inputs: list[torch.Tensor], sizes: Sequence[int],
                      scalars: list[Any], origins: Any = None, accumulate_grad: bool = True,
                      check_nans: bool = False, *rest: Any) -> tuple[str, list[Any], list[Any],
                                                                      list[Any]]:
        """Start a graph: fake the inputs and turn sizes and scalars into symbols."""
        refuse_unsupported_modes()  # the engine runs a create_graph=True backward with grad on
        if check_nans:
            raise UnsupportedError(NAN_CHECK_MESSAGE)
        self.id = next(_ids)
        # The nodes in the order eager would run them: See Note [Eager node order].
        self.eager_order, self.order_unknown = engine_order.execution_order()
        self.name = f"aotkit_compiled_autograd_{self.id}"
        self._note_foreign_thread()
        self.input_shapes = [tuple(x.shape) for x in inputs]
        self.example = Example(list(inputs), list(sizes), list(scalars))
        inputs_p, self.sizes_p, self.scalars_p, self.hooks_p, self.packed_p = self.start_graph()
        self.stack.enter_context(enable_python_dispatcher())  # SymInts must not be hashed
        for i, x in enumerate(inputs):
            inputs[i] = self.fake(x, i)
        self.bind(inputs, inputs_p)
        sym_sizes = [self.symbol(v, "sizes", i, self.sizes_p) for i, v in enumerate(sizes)]
        sym_scalars = [self.symbol(v, "scalars", i, self.scalars_p) for i, v in enumerate(scalars)]
        self.stack.enter_context(self.fake_mode)
        self.stack.enter_context(self.proxy_mode)
        # Capture must not add shape guards: the engine's cache decides when to capture again.
        self.stack.enter_context(_suppress_guards(self.shape_env))
        return self.name, inputs, sym_sizes, sym_scalars

    def _note_foreign_thread(self) -> None:
        """A backward in another thread than the enable() block's is captured too: the engine
        holds one compiler per process (Note [Backwards in other threads])."""
        here, block = threading.current_thread(), self.session.thread
        if here is not block:
            counters.record(
                "thread", "compiled_autograd",
                f"{self.name}: captured a backward run in thread {here.name} while the enable() "
                f"block of thread {block.name} is active; PyTorch's engine compiles every "
                "thread's backward while a compiler is set", logger=log)

    def _call(self, fn: Callable[..., Any], args: Any, kwargs: Any = None) -> fx.Proxy:
        proxy = self.tracer.create_proxy("call_function", fn, self.to_proxy(args), kwargs or {})
        proxy.node.meta["autograd_node"] = self.origin
        proxy.node.meta["nodecall"] = self.nodecall
        return proxy

    def _dummies(self, count: int) -> list[torch.Tensor]:
        # Placeholders the engine replaces through validate_outputs; their metadata is unused.
        with disable_proxy_modes_tracing():
            return [torch.empty(0) for _ in range(count)]

    def _fresh(self, x: Any) -> Any:
        """A new fake with ``x``'s metadata: a hook's result is a new value of the graph."""
        if not isinstance(x, torch.Tensor):
            return x
        with disable_proxy_modes_tracing():
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)

    # ---- what the engine calls per node ------------------------------------------------------

    def set_node_origin(self, node_name: str, nodecall_index: int, pyobj: Any = None) -> None:
        """Which autograd node the following calls come from (kept in ``node.meta``)."""
        self.origin = f"{node_name} (NodeCall {nodecall_index})"
        self.origins.append(node_name)
        self.call_names[nodecall_index] = node_name
        self.nodecall = nodecall_index

    def log_compile_reasons(self, reasons: Sequence[str]) -> None:
        """Why the engine's cache missed; see :meth:`end_capture`.

        The engine passes every reason it logged so far, each prefixed with the name of the graph
        it was captured for (the name :meth:`begin_capture` returned): keep this capture's."""
        ours = f"{self.name}:"
        self.reasons.extend(r for r in map(str, reasons) if r.startswith(ours))

    def bind_function(self, fn_name: str, fn: Callable[..., Any], is_custom_function: bool = False,
                      is_traceable: bool = True, *rest: Any) -> str:
        """Register a C++ backward formula (the engine does this once per process)."""
        return runtime.bind(fn_name, fn, is_custom_function, is_traceable)

    def apply_functional(self, fn_name: str, grads: Sequence[Any], args: Any,
                         output_metadata: Sequence[Any]) -> list[torch.Tensor]:
        """Record a call of a built-in backward formula."""
        return self.proxy_call(runtime.lookup(fn_name), (grads, *args), output_metadata)

    def proxy_call(self, fn: Callable[..., Any], args: Any,
                   output_metadata: Sequence[Any]) -> list[torch.Tensor]:
        """Record ``fn(*args)`` with one output per entry of ``output_metadata``."""
        proxy = self._call(fn, tuple(pytree.tree_map(lambda x: x, args)))
        results = self._dummies(len(output_metadata))
        self.bind(results, proxy)
        return results

    def validate_outputs(self, fn_name: str, outputs: list[Any], args: Any,
                         output_metadata: Sequence[Any]) -> list[Any]:
        """Record the engine's shape/dtype/device fix-up of a node's gradients."""
        proxy = self._call(runtime.lookup(fn_name), (outputs, *args))
        self.bind(outputs, proxy)
        return outputs

    def proxy_call_backward(self, inputs: Sequence[Any], output_metadatas: Sequence[Any],
                            saved_tensors: Sequence[torch.Tensor], backward_idx: int, ctx: Any,
                            *rest: Any) -> tuple[torch.Tensor | None, ...]:
        """Record a custom ``autograd.Function`` backward; the ctx arrives in ``hooks``."""
        forward_cls = ctx._forward_cls
        if hasattr(forward_cls, "_aot_id") or getattr(forward_cls, "boxed_grads_call", False):
            raise UnsupportedError(
                f"compiled autograd cannot capture the backward of {forward_cls.__name__}, a "
                "forward compiled by PyTorch's own AOT autograd (torch.compile with "
                "backend=\"aot_eager\" or \"inductor\").\nFix: compile the forward with "
                "backend=\"aotkit\" or \"aotkit_inductor\" (or aotkit.aot_function/aot_module), "
                "or run this backward under aotkit.compiled_autograd.disable()."
            )
        options: dict[str, Any] = {"tensor_inputs": tuple(m is not None for m in output_metadatas)}
        if runtime.defines_vjp(forward_cls):
            options["vjp"] = True
        proxy = self._call(runtime.call_backward,
                           (self.hooks_p[backward_idx], list(saved_tensors), *inputs), options)
        with disable_proxy_modes_tracing():
            grads = [None if meta is None else
                     torch.empty(meta[3], layout=meta[0], device=meta[1], dtype=meta[2])
                     for meta in output_metadatas]
        self.bind(grads, proxy)
        return tuple(grads)

    def call_copy_slices_prologue(self, inputs: Sequence[Any], *geometry: Any) -> list[Any]:
        """Record the first half of an in-place-on-view backward."""
        return self.proxy_call(runtime.copy_slices_prologue, (inputs, *geometry), [None] * 3)

    def call_copy_slices_epilogue(self, needs_input_grad: Sequence[bool], result: Any,
                                  res: Sequence[Any], grad_slice: Any) -> list[Any]:
        """Record the second half of an in-place-on-view backward."""
        return self.proxy_call(runtime.copy_slices_epilogue,
                               (list(needs_input_grad), result, res, grad_slice),
                               [None] * len(needs_input_grad))

    def accumulate(self, old_var: Any, new_var: Any) -> torch.Tensor:
        """Record the sum of two gradients flowing into one node input."""
        proxy = self._call(runtime.add_gradients, (old_var, new_var))
        proxy.node.meta["buffer_sum"] = True  # see passes.sum_in_eager_order
        (result,) = self._dummies(1)
        self.bind([result], [proxy])
        return result

    def accumulate_grad(self, variable: torch.Tensor, variable_grad: Any, grad: Any,
                        has_post_hooks: bool | None = None) -> torch.Tensor | None:
        """Record accumulation into a leaf's ``.grad``, where eager runs it."""
        old_protocol = has_post_hooks is None
        variable, _, grad, has_post_hooks = compat.accumulate_grad_args(
            variable, variable_grad, grad, has_post_hooks)
        # The engine's snapshot of .grad is dropped: see Note [Accumulate into the current .grad].
        proxy = self._call(runtime.call_accumulate_grad, (variable, grad, has_post_hooks))
        with disable_proxy_modes_tracing():  # .grad keeps its dtype, else takes grad_dtype
            dtype = variable.grad.dtype if variable.grad is not None else (
                getattr(variable, "grad_dtype", None) or variable.dtype)
            result = torch.empty_like(variable, dtype=dtype)
        self.bind([result], [proxy])
        variable.grad = result
        return None if old_protocol else result

    def _hook(self, hook_id: int, *args: Any, hook_type: str) -> fx.Proxy:
        return self._call(runtime.call_hook, (self.hooks_p[hook_id], *args),
                          {"hook_type": hook_type, "hook_id": hook_id})

    def tensor_pre_hook(self, inputs: list[Any], hook_id: int, i: int) -> list[Any]:
        """Record a ``Tensor.register_hook`` hook on gradient ``i``."""
        proxy = self._hook(hook_id, inputs[i], hook_type="tensor_pre_hook")
        proxy.node.meta["nodecall"] = None  # see passes.follow_node_order
        inputs[i] = self._fresh(inputs[i])
        self.bind([inputs[i]], [proxy])
        return inputs

    def cpp_tensor_pre_hook(self, inputs: list[Any], hook_id: int, i: int) -> list[Any]:
        """Record a C++ tensor pre-hook (``retain_grad``)."""
        proxy = self._call(runtime.call_cpp_tensor_pre_hooks, (hook_id, inputs[i]))
        proxy.node.meta["nodecall"] = None  # see passes.follow_node_order
        inputs[i] = self._fresh(inputs[i])
        self.bind([inputs[i]], [proxy])
        return inputs

    def pre_hook(self, inputs: Sequence[Any], hook_id: int) -> list[Any]:
        """Record a node pre-hook (``grad_fn.register_prehook``, module backward pre-hooks)."""
        proxy = self._hook(hook_id, list(inputs), hook_type="pre_hook")
        proxy.node.meta["nodecall"] = None  # see passes.follow_node_order
        fresh = [self._fresh(x) for x in inputs]
        self.bind(fresh, proxy)
        return fresh

    def post_hook(self, outputs: list[Any], inputs: Sequence[Any], hook_id: int) -> list[Any]:
        """Record a node post-hook (``grad_fn.register_hook``, module full backward hooks)."""
        proxy = self._hook(hook_id, list(outputs), list(inputs), hook_type="post_hook")
        fresh = [self._fresh(x) for x in outputs]
        self.bind(fresh, proxy)
        return fresh

    def post_acc_grad_hook(self, input: torch.Tensor, hook_id: int) -> list[Any]:
        """Record a ``register_post_accumulate_grad_hook`` hook."""
        proxy = self._hook(hook_id, input, hook_type="post_acc_grad_hook")
        result = [self._fresh(input)]
        self.bind(result, [proxy])
        return result

    def unpack_hook(self, hook_id: int, data_id: int) -> torch.Tensor:
        """Record a saved-tensor unpack hook on packed value ``data_id``."""
        proxy = self._hook(hook_id, self.packed_p[data_id], hook_type="unpack_hook")
        (result,) = self._dummies(1)
        self.bind([result], [proxy])
        return result

    # ---- end ----------------------------------------------------------------------------------

    def end_capture(self, outputs: Any) -> tuple[CompiledBackward, Any]:
        """Finish the graph, compile it with the session's compiler, record why we captured."""
        self.stack.close()
        graph = self.tracer.graph
        self.tracer.create_node("output", "output", (self.tracer.create_arg(
            self.to_proxy(outputs)),), {})
        to_cuda = self._plan_cuda_scalars(graph)
        for node in graph.nodes:
            # Values were traced with placeholder fakes; their metadata would mislead passes.
            for key in ("val", "tensor_meta"):
                node.meta.pop(key, None)
        self._follow_eager_order(graph)
        passes.eliminate_dead_code(graph)
        gm = fx.GraphModule(self.tracer.root, graph, f"CompiledAutograd{self.id}")
        if log.isEnabledFor(logging.INFO):
            log.info("captured backward graph %d:\n%s", self.id,
                     gm.print_readable(print_output=False))
        variant = make_variant(gm, self.example, self.session, why_captured=(
            f"inputs {to_cuda} move to CUDA for CUDA graphs" if to_cuda else None))
        captured_for = Example([], list(self.example.sizes), list(self.example.scalars))
        grad_dtypes = [(i, self.example.inputs[i].grad_dtype)
                       for i in runtime.accumulated_inputs(gm)]
        self.example = None  # the backward's real tensors: not kept past the capture
        self._record()
        return CompiledBackward(gm, self.session, variant, to_cuda, captured_for,
                                grad_dtypes), variant.compiled

    def _follow_eager_order(self, graph: fx.Graph) -> None:
        """Put the recorded calls in eager's node order (See Note [Eager node order]); where it
        is unknown, at least accumulate into ``.grad`` as soon as the gradient is ready."""
        if self.eager_order is None:
            why, ranks = self.order_unknown, None
        else:
            why = ("could not match the engine's capture order to eager's node order (several "
                   "backward roots alike in structure, depending on each other, or too many to "
                   "search)")
            ranks = engine_order.eager_ranks(self.eager_order, self.call_names)
        if ranks is None:
            counters.record(
                "hook_order", "compiled_autograd",
                f"{self.name}: {why}; hooks on independent branches run in the capture's order "
                "and gradients summed over several branches may round differently from eager, "
                "for this backward and every later one this graph replays (roots passed in "
                "another order included)", logger=log)
            passes.place_accumulations_eagerly(graph)
            return
        passes.sum_in_eager_order(graph, ranks)
        passes.follow_node_order(graph, ranks)

    def _plan_cuda_scalars(self, graph: fx.Graph) -> list[int]:
        if not config.compiled_autograd_cudagraphs:
            return []
        plan = passes.cpu_scalars_to_move(graph)
        if plan.moved or plan.kept:
            kept = "; ".join(f"inputs[{i}] stays: {why}" for i, why in sorted(plan.kept.items()))
            counters.record("cuda_scalars", "compiled_autograd",
                            f"moved inputs {plan.moved} to cuda. {kept}".strip(), logger=log)
        return plan.moved

    def _record(self) -> None:
        counters.bump("compiled_autograd", "captures")
        self.session.captures += 1
        first = session_state.graphs_cached == 0
        session_state.graphs_cached += 1
        kind = "capture" if first else "recapture"
        why = "; ".join(self.reasons) or (
            "the engine's cache held an entry without a graph for this backward's autograd "
            "nodes (an earlier capture of them failed, or an earlier backward passed them on its "
            "way to more nodes)" if runtime.retrying_unexplained()
            else "first backward since the engine's cache was cleared" if first
            else "the engine's cache missed (no reason reported by this PyTorch)")
        why += f" (input shapes {self.input_shapes})"
        counters.record(kind, "compiled_autograd", why, logger=log)
