"""Inductor as the code generator for aotkit's partitioned graphs.

``inductor`` hands one forward, backward or inference graph that aotkit traced and partitioned
to Inductor's per-graph entry point, ``torch._inductor.compile_fx.compile_fx_inner``. It does
not go through ``torch._inductor.compile_fx.compile_fx``, which would run PyTorch's own AOT
autograd and partitioner again. See Note [Inductor on partitioned graphs].
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.fx as fx

from aotkit import counters
from aotkit.compilers.basic import closed_over_tensors, nop, require_graph_module
from aotkit.errors import ArgumentError, CompilerError
from aotkit.partition.graph import copy_graph_module

Kind = Literal["forward", "backward", "inference"]
KINDS: tuple[Kind, ...] = ("forward", "backward", "inference")

_graph_ids = itertools.count()

# Note [Inductor on partitioned graphs]
# compile_fx_inner compiles one graph; compile_fx normally arranges what it needs around it.
# What we arrange instead, per graph:
# - which graph it is (is_backward / is_inference): from the compiler variant, or guessed from
#   the graph (see graph_kind);
# - static inputs: the forward's and inference graph's leading parameters and buffers
#   (gm.meta["num_params_buffers"]), the backward's saved values (every input but tangents);
# - strides: every forward output, saved values included, keeps the strides it was traced
#   with. The backward graph was traced, and is compiled, for saved values with those strides;
#   Inductor may otherwise pick other strides for outputs nobody sees. (PyTorch instead reports
#   Inductor's strides back to its AOT autograd, which restrides the backward's inputs; our
#   compilers are independent, so the traced strides are the contract.);
# - CUDA graphs off: aotkit.cudagraphs captures graphs, never Inductor's cudagraph trees;
# - Inductor's joint-graph passes (its pattern rewrites and its own RNG) run on each graph, as
#   compile_fx runs them on the joint graph before partitioning;
# - the graph is copied first, since Inductor's passes rewrite the graph they are given;
# - outputs stay apart: see Note [Outputs Inductor merges].

# Note [Outputs Inductor merges]
# Inductor drops clones and copies it takes for no-ops unless that would make an output alias
# another, but it decides with the outputs it saw before it dropped any: in ``y = x * 2;
# return y.clone(), y.clone()`` both clones go, and the two outputs come back as one tensor
# (PyTorch's backend="inductor" does the same), so an in-place change to one changes the other.
# Compiled autograd meets it whenever one gradient reaches two leaves (``W + dW``): both
# ``.grad``s were one tensor. It also drops ``x * ones``, ``x + zeros``: the output came back as
# the input's memory (a caller's in-place change to it changed the input). The first call
# compares the outputs' memory with the inputs' and the traced graph's; outputs sharing memory
# that the graph gave memory of their own are copied from then on (the sharing comes from
# Inductor's buffer plan, the same at every call). An empty output (a dynamic size of 0 at the
# first call) shows no memory: calls compare until one shows all. One node returned at two
# places (a gradient reaching two leaves, after CSE) comes back as two tensors over one buffer,
# which autograd took as two ``.grad``s of one memory: both places get the first one's tensor,
# as the graph run as traced gives them.


class Inductor:
    """A compiler that generates code with Inductor for one kind of aotkit graph.

    ``inductor`` guesses the kind of each graph (a graph with ``tangents_*`` inputs is a
    backward, a graph aotkit partitioned is a forward, anything else is an inference graph);
    ``inductor.forward``, ``inductor.backward`` and ``inductor.inference`` say it.
    Inductor expects graphs traced with its decompositions, ``inductor.decompositions``, as
    ``torch.compile(backend="aotkit_inductor")`` does; a graph holding an op Inductor only
    knows decomposed raises :class:`~aotkit.errors.CompilerError`.

    Example::

        >>> import torch, aotkit
        >>> from aotkit.compilers import inductor
        >>> f = aotkit.aot_function(lambda x: x.sin().cos(), inductor.forward, inductor.backward,
        ...                         inference_compiler=inductor.inference,
        ...                         decompositions=inductor.decompositions)
        >>> x = torch.randn(8, requires_grad=True)
        >>> f(x).sum().backward()  # doctest: +SKIP
    """

    # Its outputs are tensors of their own or views it makes with as_strided, never the view
    # ops the function ran (Note [Views of inputs with gaps] in aotkit.aot.analysis).
    returns_views = False

    def __init__(self, kind: Kind | None = None) -> None:
        if kind is not None and kind not in KINDS:
            raise ArgumentError(f"unknown Inductor graph kind {kind!r}.\nFix: pass one of "
                                f"{KINDS}, or nothing (the kind is then read from the graph).")
        self.kind = kind
        self.__name__ = "inductor" if kind is None else f"inductor.{kind}"

    @property
    def decompositions(self) -> dict[Any, Callable[..., Any]]:
        """The decompositions to trace with for this compiler: Inductor's own table
        (``select_decomp_table()``, which follows ``torch._inductor.config``)."""
        # Some of them (max_pool's) ask Inductor's lowerings whether to decompose, and reach
        # them as an attribute of torch._inductor, which only an import of the module sets.
        import torch._inductor.lowering  # noqa: F401
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()

    @property
    def forward(self) -> Inductor:
        """The compiler for forward graphs of training (``fw_compiler``)."""
        return Inductor("forward")

    @property
    def backward(self) -> Inductor:
        """The compiler for backward graphs (``bw_compiler``)."""
        return Inductor("backward")

    @property
    def inference(self) -> Inductor:
        """The compiler for inference graphs (``inference_compiler``)."""
        return Inductor("inference")

    def __repr__(self) -> str:
        return f"aotkit.compilers.{self.__name__}"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
        require_graph_module(gm, self.__name__)
        if any("grapharg" in n.meta for n in gm.graph.find_nodes(op="placeholder")):
            raise ArgumentError(
                f"{self!r} compiles the ATen graphs aotkit's AOT autograd makes, but was given "
                "a graph Dynamo captured (it was passed to torch.compile as the backend).\nFix: "
                'torch.compile(fn, backend="aotkit_inductor").'
            )
        if not isinstance(gm.graph.output_node().args[0], (list, tuple)):
            raise ArgumentError(
                f"{self!r} compiles the ATen graphs aotkit's AOT autograd makes, which return a "
                "tuple of values; this graph returns one value (a graph from "
                "torch.fx.symbolic_trace?).\nFix: compile the function itself, "
                "aotkit.aot_function(fn, inductor), or torch.compile(fn, "
                'backend="aotkit_inductor").')
        return compile_graph(gm, example_inputs, self.kind or graph_kind(gm))


# Note [Inductor's graph cache and symbolic sizes]
# Inductor keeps compiled graphs on disk (its FX graph cache) with the shape guards they hold,
# written in terms of the ShapeEnv's sources, which for aotkit's graphs of a Dynamo frame are
# Dynamo's inputs (``L['x']``): looking a cached backward up in a later process (or after
# torch._dynamo.reset()) failed with a KeyError naming that input, since the lookup binds only
# the graph's own symbolic inputs. Graphs with symbolic sizes are therefore compiled with that
# cache off (a "fallback" decision, once per process); static graphs use it.
def _fx_graph_cache_for(example_inputs: Sequence[Any]) -> Any:
    from torch._inductor import config as inductor_config

    symbolic = any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
        isinstance(n, torch.SymInt) for n in (*x.shape, *x.stride()))) for x in example_inputs)
    if not symbolic or not inductor_config.fx_graph_cache:
        return contextlib.nullcontext()
    if not counters.counters["fallback"].get(_NO_GRAPH_CACHE):
        counters.record("fallback", _NO_GRAPH_CACHE, (
            "graphs with symbolic sizes are compiled with Inductor's FX graph cache off: "
            "its cached guards name Dynamo's inputs, which its lookup cannot bind (Note "
            "[Inductor's graph cache and symbolic sizes]); static graphs use the cache"))
    return inductor_config.patch(fx_graph_cache=False)


_NO_GRAPH_CACHE = "inductor (symbolic sizes)"


def graph_kind(gm: fx.GraphModule) -> Kind:
    """Guess which kind of aotkit graph ``gm`` is: ``tangents_*`` inputs make a backward; aotkit
    records a partition report (``gm.meta["partition"]``) on every forward it partitions."""
    if any(n.name.startswith("tangents") for n in gm.graph.find_nodes(op="placeholder")):
        return "backward"
    return "forward" if "partition" in gm.meta else "inference"


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], kind: Kind) -> Callable[[list[Any]], Any]:
    """Compile one graph of ``kind`` with ``compile_fx_inner``; returns Inductor's boxed callable.
    See Note [Inductor on partitioned graphs]."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    sparse = _sparse_value(gm)
    meta = any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in example_inputs)
    shared = _custom_op_writes_inductor_loses(gm)
    if sparse is not None or meta or shared or _strided_over_closed_over(gm):  # Note [Sparse...]
        why = (f"the graph computes or reads a sparse tensor ({sparse}), whose memory "
               "Inductor's buffer reuse does not track" if sparse is not None else
               "the graph takes meta tensors, for which Inductor generates no kernels" if meta
               else f"custom op {shared}, which Inductor's in-place lowering gets wrong "
               "(it lost a write, or wrote other rows)" if shared
               else "the graph calls as_strided on a closed-over tensor, whose storage offset "
               "counts from its memory's start, where Inductor's code counts from the tensor's")
        counters.record("fallback", f"inductor ({kind} graph {next(_graph_ids)})",
                        f"{why}; it runs as traced (aotkit.compilers.nop) instead")
        return nop(gm, example_inputs)
    _refuse_undecomposed(gm)
    repeated = _repeated_outputs(gm)
    gm = copy_graph_module(gm)
    lifted = _lift_closed_over_tensors(gm)
    storages = _output_storages(gm)  # before Inductor's passes change them
    gm = _joint_graph_passes(gm, example_inputs)
    _keep_output_strides(gm)
    static = _static_input_idxs(gm, kind)
    first_lifted = len(example_inputs)
    with _fx_graph_cache_for(example_inputs):
        compiled = compile_fx_inner(
            gm,
            [*example_inputs, *(fake for fake, _ in lifted)],
            static_input_idxs=sorted({*static, *range(first_lifted, first_lifted + len(lifted))}),
            cudagraphs=BoxedBool(False),
            is_backward=kind == "backward",
            is_inference=kind == "inference",
            graph_id=next(_graph_ids),
        )
    tensors = [tensor for _, tensor in lifted]
    copies: list[int] | None = None  # the outputs to copy, once a call has shown them
    signed = _signed_inputs(gm, [*example_inputs, *tensors])

    def run(args: list[Any]) -> Any:
        nonlocal copies
        args.extend(tensors)
        written = _resolve_signs(args, signed) if signed else None
        inputs = _input_memory(args) if copies is None else None  # compiled() clears args
        try:
            out = compiled(args)
        except AssertionError as exc:  # Inductor's check of its inputs' sizes and strides
            if not str(exc).startswith("expected size"):
                raise
            raise _unexpected_layout(exc) from exc
        if written:
            for caller, resolved in written:
                caller.copy_(resolved)
        merged = copies
        if merged is None:
            merged, shown = _merged_outputs(out, storages, inputs)
            if shown:
                copies = merged
        if merged or repeated:
            out = list(out)
            for i in merged:
                out[i] = out[i].clone()
            for i, first in repeated:
                out[i] = out[first]
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


