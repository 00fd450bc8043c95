"""Hugging Face ``transformers`` models, as users train and run them: tiny randomly initialised
configurations of three architectures (GPT-2: learned positions and dropout; Llama: rotary
embeddings, grouped-query attention, SDPA; T5: encoder-decoder with relative position bias)
give eager's losses and gradients step by step under ``torch.compile(backend="aotkit")`` and
under ``aotkit.compiled_autograd``, and greedy generation (a key/value cache the compiled
forward updates in place) gives eager's tokens and logits."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tests.test_models import assert_same_training
from torch import nn

import aotkit
from aotkit import compiled_autograd

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 64
STEPS = 2


def tiny_model(name: str) -> nn.Module:
    """A two-layer model of architecture ``name`` with width 32, seeded."""
    torch.manual_seed(0)
    t = transformers
    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
                              "pad_token_id": 0}
    if name == "gpt2":
        config = t.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, **common)
        return t.GPT2LMHeadModel(config)
    if name == "llama":
        config = t.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64,
                               max_position_embeddings=32, **common)
        return t.LlamaForCausalLM(config)
    if name == "t5":
        config = t.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                            decoder_start_token_id=0, **common)
        return t.T5ForConditionalGeneration(config)
    raise ValueError(name)


def batch(name: str, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, VOCAB, (2, 10), generator=gen)
    labels = torch.randint(3, VOCAB, (2, 6), generator=gen) if name == "t5" else ids
    return {"input_ids": ids, "labels": labels}


Trace = tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]


def train(model: nn.Module, name: str, forward: Callable[..., Any],
          backward: Callable[[torch.Tensor], None]) -> Trace:
    """``STEPS`` SGD steps in train mode (dropout on, same seed per step); losses and grads."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        loss = forward(**batch(name, step)).loss
        backward(loss)
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def eager_backward(loss: torch.Tensor) -> None:
    loss.backward()


@pytest.fixture(scope="module", params=["gpt2", "llama", "t5"])
def reference(request: pytest.FixtureRequest) -> tuple[str, nn.Module, Trace]:
    name = request.param
    model = tiny_model(name)
    eager = copy.deepcopy(model)
    return name, model, train(eager, name, eager, eager_backward)


def test_torch_compile_trains_like_eager(reference: tuple[str, nn.Module, Trace]) -> None:
    name, model, want = reference
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    aotkit.counters.reset()
    got = train(model, name, torch.compile(model, backend="aotkit"), eager_backward)
    assert_same_training(eager=want, compiled=got)
    assert aotkit.counters.counters["aot"]["traces"] >= 1  # the model ran through aotkit


def test_compiled_autograd_trains_like_eager(reference: tuple[str, nn.Module, Trace]) -> None:
    name, model, want = reference
    model = copy.deepcopy(model)
    compiled_autograd.reset()
    aotkit.counters.reset()

    def backward(loss: torch.Tensor) -> None:
        with compiled_autograd.enable(compiled_autograd.nop):
            loss.backward()

    got = train(model, name, model, backward)
    assert_same_training(eager=want, compiled=got)
    # Both steps have one autograd-graph structure: captured once, replayed once.
    assert aotkit.counters.counters["compiled_autograd"]["captures"] == 1
    assert not aotkit.explain().of_kind("fallback")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_compiled_generation_matches_eager(cache: str) -> None:
    """Greedy decoding with the forward compiled: the prompt's forward, then one token at a
    time, each call updating the key/value cache in place (a static cache's tensors are
    buffers the graph mutates)."""
    model = tiny_model("llama").eval()
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    kwargs: dict[str, Any] = {"max_new_tokens": 5, "do_sample": False, "output_logits": True,
                              "return_dict_in_generate": True}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    want = model.generate(prompt, **kwargs)
    compiled = copy.deepcopy(model)
    torch._dynamo.reset()
    aotkit.counters.reset()
    compiled.forward = torch.compile(compiled.forward, backend="aotkit")
    got = compiled.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits))
    assert aotkit.counters.counters["aot"]["inference_compiles"] >= 1


def test_a_cache_argument_is_keyed_by_its_contents_and_put_back_when_refused() -> None:
    """transformers' cache layers derive from abc.ABC, whose empty __slots__ made them look
    slotted: keyed by identity, a grown cache reused the stale graph, and a refused update left
    the trace's tensors in the caller's cache."""
    cache = transformers.DynamicCache()
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)

    def attend(q: torch.Tensor, cache: Any) -> torch.Tensor:
        return (q @ cache.layers[0].keys.transpose(-1, -2)).softmax(-1)

    compiled, q = aotkit.aot_function(attend, aotkit.compilers.nop), torch.ones(1, 1, 1, 4)
    compiled(q, cache)
    cache.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 0)  # a decode step
    torch.testing.assert_close(compiled(q, cache), attend(q, cache), rtol=0, atol=0)

    def update(x: torch.Tensor, cache: Any) -> torch.Tensor:
        return cache.update(x, x, 0)[0].sum()

    keys = cache.layers[0].keys
    with pytest.raises(aotkit.errors.UnsupportedError):
        aotkit.aot_function(update, aotkit.compilers.nop)(torch.ones(1, 1, 1, 4), cache)
    assert cache.layers[0].keys is keys


def test_a_returned_kv_cache_names_use_cache_false() -> None:
    """The refusal of a returned DynamicCache only suggested registering a pytree."""
    gpt2 = tiny_model("gpt2").eval()  # no dropout: outputs comparable
    gpt2.set_attn_implementation("eager")  # SDPA's mask check reads data: refused at the trace
    model = aotkit.aot_module(gpt2, aotkit.compilers.nop)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(aotkit.errors.OutputTypeError, match=r"DynamicCache(.|\n)*use_cache=False"):
        model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
    out = model(ids, attention_mask=torch.ones_like(ids), use_cache=False)  # the fix it names
    torch.testing.assert_close(out.logits, model.orig_module(ids, use_cache=False).logits)
