"""Checks of what the AOT entry points are given: compilers, decomposition tables, the
parameter count, and arguments a trace cannot take; keys that stop short of an argument's
values are recorded as ``identity_key`` decisions; calls with forward-mode AD dual tensors,
which run eagerly."""

from __future__ import annotations

import inspect
import logging
import os
import re
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.utils import _pytree as pytree

from aotkit import counters
from aotkit.aot.boxing import refused_call
from aotkit.aot.signature import identity_keyed_parts
from aotkit.aot.subclass import is_subclass, overrides_torch_function
from aotkit.aot.trace import FlatFn, refuse_kept_outputs
from aotkit.aot.untraceable import NOT_AN_ARGUMENT
from aotkit.compat import FakeTensorMode, treespec_children
from aotkit.errors import ArgumentError, OutputTypeError, UnsupportedError

log = logging.getLogger("aotkit.aot")


def check_compiler_signature(role: str, compiler: Callable[..., Any]) -> None:
    """A compiler is called as ``compiler(gm, example_inputs)``; one that cannot be (a factory
    of compilers, ``lambda gm: gm``) would fail at the first call with a bare TypeError."""
    refused = refused_call(compiler, 2)
    if refused is not None:
        raise ArgumentError(
            f"{role} {refused.partition('(')[0]!r} cannot be called as compiler(gm, "
            f"example_inputs): its signature is {refused}.\nFix: pass a function of the graph "
            "module and its example inputs returning a callable (aotkit.compilers.nop); a "
            "factory of compilers is called first (draw_graph_compile('graph')), and "
            "memory_efficient_fusion wraps a function or module instead of compiling graphs.")


def check_decompositions(table: Any) -> None:
    """A decomposition table maps op overloads (``aten.gelu.default``) to functions; a packet
    key (``aten.gelu``) would never match a traced op and be ignored without a word."""
    if table is None:
        return
    if not isinstance(table, Mapping):
        raise ArgumentError(
            f"decompositions must be a mapping from op overloads to functions, got "
            f"{type(table).__name__}.\nFix: pass a dict such as "
            "torch._decomp.get_decompositions([torch.ops.aten.gelu])."
        )
    bad = [k for k in table if not isinstance(k, torch._ops.OperatorBase)]
    if bad:
        raise ArgumentError(
            f"decompositions has keys that are not op overloads: {bad[:3]}; traced ops are "
            "overloads (aten.gelu.default), so these would never apply.\nFix: key each "
            "overload (aten.gelu.default), or build the table with "
            "torch._decomp.get_decompositions([...]), which expands packets."
        )
    not_callable = [f"{k}: {type(v).__name__}" for k, v in table.items() if not callable(v)]
    if not_callable:
        raise ArgumentError(
            f"decompositions maps ops to values that are not functions: {not_callable[:3]}."
            "\nFix: map each op overload to a function taking the op's arguments and returning "
            "its result.")


def check_params_buffers(n: int, leaves: Sequence[Any], name: str) -> None:
    """``num_params_buffers`` counts leading inputs that must be tensors: compilers are told
    the first ``n`` graph inputs are parameters and buffers, and they keep static sizes."""
    if n and (n > len(leaves) or not all(isinstance(t, torch.Tensor) for t in leaves[:n])):
        found = [type(x).__name__ for x in leaves[:n]]
        raise ArgumentError(
            f"{name} was created with num_params_buffers={n}, but its first {n} flattened "
            f"argument(s) are {found}, not {n} tensors: compilers would take other inputs "
            "for parameters.\nFix: pass the parameters and buffers first, or set "
            "num_params_buffers to how many of them lead the arguments.")


