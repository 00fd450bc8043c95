"""draw_graph: SVG, PNG and DOT through pydot and Graphviz, and DOT with a warning without it."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

import aotkit
from aotkit.errors import ArgumentError
from aotkit.partition import draw_graph
from aotkit.partition.draw import DrawnGraph

needs_graphviz = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz not installed")


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)).sum(1)  # the source line drawn with clear_meta=False


def forward_graph(record_stack_traces: bool = False) -> fx.GraphModule:
    """The ATen forward graph of ``TwoLayers`` with traced values in ``meta["val"]``."""
    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    with aotkit.config.patch(record_stack_traces=record_stack_traces):
        aotkit.aot_module(TwoLayers(), keep)(torch.randn(2, 3))
    return graphs[0]


@needs_graphviz
@pytest.mark.parametrize(("name", "magic"), [("g.svg", b"<?xml"), ("g.png", b"\x89PNG\r\n\x1a\n"),
                                             ("g", b"<?xml"), ("g.dot", b"digraph")])
def test_draws_each_format(tmp_path: Path, name: str, magic: bytes) -> None:
    result = draw_graph(forward_graph(), tmp_path / name)
    expected = tmp_path / (name if "." in name else name + ".svg")
    assert result == DrawnGraph(expected, expected.suffix[1:])
    data = expected.read_bytes()
    assert data.startswith(magic)
    if expected.suffix == ".svg":
        assert b"<svg" in data and b">aten.addmm.default<" in data and b">float32[2, 4]<" in data
    assert [p.name for p in tmp_path.iterdir()] == [expected.name]


def test_dot_labels_show_name_op_and_traced_value(tmp_path: Path) -> None:
    gm = forward_graph()
    before = gm.code
    text = draw_graph(gm, tmp_path / "fw.dot").path.read_text()
    assert text.startswith('digraph "fx_graph" {')
    assert 'label="addmm\\naten.addmm.default\\nfloat32[2, 4]"' in text
    assert 'label="primals_3\\nplaceholder\\nfloat32[2, 3]"' in text
    assert '"primals_3" -> "addmm"' in text
    assert "the source line" not in text
    assert gm.code == before


def test_clear_meta_false_adds_the_user_source_line(tmp_path: Path) -> None:
    text = draw_graph(forward_graph(record_stack_traces=True), tmp_path / "fw.dot",
                      clear_meta=False).path.read_text()
    assert "return torch.relu(self.fc(x)).sum(1)  # the source line drawn" in text


@needs_graphviz
def test_node_names_that_are_dot_keywords_are_drawn(tmp_path: Path) -> None:
    gm = fx.symbolic_trace(lambda node, graph, edge: node + graph * edge)
    svg = draw_graph(gm, tmp_path / "keywords.svg").path.read_text()
    for name in ("node", "graph", "edge"):
        assert f"<title>{name}</title>" in svg


def test_unknown_extension_names_the_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match=r"(?s)'\.pdf'.*\.svg, \.png, \.dot"):
        draw_graph(forward_graph(), tmp_path / "g.pdf")
    assert list(tmp_path.iterdir()) == []


def test_without_graphviz_writes_dot_and_warns(tmp_path: Path, monkeypatch: Any,
                                               caplog: Any) -> None:
    from aotkit.partition import draw

    monkeypatch.setenv("PATH", str(tmp_path / "no-graphviz-here"))
    monkeypatch.setattr(draw, "_told_no_dot", False)
    with caplog.at_level(logging.INFO, logger="aotkit.partition"):
        result = draw_graph(forward_graph(), tmp_path / "g.png")
        again = draw_graph(forward_graph(), tmp_path / "h.png")  # logged, not warned again
    assert result.path == tmp_path / "g.dot" and result.format == "dot"
    assert result.path.read_text().startswith("digraph")
    assert not (tmp_path / "g.png").exists()
    assert result.fallback is not None and "apt-get install graphviz" in result.fallback
    assert f"dot -Tpng {tmp_path / 'g.dot'} -o {tmp_path / 'g.png'}" in result.fallback
    assert again.fallback is not None and again.path == tmp_path / "h.dot"
    [record, later] = [r for r in caplog.records if r.getMessage().startswith("draw_graph:")]
    assert record.levelno == logging.WARNING and "brew install graphviz" in record.getMessage()
    assert later.levelno == logging.INFO and "h.png" in later.getMessage()


def test_a_failing_graphviz_writes_dot_and_says_why(tmp_path: Path, monkeypatch: Any) -> None:
    """A `dot` that exits with an error (a plugin missing) raised pydot's raw AssertionError."""
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'dot: cannot load plugin' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    result = draw_graph(forward_graph(), tmp_path / "g.svg")
    assert result.path == tmp_path / "g.dot" and result.path.read_text().startswith("digraph")
    assert result.fallback is not None and "`dot` failed" in result.fallback


