"""Recomputation policies: with dropout on, loss and every gradient bit-identical to no
recomputation, on largebatch's GPT/BERT (both attention kinds) and on transformers' GPT-2/BERT."""

from __future__ import annotations

import copy
import inspect
import os
import pickle

import pytest
import torch

from largebatch.memory import apply_recompute, measure_forward_bytes, transformer_layers
from largebatch.models import BERT, GPT, ModelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

POLICIES = ["selective", "op", "full", ["full", "op", "selective", "none"]]


def _loss_and_grads(model, loss_fn):
    torch.manual_seed(1234)  # same dropout masks for every run
    loss = loss_fn(model)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_bit_identical(model, loss_fn, policies):
    ref_loss, ref_grads = _loss_and_grads(model, loss_fn)
    for policy in policies:
        apply_recompute(model, policy)
        loss, grads = _loss_and_grads(model, loss_fn)
        assert torch.equal(loss, ref_loss), policy
        for name, g in ref_grads.items():
            assert torch.equal(grads[name], g), (policy, name)
    apply_recompute(model, "none")


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_gradients_bit_identical_with_dropout(kind, attention):
    config = ModelConfig(kind=kind, n_layer=4, n_embd=32, n_head=4, seq_len=16, vocab_size=50,
                         dropout=0.2, attention=attention)
    model = (GPT if kind == "gpt" else BERT)(config).train()
    ids = torch.randint(0, 50, (2, 16))
    labels = ids.clone()
    labels[:, ::2] = -100
    _assert_bit_identical(model, lambda m: m(ids, labels)[1], POLICIES)


def test_dropout_is_really_on():
    # guards the test above: with dropout 0.2 two forward passes differ
    model = GPT(ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=50, dropout=0.2))
    ids = torch.randint(0, 50, (2, 16))
    assert not torch.equal(model(ids)[0], model(ids)[0])


def test_wrapping_keeps_names_copies_and_pickles():
    model = GPT(ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=50))
    names = list(model.state_dict())
    assert apply_recompute(model, ["full", "selective"]) == ["full", "selective"]
    assert list(model.state_dict()) == names and transformer_layers(model) is model.blocks
    ids = torch.randint(0, 50, (2, 16))
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(ids)[0], model(ids)[0])
    # the copy's wrapped forward runs the copy, not the original
    with torch.no_grad():
        clone.blocks[0].mlp.fc2.weight.add_(1.0)
    assert not torch.equal(clone(ids)[0], model(ids)[0])
    assert pickle.loads(pickle.dumps(model)) is not None
    apply_recompute(model, "none")
    assert "forward" not in model.blocks[0].__dict__ and "forward" not in model.blocks[1].attn.core.__dict__


def test_bad_policy_errors():
    model = GPT(ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=50))
    with pytest.raises(ValueError, match="'half'"):
        apply_recompute(model, "half")
    with pytest.raises(ValueError, match="1 entries but the model has 2 layers"):
        apply_recompute(model, ["full"])
    with pytest.raises(ValueError, match=r"'fast' \(layer 1\)"):
        apply_recompute(model, ["full", "fast"])
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        apply_recompute(torch.nn.Linear(2, 2), "full")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_transformers_layers_bit_identical(impl):
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 50, (2, 16))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=3, n_head=4, attn_pdrop=0.2,
        resid_pdrop=0.2, embd_pdrop=0.2, attn_implementation=impl)).train()
    # use_cache=False: a KV cache in training changes the un-recomputed graph (transformers' own
    # gradient checkpointing turns it off too)
    _assert_bit_identical(gpt2, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss,
                          ["selective", "op", "full", ["full", "selective", "none"]])
    assert gpt2.config._attn_implementation == impl  # "none" gave the original back
    held = {}
    for policy in ("none", "selective", "full"):  # and it really drops what it should
        apply_recompute(gpt2, policy)
        out, held[policy] = measure_forward_bytes(
            lambda: gpt2(input_ids=ids, labels=ids, use_cache=False).loss)
    assert held["full"].tensor_bytes < held["selective"].tensor_bytes < held["none"].tensor_bytes
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2, attn_implementation=impl)).train()
    _assert_bit_identical(bert, lambda m: m(input_ids=ids, labels=ids).loss,
                          ["selective", "op", "full"])