def record_identity_keys(leaves: Sequence[Any], names: Sequence[str], name: str,
                          told: frozenset[str]) -> frozenset[str]:
    """An ``identity_key`` decision for object arguments whose key stops short of some of
    their values (Note [Objects as arguments]), but those ``told`` already; all told now."""
    cut = [part for leaf, leaf_name in zip(leaves, names, strict=True)
           for part in identity_keyed_parts(leaf, leaf_name) if part not in told]
    if cut:
        more = f" and {len(cut) - 3} more" if len(cut) > 3 else ""
        counters.record(
            "identity_key", name,
            f"{', '.join(cut[:3])}{more} keyed by identity (past the levels, items or values "
            "an argument's key holds, or an object keeping state in slots or a base written "
            "in C): a value changed in place there is not seen, and the "
            "graph keeps the one it traced. Fix: pass such a value as an argument of its own "
            "(a float, or a tensor if it changes at every call).", logger=log)
    return told.union(cut)


def refuse_torch_function_overrides(leaves: Sequence[Any], names: Sequence[str],
                                     name: str) -> None:
    for leaf, where in zip(leaves, names, strict=False):
        if issubclass(type(leaf), torch.Tensor) and overrides_torch_function(leaf):
            raise UnsupportedError(
                f"{name} was passed a tensor of subclass {type(leaf).__qualname__} as {where}, "
                "which has its own __torch_function__, and a trace on fake tensors does not run "
                "it: "
                "the graph would compute without it.\nFix: use torch.compile(fn, "
                "backend='aotkit'), whose Dynamo traces __torch_function__, or pass a plain "
                "tensor (x.as_subclass(torch.Tensor)).")


def refuse_tensor_sets(leaves: Sequence[Any], names: Sequence[str], name: str) -> None:
    """A set is not a pytree container: tensors in it would be read as constants."""
    for leaf, where in zip(leaves, names, strict=False):
        if issubclass(type(leaf), (set, frozenset)) and any(isinstance(v, torch.Tensor) for v in leaf):
            raise ArgumentError(
                f"{name} was passed a {type(leaf).__name__} of tensors as {where}; sets have no "
                "order, so aotkit cannot flatten them into graph inputs.\nFix: pass a list or "
                "tuple of the tensors."
            )


# Note [Forward-mode AD runs eagerly]
# Dual tensors (torch.autograd.forward_ad) carry their tangents through a graph only where
# the graph runs ATen ops from Python (nop): Inductor's kernels dropped them (tangent None,
# a zero Jacobian), a custom Function's jvp had been traced away (its forward's own
# derivative instead), and fwAD.unpack_dual inside the function saw no tangent, as the
# trace has none: each silently wrong, as in PyTorch's AOT autograd. A call with a dual
# argument runs the function (Dynamo's graph, for torch.compile) eagerly, which is right in
# every case, with a "fallback" decision the first time. A dual tensor the function reads
# without taking it as an argument is refused (Note [Closed-over tensors]).
def has_tangents(leaves: Sequence[Any]) -> bool:
    """Whether a tensor among ``leaves`` is a dual tensor of the current forward-AD level."""
    return fwAD._current_level >= 0 and any(
        isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None for t in leaves)


def refuse_dual_outputs(flat: Sequence[Any], name: str) -> None:
    """An output that is a dual tensor of the caller's level, made inside the function
    (``fwAD.make_dual(x, t).sin()``), would come back without its tangent: the graph returns
    primals only (Note [Forward-mode AD runs eagerly])."""
    if has_tangents(flat):
        raise UnsupportedError(
            f"{name} returns a forward-mode AD dual tensor it made at the caller's dual level "
            "(fwAD.make_dual inside the function): the compiled graph returns plain tensors, "
            "so the output would lose its tangent.\nFix: return the tangent itself "
            "(fwAD.unpack_dual(out).tangent, with the primal), make the dual tensor before the "
            "call and pass it in (the function then runs eagerly), or call the function "
            "uncompiled.")


def note_forward_ad(name: str) -> None:
    counters.bump("aot", "forward_ad_eager_calls")
    counters.record_once("fallback", name, (
        "called with forward-mode AD dual tensors: it runs eagerly, as compiled graphs do "
        "not carry tangents in general (Note [Forward-mode AD runs eagerly]). Fix: none "
        "needed, the results are eager's; to compile the forward-mode work, open the dual "
        "level inside the function (forward_ad.dual_level() or torch.func.jvp in it), whose "
        "trace then computes the tangents."), once="forward AD", logger=log)


