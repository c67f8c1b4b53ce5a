"""GPT-NeoX's layers (Black et al. 2022; Pythia, Biderman et al. 2023): the attention and the MLP both
reading the layer's input, x + attn(LN1(x)) + mlp(LN2(x)) (model.norm_position="parallel"), and the
rotary positions turning only the first rope_fraction of each head (model.rope_fraction), against a
float64 reference written from the formulas of docs/papers.md, and in and out of transformers'
GPTNeoXForCausalLM (logits and gradients both ways, the parallel and the sequential layer). Tensor
and sequence parallel: tests/test_parallel.py ("neox"); bytes kept: tests/test_memory_llama.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from largebatch.integrations.hf_export import save_hf
from largebatch.memory.hf import config_from_hf
from largebatch.models import build_model
from largebatch.models.config import ModelConfig, default_hf_model_type, hf_layout_problem
from largebatch.train.hf_import import init_from_pretrained, model_fields
from largebatch.typed_config import ConfigError
from test_hf_llama import _scrambled  # (weights far from the init: logits of order 1-10)

NEOX = dict(norm="layernorm", position="rope", activation="gelu", bias=True, norm_position="parallel",
            rope_fraction=0.25, tie_embeddings=False)
# 3 layers, 4 heads of 16 values on a 64-wide stream (4 of each head's values rotated)
SHAPE = dict(n_layer=3, n_embd=64, n_head=4, ffn_hidden=96, seq_len=16, vocab_size=80, rope_theta=1e4)


def _reference_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The GPT-NeoX network in float64, from the formulas alone (not the code under test), on the
    model's weights: per layer x <- x + attn(ln(x; g1, b1)) + mlp(ln(x; g2, b2)) with the parallel
    layer, or x <- x + attn(ln1(x)), then x <- x + mlp(ln2(x)) with the sequential one; ln(v) =
    (v - mean) / sqrt(var + eps) g + b over the last dimension; attn: q, k, v = x W^T + b split into
    heads of d values, the first r = int(d f) values of each query and key head rotated by position m
    (pair (i, i + r/2) turned by m theta^(-2i/r)), the other d - r unchanged; softmax(q k^T / sqrt(d))
    over j <= i times v, then Wo + bo; mlp: gelu(x W1^T + b1) W2^T + b2 (exact GeLU); the final ln and
    the output layer."""
    c = model.config
    p = {n: t.detach().double() for n, t in model.state_dict().items() if t.is_floating_point()}
    T, d, a = idx.shape[1], c.head_dim, c.n_head
    r = int(d * c.rope_fraction)

    def ln(v, g, b):
        mean = v.mean(-1, keepdim=True)
        var = ((v - mean) ** 2).mean(-1, keepdim=True)
        return (v - mean) / torch.sqrt(var + c.norm_eps) * g + b

    def linear(v, name):
        return v @ p[name + ".weight"].T + p[name + ".bias"]

    pos = torch.arange(T, dtype=torch.float64)[:, None]
    angle = pos * c.rope_theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)  # (T, r/2)
    cos, sin = (t.float().double() for t in (angle.cos(), angle.sin()))  # (the model's tables are stored fp32)

    def rotate(t):  # (B, heads, T, d): the first r values turn
        x1, x2, rest = t[..., :r // 2], t[..., r // 2:r], t[..., r:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

    def attn(x, b):
        B = x.shape[0]
        q, k, v = (linear(x, b + f"attn.{n}").view(B, T, a, d).transpose(1, 2) for n in "qkv")
        q, k = rotate(q), rotate(k)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(j > i, float("-inf"))
        return linear((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, a * d), b + "attn.proj")

    def mlp(x, b):
        h = linear(x, b + "mlp.fc1")
        return linear(0.5 * h * (1 + torch.erf(h / math.sqrt(2))), b + "mlp.fc2")

    x = p["tok_emb.weight"][idx]
    for layer in range(c.n_layer):
        b = f"blocks.{layer}."
        norm1, norm2 = ((p[b + n + ".weight"], p[b + n + ".bias"]) for n in ("ln1", "ln2"))
        if c.norm_position == "parallel":
            x = x + attn(ln(x, *norm1), b) + mlp(ln(x, *norm2), b)
        else:
            x = x + attn(ln(x, *norm1), b)
            x = x + mlp(ln(x, *norm2), b)
    return ln(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["lm_head.weight"].T


@pytest.mark.parametrize("layout", ["parallel", "pre"])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_the_neox_layers_compute_the_formula_in_float64(layout, fraction):
    """The parallel layer (and the sequential one, GPT-NeoX's use_parallel_residual=false) with a
    quarter of each head rotated, or all of it, against the float64 reference; the other layout and
    the other fraction on the same weights are far off, so the reference tells them apart."""
    cfg = ModelConfig(**SHAPE, **{**NEOX, "norm_position": layout, "rope_fraction": fraction})
    model = _scrambled(cfg).double()
    idx = torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(idx)[0]
    expected = _reference_logits(model, idx)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-10)
    for other in (cfg.replace(norm_position="pre" if layout == "parallel" else "parallel"),
                  cfg.replace(rope_fraction=0.5 if fraction == 1.0 else 1.0)):
        twin = build_model(other).double().eval()
        twin.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (twin(idx)[0] - expected).abs().max() > 0.05


def _config(path: Path) -> ModelConfig:
    """The ModelConfig model.init_from builds for ``path`` (its model fields: no tokenizer needed)."""
    return ModelConfig(init_from=f"hf:{path}", **model_fields(path))


@pytest.mark.parametrize("layout", [{}, {"norm_position": "pre", "rope_fraction": 0.5, "activation": "gelu_tanh"},
                                    {"tie_embeddings": True, "rope_scaling": "linear", "rope_factor": 2.0}])
def test_neox_layouts_go_out_as_gpt_neox_and_back_unchanged(layout, tmp_path):
    """A GPT with LayerNorm, rotary positions, a GeLU MLP and biases exports as GPTNeoXForCausalLM
    (the default type of that layout) computing largebatch's logits: use_parallel_residual from
    norm_position, the rotated share and base in rope_parameters and in transformers 4's keys, q, k
    and v fused head by head; init_from of it builds the same model, tensor for tensor."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(**SHAPE, **{**NEOX, **layout})
    assert default_hf_model_type(cfg) == "gpt_neox" and hf_layout_problem(cfg) is None
    ours = _scrambled(cfg)
    assert save_hf(ours, None, tmp_path / "out")["architecture"] == "GPTNeoXForCausalLM"
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["use_parallel_residual"] == (cfg.norm_position == "parallel")
    assert (raw["rope_parameters"]["partial_rotary_factor"], raw["rotary_pct"]) == (cfg.rope_fraction,) * 2
    assert (raw["rope_parameters"]["rope_theta"], raw["rotary_emb_base"]) == (1e4, 1e4)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    # head 1's key rows of the fused projection are largebatch's k rows 16..31
    qkv = hf.gpt_neox.layers[1].attention.query_key_value.weight.view(4, 3, 16, 64)
    torch.testing.assert_close(qkv[1, 1], ours.blocks[1].attn.k.weight[16:32], rtol=0, atol=0)
    idx = torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(idx)[0]
        assert expected.abs().max() > 1.0
        theirs = hf(input_ids=idx).logits
    # (transformers' rotary angles are fp32, largebatch's fp64)
    torch.testing.assert_close(theirs, expected, rtol=0, atol=5e-6 * float(expected.abs().max()))
    back = build_model(_config(tmp_path / "out"))
    init_from_pretrained(back)
    assert back.config.replace(init_from=None, hf_model_type=None) == ours.config
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _neox_dir(path: Path, **config) -> torch.nn.Module:
    """A transformers-built GPTNeoXForCausalLM with random weights (gains near 1), saved to ``path``."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    shape = dict(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 max_position_embeddings=24, bos_token_id=0, eos_token_id=0, **config)
    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(**shape))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "layernorm.weight" in name
                                                                or "layer_norm.weight" in name else 0.0))
    hf.save_pretrained(path)
    return hf.eval()


