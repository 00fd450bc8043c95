"""The ``aotkit`` command.

``aotkit demo`` compiles a real model with ``backend="aotkit"``, checks it against eager and
reports what aotkit did; ``aotkit graphs`` prints the graphs aotkit captures for a model (AOT
forward and backward, or with ``--compiled-autograd`` the whole backward)::

    $ aotkit demo --steps 10
    $ aotkit graphs --model mlp --code
    $ aotkit graphs --model transformer --partition min_cut --budget 0.5 --draw graphs/
    $ aotkit graphs --model mlp --compiled-autograd --code
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aotkit import config
from aotkit.errors import AotkitError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from aotkit.demo import run_demo

    report = run_demo(steps=args.steps, threads=args.threads, dropout=not args.no_dropout,
                      seed=args.seed)
    print(report)
    if not report.ok:
        print("aotkit demo: compiled results differ from eager PyTorch (see above).",
              file=sys.stderr)
        return 1
    return 0


_PARTITIONERS = ("default", "min_cut")


def _graphs(args: argparse.Namespace) -> int:
    from aotkit import config, partition
    from aotkit.demo import capture_backward_graph, capture_graphs

    partition_fn = {"default": partition.default_partition,
                    "min_cut": partition.min_cut_rematerialization_partition}[args.partition]
    if args.compiled_autograd:
        graphs = capture_backward_graph(args.model)
        mode = "whole backward under aotkit.compiled_autograd"
    else:
        with config.patch(**_options_set(args)):
            graphs = capture_graphs(args.model, training=not args.inference,
                                    partition_fn=partition_fn)
        mode = "inference" if args.inference else "training"
    print(f"aotkit graphs: {args.model} ({mode})")
    for graph in graphs:
        print("  " + graph.summary())
        if "partition" in graph.gm.meta:
            print(f"    {graph.gm.meta['partition']}")
    if args.draw:
        _draw(graphs, Path(args.draw))
    if args.code:
        for graph in graphs:
            print(f"\n# ---- {graph.kind} graph ----")
            print(graph.gm.code.strip())
    return 0


def _draw(graphs: Sequence[Any], folder: Path) -> None:
    """Draw each graph to ``folder``: SVG, or DOT where Graphviz is missing (said once here,
    rather than by draw_graph's fallback warning for every graph)."""
    from aotkit.partition import draw_graph

    suffix = ".svg"
    if shutil.which("dot") is None:
        suffix = ".dot"
        print("  Graphviz's `dot` program is not on PATH, so the graphs are written as DOT "
              "files. To get images, install Graphviz (apt-get install graphviz, brew install "
              "graphviz or conda install graphviz) or render them elsewhere: dot -Tsvg "
              "FILE.dot -o FILE.svg")
    for graph in graphs:
        drawn = draw_graph(graph.gm, folder / f"{graph.kind}{suffix}")
        print(f"  drew the {graph.kind} graph: {drawn.path}")


def _version() -> str:
    """aotkit's version, with the torch it runs on (read without importing torch)."""
    from importlib.metadata import PackageNotFoundError, version

    import aotkit

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"aotkit {aotkit.__version__} (torch {torch_version})"


def _options_set(args: argparse.Namespace) -> dict[str, Any]:
    """The aotkit.config options the command line sets."""
    budget = getattr(args, "budget", None)
    return {} if budget is None else {"activation_memory_budget": budget}


def budget(text: str) -> float:
    """``--budget``: a float in [0, 1] (argparse names this function in its errors)."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``aotkit`` command.

    Example::

        >>> build_parser().parse_args(["graphs", "--model", "mlp"]).model
        'mlp'
    """
    parser = argparse.ArgumentParser(
        prog="aotkit",
        description="aotkit: ahead-of-time graph compilation for PyTorch. Run 'aotkit demo' "
                    "to compile a small transformer and check it against eager PyTorch.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="compile a TinyTransformer with backend='aotkit', "
                          "check it against eager and report compile/step times and graphs")
    demo.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    demo.add_argument("--threads", type=int, default=1,
                      help="torch.set_num_threads (default 1: the model is tiny, and one "
                           "thread keeps the timings steady on a busy machine)")
    demo.add_argument("--seed", type=int, default=0, help="model and dropout seed (default 0)")
    demo.add_argument("--no-dropout", action="store_true", help="train with dropout off")
    demo.set_defaults(func=_demo, usage_error=demo.error)

    graphs = sub.add_parser("graphs", help="print the forward/backward graphs aotkit captures")
    graphs.add_argument("--model", choices=["transformer", "mlp"], default="transformer",
                        help="which model's graphs (default: transformer)")
    graphs.add_argument("--code", action="store_true", help="also print each graph's code")
    graphs.add_argument("--inference", action="store_true",
                        help="capture the inference graph (model.eval(), torch.no_grad) instead")
    graphs.add_argument("--partition", choices=_PARTITIONERS, default="default",
                        help="how the joint graph is split (default: default)")
    graphs.add_argument("--budget", type=budget, default=None,
                        help="activation_memory_budget for --partition min_cut (0..1; default "
                             "aotkit.config's: 1, or AOTKIT_ACTIVATION_MEMORY_BUDGET)")
    graphs.add_argument("--compiled-autograd", action="store_true",
                        help="capture the whole backward with aotkit.compiled_autograd (one "
                             "graph, hooks and .grad accumulation included) instead")
    graphs.add_argument("--draw", metavar="DIR",
                        help="also draw each graph to DIR/<kind>.svg (without Graphviz: "
                             "DIR/<kind>.dot)")
    graphs.set_defaults(func=_graphs, usage_error=graphs.error)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # a missing command names the commands
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aotkit`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Example::

        >>> main(["graphs", "--model", "mlp"])  # doctest: +SKIP
        0
    """
    args = build_parser().parse_args(argv)
    _check(args)
    try:  # an option the command line sets replaces its environment variable, as patch() does
        with config.patch(**_options_set(args)):
            config.check_environment()
    except AotkitError as exc:
        print(f"aotkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except AotkitError as exc:  # a deliberate error already says what failed and how to fix it
        print(f"aotkit {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader stopped early (``aotkit graphs --code | head``)
        # Python flushes stdout once more at exit, which would fail again: point it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # writing the report failed (a full disk behind ``> file``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"aotkit {args.command}: error: could not write the report: {exc}",
              file=sys.stderr)
        return 1


def _check(args: argparse.Namespace) -> None:
    """Usage errors argparse cannot see alone, reported with the subcommand's usage (exit 2)."""
    if args.command == "demo" and args.steps < 2:
        args.usage_error("--steps must be at least 2 (the first step includes compiling)")
    if args.command == "demo" and not 1 <= args.threads < 2**31:
        args.usage_error(f"--threads must lie in [1, 2**31), got {args.threads}")
    if args.command == "demo" and not 0 <= args.seed < 2**63:
        args.usage_error(f"--seed must lie in [0, 2**63), got {args.seed}")
    if args.command == "graphs" and args.draw == "":
        args.usage_error("--draw needs a folder (e.g. --draw graphs/)")
    if args.command != "graphs":
        return
    if args.inference and (args.partition != "default" or args.budget is not None):
        args.usage_error("--inference captures one forward-only graph: nothing to partition, "
                         "so it takes no --partition or --budget")
    if args.compiled_autograd and (args.inference or args.partition != "default"
                                   or args.budget is not None):
        args.usage_error("--compiled-autograd captures the backward alone: it takes no "
                         "--inference, --partition or --budget")
    if args.budget is not None and args.partition != "min_cut":
        args.usage_error("--budget applies to --partition min_cut")


if __name__ == "__main__":
    raise SystemExit(main())
