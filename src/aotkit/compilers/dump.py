"""Graphs written to disk: ``graph_dumper_aot``, ``get_inputs``, ``debug_compile``.

A saved graph is a folder holding ``module.py`` (the graph's code as an ``FxModule`` class),
``constants.tensors`` when the graph reads tensor attributes, a ``.input`` JSON file describing
every input and, when asked for, a ``.tensors`` file with the inputs of the graph's first call.
Nothing here is loaded by unpickling: ``.tensors`` files are an 8-byte little-endian header
length, a JSON header (dtype, shape, stride, storage offset, device, byte range of each tensor)
and the raw bytes of each tensor's storage span.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from aotkit import config
from aotkit.aot import aot_function, aot_module, aot_module_simplified
from aotkit.aot.boxing import make_boxed_func
from aotkit.compat import FakeTensor, size_hint
from aotkit.compilers.basic import next_number, require_graph_module
from aotkit.compilers.bind import bind_aten_calls
from aotkit.errors import ArgumentError, UnsupportedError
from aotkit.partition.default import default_partition

log = logging.getLogger("aotkit.compilers")

_INPUTS_FORMAT = "aotkit.inputs/1"
_TENSORS_FORMAT = "aotkit.tensors/1"
_INDEX = "aotkit_dump_index"  # gm.meta key: which compiled entry a forward/backward belongs to

# --- describing, saving and rebuilding inputs ---------------------------------------------------


def _layout(t: torch.Tensor) -> dict[str, Any]:
    """Everything needed to rebuild ``t``'s memory layout; symbolic sizes become their hints."""
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": [size_hint(s) for s in t.shape],
        "stride": [size_hint(s) for s in t.stride()],
        "storage_offset": size_hint(t.storage_offset()),
        "device": str(t.device),
    }