@pytest.mark.parametrize("parallel", [True, False])
def test_a_transformers_gpt_neox_imports_with_its_logits_and_gradients(parallel, tmp_path):
    """init_from of a transformers-built GPT-NeoX directory, written as Pythia's config.json is
    (transformers 4's rotary_pct and rotary_emb_base, no rope_parameters; the output layer stored as
    embed_out): the fields, transformers' logits and the gradients of the fused projection's parts,
    the two norms and the embedding, in fp32, with the parallel layer and the sequential one."""
    hf = _neox_dir(tmp_path / "hf", use_parallel_residual=parallel,
                   rope_parameters={"rope_type": "default", "rope_theta": 2e4, "partial_rotary_factor": 0.5})
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.pop("rope_parameters")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "rotary_pct": 0.5, "rotary_emb_base": 2e4}))
    m = _config(tmp_path / "hf")
    assert (m.norm_position, m.rope_fraction, m.rope_theta, m.rotary_dim, m.bias, m.tie_embeddings) == (
        "parallel" if parallel else "pre", 0.5, 2e4, 8, True, False)
    assert (m.norm, m.position, m.activation, m.hf_model_type, m.seq_len) == (
        "layernorm", "rope", "gelu", "gpt_neox", 24)
    assert config_from_hf(tmp_path / "hf") == m.replace(init_from=None, hf_model_type=None)
    model = build_model(m)
    init_from_pretrained(model)
    idx = torch.randint(0, 80, (3, 24), generator=torch.Generator().manual_seed(2))
    theirs = hf(input_ids=idx).logits
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(model.eval()(idx)[0], theirs, rtol=0, atol=5e-6 * float(theirs.detach().abs().max()))
    targets = torch.randint(0, 80, (3, 24), generator=torch.Generator().manual_seed(3))
    for mod, logits_of in ((model, lambda x: model(x)[0]), (hf, lambda x: hf(input_ids=x).logits)):
        mod.train().zero_grad()
        torch.nn.functional.cross_entropy(logits_of(idx).reshape(-1, 80), targets.reshape(-1)).backward()
    layer, block = hf.gpt_neox.layers[1], model.blocks[1]
    qkv = layer.attention.query_key_value.weight.grad.view(4, 3, 16, 64)
    for ours_grad, theirs_grad in ((block.attn.q.weight.grad, qkv[:, 0].reshape(64, 64)),
                                   (block.attn.v.weight.grad, qkv[:, 2].reshape(64, 64)),
                                   (block.ln1.weight.grad, layer.input_layernorm.weight.grad),
                                   (block.ln2.bias.grad, layer.post_attention_layernorm.bias.grad),
                                   (block.mlp.fc1.weight.grad, layer.mlp.dense_h_to_4h.weight.grad),
                                   (model.lm_head.weight.grad, hf.lm_head.weight.grad),
                                   (model.tok_emb.weight.grad, hf.gpt_neox.embed_in.weight.grad)):
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-4, atol=1e-6)


