"""``draw_graph``: an FX graph as SVG, PNG or DOT through pydot and Graphviz."""

from __future__ import annotations

import logging
import operator
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from aotkit.errors import ArgumentError

log = logging.getLogger("aotkit.partition")

_FORMATS = {".svg": "svg", ".png": "png", ".dot": "dot"}
_FILL = {"placeholder": "lightblue", "output": "lightgrey", "get_attr": "lightyellow"}


@dataclass(frozen=True)
class DrawnGraph:
    """What :func:`draw_graph` wrote: the file, its format (``"svg"``, ``"png"`` or ``"dot"``)
    and, when Graphviz was missing and DOT was written instead of an image, why."""

    path: Path
    format: str
    fallback: str | None = None


def draw_graph(gm: fx.GraphModule | fx.Graph, path: str | os.PathLike[str], *,
               name: str = "fx_graph",
               clear_meta: bool = True) -> DrawnGraph:
    """Write ``gm``'s graph to ``path`` as SVG, PNG or DOT, chosen by the extension (none: SVG);
    missing folders are created.

    Each node shows its name, op and target, and the dtype and shape of its traced value;
    ``clear_meta=False`` adds the user's source line where ``node.meta`` records one. The graph
    itself is not changed. Images are rendered by Graphviz's ``dot``; without it the DOT source
    is written next to ``path`` (``path`` with a ``.dot`` extension), a warning says how to get
    images, and the result's ``fallback`` holds that reason. A path that cannot be written
    (a read-only folder, a file where a folder should be) raises ``ArgumentError``.

    Example::

        >>> import tempfile, pathlib, torch
        >>> from aotkit.partition import draw_graph
        >>> gm = torch.fx.symbolic_trace(lambda x: x.relu() + 1)
        >>> out = draw_graph(gm, pathlib.Path(tempfile.mkdtemp()) / "relu.dot")
        >>> out.format, out.path.read_text().startswith("digraph")
        ('dot', True)
    """
    if isinstance(gm, fx.Graph):
        gm = fx.GraphModule({}, gm)
    if not isinstance(gm, fx.GraphModule):
        raise ArgumentError(
            f"draw_graph draws a torch.fx.GraphModule or Graph, got {type(gm).__name__}.\n"
            "Fix: pass the GraphModule a compiler received, or torch.fx.symbolic_trace(fn)."
        )
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".svg")
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ArgumentError(
            f"draw_graph cannot write {path.name!r}: unknown extension {path.suffix!r}.\n"
            f"Fix: end the path with one of {', '.join(_FORMATS)} (no extension writes SVG)."
        )
    dot = _to_dot(gm, name, clear_meta)
    try:
        return _write(dot, path, fmt)
    except OSError as exc:
        raise ArgumentError(
            f"draw_graph cannot write {path}: {type(exc).__name__}: {exc}\nFix: pass a path in "
            "a folder that exists or can be created, and that you may write to (no part of it "
            "may be an existing file)."
        ) from exc


def _write(dot: Any, path: Path, fmt: str) -> DrawnGraph:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        path.write_text(dot.to_string())
        return DrawnGraph(path, fmt)
    if shutil.which("dot") is None:
        return _write_dot_instead(dot, path, "Graphviz's `dot` program is not on PATH")
    try:
        dot.write(str(path), format=fmt, prog="dot")
    except AssertionError as exc:  # pydot's report of dot's failure, with its stderr
        failure = " ".join(str(exc).split())
        return _write_dot_instead(dot, path, f"Graphviz's `dot` failed ({failure})")
    return DrawnGraph(path, fmt)


def _write_dot_instead(dot: Any, path: Path, cause: str) -> DrawnGraph:
    # Note [draw_graph fallback]: aotkit.partition sits below aotkit.counters (DESIGN.md, Layout),
    # so this level only logs the warning and returns the reason; callers on higher floors
    # (aotkit.compilers.draw_graph_compile) record it as a "fallback" decision.
    dot_path = path.with_suffix(".dot")
    dot_path.write_text(dot.to_string())
    why = (f"{cause}, so {path.name} could not be rendered; "
           f"wrote the DOT source to {dot_path} instead. To get images, install Graphviz "
           "(apt-get install graphviz, brew install graphviz or conda install graphviz) or "
           f"render the file elsewhere: dot -T{path.suffix.lstrip('.').lower()} "
           f"{shlex.quote(str(dot_path))} -o {shlex.quote(str(path))}")
    global _told_no_dot
    # A warning once per process; each later file is logged at INFO (and, through
    # draw_graph_compile, still a decision of its own).
    log.log(logging.INFO if _told_no_dot else logging.WARNING, "draw_graph: %s", why)
    _told_no_dot = True
    return DrawnGraph(dot_path, "dot", why)


_told_no_dot = False


def _to_dot(gm: fx.GraphModule, name: str, clear_meta: bool) -> Any:
    import pydot

    dot = pydot.Dot(_quote(name), graph_type="digraph", rankdir="TB")
    for node in gm.graph.nodes:
        label = _quote(_label(node, clear_meta))
        dot.add_node(pydot.Node(_quote(node.name), label=label, shape="box", style="filled",
                                fillcolor=_FILL.get(node.op, "white")))
        for source in node.all_input_nodes:
            dot.add_edge(pydot.Edge(_quote(source.name), _quote(node.name)))
    return dot


def _quote(text: str) -> str:
    # Names and labels are written as double-quoted DOT strings, so that FX
    # names such as ``graph`` or ``node`` are not read as keywords, and pydot passes them through
    # untouched (its own quoting leaves backslashes as they are, so a source line ending in a
    # backslash would escape the closing quote). Graphviz reads ``\\`` in a label as one
    # backslash and ``\n`` as a line break; backslashes are doubled first.
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def _label(node: fx.Node, clear_meta: bool) -> str:
    lines = [node.name, _op(node)]
    value = _describe(node.meta.get("val"))
    if value:
        lines.append(value)
    trace = node.meta.get("stack_trace")
    if not clear_meta and trace:
        # The source line: Python 3.11+ tracebacks follow it with a line of carets.
        source = [line.strip() for line in trace.splitlines() if line.strip(" ^~")]
        lines.append(source[-1] if source else "")
    return "\n".join(lines)


def _op(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    target = node.target
    if target is operator.getitem:
        return f"getitem [{node.args[1]}]"
    if isinstance(target, str):
        return f"{node.op} {target}"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _describe(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym {val}"
    if isinstance(val, (list, tuple)):
        return ", ".join(filter(None, (_describe(v) for v in val)))
    return ""