def _describe(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        described = {"kind": "tensor", **_layout(value), "requires_grad": value.requires_grad}
        if any(isinstance(s, torch.SymInt) for s in value.shape):
            described["traced_shape"] = [str(s) for s in value.shape]
        return described
    if isinstance(value, torch.SymInt):
        return {"kind": "int", "value": size_hint(value), "traced": str(value)}
    if value is None:
        return {"kind": "none"}
    if isinstance(value, (bool, int, float)):
        return {"kind": type(value).__name__, "value": value}
    return {"kind": "unsupported", "type": type(value).__qualname__}


def _span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """How many storage elements a layout touches, from its storage offset on."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedError(f"unknown dtype {name!r} in a saved aotkit file.\nFix: load it with "
                               "the PyTorch version that wrote it.")
    return dtype


def _allocate(layout: Mapping[str, Any], device: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat buffer and a (non-view) tensor with ``layout``'s exact strides over it."""
    dtype, offset = _dtype(layout["dtype"]), layout["storage_offset"]
    device = device or layout["device"]
    buffer = torch.empty(offset + _span(layout["shape"], layout["stride"]), dtype=dtype, device=device)
    tensor = torch.empty(0, dtype=dtype, device=device)
    with torch.no_grad():
        tensor.set_(buffer.untyped_storage(), offset, layout["shape"], layout["stride"])
    return buffer, tensor


def _span_bytes(t: torch.Tensor) -> bytearray:
    if isinstance(t, FakeTensor):
        raise UnsupportedError("cannot save the data of a fake tensor (it has none).\nFix: save "
                               "values of real tensors, e.g. at the graph's first call.")
    span = _span(t.shape, t.stride())
    data = bytearray(span * t.element_size())
    if span:
        flat = t.detach().as_strided((span,), (1,), t.storage_offset()).to("cpu", copy=True)
        torch.frombuffer(data, dtype=torch.uint8).copy_(flat.view(torch.uint8))
    return data


def write_tensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Save named tensors (any dtype, strides, device) in aotkit's pickle-free ``.tensors`` format.

    Example::

        >>> import tempfile, pathlib, torch
        >>> from aotkit.compilers.dump import read_tensors, write_tensors
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "x.tensors"
        >>> write_tensors(path, {"x": torch.arange(6.).view(2, 3).t()})
        >>> read_tensors(path)["x"]
        tensor([[0., 3.],
                [1., 4.],
                [2., 5.]])
    """
    header, chunks, end = {}, [], 0
    for name, t in tensors.items():
        chunks.append(_span_bytes(t))
        header[name] = {**_layout(t), "data_offsets": [end, end + len(chunks[-1])]}
        end += len(chunks[-1])
    head = json.dumps({"format": _TENSORS_FORMAT, "tensors": header}).encode()
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for chunk in chunks:
            f.write(chunk)


def read_tensors(path: str | os.PathLike[str], device: str | None = None) -> dict[str, torch.Tensor]:
    """Load a file written by :func:`write_tensors`, on each tensor's own device or ``device``.

    Example::

        >>> import tempfile, pathlib, torch
        >>> from aotkit.compilers.dump import read_tensors, write_tensors
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "b.tensors"
        >>> write_tensors(path, {"b": torch.tensor([True, False])})
        >>> read_tensors(path, device="cpu")
        {'b': tensor([ True, False])}
    """
    raw = Path(path).read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = _json(raw[8:8 + size]) if 8 + size <= len(raw) else {}
    if header.get("format") != _TENSORS_FORMAT:
        raise UnsupportedError(f"{path} is not an aotkit tensors file ({_TENSORS_FORMAT}).\nFix: pass a "
                               ".tensors file written by aotkit.compilers.dump.write_tensors.")
    data = memoryview(raw)[8 + size:]
    out = {}
    for name, layout in header["tensors"].items():
        buffer, tensor = _allocate(layout, device)
        begin, end = layout["data_offsets"]
        if end > begin:
            values = torch.frombuffer(bytearray(data[begin:end]), dtype=buffer.dtype)
            buffer[layout["storage_offset"]:].copy_(values)
        out[name] = tensor
    return out


def _json(raw: bytes) -> dict[str, Any]:
    """Parsed JSON object, or ``{}`` for anything else (e.g. a pickle): callers then refuse it."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _random(spec: Mapping[str, Any], device: str | None) -> torch.Tensor:
    buffer, tensor = _allocate(spec, device)
    if buffer.is_floating_point() or buffer.is_complex():
        sample = torch.complex64 if buffer.is_complex() else torch.float32
        buffer.copy_(torch.randn(buffer.shape, dtype=sample, device=buffer.device))
    else:
        buffer.zero_()  # integers and bools: zeros are valid indices and masks
    return tensor


def _rebuild(i: int, spec: Mapping[str, Any], stored: torch.Tensor | None, device: str | None) -> Any:
    kind = spec.get("kind")
    if kind == "tensor":
        if stored is not None and (list(stored.shape) != spec["shape"]
                                   or str(stored.dtype).removeprefix("torch.") != spec["dtype"]):
            raise UnsupportedError(
                f"input {i}: the stored values ({stored.dtype}, {list(stored.shape)}) do not match "
                f"the description ({spec['dtype']}, {spec['shape']}); the .tensors file is from "
                "another dump.\nFix: delete it (random values are used then) or dump again.")
        tensor = stored if stored is not None else _random(spec, device)
        return tensor.requires_grad_(spec["requires_grad"])
    if kind in ("int", "float", "bool"):
        return spec["value"]
    if kind == "none":
        return None
    raise UnsupportedError(f"input {i} is a {spec.get('type', kind)}, which aotkit cannot rebuild."
                           "\nFix: pass that input yourself instead of using get_inputs.")


def _input_file(path: Path, who: str = "get_inputs") -> Path:
    """``path`` itself, or the one ``.input`` file in the folder ``path``."""
    found = sorted(path.glob("*.input")) if path.is_dir() else [path] if path.exists() else []
    if len(found) != 1:
        what = "does not exist" if not found and not path.is_dir() else \
            f"is a folder with {len(found)} .input files"
        raise ArgumentError(f"{who}: {path} {what}.\nFix: pass the .input file of a graph "
                            "saved by graph_dumper_aot or debug_compile (or its folder).")
    return found[0]


def get_inputs(input_data_path: str | os.PathLike[str], *, device: str | None = None) -> list[Any]:
    """Rebuild a saved graph's inputs from its ``.input`` file: tensors with the recorded shape,
    strides, storage offset, dtype, device (or ``device``) and requires_grad, filled with the
    stored values of the first call when a ``.tensors`` file sits next to it, random values
    otherwise (normal floats, zero integers and bools); ints, floats and bools as recorded.

    Example::

        >>> import tempfile, torch, aotkit
        >>> from aotkit.compilers import get_inputs, graph_dumper_aot
        >>> dumper = graph_dumper_aot("sin", tempfile.mkdtemp())
        >>> f = dumper(torch.sin)
        >>> f(torch.zeros(2, 3).t())
        tensor([[0., 0.],
                [0., 0.],
                [0., 0.]])
        >>> [x.stride() for x in get_inputs(dumper.saved[0] / "sin_inference_0.input")]
        [(1, 3)]
    """
    _check_device(device)
    path = _input_file(Path(input_data_path))
    described = _json(path.read_bytes())
    if described.get("format") != _INPUTS_FORMAT:
        raise UnsupportedError(f"{path} is not an aotkit input description ({_INPUTS_FORMAT})."
                               "\nFix: pass the "
                               ".input file of a graph saved by graph_dumper_aot or debug_compile.")
    values_path = path.with_suffix(".tensors")
    stored = read_tensors(values_path, device) if values_path.exists() else {}
    try:
        return [_rebuild(i, spec, stored.get(str(i)), device)
                for i, spec in enumerate(described["inputs"])]
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # edited or cut short
        raise UnsupportedError(
            f"{path} describes its inputs in a way aotkit cannot read ({type(exc).__name__}: "
            f"{exc}).\nFix: pass the .input file as graph_dumper_aot or debug_compile wrote it "
            "(save the graph again if it was edited).") from exc


def _check_device(device: str | None) -> None:
    """A device to rebuild inputs on that this process can make tensors on."""
    if device is None:
        return
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:  # a bad name, or a build without the device
        raise ArgumentError(
            f"get_inputs cannot make tensors on device {device!r} ({type(exc).__name__}: "
            f"{exc}).\nFix: pass a device this process has (device='cpu', or a CUDA device "
            "where torch.cuda.is_available()); for repro.py, set AOTKIT_REPRO_DEVICE so.") from exc


# --- saving and loading graph code --------------------------------------------------------------


def _imports(globals_: Mapping[str, Any]) -> list[str]:
    from torch.fx.graph import _custom_builtins

    lines = []
    for name, obj in globals_.items():
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
        if name in _custom_builtins:
            lines.append(_custom_builtins[name].import_str)
        elif module and qualname.isidentifier():
            lines.append(f"from {module} import {qualname} as {name}")
        else:
            raise UnsupportedError(f"cannot save a graph that calls {obj!r} ({name}): it cannot "
                                   "be imported by name.\nFix: make it a module-level function.")
    return lines


def _source(gm: fx.GraphModule) -> str:
    classes: list[str] = []
    imports: dict[str, None] = {}
    _class_source(gm, "FxModule", classes, imports)
    return "\n".join([
        "# An FX graph saved by aotkit; load it with aotkit.compilers.dump.load_graph(folder).",
        *imports, "", "", *classes,
    ])


def _class_source(gm: fx.GraphModule, name: str, classes: list[str],
                  imports: dict[str, None]) -> None:
    """``gm`` as class ``name``, after the classes of its subgraphs (the branches of a
    higher-order op such as torch.cond), which its ``__init__`` makes."""
    graph = copy.deepcopy(gm.graph)
    graph.set_codegen(fx.graph.CodeGen())  # flat inputs, as the compiled graph is called
    code = graph.python_code(root_module="self")
    imports.update(dict.fromkeys(_imports(code.globals)))
    made = []
    for attr, sub in _attributes(gm, fx.GraphModule).items():
        _class_source(sub, f"{name}_{attr}", classes, imports)
        made.append(f"self.{attr} = {name}_{attr}()")
    init = ["def __init__(self):", "    super().__init__()", *(f"    {m}" for m in made), "", ""]
    body = "\n".join(init if made else []) + code.src.strip()
    classes.append(f"class {name}(torch.nn.Module):\n{textwrap.indent(body, '    ')}\n\n")


def _attributes(gm: fx.GraphModule, kind: type) -> dict[str, Any]:
    """The graph's attributes (``get_attr`` targets) of ``kind``; any other than a tensor or a
    subgraph is refused."""
    found = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if isinstance(value, fx.GraphModule) and "." in str(node.target):
            value = None  # a subgraph is made by its owner's __init__, under its own name
        if not isinstance(value, (torch.Tensor, fx.GraphModule)):
            raise UnsupportedError(
                f"cannot save the graph's attribute {node.target!r}, a {type(value).__name__}: "
                "only tensors and subgraphs of higher-order ops are saved.\nFix: save the "
                "ATen graphs AOT tracing makes (aot_function, aot_module_simplified).")
        if isinstance(value, kind):
            found[str(node.target)] = value
    return found


def _constants(gm: fx.GraphModule, prefix: str = "") -> dict[str, torch.Tensor]:
    """The graph's tensor attributes, its subgraphs' too, by their dotted names."""
    constants = {prefix + k: v for k, v in _attributes(gm, torch.Tensor).items()}
    for attr, sub in _attributes(gm, fx.GraphModule).items():
        constants.update(_constants(sub, f"{prefix}{attr}."))
    return constants


def _write_graph(gm: fx.GraphModule, folder: Path) -> None:
    if gm.graph.find_nodes(op="call_module"):
        raise UnsupportedError("cannot save a graph that calls submodules (call_module nodes)."
                               "\nFix: save the ATen graphs AOT tracing makes (aot_function, "
                               "aot_module_simplified), whose nodes are all ops.")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "module.py").write_text(_source(gm))
    constants = _constants(gm)
    if constants:
        write_tensors(folder / "constants.tensors", constants)


