"""AOT autograd and compiled autograd semantics that depend on CUDA itself, run where a GPU is
lent (skipped cleanly elsewhere): the CUDA RNG (dropout, ``rand_like``, flash attention's
dropout), autocast, CPU scalars and cross-device copies inside a graph, side streams, saved
tensors offloaded to pinned memory, cuDNN convolutions in channels-last, and CUDA graphs of a
compiled backward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import aotkit
from aotkit.models import TinyTransformer, make_token_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

nop = aotkit.compilers.nop


def _pair() -> tuple[nn.Module, nn.Module]:
    """Two identical CUDA MLPs (one for eager, one to compile)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.25),
                             nn.Linear(64, 8)).cuda()
    return build(), build()


def _assert_grads_equal(model: nn.Module, reference: nn.Module, **tol: float) -> None:
    pairs = zip(model.named_parameters(), reference.parameters(), strict=True)
    for (name, p), q in pairs:
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}", **tol)


def test_rng_ops_draw_eagers_numbers_across_calls() -> None:
    """Dropout, ``rand_like`` and ``randn`` in a compiled graph consume the CUDA generator as
    eager does: the same seed gives the same values, and so does the next call."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5) * torch.rand_like(x) + torch.randn(x.shape, device=x.device)

    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    compiled = aotkit.aot_function(f, nop)
    results = []
    for fn in (f, compiled):
        torch.manual_seed(0)
        first, second = fn(x), fn(x)
        (x_grad,) = torch.autograd.grad((first + second).sum(), x)
        results.append((first, second, x_grad))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    assert not torch.equal(results[0][0], results[0][1])  # the calls drew new numbers


@pytest.mark.parametrize("wrap, dtype", [("aot_module", torch.bfloat16),
                                         ("torch.compile", torch.float16)])
def test_autocast_training_matches_eager(wrap: str, dtype: torch.dtype) -> None:
    eager, model = _pair()
    compiled = aotkit.aot_module(model, nop) if wrap == "aot_module" else \
        torch.compile(model, backend="aotkit")
    x = torch.randn(16, 32, device="cuda")
    outs = []
    for run in (eager, compiled):
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=dtype):
            out = run(x)
        out.float().square().sum().backward()
        outs.append(out)
    assert outs[1].dtype == outs[0].dtype == dtype
    torch.testing.assert_close(outs[1], outs[0])
    _assert_grads_equal(model, eager)
    # Leaving autocast is a new signature, not the low-precision graph run again.
    torch.manual_seed(1)
    plain = compiled(x)
    torch.manual_seed(1)
    expected = eager(x)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, expected)


def test_cpu_scalar_tensor_times_cuda_input() -> None:
    """A 0-dim CPU tensor may meet a CUDA tensor in eager; its gradient stays on the CPU."""
    def f(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (x * s).sin() + s

    x = torch.randn(8, device="cuda", requires_grad=True)
    s = torch.tensor(1.5, requires_grad=True)
    expected = f(x, s)
    expected_grads = torch.autograd.grad(expected.sum(), (x, s))
    out = aotkit.aot_function(f, nop)(x, s)
    grads = torch.autograd.grad(out.sum(), (x, s))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, expected_grads)
    assert grads[1].device.type == "cpu" and grads[0].device.type == "cuda"


def test_copies_between_devices_inside_a_graph() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.cpu() * 2, y.to("cuda", non_blocking=True).sin() + x.sum()

    x = torch.randn(4, device="cuda", requires_grad=True)
    y = torch.randn(4, requires_grad=True).pin_memory().detach().requires_grad_()
    expected = f(x, y)
    expected_grads = torch.autograd.grad(sum(o.sum().cpu() for o in expected), (x, y))
    out = aotkit.aot_function(f, nop)(x, y)
    grads = torch.autograd.grad(sum(o.sum().cpu() for o in out), (x, y))
    assert [o.device.type for o in out] == ["cpu", "cuda"]
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, expected_grads)
    assert [g.device.type for g in grads] == ["cuda", "cpu"]


def test_input_mutation_and_view_outputs_on_cuda() -> None:
    def f(buf: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buf.add_(1)
        return (w * buf).sum(), buf.view(2, 4)

    w = torch.randn(8, device="cuda", requires_grad=True)
    buf = torch.randn(8, device="cuda")
    ref_buf = buf.clone()
    expected_loss, expected_view = f(ref_buf, w)
    (expected_grad,) = torch.autograd.grad(expected_loss, w)
    loss, view = aotkit.aot_function(f, nop)(buf, w)
    (grad,) = torch.autograd.grad(loss, w)
    torch.testing.assert_close(buf, ref_buf)  # the caller's tensor was written
    torch.testing.assert_close((loss, view, grad), (expected_loss, expected_view, expected_grad))
    view.mul_(0)  # a real view of the caller's tensor
    assert torch.count_nonzero(buf) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scaled_dot_product_attention_training_matches_eager(dtype: torch.dtype) -> None:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    expected = f(q, k, v)
    expected_grads = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
    out = aotkit.aot_function(f, nop)(q, k, v)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, expected_grads)


def test_attention_dropout_draws_eagers_mask() -> None:
    """Flash/efficient attention with dropout takes its Philox seed and offset from the CUDA
    generator at the point eager would."""
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    results = []
    for fn in (f, aotkit.aot_function(f, nop)):
        torch.manual_seed(3)
        out = fn(q, k, v)
        results.append((out, torch.autograd.grad(out.float().sum(), (q, k, v))))
    torch.testing.assert_close(results[1], results[0])


def test_tiny_transformer_trains_as_eager_with_torch_compile() -> None:
    eager = TinyTransformer.from_seed(0).cuda()
    model = TinyTransformer.from_seed(0).cuda()
    compiled = torch.compile(model, backend="aotkit")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    for step in range(3):
        tokens, targets = (t.cuda() for t in make_token_batch(seed=step))
        losses = []
        for run, opt in zip((eager, compiled), opts, strict=True):
            torch.manual_seed(step)
            out = run(tokens)
            loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
        _assert_grads_equal(model, eager, rtol=1e-4, atol=1e-5)
        for opt in opts:
            opt.step()


def test_aotkit_inductor_dynamic_batch_on_cuda() -> None:
    eager, model = _pair()
    eager.eval(), model.eval()
    compiled = torch.compile(model, backend="aotkit_inductor", dynamic=True)
    for batch in (8, 12, 20):
        x = torch.randn(batch, 32, device="cuda")
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        expected = eager(x)
        expected.square().sum().backward()
        out = compiled(x)
        out.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        _assert_grads_equal(model, eager, rtol=1e-4, atol=1e-4)
    # One dynamic graph for all batches; the eval-mode dropout's p is a float read nothing uses,
    # not a reason to trace again (Note [Float arguments from Dynamo]).
    assert aotkit.counters.counters["aot"]["traces"] == 1
    assert not aotkit.counters.explain().of_kind("specialize")


def test_side_stream_matches_eager() -> None:
    eager, model = _pair()
    compiled = aotkit.aot_module(model, nop)
    x = torch.randn(16, 32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    outs = []
    with torch.cuda.stream(stream):
        for run in (eager, compiled):
            torch.manual_seed(1)
            out = run(x)
            out.square().sum().backward()
            outs.append(out)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(outs[1], outs[0])
    _assert_grads_equal(model, eager)


def test_saved_tensors_offloaded_to_pinned_cpu_memory() -> None:
    eager, model = _pair()
    compiled = aotkit.aot_module(model, nop)
    x = torch.randn(16, 32, device="cuda")
    outs = []
    for run in (eager, compiled):
        torch.manual_seed(1)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            out = run(x)
        out.square().sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0])
    _assert_grads_equal(model, eager)


def test_channels_last_conv_batchnorm_training() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 8, 3, stride=2)).cuda().to(memory_format=torch.channels_last)

    eager, model = build(), build()
    compiled = aotkit.aot_module(model, nop)
    x = torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    expected, out = eager(x), compiled(x)
    expected.square().sum().backward()
    out.square().sum().backward()
    torch.testing.assert_close(out, expected)
    assert out.is_contiguous(memory_format=torch.channels_last) == \
        expected.is_contiguous(memory_format=torch.channels_last)
    _assert_grads_equal(model, eager, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[1].running_mean, eager[1].running_mean)
    torch.testing.assert_close(model[1].running_var, eager[1].running_var)


def test_moving_between_cpu_and_cuda_retraces_with_a_reason() -> None:
    compiled = aotkit.aot_function(lambda x: x.sin() * 2, nop)
    for device in ("cpu", "cuda"):
        x = torch.randn(4, device=device)
        torch.testing.assert_close(compiled(x), x.sin() * 2)
    [why] = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert "device" in why, why


def test_compiled_autograd_with_inductor_on_cuda() -> None:
    eager, model = _pair()
    eager.eval(), model.eval()
    x = torch.randn(16, 32, device="cuda")

    def compiler(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)

    for _ in range(2):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        eager(x).square().sum().backward()
        with aotkit.compiled_autograd.enable(compiler):
            model(x).square().sum().backward()
        _assert_grads_equal(model, eager, rtol=1e-4, atol=1e-4)
    assert aotkit.counters.counters["compiled_autograd"]["captures"] == 1


def test_compiled_autograd_cuda_graph_takes_the_moved_cpu_scalar() -> None:
    """With ``compiled_autograd_cudagraphs``, the CPU scalar MulBackward saved moves to the GPU,
    so Inductor's CUDA graphs do not skip the backward for a CPU input."""
    from torch._dynamo.utils import counters as dynamo_counters

    eager, model = _pair()
    eager.eval(), model.eval()
    x = torch.randn(16, 32, device="cuda")
    scale = torch.tensor(0.5)

    def compiler(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend="inductor", mode="reduce-overhead", fullgraph=True)

    for _ in range(3):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        (eager(x) * scale).sum().backward()
        with aotkit.config.patch(compiled_autograd_cudagraphs=True), \
                aotkit.compiled_autograd.enable(compiler):
            (model(x) * scale).sum().backward()
        _assert_grads_equal(model, eager, rtol=1e-4, atol=1e-4)
    [decision] = aotkit.explain().of_kind("cuda_scalars")
    assert "moved inputs [" in decision.why and "moved inputs []" not in decision.why
    assert not dynamo_counters["inductor"].get("cudagraph_skips"), dict(dynamo_counters["inductor"])


def _backward_peak(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the backward allocates above what was live when it started."""
    loss = model(x).square().sum()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def test_backward_peak_memory_is_eagers() -> None:
    """Saved activations are freed as the backward graph uses them, as eager's engine frees
    each node's (Note [Freeing inputs as the graph goes])."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.GELU()))
                             ).cuda()

    x = torch.randn(512, 1024, device="cuda")
    eager, model = build(), build()
    compiled = aotkit.aot_module(model, nop)
    _backward_peak(compiled, x)  # compiles the backward
    model.zero_grad(set_to_none=True)
    eager_peak, peak = _backward_peak(eager, x), _backward_peak(compiled, x)
    _assert_grads_equal(model, eager)
    assert peak <= eager_peak * 1.1 + 2**20, (peak, eager_peak)
