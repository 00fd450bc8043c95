"""graph_dumper_aot, get_inputs and debug_compile: what they write reloads without unpickling,
the saved graphs run like the in-memory ones, and the repro scripts run in a fresh process."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from tests.aot.eager_check import RecordingCompiler
from tests.compilers.compiler_check import MLP_CFG, check_model

import aotkit
from aotkit.compat import FakeTensorMode
from aotkit.compilers import debug_compile, get_inputs, graph_dumper_aot
from aotkit.compilers.dump import load_graph, restore_rng_state, write_tensors
from aotkit.errors import ArgumentError, UnsupportedError
from aotkit.models import MLP, make_mlp_batch


def saved_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def train_step(model: torch.nn.Module, run: Any, batch: int) -> dict[str, torch.Tensor]:
    """Loss and every parameter gradient of one step of ``run`` (``model`` or a compiled one)."""
    x, target = make_mlp_batch(0, MLP_CFG, batch=batch)
    loss = torch.nn.functional.mse_loss(run(x), target)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def test_dumper_trains_like_eager_and_saves_every_graph_of_every_entry(tmp_path: Path) -> None:
    eager, model = MLP.from_seed(0, MLP_CFG), MLP.from_seed(0, MLP_CFG)
    dumper = graph_dumper_aot("mlp", tmp_path)
    compiled = dumper(model)
    for batch in (4, 3):  # a new batch size is a new compiled entry: N = 1
        want, got = train_step(eager, eager, batch), train_step(model, compiled, batch)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    names = [f"mlp_{kind}_{n}" for n in (0, 1) for kind in ("joint", "forward", "backward")]
    assert [p.name for p in dumper.saved] == names
    assert saved_files(tmp_path) == ["mlp"]
    assert saved_files(tmp_path / "mlp") == sorted(names)
    for name in names:
        assert saved_files(tmp_path / "mlp" / name) == sorted(["module.py", f"{name}.input"])

    described = json.loads((tmp_path / "mlp" / "mlp_forward_1" / "mlp_forward_1.input").read_text())
    assert described["format"] == "aotkit.inputs/1" and described["graph"] == "mlp_forward_1"
    weight, *_, x = described["inputs"]
    assert weight == {"kind": "tensor", "dtype": "float32", "shape": [16, 16], "stride": [16, 1],
                      "storage_offset": 0, "device": "cpu", "requires_grad": False}
    assert x["shape"] == [3, 16]


def test_each_backward_of_one_entry_is_saved_apart(tmp_path: Path) -> None:
    """A backward for a call bringing one gradient overwrote the full backward's folder."""
    dumper = graph_dumper_aot("two", tmp_path)
    compiled = dumper(lambda x, w: ((x @ w).sin(), (x @ w).cos()))
    x = torch.randn(3, 4)
    for used in ((0, 1), (0,), (1,)):
        outs = compiled(x, torch.randn(4, 4, requires_grad=True))
        sum(outs[i].sum() for i in used).backward()
    backwards = [p for p in dumper.saved if "_backward_" in p.name]
    assert len(backwards) == len(set(backwards)) == 3
    assert backwards[0].name == "two_backward_0"
    codes = {(p / "module.py").read_text().count("tangents_") for p in backwards}
    assert len(codes) > 1  # the variants' graphs differ from the full backward's


def test_saved_graphs_reload_and_compute_what_the_in_memory_graphs_compute(tmp_path: Path) -> None:
    x = make_mlp_batch(0, MLP_CFG)[0]
    dumper = graph_dumper_aot("mlp", tmp_path)
    dumper(MLP.from_seed(0, MLP_CFG))(x).sum().backward()

    recorder, joints = RecordingCompiler(), []

    def keep_joint(gm: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        joints.append(gm)
        return aotkit.default_partition(gm, inputs, **kwargs)

    aotkit.aot_module(MLP.from_seed(0, MLP_CFG), recorder, partition_fn=keep_joint)(x).sum().backward()
    in_memory = {"joint": joints[0], "forward": recorder.graphs[0], "backward": recorder.graphs[1]}
    for kind, gm in in_memory.items():
        folder = tmp_path / "mlp" / f"mlp_{kind}_0"
        inputs = get_inputs(folder / f"mlp_{kind}_0.input")
        assert [tuple(t.shape) for t in inputs] == [tuple(v.shape) for v in recorder_inputs(gm)]
        saved = load_graph(folder)(*inputs)
        expected = gm(*inputs)
        assert len(saved) == len(expected) > 1
        for s, e in zip(saved, expected, strict=True):
            assert (s is None and e is None) or torch.equal(s, e)


def test_graphs_with_higher_order_ops_save_their_branches(tmp_path: Path) -> None:
    scale = torch.full((4,), 3.0)  # a constant read inside a branch

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda a: (a * scale).sin(), lambda a: a.cos(), (x,))

    dumper = graph_dumper_aot("cond", tmp_path, dump_example_input=True)
    compiled = dumper(fn)
    for sign in (1, -1):  # both branches
        x = (torch.randn(4).abs() * sign).requires_grad_()
        expected_x = x.detach().clone().requires_grad_()
        out, expected = compiled(x), fn(expected_x)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, expected_x.grad)
    for folder in dumper.saved:  # one entry: each graph reloads and runs as saved
        inputs = get_inputs(folder)
        assert "class FxModule_true_graph_" in (folder / "module.py").read_text()
        assert all(isinstance(t, torch.Tensor) for t in load_graph(folder)(*inputs))


