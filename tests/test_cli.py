"""The ``aotkit`` command: ``aotkit demo`` and ``aotkit graphs``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import aotkit
from aotkit import cli
from aotkit.demo import capture_graphs


def run_command(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=300, env=env)


def test_demo_subprocess_reports_figures() -> None:
    proc = run_command(sys.executable, "-m", "aotkit", "demo", "--steps", "4", "--threads", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"compile time:\s+-?\d+\.\d+ s \(first step \d+\.\d+ s", out), out
    assert re.search(r"steady step:\s+\d+\.\d+ ms vs eager \d+\.\d+ ms \(\d+\.\d+x eager\)", out), out
    assert "graphs captured:    1 trace(s), 1 forward, 1 backward" in out, out
    assert re.search(r"recompiles:\s+0", out), out
    saved = re.search(r"saved activations:  default partition (\d+\.\d+) MB; min-cut "
                      r"(\d+\.\d+) MB \((\d+\.\d+)x\), recomputing (\d+) op", out)
    assert saved, out
    assert float(saved[2]) < float(saved[1]) and int(saved[4]) > 0
    assert "result: OK" in out


def test_demo_saved_activations_describe_the_model_it_trained() -> None:
    """--no-dropout trained a model without dropout but reported the dropout model's saved
    activations."""
    from aotkit.demo import run_demo

    report = run_demo(steps=2, dropout=False)
    assert report.problems == []
    (decision,) = [d for d in report.other_decisions if "[partition]" in d]
    saved = int(re.search(r"(\d+) activation bytes", decision)[1])
    assert report.partitions["default"].saved_bytes == saved


def test_a_bad_environment_variable_is_a_usage_error_and_help_still_works() -> None:
    env = {**os.environ, "AOTKIT_LOG_GRAPHS": "2", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "aotkit"]
    helped = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "usage: aotkit" in helped.stdout
    graphs = subprocess.run([*command, "graphs", "--model", "mlp"], capture_output=True,
                            text=True, env=env)
    assert graphs.returncode == 2 and "Traceback" not in graphs.stderr
    assert "aotkit graphs: error: AOTKIT_LOG_GRAPHS='2' is not a boolean" in graphs.stderr


def test_budget_on_the_command_line_replaces_a_bad_environment_variable() -> None:
    """The environment was checked before --budget applied, as patch() replaces it in Python."""
    env = {**os.environ, "AOTKIT_ACTIVATION_MEMORY_BUDGET": "nan", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "aotkit", "graphs", "--model", "mlp"]
    budgeted = subprocess.run([*command, "--partition", "min_cut", "--budget", "0.5"],
                              capture_output=True, text=True, env=env, timeout=300)
    assert budgeted.returncode == 0, budgeted.stderr
    plain = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode == 2 and "AOTKIT_ACTIVATION_MEMORY_BUDGET='nan'" in plain.stderr


def _perturbed_compile(model: torch.nn.Module, **kwargs: object) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: model(x) * 1.001


def _failing_compile(model: torch.nn.Module, **kwargs: object) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backend exploded")

    return run


def test_demo_exits_1_when_results_differ(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch, "compile", _perturbed_compile)
    assert cli.main(["demo", "--steps", "2"]) == 1
    captured = capsys.readouterr()
    assert "result: FAILED" in captured.out
    assert re.search(r"step 0: loss [\d.]+, eager [\d.]+", captured.out), captured.out
    assert "differ from eager" in captured.err


def test_demo_exits_1_when_compiled_training_raises(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch, "compile", _failing_compile)
    assert cli.main(["demo", "--steps", "2"]) == 1
    assert "compiled training raised RuntimeError at step 0: backend exploded" in capsys.readouterr().out


def test_demo_rejects_too_few_steps() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--steps", "1"])
    assert exc.value.code == 2


@pytest.mark.parametrize("threads", ["0", "-2", "2147483648"])
def test_demo_rejects_thread_counts_torch_cannot_take(threads: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """2**31 threads raised a raw overflow error from torch.set_num_threads."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--threads", threads])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: aotkit demo ")
    assert f"--threads must lie in [1, 2**31), got {threads}" in err


def test_graphs_console_script_prints_sizes_and_code() -> None:
    script = Path(sys.executable).with_name("aotkit")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "aotkit"]
    proc = run_command(*command, "graphs", "--model", "mlp", "--code")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"forward: \d+ nodes \(11 ops, 9 inputs", proc.stdout), proc.stdout
    assert re.search(r"backward: \d+ nodes", proc.stdout), proc.stdout
    assert "# ---- backward graph ----" in proc.stdout
    assert "aten.gelu_backward.default" in proc.stdout


def test_graphs_transformer_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["graphs", "--model", "transformer"]) == 0
    out = capsys.readouterr().out
    assert "aotkit graphs: transformer (training)" in out
    assert re.search(r"forward: \d+ nodes", out) and re.search(r"backward: \d+ nodes", out)