# Note [Inputs with a negative bit]
# ``z.conj().imag`` is a view whose values are its memory's negated; the bit belongs to the
# tensor. Inductor's kernels read memory as it is, so such an input gave values of the wrong
# sign (``x * 2``) and wrote them back (``x.add_(1)``; PyTorch's inductor backend the same).
# It is passed as a resolved copy instead, and where the graph writes it
# (keep_inference_input_mutations) the copy is written back through the caller's tensor,
# whose bit applies. The signature keys on the bits, so a graph knows its inputs'. A conjugate
# input needs nothing: the graph resolves its conjugation with ops of its own.
def _signed_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[tuple[int, bool]]:
    """(position, written by the graph) of each input carrying a negative bit."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    written = {n.args[0] for n in gm.graph.find_nodes(op="call_function",
                                                      target=torch.ops.aten.copy_.default)}
    return [(i, placeholders[i] in written) for i, t in enumerate(example_inputs)
            if isinstance(t, torch.Tensor) and t.is_neg() and not t.is_conj()]


def _resolve_signs(args: list[Any], signed: list[tuple[int, bool]]) -> list[tuple[Any, Any]]:
    """See Note [Inputs with a negative bit]; returns (caller's, resolved) pairs
    to write back."""
    written = []
    for i, writes in signed:
        caller = args[i]  # resolved in the layout the graph was compiled for
        if _overlaps(caller):  # an expanded one: resolve the memory it spans, view as it
            span = 1 + sum((n - 1) * s for n, s in zip(caller.shape, caller.stride(),
                                                       strict=True))
            memory = caller.as_strided((span,), (1,)).resolve_neg()
            args[i] = memory.as_strided(caller.shape, caller.stride())
            continue  # never written: writes to expanded inputs are refused
        args[i] = torch.empty_strided(caller.shape, caller.stride(), dtype=caller.dtype,
                                      device=caller.device).copy_(caller)
        if writes:
            written.append((caller, args[i]))
    return written


def _overlaps(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory (a size-1 or empty dimension with stride 0 is
    no expansion: its own resolved copy can be made, and written back)."""
    return t.numel() > 0 and any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride(),
                                                                   strict=True))