def name_held_tensor(exc: BaseException, held: Mapping[int, tuple[str, Any]]) -> None:
    """A refused tensor the function "does not take as an argument" that an argument object
    holds (a transformers cache layer's attribute) is named where it is: arguments are
    flattened only through lists, tuples, dicts and registered pytrees, and a tensor held
    elsewhere is read as a constant. ``held``: where each such tensor is, by id."""
    where, _ = held.get(id(getattr(exc, "outside_tensor", None)), (None, None))
    if where is None or not isinstance(exc, UnsupportedError):
        return
    if where.startswith(("the global ", "the closed-over ")):
        exc.args = (str(exc).replace(NOT_AN_ARGUMENT, f"that it reads from {where}", 1),)
    else:
        exc.args = (str(exc).replace(NOT_AN_ARGUMENT, (
            f"that it reads from {where}, inside an argument object (only tensors in lists, "
            "tuples, dicts and registered pytrees become graph inputs)"), 1),)


def name_refused_input(exc: BaseException, name: str, names: Sequence[str]) -> None:
    """A refusal raised while tracing names "the compiled function" and a traced input by its
    position (its ``input_index``): name them as the caller knows them (``args[2]``,
    ``opts['w']``, a parameter's name)."""
    k = getattr(exc, "input_index", None)
    if k is None and (found := _INPUT.search(str(exc))):
        k = int(found[1])
    if isinstance(exc, UnsupportedError) and k is not None and k < len(names):
        message = str(exc).replace(f"input {k} of the compiled function", f"{names[k]} of {name}", 1)
        exc.args = (message.replace("the compiled function", name, 1)
                    .replace(f"input {k} (", f"{names[k]} (", 1),)


# How a refusal raised while tracing names a traced input: "x.data = ... on input 2 of the
# compiled function", "sets requires_grad on input 0 (requires_grad_() ...".
_INPUT = re.compile(r"\binput (\d+) (of the compiled function|\()")


def under_transform(name: str) -> UnsupportedError:
    if torch.compiler.is_compiling():  # Dynamo tracing the caller shows as a transform too
        return UnsupportedError(
            f"{name} was called while Dynamo traces its caller (torch.compile, or "
            "torch.export with strict=True); Dynamo cannot trace aotkit's compiled functions. "
            "torch.compile breaks its graph there and runs the call eagerly; with "
            "fullgraph=True, and in strict export, it fails.\nFix: "
            "export with strict=False (the default), which traces the original function, or "
            "call the original function in the code Dynamo traces.")
    return UnsupportedError(
        f"{name} was called inside a torch.func transform (grad, vmap, jacrev, ...), where "
        "aotkit's compiled functions cannot run, also on tensors the transform did not wrap: "
        "its graphs were traced for plain tensors, without the transform.\nFix: call "
        "the original function inside the transform, or compile a function that applies the "
        "transform itself (aot_function(lambda x: vmap(f)(x), ...)), whose trace holds it."
    )


def subclass_dynamic(name: str, tensors: Sequence[torch.Tensor]) -> UnsupportedError:
    kinds = sorted({type(t).__name__ for t in tensors if is_subclass(t)})
    return UnsupportedError(
        f"{name} was compiled with dynamic=True and called with tensor subclass arguments "
        f"({', '.join(kinds)}); aotkit traces subclasses with static sizes only.\nFix: pass "
        "dynamic=False (one graph then serves every subclass whose parts have the same shapes: "
        "a jagged tensor's graph, every raggedness with the same batch, total, shortest and "
        "longest length), or use torch.compile(fn, backend='aotkit', dynamic=True)."
    )


_PUT_BACK = ("the compiled graph cannot store it at each call, so it was put back as it was "
             "(Note [Tracing tensors left in argument objects])")


