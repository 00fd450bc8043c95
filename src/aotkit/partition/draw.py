"""``draw_graph``: an FX graph as SVG, PNG or DOT through pydot and Graphviz."""

from __future__ import annotations

from typing import Any


def draw_graph(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("helper A")