def recorder_inputs(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]


def test_dump_example_input_saves_the_first_call_without_pickle(tmp_path: Path) -> None:
    model = MLP.from_seed(0, MLP_CFG)
    x = torch.randn(16, 4).t()  # column-major: its layout must come back too
    dumper = graph_dumper_aot("mlp", tmp_path, dump_example_input=True)
    dumper(model)(x).sum().backward()
    forward = tmp_path / "mlp" / "mlp_forward_0"
    assert saved_files(forward) == ["mlp_forward_0.input", "mlp_forward_0.tensors", "module.py"]
    raw = (forward / "mlp_forward_0.tensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["format"] == "aotkit.tensors/1" and header["tensors"]["6"]["stride"] == [1, 4]

    inputs = get_inputs(forward / "mlp_forward_0.input")
    for got, want in zip(inputs, [*model.parameters(), x], strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()
    assert (tmp_path / "mlp" / "mlp_backward_0" / "mlp_backward_0.tensors").exists()
    joint = tmp_path / "mlp" / "mlp_joint_0"
    assert "never run" in json.loads((joint / "mlp_joint_0.input").read_text())["values"]
    assert not (joint / "mlp_joint_0.tensors").exists()


def test_get_inputs_rebuilds_layouts_dtypes_and_constants(tmp_path: Path) -> None:
    def f(x: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (x[index] * mask + torch.tensor([1.0, 2.0, 3.0])).sum(0)

    base = torch.randn(5, 6)
    args = (base[1:, ::2], torch.tensor([0, 2]), torch.tensor([True, False, True]))
    dumper = graph_dumper_aot("f", tmp_path)
    with torch.no_grad():
        want = dumper(f)(*args)
    folder = tmp_path / "f" / "f_inference_0"
    assert saved_files(folder) == ["constants.tensors", "f_inference_0.input", "module.py"]
    x, index, mask = get_inputs(folder / "f_inference_0.input")
    assert (x.shape, x.stride(), x.storage_offset()) == ((4, 3), (6, 2), 6)
    assert x.dtype == torch.float32 and not torch.equal(x, args[0])  # random values
    assert index.dtype == torch.int64 and not index.any()  # zeros: valid indices
    assert mask.dtype == torch.bool and mask.shape == (3,)
    [out] = load_graph(folder)(*args)
    torch.testing.assert_close(out, want)


def test_dumper_as_a_dynamic_torch_compile_backend_records_symbolic_sizes(tmp_path: Path) -> None:
    dumper = graph_dumper_aot("g", tmp_path)
    f = torch.compile(lambda x: x.sin() * x.shape[0], backend=dumper, dynamic=True)
    x = torch.randn(5, 2)
    with torch.no_grad():
        torch.testing.assert_close(f(x), x.sin() * 5)
    folder = tmp_path / "g" / "g_inference_0"
    rows, cols, tensor = json.loads((folder / "g_inference_0.input").read_text())["inputs"]
    assert rows["kind"] == "int" and rows["value"] == 5 and rows["traced"].startswith("s")
    assert tensor["shape"] == [5, 2] and tensor["traced_shape"] == [rows["traced"], cols["traced"]]
    n, m, x = get_inputs(folder / "g_inference_0.input")
    assert (n, m, x.shape) == (5, 2, (5, 2))
    [out] = load_graph(folder)(n, m, x)
    torch.testing.assert_close(out, x.sin() * 5)


@pytest.mark.parametrize("device", ["gpu", "meta:x"])
def test_get_inputs_names_a_device_it_cannot_use(tmp_path: Path, device: str) -> None:
    """A bad device was blamed on the .input file ("describes its inputs in a way aotkit cannot
    read ... save the graph again")."""
    dumper = graph_dumper_aot("f", tmp_path)
    with torch.no_grad():
        dumper(torch.sin)(torch.zeros(2))
    with pytest.raises(ArgumentError, match=rf"cannot make tensors on device '{device}'"):
        get_inputs(tmp_path / "f" / "f_inference_0" / "f_inference_0.input", device=device)


def test_get_inputs_refuses_files_it_did_not_write(tmp_path: Path) -> None:
    pickled = tmp_path / "pickled.input"
    pickled.write_bytes(b"\x80\x04\x95" + bytes(20))
    unknown = tmp_path / "unknown.input"
    unknown.write_text(json.dumps({"format": "aotkit.inputs/1", "inputs": [
        {"kind": "unsupported", "type": "Generator"}]}))
    with pytest.raises(UnsupportedError, match="is not an aotkit input description"):
        get_inputs(pickled)
    with pytest.raises(UnsupportedError, match="input 0 is a Generator"):
        get_inputs(unknown)
    for name, inputs in (("no_dtype", [{"kind": "tensor", "shape": [2]}]), ("none", None)):
        edited = tmp_path / f"{name}.input"  # edited by hand: raw KeyErrors came through
        edited.write_text(json.dumps({"format": "aotkit.inputs/1", "inputs": inputs}
                                     if inputs is not None else {"format": "aotkit.inputs/1"}))
        with pytest.raises(UnsupportedError, match="in a way aotkit cannot read"):
            get_inputs(edited)


# --- debug_compile -----------------------------------------------------------------------------


def run_repro(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(folder / "repro.py")], capture_output=True,
                          text=True, cwd=folder.parent, env={**os.environ, **env}, timeout=120)


def test_debug_compile_trains_like_eager_and_writes_repros_that_run(tmp_path: Path) -> None:
    check_model("mlp", functools.partial(debug_compile, folder=tmp_path, dump_example_input=True))
    assert saved_files(tmp_path) == ["graph_0", "graph_1"]  # forward, backward
    assert saved_files(tmp_path / "graph_0") == ["graph.input", "graph.tensors", "module.py",
                                                 "repro.py"]
    done = run_repro(tmp_path / "graph_0")
    assert done.returncode == 0, done.stderr
    outputs = [line for line in done.stdout.splitlines() if line.startswith("repro: output")]
    assert outputs[0] == "repro: output 0: float32[4, 16] on cpu"
    assert done.stdout.splitlines()[-1] == f"repro: ok ({len(outputs)} output(s))"


def test_debug_compile_writes_under_config_debug_dir_and_says_where(tmp_path: Path,
                                                                    caplog: Any) -> None:
    with aotkit.config.patch(debug_dir=str(tmp_path / "debug")), \
            caplog.at_level(logging.INFO, logger="aotkit.compilers"):
        f = aotkit.aot_function(lambda x: x.cos(), debug_compile)
        torch.testing.assert_close(f(torch.ones(2)), torch.ones(2).cos())
    assert saved_files(tmp_path / "debug") == ["graph_0"]
    [message] = [r.getMessage() for r in caplog.records if r.name == "aotkit.compilers"]
    assert str(tmp_path / "debug" / "graph_0" / "repro.py") in message


def repro_module(folder: Path) -> Any:
    """The repro script as a module of this process (a subprocess per case would cost
    seconds)."""
    spec = importlib.util.spec_from_file_location("repro", folder / "repro.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def repro_main(folder: Path) -> Any:
    return repro_module(folder).main


def test_debug_compile_repro_draws_the_first_calls_random_numbers(tmp_path: Path) -> None:
    """With the first call's values saved, the repro also restores the generator's state then,
    so a graph with dropout computes the same outputs (its random numbers were others)."""
    compiled = aotkit.aot_function(
        lambda x: torch.nn.functional.dropout(x, 0.5) * 3,
        functools.partial(debug_compile, folder=tmp_path, dump_example_input=True))
    expected = compiled(torch.ones(64))
    repro = repro_module(tmp_path / "graph_0")
    ran: list[Any] = []
    repro.load_graph = lambda *a: (lambda *inputs: ran.append(load_graph(*a)(*inputs)) or ran[0])
    torch.manual_seed(123)  # the repro seeds again; its draw must not depend on this
    assert repro.main() == 0
    [[out]] = ran
    assert torch.equal(out, expected)


def test_debug_compile_repro_of_a_cuda_graph_needs_cuda_or_says_so(
        tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    with FakeTensorMode():
        fake = torch.empty(3, 4, device="cuda")
    debug_compile(fx.symbolic_trace(lambda x: x * 2), [fake], folder=tmp_path)
    described = json.loads((tmp_path / "graph_0" / "graph.input").read_text())
    assert described["inputs"][0]["device"] == "cuda:0"
    main = repro_main(tmp_path / "graph_0")
    monkeypatch.delenv("AOTKIT_REPRO_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main() == 2
    refused = capsys.readouterr().err
    assert "cuda:0, but CUDA is not available" in refused and "AOTKIT_REPRO_DEVICE=cpu" in refused
    monkeypatch.setenv("AOTKIT_REPRO_DEVICE", "cpu")
    assert main() == 0
    assert "repro: output 0: float32[3, 4] on cpu" in capsys.readouterr().out


@torch.library.custom_op("aotkit_dump_test::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_triple.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_debug_compile_repro_of_a_custom_op_imports_its_module_or_says_which(
        tmp_path: Path, capsys: Any) -> None:
    """The repro failed with "'_OpNamespace' object has no attribute" for a custom op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    debug_compile(make_fx(lambda x: _triple(x) + 1)(torch.ones(3)), [torch.ones(3)],
                  folder=tmp_path)
    repro = (tmp_path / "graph_0" / "repro.py").read_text()
    assert repr({"aotkit_dump_test::triple": __name__}) in repro
    assert repro_main(tmp_path / "graph_0")() == 0  # registered in this process
    elsewhere = run_repro(tmp_path / "graph_0")  # a process that cannot import tests.*
    assert elsewhere.returncode == 2
    assert f"importing {__name__}, which registers aotkit_dump_test::triple" in elsewhere.stderr
    root = Path(__file__).resolve().parents[__name__.count(".")]  # the folder holding tests/
    assert f"run the repro with PYTHONPATH={root} " in elsewhere.stderr


def test_a_new_dump_replaces_stale_values_and_get_inputs_takes_the_folder(tmp_path: Path) -> None:
    first = graph_dumper_aot("g", tmp_path, dump_example_input=True)
    first(lambda x: x.sin())(torch.randn(2, 2))
    second = graph_dumper_aot("g", tmp_path)
    second(lambda x: x.cos() @ x)(torch.randn(5, 5))
    [x] = get_inputs(second.saved[0])  # the folder holds one .input file
    assert x.shape == (5, 5)
    assert not list(second.saved[0].glob("*.tensors"))


def test_get_inputs_refuses_mismatched_values_and_missing_files(tmp_path: Path) -> None:
    dumper = graph_dumper_aot("g", tmp_path, dump_example_input=True)
    dumper(lambda x: x.sin())(torch.randn(2, 2))
    folder = dumper.saved[0]
    write_tensors(folder / "g_inference_0.tensors", {"0": torch.zeros(3)})
    with pytest.raises(UnsupportedError, match="from another dump"):
        get_inputs(folder / "g_inference_0.input")
    with pytest.raises(ArgumentError, match="does not exist"):
        get_inputs(tmp_path / "nothing.input")


def test_an_unwritable_folder_is_named_with_a_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    dumper = graph_dumper_aot("f", blocker / "graphs")  # a folder inside a file
    f = dumper(lambda x: x.sin())
    with pytest.raises(aotkit.errors.CompilerError, match=r"could not write the (.|\n)*"
                                                          r"Fix: give it a folder you can write"):
        f(torch.randn(3))
    # with grad its partitioner writes first: the failure blamed the partitioner's signature
    with pytest.raises(aotkit.errors.CompilerError, match=r"could not write the joint graph"
                                                          r"(.|\n)*Fix: give it a folder"):
        f(torch.randn(3, requires_grad=True))


def test_two_dumpers_of_one_name_write_apart_and_loaders_say_what_is_missing(
        tmp_path: Path) -> None:
    """Two dumpers named alike overwrote each other's folders (the first one's ``saved`` then
    loaded the other's graph); load_graph of a folder without a graph raised a raw
    FileNotFoundError, and restore_rng_state's error named get_inputs."""
    first = graph_dumper_aot("model", tmp_path, dump_example_input=True)
    second = graph_dumper_aot("model", tmp_path, dump_example_input=True)
    first(torch.sin)(torch.zeros(2, requires_grad=True)).sum().backward()
    second(lambda t: t.cos() * 3)(torch.zeros(5, requires_grad=True)).sum().backward()
    assert not set(first.saved) & set(second.saved)
    forward = first.saved[1]
    (out,) = load_graph(forward)(*get_inputs(forward))[:1]
    assert out.shape == (2,)
    with pytest.raises(ArgumentError, match=r"load_graph: .* holds no saved graph"):
        load_graph(tmp_path)
    with pytest.raises(ArgumentError, match=r"^restore_rng_state: .* does not exist"):
        restore_rng_state(tmp_path / "missing.input")