def test_missing_folders_are_created_and_graphs_accepted(tmp_path: Path) -> None:
    gm = forward_graph()
    out = draw_graph(gm.graph, tmp_path / "a" / "b" / "fw.dot")
    assert out.path.read_text().startswith("digraph")


def test_a_function_is_refused_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="symbolic_trace"):
        draw_graph(lambda x: x, tmp_path / "f.svg")  # type: ignore[arg-type]


def _graph_with_source_line(line: str) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.add, (x, 1))
    y.meta["stack_trace"] = f'  File "f.py", line 3, in f\n    {line}\n'
    graph.output(y)
    return fx.GraphModule({}, graph)


_AWKWARD_LINES = ["y = x + \\", 'y = f("\\n")', 'y = x  # \\"', 'y = x  # "quoted"',
                  "y = x  # a\\\\b \\l \\N"]


@pytest.mark.parametrize(("line", "in_dot"), list(zip(_AWKWARD_LINES, [
    r"y = x + \\", r'y = f(\"\\n\")', r'y = x  # \\\"', r'y = x  # \"quoted\"',
    r"y = x  # a\\\\b \\l \\N"], strict=True)))
def test_dot_labels_escape_backslashes_and_quotes(tmp_path: Path, line: str, in_dot: str) -> None:
    text = draw_graph(_graph_with_source_line(line), tmp_path / "g.dot",
                      clear_meta=False).path.read_text()
    assert f'label="add\\nadd\\n{in_dot}"' in text


def test_the_source_line_is_drawn_not_the_carets_under_it(tmp_path: Path) -> None:
    gm = _graph_with_source_line("y = (x @ w).tanh()")
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    add.meta["stack_trace"] += "        ^^^^^^^^^^^^^^^^^^\n"  # as Python 3.11+ prints it
    text = draw_graph(gm, tmp_path / "g.dot", clear_meta=False).path.read_text()
    assert 'label="add\\nadd\\ny = (x @ w).tanh()"' in text


@needs_graphviz
@pytest.mark.parametrize("line", _AWKWARD_LINES)
def test_source_lines_with_backslashes_render_as_written(tmp_path: Path, line: str) -> None:
    import html

    svg = draw_graph(_graph_with_source_line(line), tmp_path / "g.svg",
                     clear_meta=False).path.read_text()
    texts = [html.unescape(t).replace("\xa0", " ")  # Graphviz keeps runs of spaces as nbsp
             for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]
    assert line in texts, texts


def _continued(x: torch.Tensor) -> torch.Tensor:
    y = torch.sin(x) + \
        1
    return y


@needs_graphviz
@pytest.mark.skipif(not hasattr(torch.fx.proxy, "_register_stack_trace_anchor"),
                    reason="this torch's make_fx keeps stack frames of module forwards only")
def test_a_recorded_line_continuation_draws_as_svg(tmp_path: Path) -> None:
    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    with aotkit.config.patch(record_stack_traces=True):
        aotkit.aot_function(_continued, keep)(torch.randn(3))
    svg = draw_graph(graphs[0], tmp_path / "g.svg", clear_meta=False).path.read_text()
    assert "y = torch.sin(x) + \\<" in svg


@pytest.mark.parametrize("name", ["g.dot", "g.svg"])
def test_unwritable_paths_are_argument_errors(tmp_path: Path, name: str) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    for path in (a_file / name, a_file / "sub" / name):
        with pytest.raises(ArgumentError, match=r"(?s)draw_graph cannot write .*a_file.*Fix:"):
            draw_graph(forward_graph(), path)
    assert a_file.read_text() == "not a folder"