def test_neox_configs_largebatch_cannot_compute_are_refused_naming_the_field(tmp_path):
    """attention_bias false (no attention biases, but the MLP's and the norms'), a rotated share that
    leaves an odd count of values, another activation and a YaRN rope are refused in one line; a
    config.json without any rotary key takes GPTNeoXConfig's quarter of each head at base 10000, and
    an untied run's output layer loads from lm_head where a state names it so."""
    _neox_dir(tmp_path / "src")
    raw = json.loads((tmp_path / "src" / "config.json").read_text())

    def variant(name: str, **changes) -> Path:  # (None: the key left out)
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({k: v for k, v in {**raw, **changes}.items() if v is not None}))
        return path

    with pytest.raises(ConfigError, match=r"attention_bias=False; GPT-NeoX then has no biases in its attention"):
        model_fields(variant("bias", attention_bias=False))
    with pytest.raises(ConfigError, match=r"hidden_act='relu'; largebatch's GeLU MLP computes"):
        model_fields(variant("relu", hidden_act="relu"))
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    with pytest.raises(ConfigError, match=r"rope_parameters with rope_type='yarn'"):
        model_fields(variant("yarn", rope_parameters=yarn))
    with pytest.raises(ValueError, match=r"rope_fraction=0.2 with head size 16: it rotates int\(16 x 0.2\) = 3 "
                                         r"values.*even and at least 2"):
        ModelConfig(**model_fields(variant("three", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                      "partial_rotary_factor": 0.2})))
    fields = model_fields(variant("bare", rope_parameters=None))
    assert (fields["rope_fraction"], fields["rope_theta"], fields["norm_position"]) == (0.25, 1e4, "parallel")
    from safetensors.torch import load_file, save_file

    renamed = variant("renamed")
    state = load_file(tmp_path / "src" / "model.safetensors")
    state["lm_head.weight"] = state.pop("embed_out.weight")
    save_file(state, renamed / "model.safetensors")
    model = build_model(_config(renamed))
    init_from_pretrained(model)
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_pythia_presets_are_the_released_sizes():
    """pythia-160m and pythia-1b: the parameter counts of the released models (162,322,944 and
    1,011,781,632; untied, biases everywhere), counted from the shapes without building them, and the
    config.json transformers writes for those shapes read back as the preset."""
    from transformers import GPTNeoXConfig

    from largebatch.memory import estimate
    from largebatch.models import preset

    for name, count, shape in (("pythia-160m", 162_322_944, dict(hidden_size=768, num_hidden_layers=12,
                                                                 num_attention_heads=12, intermediate_size=3072)),
                               ("pythia-1b", 1_011_781_632, dict(hidden_size=2048, num_hidden_layers=16,
                                                                 num_attention_heads=8, intermediate_size=8192))):
        assert estimate(preset(name), 1, dtype_bytes=4).parameters == 4 * count, name
        raw = GPTNeoXConfig(vocab_size=50304, max_position_embeddings=2048, **shape).to_dict()
        assert config_from_hf(raw) == preset(name), name


def test_a_neox_run_trains_resumes_and_refuses_another_layer_on_resume(tiny_data_cache, tmp_path, capsys):
    """A tiny GPT-NeoX-style run (parallel layer, a quarter of each head of 16 rotated) trains,
    stops and continues; continuing it with another rotated share or the sequential layer is refused
    in one line naming the field (its checkpoints were trained with the run's own)."""
    from largebatch.train.cli import main
    from test_train import tiny_overrides

    out = tmp_path / "run"
    o = tiny_overrides(tiny_data_cache, out, **{"model.position": "rope", "model.rope_fraction": 0.25,
                                                "model.norm_position": "parallel", "run.max_steps": 2})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    capsys.readouterr()
    for change in ("--model.rope_fraction=0.5", "--model.norm_position=pre"):
        assert main(["--resume", str(out), change, "--run.max_steps=1"]) == 2
        err = capsys.readouterr().err.strip()
        assert change.split("=")[0][2:] in err and len(err.splitlines()) == 1, err
    assert main(["--resume", str(out), "--run.max_steps=1"]) == 0