def load_graph(folder: str | os.PathLike[str], device: str | None = None) -> nn.Module:
    """Load a graph saved by :func:`graph_dumper_aot` or :func:`debug_compile` as a module whose
    ``forward`` takes the graph's flat inputs; tensor constants go to ``device`` if given.

    Example::

        >>> import tempfile, torch
        >>> from aotkit.compilers import get_inputs, graph_dumper_aot
        >>> from aotkit.compilers.dump import load_graph
        >>> dumper = graph_dumper_aot("cos", tempfile.mkdtemp(), dump_example_input=True)
        >>> dumper(torch.cos)(torch.zeros(2))
        tensor([1., 1.])
        >>> load_graph(dumper.saved[0])(*get_inputs(dumper.saved[0] / "cos_inference_0.input"))
        [tensor([1., 1.])]
    """
    folder = Path(folder)
    if not (folder / "module.py").is_file():
        raise ArgumentError(
            f"load_graph: {folder} holds no saved graph (no module.py).\nFix: pass a folder "
            "graph_dumper_aot or debug_compile wrote (graph_dumper_aot(...).saved lists them).")
    spec = importlib.util.spec_from_file_location("aotkit_saved_graph", folder / "module.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    graph = module.FxModule()
    constants = folder / "constants.tensors"
    for target, value in (read_tensors(constants, device) if constants.exists() else {}).items():
        *path, attr = target.split(".")
        owner = graph
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        setattr(owner, attr, value)
    return graph


def _save(gm: fx.GraphModule, example_inputs: Sequence[Any], folder: Path, stem: str,
          values: str) -> None:
    """Write the graph's code and ``{stem}.input``; ``values`` says where input values are."""
    (folder / f"{stem}.tensors").unlink(missing_ok=True)  # an earlier dump's values
    placeholders = gm.graph.find_nodes(op="placeholder")
    if all("val" in n.meta for n in placeholders):
        example_inputs = [n.meta["val"] for n in placeholders]
    _write_graph(gm, folder)
    about = {"format": _INPUTS_FORMAT, "graph": stem, "torch": torch.__version__, "values": values}
    inputs = ",\n  ".join(json.dumps(_describe(x)) for x in example_inputs)  # one per line
    head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in about.items())
    (folder / f"{stem}.input").write_text(f'{{\n{head} "inputs": [\n  {inputs}\n ]\n}}\n')