def _repeated_outputs(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """(position, earlier position) of each output that is the same node as an earlier one:
    returned as the same tensor (Note [Outputs Inductor merges])."""
    first: dict[fx.Node, int] = {}
    return [(i, first[n]) for i, n in enumerate(gm.graph.output_node().args[0])
            if isinstance(n, fx.Node) and first.setdefault(n, i) != i]


def _output_storages(gm: fx.GraphModule) -> list[Any]:
    """Per output of ``gm``: which of the traced memories it is in, an input's (by its
    position, negative: ``-1 - k``) or the outputs' (None for a non-tensor). See Note [Outputs
    Inductor merges]."""
    from torch.multiprocessing.reductions import StorageWeakRef

    index: dict[Any, int] = {}
    for k, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.layout == torch.strided:
            index.setdefault(StorageWeakRef(val.untyped_storage()), -1 - k)
    found = []
    for node in gm.graph.output_node().args[0]:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided \
                or (isinstance(val.numel(), int) and val.numel() == 0):  # no memory, ever
            found.append(None)
            continue
        root = _viewed(node)  # a lifted closed-over tensor's value is not its views' base's
        if root.op == "placeholder" and isinstance(root.meta.get("val"), torch.Tensor):
            val = root.meta["val"]
        found.append(index.setdefault(StorageWeakRef(val.untyped_storage()), len(found)))
    return found


def _viewed(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` views (itself if it is no view)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) \
            and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _input_memory(args: Sequence[Any]) -> dict[int, int]:
    """Data pointer -> ``-1 - k`` for the memory of each input ``k`` (the first holding it),
    and ``-1 - k`` -> that first one's for each later input holding it too (closed-over
    tensors sharing memory are lifted as inputs of their own)."""
    memory: dict[int, int] = {}
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.layout == torch.strided and a.numel():
            first = memory.setdefault(a.untyped_storage().data_ptr(), -1 - k)
            if first != -1 - k:
                memory[-1 - k] = first  # no data pointer is negative
    return memory


def _merged_outputs(out: Sequence[Any], storages: list[Any], inputs: dict[int, int]
                    ) -> tuple[list[int], bool]:
    """The outputs that came back in memory an input or an earlier output has, where the
    traced graph gave them their own (Note [Outputs Inductor merges]), and whether this call
    showed every output's memory (an empty output has none to compare: a later call must look
    again)."""
    owner: dict[int, Any] = dict(inputs)  # data pointer -> the traced memory holding it
    merged = []
    shown = True
    for i, (t, traced) in enumerate(zip(out, storages, strict=False)):
        if traced is None or not isinstance(t, torch.Tensor):
            continue
        ptr = t.untyped_storage().data_ptr()
        if t.numel() == 0 or not ptr:
            shown = False
            continue
        if owner.setdefault(ptr, traced) != inputs.get(traced, traced):
            merged.append(i)
    return merged, shown


def _unexpected_layout(exc: AssertionError) -> CompilerError:
    return CompilerError(
        f"inductor: the compiled code got a tensor of other sizes or strides than traced "
        f"({exc}): an op's fake kernel, which tracing ran, gave other sizes than its real kernel "
        "(a quantization observer growing its per-channel buffers in place).\nFix: find the "
        "op with aotkit.compilers.debug_nop (its MetadataMismatchError names it), or use "
        "torch.compile(model, backend='aotkit_inductor') (a QAT model trains there).")


def _strided_over_closed_over(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls ``as_strided`` (or its in-place or scatter form) on a closed-over
    tensor, which may start past its memory's start or be moved there later (T.set_)."""
    strided = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default,
               torch.ops.aten.as_strided_scatter.default)
    return any(user.target in strided for node, _ in closed_over_tensors(gm) for user in node.users)


def _lift_closed_over_tensors(gm: fx.GraphModule) -> list[tuple[Any, torch.Tensor]]:
    """Make each closed-over tensor a last input of ``gm`` (Inductor folds attributes into the
    code: small ones by value, uniform ones as ``full``, and changes the caller makes in place
    would not show), as Dynamo does with the tensors it finds. Returns each one's traced value
    and the tensor to pass."""
    lifted = []
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, tensor in closed_over_tensors(gm):
        anchor = placeholders[-1] if placeholders else next(iter(gm.graph.nodes))
        with (gm.graph.inserting_after(anchor) if placeholders
              else gm.graph.inserting_before(anchor)):
            placeholder = gm.graph.placeholder(f"closed_over_{len(lifted)}")
        placeholder.meta.update(node.meta)
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        placeholders.append(placeholder)
        lifted.append((placeholder.meta.get("val"), tensor))
    gm.recompile()
    return lifted


def _custom_op_writes_inductor_loses(gm: fx.GraphModule) -> str | None:
    """The first custom op the graph calls on two views of one tensor it computes
    (``op_(y[:4], y[2:6])``), or on a view placed at a symbolic storage offset, or of a base
    at one (``op_(y[1:3])`` of an input inside its memory under dynamic=True), which Inductor
    (2.13, and PyTorch's own backend) gets wrong; says so."""
    for node in gm.graph.find_nodes(op="call_function",
                                    target=torch.ops.higher_order.auto_functionalized_v2):
        bases = node.kwargs.get("_all_bases", ())
        indices = [v for k, v in node.kwargs.items() if k.endswith("_base_index")]
        if any(indices.count(i) > 1 and getattr(bases[i], "op", None) != "placeholder"
               for i in set(indices)):
            return f"{node.args[0]} writes two views of one intermediate"
        if any(k.endswith("_storage_offset") and isinstance(v, fx.Node)
               for k, v in node.kwargs.items()) or any(
                isinstance(getattr(b, "meta", {}).get("val"), torch.Tensor)
                and isinstance(b.meta["val"].storage_offset(), torch.SymInt) for b in bases):
            return f"{node.args[0]} writes a view at a symbolic storage offset"
    return None


def _refuse_undecomposed(gm: fx.GraphModule) -> None:
    """Inductor lowers an op in its decomposition table only if it also has a lowering for it;
    otherwise it fails deep inside with an assertion. Say which ops and how to fix it."""
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings

    table = select_decomp_table()
    # native_dropout's lowering only runs with fallback_random; otherwise it asserts that the
    # decomposition (rand + compare) reached Inductor's RNG pass instead.
    asserting = set() if inductor_config.fallback_random else {torch.ops.aten.native_dropout.default}
    ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and (
        n.target in asserting or (n.target in table and n.target not in lowerings))})
    if ops:
        raise CompilerError(
            f"inductor: the graph holds {', '.join(ops)}, which Inductor compiles only "
            "decomposed.\nFix: trace with Inductor's decompositions, e.g. "
            "aotkit.aot_function(fn, inductor, decompositions=inductor.decompositions), or use "
            'torch.compile(backend="aotkit_inductor").'
        )


# Note [Sparse values and Inductor]
# A sparse tensor's values may be another value's memory (a sparse Embedding's gradient keeps the
# incoming gradient as its values). Inductor's buffer plan does not see that sharing and reused
# the memory: the second table's gradient of a two-embedding product came out wrong, silently
# (so did PyTorch's compiled autograd with backend="inductor"), and a sparse constant failed
# inside Inductor. A graph computing or reading sparse tensors runs as traced instead (a
# "fallback" decision per graph); aotkit's graphs hold them where a sparse Embedding's backward
# or a closed-over sparse matrix puts them. So does a graph on meta tensors (a model built on
# the meta device), for which Inductor generates no kernels.
def _sparse_value(gm: fx.GraphModule) -> str | None:
    """The first node computing or reading a sparse tensor, described; None if there is none."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
        if isinstance(value, torch.Tensor) and value.layout is not torch.strided:
            return f"{node.name} = {node.target}, {value.layout}"
    return None


def _joint_graph_passes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Inductor's joint-graph passes, under the fake mode the graph's values were traced in
    (its RNG rewrite makes new fake values)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    from aotkit.compat import FakeTensorMode, inductor_joint_graph_passes

    traced = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(traced) or FakeTensorMode(allow_non_fake_inputs=True)
    devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
    with V.set_fake_mode(mode):
        return inductor_joint_graph_passes(gm, devices[0] if devices else None)


def _keep_output_strides(gm: fx.GraphModule) -> None:
    output = gm.graph.output_node()
    output.meta["user_visible_output_idxs"] = [
        i for i, arg in enumerate(output.args[0]) if isinstance(arg, fx.Node)
    ]


def _static_input_idxs(gm: fx.GraphModule, kind: Kind) -> list[int]:
    placeholders = gm.graph.find_nodes(op="placeholder")
    if kind == "backward":
        return [i for i, n in enumerate(placeholders) if not n.name.startswith("tangents")]
    return list(range(min(gm.meta.get("num_params_buffers", 0), len(placeholders))))


inductor = Inductor()
