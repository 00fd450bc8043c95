"""Which hooks a module holds, compared without holding them (Note [What a trace reads besides
its inputs] in aotkit.aot.reads)."""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.nn.modules import module as nn_module


def _ref(obj: Any) -> Callable[[], Any]:
    """A weak reference where ``obj`` takes one, else a strong one (``ref() is obj`` either way,
    but for a bound method, made anew at each attribute access: ``==`` to it)."""
    try:
        return weakref.WeakMethod(obj) if isinstance(obj, types.MethodType) else weakref.ref(obj)
    except TypeError:  # a method of an object with __slots__ and no __weakref__, an int
        return lambda: obj


def hook_identity(hook: Any) -> Any:
    """What tells a hook apart: the object, or a bound method's function and object (``self.hook``
    registered again is a new bound method of both)."""
    if isinstance(hook, types.MethodType):
        return id(hook.__func__), id(hook.__self__)
    return id(hook)


def refs(objs: Iterable[Any]) -> tuple[Callable[[], Any], ...]:
    return tuple(map(_ref, objs))


def same_objects(refs: tuple[Callable[[], Any], ...], objs: Iterable[Any]) -> bool:
    """Whether ``objs`` are the objects ``refs`` were taken of, in order."""
    objs = tuple(objs)
    return len(refs) == len(objs) and all(
        (x := r()) is o or (isinstance(o, types.MethodType) and x == o)
        for r, o in zip(refs, objs, strict=True))


def hooks_of(m: nn.Module) -> list[Any]:
    """``m``'s own hooks, each table's followed by a None, and its instance forward: the hook
    objects, not their handles' ids (pruning again re-registers the same hook under a new id);
    a forward (pre-)hook registered ``with_kwargs`` followed by a marker (it is called so)."""
    found: list[Any] = []
    d = m.__dict__
    kwargs = (d.get("_forward_pre_hooks_with_kwargs", {}), d.get("_forward_hooks_with_kwargs", {}))
    for k, table in enumerate(hook_tables(m)):
        for key, hook in table.items():
            found.append(hook)
            if k < 2 and key in kwargs[k]:
                found.append(_WITH_KWARGS)
        found.append(None)
    found.append(d.get("forward"))
    return found if len(found) > 5 or found[-1] is not None else []


_WITH_KWARGS = object()


# Note [Hooks seen by counts]
# Comparing every hooked module's hooks object by object at every call cost 3-6 us a module (a
# forward hook on each of a 12-layer encoder's 110 modules: 300-700 us a call). Every hook
# registered gets a handle whose id comes from one counter (``RemovableHandle.next_id``): while
# it stands where it stood at the last full comparison, no hook was registered since, and a
# module holding as many hooks as traced (none removed) holds the same ones. A hook put into a
# table by hand, without a handle, is not seen then.
def num_hooks(d: dict[str, Any]) -> int:
    """How many hooks a module with ``__dict__`` ``d`` holds; -1 with an instance forward."""
    return -1 if "forward" in d else len(d["_forward_pre_hooks"]) + len(d["_forward_hooks"]) \
        + len(d["_backward_pre_hooks"]) + len(d["_backward_hooks"])


def global_hook_ids() -> tuple[Any, ...]:
    tables = global_hook_tables()
    return tuple(map(tuple, tables)) if any(tables) else ()


def hook_tables(m: nn.Module) -> tuple[dict[int, Any], ...]:
    """A module's own hooks: forward pre-hooks, forward hooks, backward pre-hooks, backward."""
    return m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks


def global_hook_tables() -> tuple[dict[int, Any], ...]:
    """The global module hooks, but the one a trace in another thread records modules with
    (Note [What a trace reads besides its inputs]): it is not the user's, and taken for a hook
    it made every other thread's compiled modules compile again."""
    tables = (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
              nn_module._global_backward_pre_hooks, nn_module._global_backward_hooks)
    if not tables[0] or not any(is_recording_hook(h) for h in tables[0].values()):
        return tables
    return ({k: h for k, h in tables[0].items() if not is_recording_hook(h)}, *tables[1:])


def is_recording_hook(hook: object) -> bool:
    """Whether a global module hook is the one :func:`recording` registers."""
    return getattr(hook, "_aotkit_recording", False)
