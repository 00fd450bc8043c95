"""What a trace cannot capture, refused while the metadata pass runs: autograd state (Note
[Autograd state inside the function]) and gradients through sparse tensors (Note [Sparse
tensors made inside]); and the inputs autograd saved after the function wrote them (Note
[Inputs saved after a write])."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import _disable_current_modes

from aotkit.aot.frames import TORCH_DIR, current_user_line
from aotkit.aot.ops import tensors_in, written_by
from aotkit.aot.reads import note_constant
from aotkit.aot.subclass import is_subclass
from aotkit.compat import FakeTensor, FunctionalTensor, StorageWeakRef
from aotkit.errors import UnsupportedError

# Note [Autograd state inside the function]
# The graphs capture what a function computes, not the autograd bookkeeping it touches, and a
# trace sees fake inputs without gradients or hooks. A function that reads an input's ``.grad``
# (``clip_grad_norm_``, an optimizer step) saw None while tracing, so the graph skipped the work
# at every call; one that sets ``.grad``, calls ``retain_grad()`` or registers a
# post-accumulate-grad hook left nothing on the caller's tensors; ``backward()`` inside failed
# deep in PyTorch; and saved-tensor hooks the function enters itself (a pack hook compressing
# activations) do not run while tracing, so the compiled backward used other values than
# eager's. Each is refused with its fix; torch.compile's Dynamo handles them by splitting the
# graph around them. PyTorch's own hooks (``torch.utils.checkpoint``, ``save_on_cpu``) keep the
# values eager computes and stay allowed (aotkit.aot.trace._saved_tensor_hooks_deferred).
_GRAD_GET = torch.Tensor.grad.__get__  # type: ignore[attr-defined]
_GRAD_SET = torch.Tensor.grad.__set__  # type: ignore[attr-defined]
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward)
_USE_TORCH_COMPILE = "or use torch.compile(fn, backend='aotkit'), whose Dynamo handles it"
NOT_AN_ARGUMENT = ("that it does not take as an argument (a closed-over variable, a global or "
                   "an attribute)")


# Note [Sparse tensors made inside]
# Graphs hold strided tensors, and autograd through a sparse tensor made inside does not
# survive the trace: ``x.to_sparse().to_dense() * 2`` silently lost x's gradient, a compressed
# layout of a tensor requiring grad (``x.to_sparse_csr()``) aborted the process in C++, and
# ``sparse_coo_tensor`` of values requiring grad failed in the backward. Those are refused
# before the call, and so is any use of a sparse tensor made from tensors requiring grad
# (Dynamo runs such code eagerly, splitting its graph); ``to_mkldnn`` cannot be traced at all.
# Sparse tensors made where autograd records nothing still work, and so does a sparse output
# (``x.to_sparse()`` returned: the backward densifies its gradient, as eager's does).
_SPARSE_MAKERS = frozenset({
    torch.Tensor.to_sparse_csr, torch.Tensor.to_sparse_csc, torch.Tensor.to_sparse_bsr,
    torch.Tensor.to_sparse_bsc, torch.sparse_coo_tensor, torch.sparse_csr_tensor,
    torch.sparse_csc_tensor, torch.sparse_bsr_tensor, torch.sparse_bsc_tensor,
    torch.sparse_compressed_tensor})
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                            torch.sparse_bsc})
# A sparse constant's fake copy stores no entries: its ``_nnz()`` read 0 while tracing (``x *
# A._nnz()`` gave zeros) and its ``_values()`` had none (``torch.ones(A._nnz())`` as edge weights
# failed at run time); so does a sparse tensor converted inside (``x.to_sparse()``: how many
# depends on data). Reading how many entries such a tensor stores, or the tensors holding them,
# is refused; one made inside from indices and values has them.
_SPARSE_ENTRIES = frozenset({
    torch.Tensor._nnz, torch.Tensor._values, torch.Tensor._indices, torch.Tensor.values,
    torch.Tensor.indices, torch.Tensor.crow_indices, torch.Tensor.col_indices,
    torch.Tensor.ccol_indices, torch.Tensor.row_indices})


def _is_leaf(t: torch.Tensor) -> bool:
    """``t.is_leaf``; False for a view made under no_grad of a base an earlier tracing pass
    wrote with grad mode on (keep_inference_input_mutations' copy_ into a shared base), whose
    autograd state PyTorch refuses to read."""
    try:
        return t.is_leaf
    except RuntimeError:
        return False


def _callers_gradient(t: torch.Tensor, verb: str) -> bool:
    """Whether ``.grad`` of ``t``, a tensor from outside, is the caller's gradient: a leaf
    requiring grad (a closed-over parameter), or any such tensor's .grad set."""
    return verb == "sets" or (t.is_leaf and t.requires_grad) or t.grad is not None


def _made_while_tracing(t: torch.Tensor) -> bool:
    """A tracing tensor, or a tensor subclass wrapping them (a TwoTensor input's product)."""
    if isinstance(t, (FakeTensor, FunctionalTensor)):
        return True
    return is_subclass(t) and all(_made_while_tracing(getattr(t, name))
                                  for name in t.__tensor_flatten__()[0])


# Note [Tensor hooks registered inside]
# ``y.register_hook(fn)`` inside the function is traced like a module's backward hook (Note
# [Module hooks]): ``fn`` runs while the backward is traced, so what it computes on the gradient
# is in the graph, and its other Python side effects happen once, with tracing tensors
# (appending the gradient to a list the function reads is refused, as any store there is:
# Note [Tracing tensors left in argument objects]). One left on a leaf input (a parameter's
# lazily installed gradient clipping, ``x.register_hook`` on a leaf argument) stays on the caller's tensor in
# eager, changing its whole gradient at every later backward: refused (one removed before the
# function returns is not). On an input the caller computed, it is traced as on any other
# tensor: it changes the gradient the function sends that input, not what the input gets from
# elsewhere. A ``hook`` decision, logged as a warning, names these; Dynamo, which
# runs such hooks at every backward, traces its graphs before we see them, so the decision is
# for aotkit's own traces (aot_function, aot_module).
def _hook_registrar() -> tuple[bool, str | None]:
    """Whether PyTorch's own code registers the hook (a module's full backward hooks, Note
    [Module hooks], checkpointing), not the user's; and the autograd helper the registration
    came through (``register_multi_grad_hook``), whose caller is the one that counts."""
    frame, outermost = sys._getframe(), None
    while frame is not None:  # the outermost call: our own modes call it again
        if frame.f_code is _REGISTER_HOOK_CODE:
            outermost = frame
        frame = frame.f_back
    caller, helper = outermost.f_back if outermost is not None else None, None
    while caller is not None and os.path.abspath(caller.f_code.co_filename) == _GRAPH_FILE:
        helper, caller = caller.f_code.co_name, caller.f_back
    torchs = caller is not None and os.path.abspath(caller.f_code.co_filename).startswith(TORCH_DIR)
    return torchs, helper


_REGISTER_HOOK_CODE = torch.Tensor.register_hook.__code__
_GRAPH_FILE = os.path.abspath(torch.autograd.graph.__file__)


def _record_tensor_hook(hook: Any, helper: str | None, where: str) -> None:
    from aotkit import counters
    from aotkit.aot.trace import traced_function

    what = traced_function()
    if what is None:
        return
    shown = f"registered through torch.autograd.graph.{helper}" if helper else \
        f"{getattr(hook, '__qualname__', repr(hook))} registered"
    counters.record(
        "hook", what,
        f"tensor hook {shown} at {where}: traced with the backward, so what it computes on the gradient "
        "is in the graph, but its other Python side effects (storing the gradient, counting "
        "calls) happen only while tracing, with tracing tensors, never when the compiled "
        "function runs. Fix: torch.compile(fn, backend='aotkit') runs such hooks as eager "
        "does; or register the hook on an output of the compiled function.",
        logger=logging.getLogger("aotkit.aot"), level=logging.WARNING)


def _hook_on_input(index: int, where: str) -> UnsupportedError:
    """A tensor hook registered inside on an input (Note [Tensor hooks registered inside]);
    ``where`` it was registered. The input is named by the caller (``input_index``)."""
    exc = UnsupportedError(
        f"the compiled function registers a tensor hook on input {index} (a parameter, or a "
        f"leaf tensor it is passed; at {where}) and leaves it there: eager "
        "installs it on the caller's tensor for good, where it changes the whole gradient "
        "(what the tensor gets outside the call too) at every later backward; the compiled "
        "graph could only apply it to the gradient inside, once traced.\nFix: register the "
        f"hook once outside the compiled function, {_USE_TORCH_COMPILE}.")
    exc.input_index = index  # type: ignore[attr-defined]
    return exc


class RefuseUntraceable(torch.overrides.TorchFunctionMode):
    """See Note [Autograd state inside the function] and Note [Sparse tensors made inside];
    ``f_args`` are the traced inputs."""

    def __init__(self, args: Sequence[Any], f_args: Sequence[Any]) -> None:
        super().__init__()
        self.inputs = {id(a): i for i, a in enumerate(f_args) if isinstance(a, torch.Tensor)}
        self.leaves = {id(f): _is_leaf(a) for a, f in zip(args, f_args, strict=True)
                       if isinstance(a, torch.Tensor)}
        self.hooks = _top_hooks()
        self.leaf_hooks: list[tuple[int, torch.Tensor, Any, str]] = []  # Note [Tensor hooks ...]
        self.hook_lines: set[str] = set()  # one decision per line: a multi-grad hook makes many
        self.sparse_from_grads: dict[int, torch.Tensor] = {}  # held: ids stay unique

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.compiler.is_compiling():  # Dynamo tracing a branch of torch.cond through us
            return func(*args, **(kwargs or {}))
        if func in (_GRAD_GET, _GRAD_SET):
            self._refuse_grad_access(args[0], "reads" if func == _GRAD_GET else "sets")
        elif func is torch.Tensor.retain_grad and self.leaves.get(id(args[0])):
            pass  # retain_grad() on a leaf input does nothing in eager
        elif func is torch.Tensor.retain_grad or func is torch.Tensor.register_post_accumulate_grad_hook:
            what = "retain_grad()" if func is torch.Tensor.retain_grad else \
                "register_post_accumulate_grad_hook()"
            raise UnsupportedError(
                f"the compiled function calls {what} (at {current_user_line()}), which the "
                "compiled backward has no place for: the tensor's .grad or hook would never "
                f"be filled or run.\nFix: call it on the tensor outside the compiled function "
                f"(return the tensor if it is made inside), {_USE_TORCH_COMPILE}.")
        elif func is torch.Tensor.to_mkldnn or self._loses_gradients(func, args, kwargs or {}):
            raise _sparse_refusal(func)
        elif func in _SPARSE_ENTRIES and args[0].layout in _SPARSE_LAYOUTS \
                and (not _made_while_tracing(args[0]) or args[0]._nnz() == 0):
            raise UnsupportedError(
                f"the compiled function reads the stored entries of a sparse tensor ("
                f"{func.__name__}, at {current_user_line()}): tracing sees a sparse constant, "
                "or one converted from dense or coalesced inside, without its entries (none "
                "stored), so the graph would hold a count of 0 or tensors of no elements.\nFix: "
                "compute what "
                "you need of them outside the compiled function and pass it as an argument, "
                f"{_USE_TORCH_COMPILE}.")
        elif func is torch.Tensor.register_hook and not (registrar := _hook_registrar())[0]:
            where = current_user_line()
            if not _made_while_tracing(args[0]):  # the caller's own
                raise UnsupportedError(
                    f"the compiled function registers a tensor hook on a tensor it does not "
                    f"take as an argument (a closed-over variable, a global or an attribute; "
                    f"at {where}): eager installs it on that tensor at every call; tracing "
                    "would install it once per tracing pass.\nFix: register the hook once "
                    f"outside the compiled function, {_USE_TORCH_COMPILE}.")
            if self.leaves.get(id(args[0])):  # refused if still there at the end
                handle = func(*args, **(kwargs or {}))
                self.leaf_hooks.append((self.inputs[id(args[0])], args[0], handle, where))
                return handle
            if where not in self.hook_lines:
                self.hook_lines.add(where)
                _record_tensor_hook(args[1] if len(args) > 1 else (kwargs or {}).get("hook"),
                                    registrar[1], where)
        elif func in _BACKWARD:
            raise UnsupportedError(
                f"the compiled function calls backward() (at {current_user_line()}); aotkit "
                "compiles a function's forward and differentiates it itself, and cannot "
                "accumulate gradients into .grad while tracing.\nFix: return the loss and call "
                f"loss.backward() after the call, {_USE_TORCH_COMPILE}.")
        self._refuse_saved_tensor_hooks()
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._follow_sparse(func, out, tensors_in((args, kwargs)))
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for index, t, handle, where in self.leaf_hooks:
            if exc[0] is None and handle.id in (t._backward_hooks or {}):
                raise _hook_on_input(index, where)

    def _follow_sparse(self, func: Any, out: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """A sparse tensor made from tensors requiring grad may be returned, not computed with:
        see Note [Sparse tensors made inside]."""
        if not torch.is_grad_enabled() or func is torch.Tensor.detach:
            return  # autograd records nothing here
        lost = any(id(t) in self.sparse_from_grads for t in tensors)
        if out.layout in _SPARSE_LAYOUTS and (lost or any(t.requires_grad for t in tensors)):
            for t in (out, getattr(out, "elem", None)):  # FunctionalTensor.to_dense: elem's
                self.sparse_from_grads[id(t)] = t
        elif lost:
            raise _sparse_refusal(func)

    def _loses_gradients(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """See Note [Sparse tensors made inside]."""
        if not torch.is_grad_enabled():
            return False
        tensors = tensors_in((args, kwargs))
        compressed = func is torch.Tensor.to_sparse and kwargs.get("layout") not in (
            None, torch.sparse_coo)
        return (compressed or func in _SPARSE_MAKERS) and any(t.requires_grad for t in tensors)

    def _refuse_grad_access(self, t: Any, verb: str) -> None:
        index = self.inputs.get(id(t))
        if index is None and (_made_while_tracing(t)
                              or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            return  # made inside, or a transform's wrapper (vmap, func.grad): None, as in eager
        if index is None and not _callers_gradient(t, verb):  # eager's .grad is None too
            note_constant(t, grad=True, after_write=False)  # a frozen one: watched
            return
        if index is None:  # an optimizer's parameters (zero_grad), Module.to()'s
            raise UnsupportedError(
                f"the compiled function {verb} .grad of a tensor {NOT_AN_ARGUMENT} (at "
                f"{current_user_line()}); tracing runs it once, so the graph would act at "
                "every call on the .grad the trace saw (a gradient norm read then, a "
                "zero_grad(set_to_none=True) done once; module.to(), .float() and .cpu() read "
                "it too).\nFix: do the gradient work (or move the module) outside the compiled "
                f"function, {_USE_TORCH_COMPILE}.")
        raise UnsupportedError(
            f"the compiled function {verb} .grad of input {index} (at {current_user_line()}); "
            "a trace sees inputs without gradients, so the graph would act at every call as "
            "if .grad were None, and could not set it on the caller's tensor.\nFix: pass the "
            "gradient as an argument (f(p, p.grad)) and return what should become .grad, do "
            f"the gradient work outside the compiled function, {_USE_TORCH_COMPILE}.")

    def _refuse_saved_tensor_hooks(self) -> None:
        hooks = _top_hooks()
        if hooks == self.hooks or hooks is None or _from_torch(hooks[0]):
            return
        raise UnsupportedError(
            f"the compiled function enters saved-tensor hooks of its own (pack hook "
            f"{getattr(hooks[0], '__qualname__', hooks[0])!r}, noticed at {current_user_line()}); "
            "they do not run while tracing, so the compiled backward would use the tensors "
            "themselves, not what the hooks make of them.\nFix: enter "
            "torch.autograd.graph.saved_tensors_hooks around the call of the compiled function "
            f"(the hooks then see what the compiled forward saves), {_USE_TORCH_COMPILE}.")


def _sparse_refusal(func: Any) -> UnsupportedError:
    return UnsupportedError(
        f"the compiled function makes or uses a sparse or mkldnn tensor that autograd must "
        f"differentiate ({getattr(func, '__name__', func)}, at {current_user_line()}); "
        "aotkit's graphs hold strided tensors, and gradients through sparse tensors made "
        f"inside are lost in the trace.\nFix: do this part outside the compiled function, "
        f"{_USE_TORCH_COMPILE} eagerly.")


def _top_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks, also while tracing defers them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _from_torch(pack: Any) -> bool:
    """A hook of PyTorch's own (checkpoint, save_on_cpu, tensor parallelism's, which it wraps
    in functools.partial); not an op such as torch.round used as a hook, which changes values."""
    while isinstance(pack, functools.partial):
        pack = pack.func
    return (getattr(pack, "__module__", None) or "").startswith("torch.")


# Note [Inputs saved after a write]
# ``x.mul_(2); y = x * w`` saves x, as it is after the write, for w's gradient. Eager's backward
# then refuses to run if the caller writes x again before it (through x, a view the function
# returned, or a second call writing it): "modified by an inplace operation". The graph holds
# x's new value as a tensor of its own and saves that, so the caller's write went unnoticed and
# the gradient used the old value. The metadata pass therefore looks at what autograd saved:
# an input the function wrote (its version moved) that some node saved at its final version
# (the input, a view, ``x.detach()``; not ``x.data``, whose version counter is its own) makes
# the runtime record the caller's tensor's version after writing the new value back. Backward
# checks it when eager would run that node: a gradient arrived for an output whose backward
# reaches it (not an unused auxiliary output), and the engine runs an edge its gradient flows
# to (not ``autograd.grad`` with respect to other inputs only; PyTorch cannot tell that for a
# leaf under autograd.grad, and then nothing is checked). Writes autograd's version counter
# does not see (BatchNorm's running statistics, updated inside the kernel) are not watched, as
# in eager.
def versions_of(tensors: Sequence[Any]) -> list[int | None]:
    """Version counters, None where there is none (not a tensor, an inference tensor)."""
    return [t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None
            for t in tensors]


@dataclass(frozen=True)
class SavedAfterWrite:
    """Where autograd saved a written input (Note [Inputs saved after a write]): the flat
    outputs and written inputs whose backward reaches a node that saved it, and the inputs that
    node's gradient flows to. Eager checks the version only when that node runs."""

    outputs: frozenset[int]
    written: frozenset[int]
    leads_to: frozenset[int]


def inputs_saved_after_write(f_args: Sequence[Any], versions: Sequence[int | None],
                             f_outs: Sequence[Any], before: Sequence[Any]
                             ) -> dict[int, SavedAfterWrite]:
    """The inputs of Note [Inputs saved after a write]: ``versions`` are the inputs' versions
    before the function ran (:func:`versions_of`), ``before`` the grad_fns they had (where the
    search stops). Bumps the written inputs' versions (see :func:`_sharing_versions`)."""
    written = {StorageWeakRef(f.untyped_storage()): i for i, (f, v) in
               enumerate(zip(f_args, versions, strict=True)) if v is not None and f._version != v}
    if not written:
        return {}
    stop = {id(g): j for j, g in enumerate(before) if g is not None}
    found = []  # (input, saved tensor, root kind, root index, saving node)
    for kind, k, t in [*(("out", k, t) for k, t in enumerate(f_outs)),
                       *(("arg", k, f_args[k]) for k in written.values())]:
        for node in nodes_below(getattr(t, "grad_fn", None), stop):
            found += [(i, saved, kind, k, node) for saved in _saved_tensors(node)
                      if (i := written.get(StorageWeakRef(saved.untyped_storage()))) is not None]
    shared = _sharing_versions(f_args, found)
    leaves = {id(f): j for j, f in enumerate(f_args) if isinstance(f, torch.Tensor)}
    reach: dict[int, tuple[set[int], set[int], set[int]]] = {}
    for i, saved, kind, k, node in found:
        if id(saved) in shared:
            outs, args, leads = reach.setdefault(i, (set(), set(), set()))
            (outs if kind == "out" else args).add(k)
            leads.update(_inputs_below(node, stop, leaves))
    return {i: SavedAfterWrite(frozenset(o), frozenset(a), frozenset(n))
            for i, (o, a, n) in reach.items()}


def _sharing_versions(f_args: Sequence[Any], found: Sequence[tuple[Any, ...]]) -> set[int]:
    """The saved tensors (ids) that share their input's version counter (a view, ``x.detach()``),
    not only its memory (``x.data``, whose writes eager's check never sees): bumping the input's
    version tells. The metadata pass reads no version after this."""
    shared = set()
    for i in {entry[0] for entry in found}:
        saved = [entry[1] for entry in found if entry[0] == i]
        versions = [t._version for t in saved]
        torch.autograd.graph.increment_version(f_args[i])
        shared.update(id(t) for t, v in zip(saved, versions, strict=True) if t._version != v)
    return shared


def nodes_below(node: Any, stop: Mapping[int, int], numbered_from: int = 0) -> Iterator[Any]:
    """Autograd nodes from ``node`` down, not past the inputs' own histories (``stop``) nor
    into nodes numbered below ``numbered_from`` (made earlier)."""
    seen: dict[int, Any] = {}  # held: an id is unique only while its node lives
    todo = [node]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop \
                or node._sequence_nr() < numbered_from:
            continue
        seen[id(node)] = node
        yield node
        todo.extend(next_node for next_node, _ in node.next_functions)


def _inputs_below(node: Any, stop: Mapping[int, int], leaves: Mapping[int, int]) -> set[int]:
    """The inputs ``node``'s gradient flows to: their histories, or their AccumulateGrad."""
    found = set()
    for below in nodes_below(node, stop):
        for next_node, _ in below.next_functions:
            variable = getattr(next_node, "variable", None)
            if id(next_node) in stop:
                found.add(stop[id(next_node)])
            elif variable is not None and id(variable) in leaves:
                found.add(leaves[id(variable)])
    return found


def _saved_tensors(node: Any) -> Iterator[torch.Tensor]:
    """The tensors an autograd node saved that are still at the version it saved them at."""
    names = ["saved_tensors"] if isinstance(node, torch.autograd.function.BackwardCFunction) \
        else [n for n in dir(node) if n.startswith("_saved_")]
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # written after being saved: Note [Saved tensors the forward changes]
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, torch.Tensor):
                yield v


# Note [Ops without an autograd kernel]
# An op registered without an autograd kernel (torch.library.Library's lib.impl for CPU or
# CompositeExplicitAutograd only) goes through autograd's fallback, which in eager runs the
# kernel and lets autograd record whatever that kernel does (a Python kernel's x * x is
# differentiated), and when nothing was recorded only warns ("an autograd kernel was not
# registered ... This may lead to silently incorrect behavior") and gives no gradient. Traced,
# the op runs its fake kernel, which records nothing: the backward always dropped its gradient,
# with that warning only. Such an op's output has the fallback's node as its grad_fn: the joint
# trace refuses the function when its outputs' autograd graph reaches one, naming the ops
# without an autograd kernel that the dispatch guard saw given a tensor requiring grad.
# (Catching the warning instead needed warnings.catch_warnings, which resets Python's
# once-per-location record of every other warning.) An op writing in place to a tensor
# requiring grad leaves no fallback node (eager records what its kernel's in-place ops do):
# the guard refuses it when it is called.
_FALLBACK_NODE = "torch::autograd::WarnNotImplemented"


def reaches_autograd_fallback(outs: Sequence[torch.Tensor]) -> bool:
    """Whether the outputs' autograd graph reaches the fallback's node: see Note [Ops without
    an autograd kernel]."""
    seen: set[Any] = set()
    stack = [o.grad_fn for o in outs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == _FALLBACK_NODE:
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def note_no_autograd_kernel(func: torch._ops.OpOverload, args: Any, kwargs: Any, what: str,
                            seen: set[str]) -> None:
    """An op without an autograd kernel given a tensor requiring grad goes into ``seen``, for
    the refusal to name; one writing to such a tensor in place is refused here (autograd's
    fallback leaves no node for it)."""
    if not torch.is_grad_enabled() or torch._C._dispatch_tls_is_dispatch_key_excluded(
            torch._C.DispatchKey.AutogradCPU) or any(  # called below an autograd kernel
            torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
            for key in ("Autograd", "AutogradCPU", "AutogradCUDA")):
        return
    tensors = tensors_in((args, kwargs))
    if any(t.requires_grad for t in tensors):
        seen.add(func.name())
        if any(t.requires_grad for t in written_by(func, args, kwargs)):
            raise no_autograd_kernel(what, [func.name()], "writes in place to a tensor")


def no_autograd_kernel(what: str, ops: Sequence[str], how: str) -> UnsupportedError:
    """The refusal of Note [Ops without an autograd kernel]."""
    calls = (f"{', '.join(ops)}, which {'has' if len(ops) == 1 else 'have'}" if ops
             else "an op that has")
    return UnsupportedError(
        f"{what} calls {calls} no autograd kernel, and {how} requiring grad: its fake kernel, "
        "which aotkit traces, records no gradient, so the backward would drop it (eager "
        "differentiates what a Python kernel computes, and warns \"may lead to silently "
        "incorrect behavior\" otherwise).\nFix: register the op's backward "
        "(torch.library.register_autograd), register its kernel as CompositeImplicitAutograd "
        "so that it traces through, or pass that input detached (x.detach()) where its "
        "gradient is not needed.")


_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))


def has_tangent(t: torch.Tensor) -> bool:
    """Whether the real tensor ``t`` is a forward-mode AD dual tensor at the current level. Read
    from a dispatch mode, which runs below autograd, where unpacking one fails: with the modes
    off and autograd's keys back on."""
    keys = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS)
    with _disable_current_modes(), keys:
        return fwAD.unpack_dual(t).tangent is not None