def _tiny_hf_models(transformers, impl):
    """Tiny GPT-2 and BERT with dropout on, and a loss function for each."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=3, n_head=4, attn_pdrop=0.2,
        resid_pdrop=0.2, embd_pdrop=0.2, attn_implementation=impl))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2, attn_implementation=impl))
    ids = torch.randint(0, 50, (2, 16))
    return [(gpt2, lambda m: m(input_ids=ids, labels=ids, use_cache=False)),
            (bert, lambda m: m(input_ids=ids, labels=ids))]


def _attributes(model):
    """Every module's attribute names and plain values, and every config's (sub-configs too)."""
    plain = (bool, int, float, str, type(None))
    modules = {name: (sorted(vars(m)), {k: v for k, v in vars(m).items() if isinstance(v, plain)})
               for name, m in model.named_modules()}
    configs = {name: (m.config.to_dict(), m.config._attn_implementation)
               for name, m in model.named_modules() if hasattr(m, "config")}
    return modules, configs


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_none_restores_transformers_models_exactly(impl):
    transformers = pytest.importorskip("transformers")
    for model, run in _tiny_hf_models(transformers, impl):
        before = _attributes(model)
        model.eval()
        reference_eval = run(model).logits
        model.train()
        ref_loss, ref_grads = _loss_and_grads(model, lambda m: run(m).loss)
        assert apply_recompute(model, "selective")[0] == "selective"
        assert model.config._attn_implementation == f"largebatch_selective_{impl}"
        apply_recompute(model, "none")
        assert _attributes(model) == before, type(model).__name__
        model.eval()
        assert torch.equal(run(model).logits, reference_eval)
        model.train()
        loss, grads = _loss_and_grads(model, lambda m: run(m).loss)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[name], g) for name, g in ref_grads.items())


def test_refuses_on_top_of_transformers_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    for model, _ in _tiny_hf_models(transformers, "eager"):
        enable = getattr(model, "activation_checkpointing_enable", None) or \
            model.gradient_checkpointing_enable
        enable()
        n = len(transformer_layers(model))
        for policy in ("selective", "full", "op", ["none"] * (n - 1) + ["selective"]):
            with pytest.raises(ValueError, match=r"gradient checkpointing on.*"
                               r"model\.(activation|gradient)_checkpointing_disable\(\) first"):
                apply_recompute(model, policy)
        assert model.config._attn_implementation == "eager"  # refused before changing anything
        assert apply_recompute(model, "none") == ["none"] * n  # nothing to undo: allowed
        disable = getattr(model, "activation_checkpointing_disable", None) or \
            model.gradient_checkpointing_disable  # (the new name from transformers 5.23)
        disable()
        assert apply_recompute(model, "selective") == ["selective"] * n
        apply_recompute(model, "none")


class _Layer(torch.nn.Module):
    def __init__(self, experts: int = 0):
        super().__init__()
        self.ff = torch.nn.Linear(8, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(experts)) if experts else None

    def forward(self, x):
        y = self.ff(x).relu()
        return x + (sum(e(y) for e in self.experts) if self.experts is not None else y)


class _Stack(torch.nn.Module):
    def __init__(self, **parts):
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part)


def test_the_layers_are_found_or_the_ambiguity_named():
    """The finder took the longest nn.ModuleList of one type anywhere: a mixture of experts'
    experts (8) over its 2 layers, one of an encoder's and a decoder's lists (the other silently
    left as it was), a list inside layers kept in an nn.Sequential. Lists inside a layer do not
    count now, and several candidate lists are refused in one line naming them."""
    moe = _Stack(layers=torch.nn.ModuleList(_Layer(experts=8) for _ in range(2)))
    assert transformer_layers(moe) is moe.layers and apply_recompute(moe, ["full", "none"]) == ["full", "none"]
    two = _Stack(encoder=torch.nn.ModuleList(_Layer() for _ in range(2)),
                 decoder=torch.nn.ModuleList(_Layer() for _ in range(3)))
    with pytest.raises(ValueError, match=r"several lists of layers \(encoder \(2 x _Layer\), decoder \(3 x _Layer\)\)"):
        apply_recompute(two, "full")
    sequential = _Stack(layers=torch.nn.Sequential(*(_Layer(experts=2) for _ in range(3))))
    with pytest.raises(ValueError, match=r"layers\.0\.experts \(2 x Linear\), layers\.1\.experts"):
        apply_recompute(sequential, "full")
    assert not any("forward" in m.__dict__ for m in list(two.modules()) + list(sequential.modules()))


def test_a_refused_policy_changes_nothing_and_none_is_named():
    """A per-layer list refused at its second layer ('selective' on a torch TransformerEncoder
    layer) had already wrapped the first; every layer is checked first now. policy=None was a bare
    TypeError."""
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with pytest.raises(ValueError, match="neither a largebatch Block nor a transformers layer"):
        apply_recompute(encoder, ["full", "selective"])
    assert not any("forward" in m.__dict__ for m in encoder.modules())
    with pytest.raises(ValueError, match="recompute policy None: give one of none, selective"):
        apply_recompute(encoder, None)


def test_generation_keeps_its_cache_and_a_wrapped_model_is_unwrapped():
    """In eval mode with gradients on, 'full' and 'op' dropped a transformers model's KV cache
    silently (a cache of length 0; the next token's logits off by up to 0.38): layers now run as they
    are outside training, as in transformers' own checkpointing, and a cache dropped in training is
    said. A model in nn.DataParallel (or DDP) got 'neither a largebatch Block nor a transformers
    layer' for 'selective': the wrapper is looked through."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    plain = transformers.GPT2LMHeadModel(config).eval()
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 50, (1, 8))
    # transformers 5.x renames the cache argument and output field from `past_key_values` to `cache`
    # (the old name goes in 5.40): use the one this version takes.
    name = "cache" if "cache" in inspect.signature(plain.forward).parameters else "past_key_values"
    for policy in ("full", "op"):
        apply_recompute(model, policy)
        outs = [m(input_ids=ids, use_cache=True) for m in (plain, model)]
        caches = [o[name] for o in outs]
        assert caches[1].get_seq_length() == caches[0].get_seq_length() == 8
        nexts = [m(input_ids=ids[:, :1], **{name: c}).logits for m, c in zip((plain, model), caches)]
        assert torch.equal(nexts[0], nexts[1])
    model.train()
    with pytest.warns(UserWarning, match="KV cache .* is dropped"):
        model(input_ids=ids, use_cache=True)
    wrapped = torch.nn.DataParallel(copy.deepcopy(plain))
    assert apply_recompute(wrapped, "selective") == ["selective", "selective"]
    assert wrapped.module.config._attn_implementation.startswith("largebatch_selective_")