def _run_saving_inputs(gm: fx.GraphModule, values_path: Path | None) -> Callable[[list[Any]], Any]:
    """Run ``gm`` like ``nop``; with ``values_path``, first save the inputs of the first call."""
    run_graph = bind_aten_calls(gm).forward
    if values_path is None:
        return make_boxed_func(run_graph)
    pending = True

    def run(*args: Any) -> Any:
        nonlocal pending
        if pending and not any(isinstance(a, FakeTensor) for a in args):
            pending = False
            inputs = {str(i): a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
            write_tensors(values_path, {**inputs, **_rng_states(args)})
        return run_graph(*args)

    return make_boxed_func(run)


_RNG_STATE = "rng_state."  # a .tensors entry: a generator's state, "rng_state.cpu"


def _rng_states(args: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The states of the generators a graph's random ops draw from as it runs with ``args``:
    the CPU's and those of the CUDA devices ``args`` live on."""
    states = {f"{_RNG_STATE}cpu": torch.get_rng_state()}
    for device in sorted({str(a.device) for a in args
                          if isinstance(a, torch.Tensor) and a.device.type == "cuda"}):
        states[f"{_RNG_STATE}{device}"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_state(input_data_path: str | os.PathLike[str], *, device: str | None = None
                      ) -> bool:
    """Set the random generators to their states when the saved graph first ran, so that its
    random ops (dropout) draw the same numbers again; False when the graph's values were not
    saved (``dump_example_input=False``). With ``device`` given (the inputs moved elsewhere),
    only the CPU's state is set.

    Example::

        >>> import tempfile, torch, aotkit
        >>> from aotkit.compilers import get_inputs, graph_dumper_aot
        >>> from aotkit.compilers.dump import load_graph, restore_rng_state
        >>> dumper = graph_dumper_aot("drop", tempfile.mkdtemp(), dump_example_input=True)
        >>> out = dumper(lambda x: torch.rand_like(x) + x)(torch.zeros(3))
        >>> saved = dumper.saved[0] / "drop_inference_0.input"
        >>> restore_rng_state(saved)
        True
        >>> torch.equal(load_graph(dumper.saved[0])(*get_inputs(saved))[0], out)
        True
    """
    values_path = _input_file(Path(input_data_path), "restore_rng_state").with_suffix(".tensors")
    if not values_path.exists():
        return False
    for name, state in read_tensors(values_path, "cpu").items():
        where = name[len(_RNG_STATE):] if name.startswith(_RNG_STATE) else None
        if where == "cpu":
            torch.set_rng_state(state)
        elif where is not None and device is None:
            torch.cuda.set_rng_state(state, where)
    return True


# --- graph_dumper_aot ---------------------------------------------------------------------------


class GraphDumper:
    """Made by :func:`graph_dumper_aot`: compiles like ``nop`` and saves every graph it compiles.

    ``saved`` lists the folders written so far, in order.
    """

    def __init__(self, current_name: str, folder_name: str | os.PathLike[str],
                 dump_example_input: bool = False) -> None:
        self.name = current_name
        self.root = Path(folder_name) / current_name
        self.dump_example_input = dump_example_input
        self.saved: list[Path] = []

    def __call__(self, fn: Callable[..., Any], example_inputs: Sequence[Any] | None = None) -> Any:
        """``aot_function(fn)`` (``aot_module`` for modules); called as a ``torch.compile`` backend
        (``fn`` a GraphModule with ``example_inputs``), ``aot_module_simplified``."""
        options = {"fw_compiler": self.forward_compiler, "bw_compiler": self.backward_compiler,
                   "partition_fn": self.partition_fn, "inference_compiler": self.inference_compiler}
        if example_inputs is not None:
            return aot_module_simplified(fn, example_inputs, **options)
        if isinstance(fn, nn.Module):
            return aot_module(fn, **options)
        return aot_function(fn, **options)

    def forward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._save(gm, example_inputs, "forward", gm.meta.get(_INDEX))

    def backward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._save(gm, example_inputs, "backward", gm.meta.get(_INDEX))

    def inference_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._save(gm, example_inputs, "inference", None)

    def partition_fn(self, joint_gm: fx.GraphModule, joint_inputs: Sequence[Any], *,
                  num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Save the joint graph, then split it with :func:`aotkit.default_partition`."""
        index = next_number(self.root)
        self._save(joint_gm, joint_inputs, "joint", index)
        fw_gm, bw_gm = default_partition(joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs)
        fw_gm.meta[_INDEX] = bw_gm.meta[_INDEX] = index
        return fw_gm, bw_gm

    def _save(self, gm: fx.GraphModule, example_inputs: Sequence[Any], kind: str,
              index: int | None) -> Callable[..., Any]:
        stem = first = f"{self.name}_{kind}_{next_number(self.root) if index is None else index}"
        while self.root / stem in self.saved:  # another backward of one entry: one bringing
            stem = f"{first}_{len(self.saved)}"  # some gradients only, or under autocast
        folder = self.root / stem
        if kind == "joint":
            values = "not available: the joint graph is traced, never run (see the forward's)"
        elif self.dump_example_input:
            values = f"{stem}.tensors, written when the graph first runs"
        else:
            values = "not saved (graph_dumper_aot(..., dump_example_input=True) saves them)"
        _save(gm, example_inputs, folder, stem, values)
        self.saved.append(folder)
        log.info("graph_dumper_aot: saved the %s graph to %s", kind, folder)
        keep = self.dump_example_input and kind != "joint"
        return _run_saving_inputs(gm, folder / f"{stem}.tensors" if keep else None)


def graph_dumper_aot(current_name: str, folder_name: str | os.PathLike[str],
                     dump_example_input: bool = False) -> GraphDumper:
    """Save the forward, backward and joint graph of every compiled entry (and inference graphs)
    to ``folder_name/current_name/current_name_{forward,backward,joint,inference}_N/``; another
    backward of entry N (for a call bringing some gradients only, or under autocast) goes to
    ``current_name_backward_N_K/``.

    Each folder holds ``module.py`` (see :func:`aotkit.compilers.dump.load_graph`) and ``current_name_{kind}_N.input``
    (JSON, read by :func:`get_inputs`); with ``dump_example_input`` the inputs of each graph's
    first call go to ``current_name_{kind}_N.tensors``. ``N`` numbers the compiled entries.
    The returned object wraps a function or module (``dumper(fn)``, like ``aot_function``) or
    serves as a ``torch.compile`` backend (``torch.compile(fn, backend=dumper)``); the joint graph
    is split with :func:`aotkit.default_partition`.

    Example::

        >>> import os, tempfile, torch
        >>> from aotkit.compilers import graph_dumper_aot
        >>> dumper = graph_dumper_aot("mul", tempfile.mkdtemp())
        >>> f = dumper(lambda x: x * x)
        >>> f(torch.ones(2, requires_grad=True)).sum().backward()
        >>> [p.name for p in dumper.saved]
        ['mul_joint_0', 'mul_forward_0', 'mul_backward_0']
        >>> sorted(os.listdir(dumper.saved[1]))
        ['module.py', 'mul_forward_0.input']
    """
    if not isinstance(current_name, str):
        given = "GraphModule" if isinstance(current_name, fx.GraphModule) else \
            type(current_name).__name__
        raise ArgumentError(
            "graph_dumper_aot(current_name, folder_name) makes the compiler; its current_name "
            f"was a {given}, not a str (was graph_dumper_aot itself passed as a compiler?).\n"
            "Fix: graph_dumper_aot('model', 'dumps') returns the object to wrap a function "
            "with or to pass as the backend.")
    if not isinstance(folder_name, (str, os.PathLike)):
        raise ArgumentError(
            f"graph_dumper_aot's folder_name must be a path (str or os.PathLike), not "
            f"{type(folder_name).__name__}.\nFix: graph_dumper_aot('model', 'dumps').")
    if not current_name or "/" in current_name or os.sep in current_name:
        raise ArgumentError(
            f"graph_dumper_aot's current_name {current_name!r} names the folder and the files "
            "of its graphs, so it must be a non-empty name without path separators.\nFix: "
            "graph_dumper_aot('model', 'dumps/run1') (the folder goes in folder_name).")
    return GraphDumper(current_name, folder_name, dump_example_input)


# --- debug_compile ------------------------------------------------------------------------------

_REPRO = '''\
"""A repro written by aotkit.compilers.debug_compile: rebuild the graph's inputs and run it.

    python repro.py        (AOTKIT_REPRO_DEVICE=cpu runs a CUDA graph's inputs on the CPU)
"""

import os
import sys
from pathlib import Path

import torch

from aotkit.compilers import get_inputs
from aotkit.compilers.dump import load_graph, restore_rng_state

HERE = Path(__file__).resolve().parent
DEVICES = {devices!r}  # where the traced inputs lived
CUSTOM_OPS = {custom_ops!r}  # ops of other libraries the graph calls, and who registered them
IMPORT_ROOTS = {import_roots!r}  # where those modules were imported from when the graph was dumped


def import_custom_ops() -> bool:
    for op, module in CUSTOM_OPS.items():
        if module and module != "__main__":
            try:
                __import__(module)
            except ImportError as exc:
                root = IMPORT_ROOTS.get(module, "the folder that holds it")
                print(f"repro: importing {{module}}, which registers {{op}}, failed ({{exc}}); "
                      f"run the repro with PYTHONPATH={{root}} (python puts repro.py's own "
                      "folder on the path, not the current one).", file=sys.stderr)
                return False
        namespace, name = op.split("::")
        if not hasattr(getattr(torch.ops, namespace), name):
            how = ("copy the script code that registers it (it was defined in __main__)"
                   if module == "__main__" else f"import {{module or 'the module that registers it'}}")
            print(f"repro: the graph calls the custom op {{op}}, which is not registered in "
                  f"this process: {{how}} at the top of repro.py.", file=sys.stderr)
            return False
    return True


def main() -> int:
    if not import_custom_ops():
        return 2
    device = os.environ.get("AOTKIT_REPRO_DEVICE")
    cuda = [d for d in DEVICES if d.startswith("cuda")]
    if cuda and device is None and not torch.cuda.is_available():
        print(f"repro: this graph was traced with inputs on {{', '.join(cuda)}}, but CUDA is not "
              "available here (torch.cuda.is_available() is False). Run it on a machine with a "
              "GPU, or set AOTKIT_REPRO_DEVICE=cpu to run it on the CPU.", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    graph = load_graph(HERE, device)
    inputs = get_inputs(HERE / "graph.input", device=device)
    restore_rng_state(HERE / "graph.input", device=device)  # when the first call's were saved
    outputs = graph(*inputs)
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    for i, out in enumerate(outputs):
        if isinstance(out, torch.Tensor):
            shown = f"{{str(out.dtype).removeprefix('torch.')}}{{list(out.shape)}} on {{out.device}}"
        else:
            shown = repr(out)
        print(f"repro: output {{i}}: {{shown}}")
    differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if differentiable:
        torch.autograd.backward(differentiable, [torch.ones_like(o) for o in differentiable])
        print(f"repro: backward ran through {{len(differentiable)}} output(s)")
    print(f"repro: ok ({{len(outputs)}} output(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


_BUILT_IN_NAMESPACES = {"aten", "prims", "prim", "quantized", "higher_order"}


def _custom_ops(gm: fx.GraphModule) -> dict[str, str | None]:
    """The graph's ops from other libraries (``torch.library``), each with the module that
    defined it where PyTorch knows it (``custom_op``'s function)."""
    from torch._library.custom_ops import OPDEFS

    found: dict[str, str | None] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and target.namespace not in _BUILT_IN_NAMESPACES and not target.namespace.startswith("_"):
            name = target._schema.name
            opdef = OPDEFS.get(name)
            found[name] = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
    return found


def _import_roots(modules: Iterable[str | None]) -> dict[str, str]:
    """For each imported module, the folder on ``sys.path`` it was imported from."""
    roots = {}
    for name in modules:
        path = getattr(sys.modules.get(name or ""), "__file__", None)
        if name and name != "__main__" and path:
            depth = name.count(".") + (Path(path).name == "__init__.py")
            roots[name] = str(Path(path).resolve().parents[depth])
    return roots


def _fresh_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    index = 0
    while True:
        folder = root / f"graph_{index}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            index += 1


def debug_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                  folder: str | os.PathLike[str] | None = None,
                  dump_example_input: bool = False) -> Callable[[list[Any]], Any]:
    """Write the graph and a runnable ``repro.py`` to a new ``graph_N`` folder under ``folder``
    (default ``aotkit.config.debug_dir``), then run the graph like ``nop``.

    The repro rebuilds the inputs from ``graph.input`` (random values, or with
    ``dump_example_input=True`` those of the graph's first call), runs the graph, and runs a
    backward through outputs that require grad; aotkit's forward and backward graphs run without
    autograd (their inputs do not require grad), so for them the repro runs the graph alone, as
    the compiled function does. Inputs traced on CUDA need CUDA to run the repro;
    without it the script says so and exits with status 2 (``AOTKIT_REPRO_DEVICE=cpu`` runs it on
    the CPU instead).

    Example::

        >>> import tempfile, torch, aotkit
        >>> with aotkit.config.patch(debug_dir=tempfile.mkdtemp()):
        ...     f = aotkit.aot_function(torch.sin, aotkit.compilers.debug_compile)
        ...     f(torch.zeros(2))
        tensor([0., 0.])
    """
    require_graph_module(gm, "debug_compile")
    target = _fresh_folder(Path(config.debug_dir if folder is None else folder))
    values = "graph.tensors, written when the graph first runs" if dump_example_input else (
        "not saved (debug_compile(..., dump_example_input=True) saves them)")
    _save(gm, example_inputs, target, "graph", values)
    devices = sorted({str(x.device) for x in example_inputs if isinstance(x, torch.Tensor)})
    custom_ops = _custom_ops(gm)
    (target / "repro.py").write_text(_REPRO.format(
        devices=devices, custom_ops=custom_ops, import_roots=_import_roots(custom_ops.values())))
    log.warning("debug_compile: wrote the graph and a repro to %s (run: python %s)",
                target, target / "repro.py")
    return _run_saving_inputs(gm, target / "graph.tensors" if dump_example_input else None)