def stored_tensor(name: str, where: str, why: str = _PUT_BACK) -> UnsupportedError:
    """A tensor the function stores into what it was passed (an object, list or dict)."""
    return UnsupportedError(
        f"{name} stores a tensor into {where} (an object, list or dict it was passed or reads, "
        f"or the module it runs as); {why}.\nFix: return the tensor and store it outside the compiled "
        "function, or use torch.compile(fn, backend='aotkit'), which replays such stores (a "
        "module's own attributes: aot_module(model) sets them after each call too).")


def flatten_with_paths(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``pytree.tree_flatten_with_path(tree)[0]``, also for pytree nodes registered without a
    ``flatten_with_keys_fn`` (optional in PyTorch), whose children are named by position."""
    try:
        return pytree.tree_flatten_with_path(tree)[0]
    except ValueError:  # "Did not find a flatten_with_keys_fn"
        leaves, spec = pytree.tree_flatten(tree)
        return list(zip(_paths(spec, ()), leaves, strict=True))


def _paths(spec: pytree.TreeSpec, prefix: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    if spec.is_leaf():
        return [prefix]
    children = treespec_children(spec)
    keyed = issubclass(spec.type, dict) and isinstance(spec.context, list) \
        and len(spec.context) == len(children)
    keys = [pytree.MappingKey(k) for k in spec.context] if keyed \
        else [pytree.SequenceKey(i) for i in range(len(children))]
    return [path for key, child in zip(keys, children, strict=True)
            for path in _paths(child, (*prefix, key))]


def leaf_names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Readable names of the flattened arguments, e.g. ``x``, ``args[1]['w']``."""
    paths = flatten_with_paths((args, kwargs))
    names = []
    for path, _leaf in paths:
        head, *rest = path
        prefix = "args" if getattr(head, "idx", 1) == 0 else "kwargs"
        names.append(prefix + "".join(str(k) for k in rest))
    return names


def changed_leaves(args: Any, kwargs: Any, full: list[Any], spec: pytree.TreeSpec,
                   namer: Callable[[Any, Any], list[str]]) -> list[str]:
    """The numbers the function changed in its list or dict arguments (Note [Values changed in
    argument objects]), matched by their place in them (keys may have been reordered)."""
    from aotkit.aot.reads import same_value

    before = dict(flatten_with_paths(pytree.tree_unflatten(full, spec)))
    after = flatten_with_paths((args, kwargs))
    return [name for name, (path, new) in zip(namer(args, kwargs), after, strict=True)
            if path in before and not same_value(before[path], new, unset_counts=True)]


def changed_value(name: str, where: str) -> UnsupportedError:
    """A plain value the function changes in what it was passed (Note [Values changed in
    argument objects])."""
    return UnsupportedError(
        f"{name} changes {where}, a number held in an object, module, list or dict "
        "(a step counter: state.step += 1), or stores a symbolic size there (st.n = "
        "x.shape[0] under dynamic=True): the compiled graph runs no Python, so the change "
        "would not happen at each call, and tracing made it once per pass, with the trace's "
        "symbols (it was put back as it was).\nFix: pass the value as an argument and return "
        "the new one (a size: return it, or read it from the output after the call), keep it "
        "in a tensor changed in place (state.step = torch.zeros(()); state.step.add_(1)), or "
        "use torch.compile(fn, backend='aotkit'), which replays such changes.")


def shown_name(fn: Any) -> str:
    """``fn``'s qualified name; a lambda's with its place (two lambdas' decisions apart); an
    object's class name where its repr is long (a model's is its whole module tree)."""
    try:
        name = getattr(fn, "__qualname__", None)
        if not isinstance(name, str):
            shown = repr(fn)
            name = shown if len(shown) <= 80 and "\n" not in shown else type(fn).__qualname__
    except Exception:  # a __getattr__ or __repr__ raising
        name = type(fn).__qualname__
    code = getattr(fn, "__code__", None)
    if name.endswith("<lambda>") and isinstance(code, types.CodeType):
        return f"{name} at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    return name


_OUTPUT_LEAVES = (
    torch.Tensor, int, float, bool, complex, str, type(None), torch.SymInt, torch.SymFloat,
    torch.SymBool, torch.dtype, torch.device, torch.layout, torch.memory_format,
)


def refuse_stores_into_arguments(args: Any, kwargs: Any, full: list[Any], spec: pytree.TreeSpec,
                                  name: str, namer: Callable[[Any, Any], list[str]]) -> None:
    """A list or dict argument is rebuilt from its leaves for each trace: a tensor the function
    stores into it (``batch["h"] = enc(x)``, ``outs.append(y)``) would not reach the caller's.
    A number changed in it is refused (Note [Values changed in argument objects]); other
    changes (``batch.pop("labels")``) do not reach the caller's either, but lose nothing the
    function computed: they are let be."""
    after = pytree.tree_leaves((args, kwargs))
    passed = {id(x) for x in full}
    if all(id(a) in passed or not isinstance(a, torch.Tensor) for a in after):
        if changed := changed_leaves(args, kwargs, full, spec, namer):
            raise changed_value(name, changed[0])
        return
    where = next(n for n, a in zip(namer(args, kwargs), after, strict=True)
                 if id(a) not in passed and isinstance(a, torch.Tensor))
    raise stored_tensor(name, where, "aotkit rebuilds list and dict arguments from their "
                         "tensors for each trace, so the caller's would not see the store")


def check_outputs(out: Any, flat: list[Any], name: str) -> None:
    """Raise OutputTypeError naming the first output that is not a tensor or simple value."""
    if all(isinstance(x, _OUTPUT_LEAVES) for x in flat):
        return
    for path, leaf in flatten_with_paths(out):
        if not isinstance(leaf, _OUTPUT_LEAVES):
            where = "output" + "".join(str(k) for k in path)
            if inspect.isgenerator(leaf) or inspect.iscoroutine(leaf) or inspect.isasyncgen(leaf):
                raise OutputTypeError(
                    f"{name} returned a {type(leaf).__name__} at {where}: a generator or async "
                    "function runs its body only when iterated or awaited, after the compiled "
                    "call.\nFix: compile a plain function that returns tensors, and call it from "
                    "the generator (or coroutine)."
                )
            kind = type(leaf).__name__
            cache = (" (a transformers model returns its KV cache with use_cache=True: pass "
                     "use_cache=False where no cache is needed, as in training)"
                     if type(leaf).__module__.startswith("transformers") and "Cache" in kind
                     else "")
            raise OutputTypeError(
                f"{name} returned {'an' if kind[0].lower() in 'aeiou' else 'a'} {kind} at "
                f"{where}; compiled functions may "
                "return tensors, Python scalars and strings, None, and lists/tuples/dicts of them.\nFix: "
                "return tensors (or convert the value), or register the type with "
                f"torch.utils._pytree.register_pytree_node so it flattens to tensors{cache}."
            )


def flat_user_fn(fn: Callable[..., Any], leaves: list[Any], positions: list[int],
                  spec: pytree.TreeSpec, name: str,
                  namer: Callable[[Any, Any], list[str]] = leaf_names,
                  copies: Mapping[int, int] | None = None) -> FlatFn:
    """``fn`` as a function of its tensor leaves at ``positions``; non-tensor leaves are baked
    in as constants, and the leaf at each key of ``copies`` is the one at its value (Note [One
    tensor passed twice]). The call's tensors are not kept: a lazy backward trace would
    otherwise hold a first batch alive as long as the compiled function; nor are its modules
    (a teacher passed per fold), whose entries are dropped once they are freed."""
    copies = copies or {}
    template = list(leaves)
    for i in [*positions, *copies]:
        template[i] = None
    modules = {i: weakref.ref(m) for i, m in enumerate(leaves) if issubclass(type(m), nn.Module)}
    for i in modules:
        template[i] = None
    where = namer(*pytree.tree_unflatten(leaves, spec)) if modules else []

    def flat_fn(*tensors: Any) -> tuple[list[Any], pytree.TreeSpec]:
        full = list(template)
        for i, ref in modules.items():
            full[i] = ref()
            if full[i] is None:  # a backward traced again (under autocast) after it was freed
                raise _freed_module(name, where[i])
        for i, t in zip(positions, tensors, strict=True):
            full[i] = t
        for i, first in copies.items():
            full[i] = full[first]
        args, kwargs = pytree.tree_unflatten(full, spec)
        out = fn(*args, **kwargs)
        refuse_stores_into_arguments(args, kwargs, full, spec, name, namer)
        flat, out_spec = pytree.tree_flatten(out)
        check_outputs(out, flat, name)
        refuse_kept_outputs(flat)
        refuse_dual_outputs(flat, name)
        return flat, out_spec

    return flat_fn


def _freed_module(name: str, where: str) -> UnsupportedError:
    return UnsupportedError(
        f"{name}: its backward is traced again (backward() under torch.autocast), which calls "
        f"the function again, but the module passed as {where} was freed since the call (the "
        "compiled function holds module arguments weakly, so that a model of each fold is "
        "freed with its graphs).\nFix: keep a reference to the module until backward() has "
        "run, or call backward() outside torch.autocast.")


def make_fake(mode: FakeTensorMode, t: torch.Tensor, index: int, dynamic: bool,
              name: str) -> torch.Tensor:
    """A fake copy of ``t`` (same leafness and requires_grad); symbolic sizes when ``dynamic``.
    ``name``: the argument, for the error when fake tensors cannot copy it (quantized)."""
    from torch._subclasses.fake_tensor import UnsupportedFakeTensorException

    if t.is_inference() and t.requires_grad and not torch.is_inference_mode_enabled():
        t = _without_inference_grad(t, name)
    grad = t.grad if t.is_leaf else None
    if grad is not None and grad.dtype != t.dtype:
        # ``grad_dtype=None`` lets .grad differ (bf16 accumulation for an fp32 weight), which the
        # fake copy's .grad refuses; tracing never reads .grad (aotkit refuses that).
        t.grad = None
        try:
            return make_fake(mode, t, index, dynamic, name)
        finally:
            t.grad = grad
    try:
        if not dynamic:  # no symbols to name, and torch._dynamo.source would load all of Dynamo
            return mode.from_tensor(t, static_shapes=True)
        from torch._dynamo.source import LocalSource

        fake = mode.from_tensor(t, static_shapes=False, source=LocalSource(f"arg{index}"))
        fake.item_memo = None  # its value is data, not a guarded size: Note [Data-dependent sizes]
        return fake
    except AssertionError as exc:
        if "shape_env must not be None" not in str(exc):
            raise
        raise UnsupportedError(  # faked as a jagged tensor's offsets: a ragged-size symbol
            f"{name} cannot be traced without dynamic shapes: it served as the offsets of a "
            "jagged nested tensor (nested_tensor_from_jagged), so PyTorch fakes it with a "
            "ragged-size symbol.\nFix: pass the nested tensor itself, pass a copy "
            "(offsets.clone()), or use dynamic=True.") from exc
    except UnsupportedFakeTensorException as exc:
        raise UnsupportedError(
            f"{name} cannot be traced: PyTorch's fake tensors cannot copy it ({exc.reason}; "
            f"a {t.dtype} tensor{' (quantized)' if t.is_quantized else ''}).\nFix: convert "
            "it before the call (x.dequantize() for a quantized tensor) or keep the code "
            "that needs it outside the compiled function; torch.compile runs such code "
            "eagerly for you."
        ) from exc


def _without_inference_grad(t: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor made under ``torch.inference_mode()`` that requires grad (a model built there)
    and is used outside it: its functional wrapper cannot take requires_grad. Under no_grad
    nothing reads it, so it is traced detached; with grad on it is refused."""
    if not torch.is_grad_enabled():
        return t.detach()
    raise UnsupportedError(
        f"{name} is an inference tensor (made under torch.inference_mode(), as the parameters "
        "of a model built there are) that requires grad, and grad mode is on: aotkit cannot "
        "trace it for autograd.\nFix: build the model under torch.no_grad() instead, or make "
        "its tensors normal ones: model.load_state_dict({k: v.clone() for k, v in "
        "model.state_dict().items()}, assign=True); or call it under torch.no_grad().")