def test_graphs_min_cut_budget_and_drawings(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    assert cli.main(["graphs", "--model", "mlp", "--partition", "min_cut", "--budget", "0",
                     "--draw", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "min_cut_rematerialization_partition: saved" in out
    assert "aten.addmm.default" in out.split("recomputed", 1)[1]  # budget 0 recomputes matmuls
    for kind in ("forward", "backward"):
        assert f"drew the {kind} graph: {tmp_path / (kind + '.svg')}" in out
        assert (tmp_path / f"{kind}.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def test_version_names_aotkit_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    from importlib.metadata import version

    # The installed distribution's version: read without importing torch, it may lack the
    # local part torch.__version__ has (2.11.0 for 2.11.0+cu130).
    assert capsys.readouterr().out.strip() == f"aotkit {aotkit.__version__} (torch {version('torch')})"
    assert torch.__version__.startswith(version("torch"))


def test_graphs_min_cut_without_budget_takes_the_configured_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The command set budget 1 whenever --budget was absent, ignoring the config's (and with
    it AOTKIT_ACTIVATION_MEMORY_BUDGET)."""
    with aotkit.config.patch(activation_memory_budget=0.0):
        assert cli.main(["graphs", "--model", "mlp", "--partition", "min_cut"]) == 0
    assert "aten.addmm.default" in capsys.readouterr().out.split("recomputed", 1)[1]


def test_graphs_inference_is_the_eval_mode_graph(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["graphs", "--model", "transformer", "--inference", "--code"]) == 0
    out = capsys.readouterr().out
    assert "aotkit graphs: transformer (inference)" in out
    assert "dropout" not in out and "bernoulli" not in out


@pytest.mark.parametrize(("args", "message"), [
    (["graphs", "--partition", "min_cut", "--budget", "7"], "not in [0, 1]"),
    (["graphs", "--partition", "min_cut", "--budget", "abc"], "invalid budget value: 'abc'"),
    (["graphs", "--budget", "0.5"], "--budget applies to --partition min_cut"),
    (["graphs", "--inference", "--partition", "min_cut"], "it takes no --partition"),
    (["graphs", "--inference", "--budget", "0.5"], "it takes no --partition or --budget"),
    (["graphs", "--compiled-autograd", "--budget", "0.3"], "--partition or --budget"),
    (["graphs", "--draw", ""], "--draw needs a folder"),
    (["demo", "--seed", str(2**64)], "--seed must lie in [0, 2**63)"),
])
def test_bad_arguments_are_usage_errors(args: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith(f"usage: aotkit {args[0]} "), err  # the subcommand's usage


def test_no_command_names_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "the following arguments are required: {demo,graphs}" in capsys.readouterr().err


def test_graphs_compiled_autograd_prints_the_whole_backward(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["graphs", "--model", "mlp", "--compiled-autograd", "--code",
                     "--draw", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "aotkit graphs: mlp (whole backward under aotkit.compiled_autograd)" in out
    # 4 Linear layers: 8 parameters accumulated, 7 matmuls (no gradient for the input).
    summary = re.search(r"compiled_backward: \d+ nodes \(\d+ ops, (\d+) inputs, 0 outputs\); "
                        r"most used: call_accumulate_grad x8, .*aten.mm.default x7", out)
    assert summary, out
    assert "# ---- compiled_backward graph ----" in out
    assert "aten.gelu_backward.default" in out.split("# ---- compiled_backward graph ----")[1]
    assert (tmp_path / "compiled_backward.svg").exists()
    assert aotkit.counters.counters["compiled_autograd"]["captures"] == 1


@pytest.mark.parametrize("extra", [["--inference"], ["--partition", "min_cut"]])
def test_graphs_compiled_autograd_refuses_forward_options(
        extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["graphs", "--compiled-autograd", *extra])
    assert info.value.code == 2
    assert "--compiled-autograd captures the backward alone" in capsys.readouterr().err


def test_capture_backward_graph_is_the_graph_the_backward_ran() -> None:
    """The recorded graph is what computed the step's gradients: replaying it on another batch
    gives eager's gradients."""
    from aotkit.demo import capture_backward_graph
    from aotkit.models import MLP, make_mlp_batch

    (graph,) = capture_backward_graph("mlp")
    assert graph.op_counts["aten.gelu_backward.default"] == 3
    model, eager = MLP.from_seed(0), MLP.from_seed(0)
    x, _ = make_mlp_batch(seed=1)
    with aotkit.compiled_autograd.enable(lambda gm: graph.gm):
        model(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_capture_graphs_match_the_model() -> None:
    forward, backward = capture_graphs("mlp")
    assert (forward.kind, backward.kind) == ("forward", "backward")
    assert forward.op_counts["aten.addmm.default"] == 4
    assert forward.op_counts["aten.gelu.default"] == 3
    assert backward.op_counts["aten.gelu_backward.default"] == 3
    (inference,) = capture_graphs("mlp", training=False)
    assert inference.kind == "inference"
    assert inference.op_counts["aten.addmm.default"] == 4
    assert aotkit.counters.counters["aot"]["inference_compiles"] == 1


@pytest.mark.parametrize("under", ["", "sub"])
def test_graphs_draw_into_a_file_is_a_clear_error(under: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    assert cli.main(["graphs", "--model", "mlp", "--draw", str(a_file / under)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aotkit graphs: error: draw_graph cannot write "), err
    assert "Fix:" in err and "Traceback" not in err


def test_graphs_draw_in_a_subprocess_exits_1_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    proc = run_command(sys.executable, "-m", "aotkit", "graphs", "--model", "mlp",
                       "--draw", str(tmp_path / "a_file"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "draw_graph cannot write" in proc.stderr


def test_graphs_without_graphviz_say_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-graphviz-here"))
    assert cli.main(["graphs", "--model", "mlp", "--draw", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    said = captured.out + captured.err + caplog.text
    assert said.count("not on PATH") == 1, said
    assert "apt-get install graphviz" in captured.out
    for kind in ("forward", "backward"):
        assert f"drew the {kind} graph: {tmp_path / 'out' / (kind + '.dot')}" in captured.out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["backward.dot", "forward.dot"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_report_that_cannot_be_written_is_one_line_without_a_traceback() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "aotkit", "graphs", "--model", "mlp"],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "could not write the report" in proc.stderr


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    """``aotkit graphs --code | head -1`` ended in a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "aotkit", "graphs", "--model", "mlp", "--code"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes anything
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
