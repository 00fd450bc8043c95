"""Autograd state inside a traced function: what a trace cannot capture, refused while the
metadata pass runs (Note [Autograd state inside the function]), and inputs autograd saved after
the function wrote them (Note [Inputs saved after a write])."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from aotkit.aot.frames import current_user_line
from aotkit.compat import StorageWeakRef
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


class RefuseAutogradState(torch.overrides.TorchFunctionMode):
    """See Note [Autograd state inside the function]; ``f_args`` are the traced inputs."""

    def __init__(self, f_args: Sequence[Any]) -> None:
        super().__init__()
        self.inputs = {id(a): i for i, a in enumerate(f_args) if isinstance(a, torch.Tensor)}
        self.hooks = _top_hooks()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.compiler.is_compiling():  # Dynamo tracing a branch of torch.cond through us
            return func(*args, **(kwargs or {}))
        if func in (_GRAD_GET, _GRAD_SET):
            self._refuse_grad_access(args[0], "reads" if func == _GRAD_GET else "sets")
        elif func is torch.Tensor.retain_grad or func is torch.Tensor.register_post_accumulate_grad_hook:
            what = "retain_grad()" if func is torch.Tensor.retain_grad else \
                "register_post_accumulate_grad_hook()"
            raise UnsupportedError(
                f"the compiled function calls {what} (at {current_user_line()}), which the "
                "compiled backward has no place for: the tensor's .grad or hook would never "
                f"be filled or run.\nFix: call it on the tensor outside the compiled function "
                f"(return the tensor if it is made inside), {_USE_TORCH_COMPILE}.")
        elif func in _BACKWARD:
            raise UnsupportedError(
                f"the compiled function calls backward() (at {current_user_line()}); aotkit "
                "compiles a function's forward and differentiates it itself, and cannot "
                "accumulate gradients into .grad while tracing.\nFix: return the loss and call "
                f"loss.backward() after the call, {_USE_TORCH_COMPILE}.")
        self._refuse_saved_tensor_hooks()
        return func(*args, **(kwargs or {}))

    def _refuse_grad_access(self, t: Any, verb: str) -> None:
        index = self.inputs.get(id(t))
        if index is None:  # a tensor made inside: eager's .grad is None too
            return
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
            f"{getattr(hooks[0], '__qualname__', hooks[0])!r}, before {current_user_line()}); "
            "they do not run while tracing, so the compiled backward would use the tensors "
            "themselves, not what the hooks make of them.\nFix: enter "
            "torch.autograd.graph.saved_tensors_hooks around the call of the compiled function "
            f"(the hooks then see what the compiled forward saves), {_USE_TORCH_COMPILE}.")


def _top_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks, also while tracing defers them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _from_torch(pack: Any) -> bool:
    module = getattr(pack, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


# Note [Inputs saved after a write]
# ``x.mul_(2); y = x * w`` saves x, as it is after the write, for w's gradient. Eager's backward
# then refuses to run if the caller writes x again before it (through x, a view the function
# returned, or a second call writing it): "modified by an inplace operation". The graph holds
# x's new value as a tensor of its own and saves that, so the caller's write went unnoticed and
# the gradient used the old value. The metadata pass therefore looks at what autograd saved:
# an input the function wrote (its version moved) whose memory some saved tensor shares at
# its final version makes the runtime record the caller's tensor's version after writing the
# new value back, and backward checks it. Writes autograd's version counter does not see
# (BatchNorm's running statistics, updated inside the kernel) are not watched, as in eager.
def versions_of(tensors: Sequence[Any]) -> list[int | None]:
    """Version counters, None where there is none (not a tensor, an inference tensor)."""
    return [t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None
            for t in tensors]


def inputs_saved_after_write(f_args: Sequence[Any], versions: Sequence[int | None],
                             f_outs: Sequence[Any], before: Sequence[Any]) -> set[int]:
    """The inputs of Note [Inputs saved after a write]: ``versions`` are the inputs' versions
    before the function ran (:func:`versions_of`), ``before`` the grad_fns they had (where the
    search stops)."""
    written = {StorageWeakRef(f.untyped_storage()): i for i, (f, v) in
               enumerate(zip(f_args, versions, strict=True))
               if v is not None and f._version != v}
    if not written:
        return set()
    stop = {id(g) for g in before if g is not None}
    roots = [t.grad_fn for t in (*f_outs, *f_args) if isinstance(t, torch.Tensor)]
    seen: dict[int, Any] = {}  # held: an id is unique only while its node lives
    found = set()
    while roots:
        node = roots.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        found.update(i for t in _saved_tensors(node)
                     if (i := written.get(StorageWeakRef(t.untyped_storage()))) is not None)
        roots.extend(next_node for next_node, _ in node.next_functions)
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
