"""What an exception raised while tracing becomes: an aotkit error that says what to change,
where the cause is known, or the exception itself."""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import PendingUnbackedSymbolNotFound

from aotkit.aot.frames import AOTKIT_DIR, user_frame
from aotkit.compat import data_dependent_errors, is_nested_compile_refusal
from aotkit.errors import AotkitError, TraceError, UnsupportedError

_TRACED_TENSORS = ("'FunctionalTensor' object has no attribute",
                   "'FakeTensor' object has no attribute")


def traced_error(what: str, exc: Exception, static: bool, symbolic: bool,
                 from_dynamo: bool = False) -> BaseException:
    """The error ``exc``, raised while tracing ``what``, becomes; ``static``: a trace without
    a ShapeEnv, ``symbolic``: one with symbolic sizes, ``from_dynamo``: a graph from Dynamo."""
    if isinstance(exc, data_dependent_errors()):
        return data_dependent(what, exc, static=static, from_dynamo=from_dynamo)
    if isinstance(exc, PendingUnbackedSymbolNotFound):  # x[mask, idx]: a count meets an index
        return _unbound_size(what, exc)
    if isinstance(exc, AttributeError) and str(exc).startswith(_TRACED_TENSORS):
        return UnsupportedError(
            f"{what} reads a Python attribute of a tensor argument ({exc}, at "
            f"{user_frame(exc)}); a trace runs on stand-ins of the arguments, which carry no "
            "attributes of their own (if the argument has no such attribute either, the name "
            "is misspelt: eager raises AttributeError).\nFix: pass the value as an argument, "
            "or use torch.compile(fn, backend='aotkit'), whose Dynamo reads it.")
    if isinstance(exc, AttributeError):
        # Some higher-order ops (torch.while_loop) trace their body with a ShapeEnv, which a
        # static trace's fake mode does not have.
        if not static or "ignore_fresh_unbacked_symbols" not in str(exc):
            return exc
        return UnsupportedError(
            f"{what} calls a higher-order op (such as torch.while_loop) that can only be traced "
            f"with symbolic shapes ({exc}).\nFix: pass dynamic=True.")
    if _QUANTIZED.search(str(exc)) and isinstance(exc, (NotImplementedError,
                                                         UnsupportedFakeTensorException)) \
            and _raised_in_torch(exc):
        return UnsupportedError(
            f"{what} runs quantized kernels (a dynamically quantized layer's packed weights, "
            f"or quantized tensors: {first_line(exc)}), which fake tensors, which aotkit "
            "traces with, cannot run.\nFix: use torch.compile(model, backend='aotkit'), which "
            "runs those kernels as eager does, or keep the quantized part outside the compiled "
            "function.")
    if isinstance(exc, NotImplementedError):
        return _not_implemented(what, exc)
    if isinstance(exc, UnsupportedOperatorException):
        return _no_fake_kernel(what, exc, symbolic)
    if isinstance(exc, AssertionError) and _raised_in_torch(exc) \
            and "`context_fn` arg passed to `torch.utils.checkpoint`" in str(exc):
        return UnsupportedError(
            f"{what} calls torch.utils.checkpoint with a context_fn whose contexts are not "
            "dispatch modes (debug=True makes such a context_fn): traced, PyTorch's checkpoint "
            "takes only selective-checkpointing contexts.\nFix: drop context_fn or debug inside "
            "the compiled function, or make the contexts with "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts.")
    if isinstance(exc, AssertionError) and _raised_in_torch(exc) and any(
            frame.name == "assert_metadata_eq" for frame in traceback.extract_tb(exc.__traceback__)):
        return UnsupportedError(
            f"{what} reads a tensor that PyTorch cannot fake: a view whose data no longer "
            f"matches its base's ({exc}), as t.data = ... on a view (a closed-over "
            "T = x.reshape(3, 4)) leaves it.\nFix: rebind the name to a new "
            "tensor (T = ...) rather than assigning its .data, or pass it as an argument.")
    if isinstance(exc, AssertionError) and static and _raised_in_torch(exc) \
            and "shape_env must not be None" in str(exc):
        return UnsupportedError(
            f"{what} reads a jagged nested tensor it does not take as an argument, somewhere "
            "aotkit does not look before tracing (a global of a module or helper it calls): "
            "faking it makes its ragged size a symbol, which needs the ShapeEnv that a trace "
            "gets when it sees such a tensor first.\nFix: pass the tensor as an argument, or "
            "read it as a global or closed-over variable of the compiled function itself.")
    if isinstance(exc, AssertionError):
        if "generator is not supported in refs" not in str(exc):
            return exc
        return _generator_in_refs(what, exc)
    if isinstance(exc, RuntimeError):
        return _runtime_error(what, exc, symbolic)
    if isinstance(exc, ZeroDivisionError) and _raised_in_torch(exc):  # aot_eager the same
        where = user_frame(exc)
        return TraceError(
            f"{what}: {exc}, in the shape function of an op"
            f"{'' if where == '<unknown location>' else ' traced at ' + where}: an op whose "
            "shape function divides by a count that is zero here (the backward of a mean over "
            "an empty tensor; batch norm's unbiased variance, training on one value per "
            "channel); eager's kernel returns nan there.\nFix: skip empty batches (for batch "
            "norm in training, batches of one sample) before calling the compiled function.")
    if symbolic and isinstance(exc, (TypeError, IndexError)):
        return _symbolic_python(what, exc) or exc
    return exc


# "unsupported operand type(s) for divmod(): 'SymInt' and 'int'"; "argument 'is_causal' must be
# bool, not SymBool" (a C++ argument).
_SYMBOLIC_REFUSED = re.compile(r"'Sym(Int|Float|Bool)'|\b(not|type) Sym(Int|Float|Bool)\b")


def _symbolic_python(what: str, exc: TypeError | IndexError) -> TraceError | None:
    """Python code that cannot take the symbolic sizes or values of a dynamic=True trace."""
    if isinstance(exc, TypeError) and _SYMBOLIC_REFUSED.search(str(exc)):
        return TraceError(
            f"{what}: {exc}, at {user_frame(exc)}: under dynamic=True sizes, and what is "
            "computed from them (q.size(-2) == k.size(-2)), are symbolic (torch.SymInt, "
            "SymBool), which this Python operation or argument (a numpy function's) does not "
            "take.\nFix: use "
            "operators on the size instead (// and % for divmod), int(size) or bool(...), "
            "which fix that value, or torch.compile(fn, backend='aotkit'), whose Dynamo "
            "handles such code.")
    if isinstance(exc, IndexError) and "(got SymInt)" in str(exc):
        return TraceError(
            f"{what}: {exc}, at {user_frame(exc)}: a tensor indexed with a symbolic int (a "
            "value read with .item() under dynamic=True, or computed from sizes), which "
            "Python indexing does not take while tracing.\nFix: use x.select(dim, i) for "
            "x[i] (x[:, i] is x.select(1, i), x[i:j] x.narrow(0, i, j - i)), or "
            "torch.compile(fn, backend='aotkit'), whose Dynamo rewrites such indexing.")
    if isinstance(exc, TypeError) and "but got FunctionalTensor" in str(exc) \
            and _raised_in_torch(exc):  # not the user's own TypeError
        return TraceError(
            f"{what}: {exc}, at {user_frame(exc)}: a tensor is passed where Python ints are "
            "expected (a size read from a tensor's element, as pack_padded_sequence's RNN "
            "does with its batch sizes); eager reads its value, which a trace cannot hold as "
            "a constant.\nFix: keep that code outside the compiled function, or use "
            "torch.compile(fn, backend='aotkit'), whose Dynamo runs it eagerly.")
    return None


def _raised_in_torch(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside PyTorch's own code (its shape functions), not the user's
    (aotkit's frames, its dispatch modes', are passed over)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(AOTKIT_DIR)]
    return bool(frames) and f"{os.sep}torch{os.sep}" in frames[-1].filename


def _not_implemented(what: str, exc: NotImplementedError) -> BaseException:
    if not _raised_in_torch(exc):  # the user's own
        return exc
    if _NO_DERIVATIVE.search(str(exc)):
        return _no_derivative(what, exc)
    if "no rule registered for HigherOrderOperator" in str(exc) \
            and "_CachingTorchDispatchMode" in str(exc):  # PyTorch's aot_eager the same
        return UnsupportedError(
            f"{what} calls a higher-order op (torch.cond, map, scan) inside a "
            "torch.utils.checkpoint region run with selective-checkpointing contexts, which "
            "do not support higher-order ops (torch.compile makes such contexts for every "
            "region; create_selective_checkpoint_contexts makes them in eager too).\nFix: call "
            "the op outside the checkpointed function; for a region without a context_fn of "
            "your own, aotkit.aot_function and aot_module trace it as eager runs it.")
    if "no rule registered for HOP" in str(exc) and "FunctionalTensor" in str(exc):
        return UnsupportedError(  # PyTorch's aot_function raises the same
            f"{what} calls a higher-order op (torch.cond, torch.while_loop) that autograd "
            f"could not trace ({first_line(exc)}); the usual cause is a branch reading a tensor "
            "the op does not take as an operand (a closed-over parameter).\nFix: pass such "
            "tensors in the op's operands (torch.cond(pred, true_fn, false_fn, (x, w))), or use "
            "torch.compile(fn, backend='aotkit'), which lifts them.")
    if "Generator" not in str(exc):
        return exc
    return UnsupportedError(  # torch < 2.13: FX cannot make a graph constant of a generator
        f"{what} draws random numbers from a torch.Generator made outside it; this torch's "
        f"make_fx cannot record a generator in a graph ({exc}).\nFix: draw from the default "
        "generator (seeded with torch.manual_seed), or use torch >= 2.13.")


# "'__eq__' is not implemented for __torch__.torch.classes.quantized.LinearPackedParamsBase";
# "quantized nyi in meta tensors"
_QUANTIZED = re.compile(r"torch\.classes\.(quantized|rnn)\.|quantized nyi")

# "the derivative for 'igamma: input' is not implemented." (a formula's missing part);
# "derivative for aten::_scaled_mm is not implemented" (an op without a formula)
_NO_DERIVATIVE = re.compile(r"derivative for \S.* is not implemented")


def _no_derivative(what: str, exc: Exception) -> UnsupportedError:
    return UnsupportedError(
        f"{what} calls an op that has no derivative for an input requiring grad "
        f"({first_line(exc)}). aotkit traces the backward of the whole function when it is "
        "called, so it needs every derivative there; eager raises only if a backward reaches "
        "the op.\nFix: pass that input detached (x.detach()) or compute the op under "
        "torch.no_grad() where its gradient is not needed.")


def _generator_in_refs(what: str, exc: AssertionError) -> UnsupportedError:
    """exponential_, geometric_, cauchy_, log_normal_ given a generator."""
    failed = getattr(exc, "_aotkit_failed", None)
    op = f" ({failed[0]})" if failed is not None else ""
    return UnsupportedError(
        f"{what} passes a torch.Generator to a random op{op} whose functional form PyTorch "
        f"traces through a reference implementation that takes no generator ({exc}).\n"
        f"  at {failed[1] if failed is not None else user_frame(exc)}\nFix: draw from the "
        "default generator (seeded with torch.manual_seed), or compile with "
        "torch.compile(fn, backend='aotkit'), which runs the op eagerly.")


def _lost_wrapper(what: str, exc: RuntimeError) -> UnsupportedError | None:
    """A plain subclass made inside (``x.as_subclass(MyTensor)``) outside functionalization."""
    if "Attempting to use FunctionalTensor on its own" not in str(exc):
        return None
    return UnsupportedError(
        f"{what} computes with a tensor that lost aotkit's tracing wrapper: a plain subclass "
        "made inside the function (x.as_subclass(MyTensor), torch.Tensor._make_subclass), "
        f"which functionalization cannot follow.\n  at {user_frame(exc)}\n"
        "Fix: convert the tensor's class outside the compiled function (pass it in as the "
        "subclass), or use torch.compile(fn, backend=\"aotkit\").")


def _no_fx(what: str, exc: RuntimeError) -> UnsupportedError | None:
    """torch.nested.nested_tensor_from_jagged refuses FX traces (make_fx's too)."""
    if "does not support tracing with fx.symbolic_trace" not in str(exc) \
            or not _raised_in_torch(exc):
        return None
    return UnsupportedError(
        f"{what} calls a PyTorch function that refuses to run under an FX trace ({exc}), as "
        "tracing a jagged nested tensor made inside needs a ragged-size symbol only Dynamo "
        "creates.\nFix: make the nested tensor outside the compiled function and pass it as an "
        "argument, or use torch.compile(fn, backend='aotkit').")


def _runtime_error(what: str, exc: RuntimeError, symbolic: bool = False) -> BaseException:
    """The error a RuntimeError raised while tracing becomes: one that says what to change where
    we know the cause, else ``exc`` itself."""
    refused = _autograd_refusal(what, exc) or _lost_wrapper(what, exc) or _no_fx(what, exc)
    if refused is not None:
        return refused
    if is_nested_compile_refusal(exc):
        return UnsupportedError(
            f"{what} calls a function or module compiled with torch.compile; aotkit cannot "
            "trace through it (Dynamo refuses to run under a trace, and inlining it would "
            "change what torch.compiler.is_compiling() tells it).\nFix: call the original "
            "(fn._torchdynamo_orig_callable, or module._orig_mod for a compiled module), "
            "or compile the whole function with torch.compile(backend=\"aotkit\")."
        )
    failed = getattr(exc, "_aotkit_failed", None)
    if "to a storage on different device" in str(exc) and failed is not None \
            and "set_" not in str(failed[0]):  # a view of a tensor whose fake storage grew
        return UnsupportedError(
            f"{what} takes a view ({failed[0]}) of a tensor it grew in place before (resize_, "
            "or an out= argument), which functionalization on fake tensors, which aotkit "
            f"traces with, cannot follow.\n  at {failed[1]}\nFix: make a tensor of the final "
            "size instead (torch.empty(...), torch.cat([y, y.new_empty(n)])).")
    if "to a storage on different device" in str(exc):  # x.set_(storage, ...) of a fake x
        return UnsupportedError(
            f"{what} calls x.set_(storage, ...), which cannot be traced: tracing runs on fake "
            "tensors, which cannot take a real tensor's storage.\nFix: pass a tensor instead "
            "(x.set_(y), or x.set_(y.as_strided(size, stride, offset)) under torch.no_grad()), or "
            "do it outside the compiled function.")
    if "tolist() shouldn't be called on a tensor with unallocated storage" in str(exc):
        return data_dependent(what, exc)  # .tolist() of a fake tensor, 2-d or more
    if (concrete := _needs_concrete_sizes(what, exc)) is not None:
        return concrete
    if "NYI SymInt equality" in str(exc):  # pow's formula comparing its exponent (aot_eager too)
        return TraceError(
            f"{what} gives an op a number the trace holds as a symbol (an integer read from "
            "data with .item(), or a size), which its derivative compares as a Python value "
            f"({first_line(exc)}).\n  at {user_frame(exc)}\nFix: pass the number as a tensor "
            "(x.pow(k), not x.pow(k.item())), or read it outside the compiled function.")
    if ".numpy() is not supported" in str(exc):
        return TraceError(
            f"{what} converts a tensor to NumPy (.numpy()); aotkit traces on fake tensors, "
            "which hold no data, and a graph cannot contain NumPy code.\n"
            f"  at {user_frame(exc)}\n"
            "Fix: do the NumPy work outside the compiled function, or compile it with "
            "torch.compile(fn, backend=\"aotkit\"), which splits the graph there."
        )
    if "data is not allocated yet" in str(exc):  # a kernel with no fake implementation read data
        return data_dependent(what, exc)
    if "you can only change requires_grad flags of leaf variables" in str(exc):
        return UnsupportedError(
            f"{what} changes requires_grad of a tensor that is not a leaf here "
            f"({first_line(exc)}). Inputs are not leaves inside aotkit's trace, and a change "
            "to the caller's tensor could not be applied anyway.\n"
            f"  at {user_frame(exc)}\n"
            "Fix: set requires_grad before calling (or use x.detach() inside), or use "
            "torch.compile(fn, backend=\"aotkit\")."
        )
    if "encountered a tensor being mutated that has internal overlap" in str(exc):
        where = failed[1] if failed is not None else user_frame(exc)
        return UnsupportedError(
            f"{what} writes in place to part of a tensor whose elements share memory (a "
            "sliding window such as unfold() or as_strided() made inside the function); "
            "functionalization, which aotkit traces with, cannot rebuild such a tensor from "
            f"the written part.\n  at {where}\nFix: clone() the window before writing to it, "
            "or write to the tensor it was made from.")
    if failed is not None and re.search(r"Sparse (CSR|CSC|BSR|BSC|Compressed).* do not have strides",
                                        str(exc)):
        return _compressed_layout(f"{what} calls {failed[0]} on", failed[1], exc)
    if "layout_impl is only implemented for TensorImpl subclasses" in str(exc):  # made inside
        return _compressed_layout(f"{what} uses", user_frame(exc), exc)
    if failed is not None and "unresolved conjugated tensors" in str(exc):
        return _read_after_conj_write(what, failed[1], exc)
    if failed is not None:  # an op's own check, raised on fake tensors: name the op and line
        return op_failed(what, *failed, exc, symbolic=symbolic)
    return exc


def _needs_concrete_sizes(what: str, exc: RuntimeError) -> BaseException | None:
    """Code that needs concrete sizes, given symbolic ones (a dynamic=True trace); not one of
    ours saying so already (a random op's explicit generator)."""
    if isinstance(exc, AotkitError):
        return None
    if "on tensor with symbolic sizes/strides" in str(exc):
        return TraceError(
            f"{what} could not be traced: it calls code that needs concrete sizes, or the "
            f"data itself (.tolist()), on a tensor with symbolic sizes ({first_line(exc)}).\n"
            f"  at {user_frame(exc)}\n"
            "Fix: move that code out of the compiled function, or compile with "
            "torch.compile(fn, backend=\"aotkit\"), which splits the graph there."
        )
    if "expected to contain only concrete integers" in str(exc):  # a C++ composite's sizes
        where = user_frame(exc)
        return UnsupportedError(
            f"{what} could not be traced with symbolic sizes: an op's C++ code needs concrete "
            f"ones ({first_line(exc).rsplit(': ', 1)[-1]}; F.affine_grid's backward is one, "
            "with PyTorch's AOT autograd too)."
            f"{'' if where == '<unknown location>' else chr(10) + '  at ' + where}\n"
            "Fix: compile it with static sizes "
            "(dynamic=False, the default; each new size compiles anew), or move that op out "
            "of the compiled function.")
    return None


def _autograd_refusal(what: str, exc: RuntimeError) -> UnsupportedError | None:
    """PyTorch's autograd refusing what the joint trace differentiates, said with the fix."""
    if _NO_DERIVATIVE.search(str(exc)) and _raised_in_torch(exc):
        return _no_derivative(what, exc)
    if "but no autograd formula was registered" in str(exc) and _raised_in_torch(exc):
        return UnsupportedError(  # a torch.library.custom_op without register_autograd
            f"{what} calls a custom op that has no autograd formula with an input requiring "
            f"grad ({first_line(exc)}). aotkit traces the backward of the whole function when "
            "it is called, so it needs every formula there; eager raises only if a backward "
            "reaches the op.\nFix: register the op's backward (op.register_autograd(backward, "
            "setup_context=...)), or pass that input detached (x.detach()) where its gradient "
            "is not needed.")
    if "use_reentrant=True" in str(exc):  # torch.utils.checkpoint refusing autograd.grad
        return UnsupportedError(
            f"{what} uses torch.utils.checkpoint with use_reentrant=True (its default where "
            "use_reentrant is not passed), which cannot be traced: aotkit takes the backward "
            "with torch.autograd.grad.\nFix: pass use_reentrant=False (PyTorch's recommended "
            "setting)."
        )
    if "passed to _will_engine_execute_node" in str(exc):  # a multi-grad hook, mode "all"
        return UnsupportedError(
            f"{what} registers a gradient hook on several tensors at once "
            "(torch.autograd.graph.register_multi_grad_hook, also through a module tracker, "
            "ModTracker or debug_grad_log) on an input it is passed; aotkit takes the "
            "backward with torch.autograd.grad, where such a hook cannot ask which inputs get "
            f"a gradient ({first_line(exc)}).\nFix: register it outside the compiled "
            "function, pass mode='any', or use torch.compile(fn, backend='aotkit'), whose "
            "Dynamo runs a hook you register at every backward (not a module tracker's: "
            "enter ModTracker around eager code only; under torch.compile its backward hooks "
            "do not run).")
    if "might be aliasing the input or the output" in str(exc) and _raised_in_torch(exc):
        return UnsupportedError(
            f"{what} calls a higher-order op whose body returns a tensor that is also one of "
            f"its inputs or another of its outputs ({first_line(exc)}); PyTorch cannot "
            "differentiate such a body. In a scan, that is often a new carry that an output's "
            "backward saves too (h as the carry, h.sin() as the output).\nFix: return a copy "
            "(h.clone() as the carry).")
    return None


def _compressed_layout(what_does: str, where: str, exc: Exception) -> UnsupportedError:
    return UnsupportedError(
        f"{what_does} a sparse tensor of a compressed layout (CSR, CSC, BSR, BSC), which the "
        "fake and functional tensors aotkit traces with cannot compute with "
        f"({first_line(exc)}).\n  at {where}\nFix: keep the matrix in COO layout "
        "(A.to_sparse_coo(), x.to_sparse()), or use torch.compile(fn, backend='aotkit').")


def _read_after_conj_write(what: str, line: str, exc: Exception) -> UnsupportedError:
    """Note [Conj bits of views after a write]: once written through ``y = x.conj()``, views
    functionalization makes from ``y`` miss its conj bit, and ``y.imag`` then fails."""
    return UnsupportedError(
        f"{what}: {first_line(exc)}\n  at {line}\n"
        "If eager runs this line, the complex tensor (or its base) was written in place "
        "through a conjugate view before (y = x.conj(); y.mul_(2); then y.imag, x.real or "
        "torch.view_as_real(x)): functionalization, which aotkit traces with, rebuilds such "
        "tensors from the written memory with the conj bit misplaced, and PyTorch's AOT "
        "autograd fails the same way.\nFix: read a resolved copy there (y.resolve_conj().imag, "
        "torch.view_as_real(x.resolve_conj())), or write through x itself (x.mul_(2) instead "
        "of x.conj().mul_(2)).")


def op_failed(what: str, op: Any, line: str, exc: Exception, symbolic: bool = False) -> TraceError:
    if "whose output has alias annotations" in str(exc):  # functionalization's own advice
        return TraceError(
            f"{what}: {op} returns a tensor annotated as an alias of its input (Tensor(a) or "
            "Tensor(a!) in its schema), which functionalization, which aotkit traces with, "
            "cannot follow for an operator outside ATen.\n"
            f"  at {line}\nFix: return a new tensor from the op (x.clone() in its kernel) and "
            "drop the annotation from its schema, or return nothing from an op that only "
            "writes its input (Tensor(a!) x) -> ().")
    if line == "<unknown location>" and _in_backward(traceback.extract_tb(exc.__traceback__)):
        line = ("the backward of an op of the function (run by the autograd engine, so no line "
                "of the function's own)")
    static = ("; with dynamic=True, first try static sizes (dynamic=False), for which some "
              "ops' shape functions are more complete" if symbolic else "")
    return TraceError(
        f"{what}: {op} failed while tracing (on fake tensors): {exc}\n  at {line}\n"
        "Fix: if eager raises the same there (a shape mistake), fix the inputs of that line; "
        "only if eager runs it is the op's shape-only kernel stricter than its real one (as "
        f"aten._grouped_mm's, for example): run that op outside the compiled function{static}.")


def _no_fake_kernel(what: str, exc: UnsupportedOperatorException,
                    symbolic: bool) -> UnsupportedError:
    op = getattr(exc, "func", None) or str(exc)
    if symbolic and getattr(op, "namespace", None) == "aten":
        return UnsupportedError(
            f"{what} calls {op}, which has no fake-tensor kernel for symbolic sizes, so it cannot "
            "be traced with dynamic shapes (with static sizes, fake tensors run its real kernel "
            "instead).\nFix: trace with static sizes: dynamic=False for "
            "aot_function/aot_module, torch.compile(..., dynamic=False) or "
            "torch._dynamo.mark_static for the inputs this op sees."
        )
    return UnsupportedError(
        f"{what} calls {op}, which has no fake-tensor kernel, so it cannot be traced.\nFix: "
        "register one with torch.library.register_fake, or call the op outside the compiled "
        "function."
    )


def _unbound_size(what: str, exc: BaseException) -> TraceError:
    return TraceError(
        f"{what} could not be traced with symbolic sizes: an op makes a size from tensor "
        f"data that none of its results carries ({first_line(exc)}), which PyTorch's "
        f"tracing cannot hold (a boolean mask indexing beside a tensor index: x[mask, idx]).\n"
        f"  at {user_frame(exc)}\nFix: index in two steps (x[mask][:, idx]), move the op "
        "out of the compiled function, or use torch.compile(fn, backend=\"aotkit\"), which "
        "runs it eagerly between graphs.")


def _data_dependent_backward(what: str, exc: BaseException, static: bool) -> TraceError:
    """A formula of PyTorch's backward (no line of the user's) needs tensor data."""
    func = getattr(exc, "func", None)
    formula = getattr(exc, "aotkit_backward_of", None)  # EmbeddingBackward0
    embedding = formula is None or formula.startswith("EmbeddingBackward")  # None: may be
    verb = "is one" if formula is None else "is this one"
    sized = static and isinstance(exc, torch._subclasses.fake_tensor.DynamicOutputShapeException) \
        and func is not None and _sized_by_symbols(func) and not embedding
    return TraceError(
        f"{what} could not be traced: its backward, which the autograd engine runs (no line of "
        f"the function), calls {f'{func}, ' if func is not None else 'an op '}whose result's "
        "size or value depends on tensor data"
        f"{f' (in {formula})' if formula else ''} ({type(exc).__name__}: {first_line(exc)})"
        + (f"; the backward of nn.Embedding with sparse=True and a padding_idx {verb}"
           if embedding else "") + ".\nFix: "
        + ("pass dynamic=True, which traces its size as a symbol; " if sized else "")
        + "keep that layer or op outside the compiled function"
        + (", drop sparse=True (or padding_idx) there" if embedding else "")
        + ", or use torch.compile(fn, backend=\"aotkit\"), which runs such a graph eagerly.")


def data_dependent(what: str, exc: BaseException, static: bool = False,
                   from_dynamo: bool = False) -> TraceError:
    """``static``: aot_function's trace without a ShapeEnv, which is told that dynamic=True
    traces data-dependent sizes and values (Note [Data-dependent sizes]). ``from_dynamo``: a
    graph Dynamo made, whose values from data it captured as symbols."""
    frames = traceback.extract_tb(exc.__traceback__)
    dynamic = ", pass dynamic=True, which traces its size as a symbol" if static else ""
    if any(f.filename.endswith(os.path.join("_higher_order_ops", "while_loop.py")) for f in frames):
        return TraceError(
            f"{what} could not be traced: torch.while_loop is differentiated by running its "
            "loop to learn the trip count, which depends on tensor data "
            f"({type(exc).__name__}: {first_line(exc)}).\n"
            f"  at {user_frame(exc)}\n"
            "Fix: call it with inputs that do not require grad (or under torch.no_grad()), or "
            "compile with torch.compile(fn, backend=\"aotkit\"), which runs the loop eagerly."
        )
    if "float(self.num_batches_tracked)" in (where := user_frame(exc)):
        return TraceError(
            f"{what} could not be traced: a batch norm layer with momentum=None (a cumulative "
            "average) computes its update factor from the value of its num_batches_tracked "
            f"buffer, which a trace does not hold.\n  at {where}\nFix: give the layer a "
            "momentum (0.1 is the default), or use torch.compile(model, backend=\"aotkit\"), "
            "which reads that value between graphs.")
    if any(f.name == "_detect_is_causal_mask" for f in frames):
        return TraceError(
            f"{what} could not be traced: nn.Transformer's layers, given a mask without "
            "is_causal, compare the mask's values with a causal mask to tell whether it is one, "
            f"which depends on tensor data.\n  at {where}\nFix: say it: pass is_causal=True "
            "or False with the mask (tgt_is_causal=, memory_is_causal= for a decoder).")
    if _in_backward(frames) and where == "<unknown location>" \
            and not (from_dynamo and _captures_data(exc)):  # not the user's own backward code
        return _data_dependent_backward(what, exc, static)
    if isinstance(exc, torch._subclasses.fake_tensor.DynamicOutputShapeException):
        dynamic = "" if not _sized_by_symbols(exc.func) else dynamic if not _custom(exc.func) \
            else f"{dynamic}, if its fake kernel sizes the result with ctx.new_dynamic_size()"
        return TraceError(
            f"{what} could not be traced: {exc.func} returns {_data_dependent_result(exc.func)} "
            "depends on tensor data"
            f"{', which a trace with static sizes cannot hold' if static else ''}."
            f"\n  at {user_frame(exc)}\n"
            f"Fix: move the op out of the compiled function{dynamic}, or use "
            "torch.compile(fn, backend=\"aotkit\"), which runs it eagerly between graphs."
        )
    if static and isinstance(exc, torch._subclasses.fake_tensor.DataDependentOutputException):
        return TraceError(
            f"{what} could not be traced: it reads a value from tensor data ({exc.func}) with "
            "static sizes, where the trace holds no data.\n"
            f"  at {user_frame(exc)}\n"
            "Fix: a Python branch on it (if x.sum() > 0:) cannot be traced: express it with "
            "torch.where or torch.cond; a value used in computation (x * n.item()) is traced "
            "as a symbol with dynamic=True; or move the read out of the compiled function "
            f"(torch.compile splits the graph there for you){_hint(where)}."
        )
    if from_dynamo and _captures_data(exc):
        return TraceError(
            f"{what} could not be traced: an op needs as a Python value a size or number "
            "Dynamo captured from tensor data as a symbol (torch._dynamo.config."
            "capture_scalar_outputs or capture_dynamic_output_shape_ops, or mark_unbacked) "
            f"({type(exc).__name__}: {first_line(exc)}).\n"
            f"  at {user_frame(exc)}\n"
            "Fix: turn that option off, so that Dynamo splits the graph where the value is "
            "read, or move the read out of the compiled function (PyTorch's aot_eager fails "
            "the same way).")
    return TraceError(
        f"{what} could not be traced: Python control flow or a Python value depends on "
        f"tensor data ({type(exc).__name__}: {first_line(exc)}).\n"
        f"  at {user_frame(exc)}\n"
        "Fix: express the branch with tensor ops (torch.where, torch.cond) or move the "
        "data-dependent part out of the compiled function"
        f"{'' if from_dynamo else '; torch.compile splits the graph there for you'}"
        f"{_hint(where)}."
    )


def _hint(where: str) -> str:
    """What to add to the fix where the data is read in a known library line."""
    if os.path.join("torch", "distributions", "") in where:
        return ("; a torch.distributions object checks its arguments' values unless made "
                "with validate_args=False (torch.distributions.Distribution."
                "set_default_validate_args(False) for all)")
    if os.path.join("torch", "nn", "modules", "rnn.py") in where:
        return ("; PyTorch's RNNs read a PackedSequence's batch sizes as numbers: pass a padded "
                "batch (torch.nn.utils.rnn.pad_packed_sequence), or use torch.compile(model, "
                "backend='aotkit'), which runs that part eagerly")
    return ""


_TRACE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace.py")


def _sized_by_symbols(op: Any) -> bool:
    """Whether fake tensors give ``op``'s data-dependent result a symbolic size under
    dynamic=True (nonzero, masked_select, unique), not refusing it there too (ctc_loss), and
    its consumers take that (an RNN does not take pack_padded_sequence's). A custom op's fake
    kernel asking for such a size (``ctx.new_dynamic_size()``) gets one there."""
    from torch._subclasses import fake_impls

    if _custom(op):
        return True
    impl = next((impl for check, impl in fake_impls.op_implementations_checks if check(op)),
                None)
    return impl is not None and impl is not fake_impls.dyn_shape \
        and op is not torch.ops.aten._pack_padded_sequence.default


def _custom(op: Any) -> bool:
    """Whether ``op`` is an operator of the user's own (torch.library), not PyTorch's."""
    return isinstance(op, torch._ops.OpOverload) and op.namespace not in ("aten", "prims")


def _in_backward(frames: traceback.StackSummary) -> bool:
    """Whether the joint trace was running the function's backward (``trace._grads``)."""
    return any(f.name == "_grads" and os.path.abspath(f.filename) == _TRACE_FILE
               for f in frames)


def _captures_data(exc: BaseException | None = None) -> bool:
    """Whether Dynamo is set to capture values read from data as symbols, or a guard on an
    unbacked symbol (one Dynamo made, mark_unbacked's) failed with ``exc``."""
    dynamo = sys.modules.get("torch._dynamo.config")
    return (dynamo is not None and bool(
        dynamo.capture_scalar_outputs or dynamo.capture_dynamic_output_shape_ops)) or \
        isinstance(exc, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode)


def _data_dependent_result(op: Any) -> str:
    returns = getattr(getattr(op, "_schema", None), "returns", ())
    if returns and not any("Tensor" in str(r.type) for r in returns):
        return "a number whose value"
    return "a tensor whose size"


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def refuse_packed_constants(gm: Any, what: str) -> None:
    """A graph holding a TorchScript object as a constant (a dynamically quantized RNN cell's
    packed weights): ``load_state_dict`` swaps in new objects the graph never sees (it ran the
    old weights, silently), so such a trace is refused as quantized kernels are."""
    for node in gm.graph.find_nodes(op="get_attr"):
        constant = getattr(gm, node.target, None)
        if isinstance(constant, torch.ScriptObject) and "ProcessGroup" in str(constant._type()):
            raise UnsupportedError(
                f"{what} calls a torch.distributed collective (dist.all_reduce, "
                "torch.distributed.nn.functional's) whose process group, a TorchScript object, "
                "the graph would hold as a constant.\nFix: call the functional collectives of "
                "torch.distributed._functional_collectives (all_reduce, all_gather_tensor, "
                "reduce_scatter_tensor) inside the function, which aotkit traces, or use "
                "torch.compile(fn, backend='aotkit').")
        if isinstance(constant, torch.ScriptObject):
            raise UnsupportedError(
                f"{what} runs quantized kernels with packed weights (TorchScript objects: a "
                "dynamically quantized LSTMCell's or GRUCell's), which the graph would hold as "
                "constants: load_state_dict's new weights would never reach it.\nFix: use "
                "torch.compile(model, backend='aotkit'), which guards on them, or keep the "
                "quantized part outside the compiled function.")


def write_through_unfold_gaps(what: str, func: Any, line: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} writes in place ({func}) through windows of unfold() that leave elements of "
        "the unfolded tensor uncovered (a step longer than the windows, a last window short "
        "of the end): the functional graph puts such writes back with zeros in every element "
        f"no window reaches.\n  at {line}\nFix: clone() the windows before writing to them, "
        "or write to the unfolded tensor itself (through indexing or as_strided).")


def write_to_overlapping_memory(what: str, func: Any, t: Any, line: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} writes in place ({func}) to a tensor of shape {tuple(t.shape)} and stride "
        f"{tuple(t.stride())} whose elements share memory (an expand()ed view, or a sliding "
        "window such as unfold()). Eager writes such memory element by element, later writes "
        "landing on earlier ones (it refuses most writes to an expanded view); aotkit's "
        f"functional graph cannot reproduce that, so it refuses them all.\n  at {line}\n"
        "Fix: clone() the tensor before writing to it in place.")
