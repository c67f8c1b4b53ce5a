"""OLMo 2's and OLMo 3's layers (OLMo et al. 2024): each sub-layer's output normalised before the
residual add (model.norm_position="reordered") and the whole query and key projections normalised
(model.qk_norm_scope="projection"), against a float64 reference written from the formulas of
docs/papers.md (Llama-style layers), and in and out of transformers' Olmo2ForCausalLM and
Olmo3ForCausalLM (logits and gradients both ways; OLMo 3's sliding windows and its rope table per
layer type). Tensor and sequence parallel: tests/test_parallel.py ("olmo"); bytes kept:
tests/test_memory_llama.py and tests/test_memory_hf.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from largebatch.integrations.hf_export import save_hf
from largebatch.memory.hf import config_from_hf
from largebatch.models import build_model
from largebatch.models.config import ModelConfig, default_hf_model_type, hf_layout_problem, hf_model_type_problem
from largebatch.train.hf_import import init_from_pretrained, model_fields
from largebatch.typed_config import ConfigError
from test_hf_llama import _scrambled  # (weights far from the init: logits of order 1-10)

LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", bias=False)
OLMO = dict(LLAMA, norm_position="reordered", qk_norm=True, qk_norm_scope="projection")
# 3 layers, 4 query heads of 12 values on a 32-wide stream (q 48 wide), 2 key/value heads (k 24 wide)
SHAPE = dict(n_layer=3, n_embd=32, n_head=4, n_kv_head=2, head_size=12, ffn_hidden=48, seq_len=16, vocab_size=64,
             norm_eps=1e-6, rope_theta=5e5)


def _reference_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The OLMo 2 network in float64, from the formulas alone (not the code under test), on the
    model's weights: per layer x <- x + rms(attn(x)) g1, then x <- x + rms(mlp(x)) g2, with
    rms(v) = v / sqrt(mean(v^2) + eps) over v's last dimension; attn: q = rms(x Wq^T) gq over all
    n_head d_h values of the projection, k = rms(x Wk^T) gk over its n_kv_head d_h, then per head the
    rotation by position m: pair (i, i + d/2) turned by m theta^(-2i/d); query head j reads key
    head j // (n_head / n_kv_head); softmax(q k^T / sqrt(d)) over the window (i - W < j <= i, or
    every j <= i) times v, then Wo; mlp: Wd (silu(x Wg^T) * x Wu^T); the final rms and the output
    layer."""
    c = model.config
    p = {n: t.detach().double() for n, t in model.state_dict().items() if t.is_floating_point()}
    T, d, a, kv = idx.shape[1], c.head_dim, c.n_head, c.kv_heads

    def rms(v, g):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + c.norm_eps) * g

    pos = torch.arange(T, dtype=torch.float64)[:, None]
    angle = pos * c.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (T, d/2)
    cos, sin = (t.float().double() for t in (angle.cos(), angle.sin()))  # (the model's tables are stored fp32)

    def rotate(t):  # (B, heads, T, d)
        x1, x2 = t[..., :d // 2], t[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    x = p["tok_emb.weight"][idx]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for layer in range(c.n_layer):
        b = f"blocks.{layer}."
        W = c.layer_window(layer)
        visible = (j <= i) & ((i - j < W) if W is not None else True)
        q = rms(x @ p[b + "attn.q.weight"].T, p[b + "attn.q_norm.weight"])
        k = rms(x @ p[b + "attn.k.weight"].T, p[b + "attn.k_norm.weight"])
        v = x @ p[b + "attn.v.weight"].T
        B = x.shape[0]
        q, k, v = (t.view(B, T, -1, d).transpose(1, 2) for t in (q, k, v))
        q, k = rotate(q), rotate(k)
        k, v = (t.repeat_interleave(a // kv, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~visible, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, a * d) @ p[b + "attn.proj.weight"].T
        x = x + rms(y, p[b + "ln1.weight"])
        m = (F.silu(x @ p[b + "mlp.gate.weight"].T) * (x @ p[b + "mlp.fc1.weight"].T)) @ p[b + "mlp.fc2.weight"].T
        x = x + rms(m, p[b + "ln2.weight"])
    return rms(x, p["ln_f.weight"]) @ p["lm_head.weight"].T


@pytest.mark.parametrize("window", [None, 5])
def test_the_olmo_layers_compute_the_formula_in_float64(window):
    """The reordered norms and the projections' q and k norms (with OLMo 3's window of 5 on layers 0
    and 2) against the float64 reference; pre-LN norms on the same weights are far off, so the
    reference tells the layouts apart."""
    cfg = ModelConfig(**SHAPE, **OLMO, sliding_window=window, full_attention_layers=(1,) if window else ())
    model = _scrambled(cfg).double()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(idx)[0]
    expected = _reference_logits(model, idx)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-10)
    pre = build_model(cfg.replace(norm_position="pre")).double().eval()
    pre.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (pre(idx)[0] - expected).abs().max() > 0.1


def test_config_refusals_name_the_field_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"ModelConfig.norm_position='reordered' with kind='bert'.*'post'"):
        ModelConfig(kind="bert", norm_position="reordered")
    with pytest.raises(ValueError, match=r"ModelConfig.norm_position='post' with kind='gpt'.*'pre', 'reordered' or "
                                         r"'parallel'"):
        ModelConfig(norm_position="post")
    with pytest.raises(ValueError, match=r"qk_norm_scope='projection' with norm='layernorm'.*norm='rmsnorm'"):
        ModelConfig(qk_norm=True, qk_norm_scope="projection")
    with pytest.raises(ValueError, match=r"ModelConfig.qk_norm_scope.*'head', 'projection'"):
        ModelConfig(qk_norm=True, qk_norm_scope="layer")
    with pytest.raises(ValueError, match=r"qk_norm_scope='projection' without qk_norm.*qk_norm=True"):
        ModelConfig(**LLAMA, qk_norm_scope="projection")
    cfg = ModelConfig(**SHAPE, **OLMO)
    assert default_hf_model_type(cfg) == "olmo2"
    assert default_hf_model_type(cfg.replace(sliding_window=8)) == "olmo3"
    assert cfg.qk_norm_width == (48, 24) and cfg.replace(qk_norm_scope="head").qk_norm_width == (12, 12)
    # asked for a family whose blocks are other: the settings that would make them so
    problem = hf_model_type_problem(cfg.replace(hf_model_type="qwen3"))
    assert "model.norm_position='reordered'" in problem and "model.norm_position='pre'" in problem, problem
    assert "model.qk_norm_scope='head'" in problem and "model.hf_model_type='olmo2'" in problem, problem
    problem = hf_model_type_problem(cfg.replace(norm_position="pre", hf_model_type="olmo2"))
    assert "model.norm_position='pre'" in problem and "model.norm_position='reordered'" in problem, problem
    # Llama's layers with the reordered norms alone: no architecture computes them
    problem = hf_layout_problem(cfg.replace(qk_norm=False, qk_norm_scope="head"))
    assert "model.norm_position='reordered'" in problem and "Olmo2ForCausalLM" in problem, problem


@pytest.mark.parametrize("layout, architecture", [({}, "Olmo2ForCausalLM"),
                                                  ({"sliding_window": 5, "full_attention_layers": (2,)},
                                                   "Olmo3ForCausalLM"),
                                                  ({"sliding_window": 5, "rope_scaling": "linear", "rope_factor": 2.0},
                                                   "Olmo3ForCausalLM"),
                                                  ({"hf_model_type": "olmo3"}, "Olmo3ForCausalLM")])
def test_olmo_layouts_go_out_as_olmo_and_back_unchanged(layout, architecture, tmp_path):
    """The export is an Olmo2ForCausalLM (Olmo3ForCausalLM with a window: layer_types, and one rope
    table for both layer types, a scaled one too) computing largebatch's logits, with ln1 / ln2 as
    post_attention_layernorm / post_feedforward_layernorm and q_norm / k_norm as wide as the
    projections; init_from of it builds the same model, tensor for tensor. A window-free model asked
    for as OLMo 3 (a run continued from an OLMo 3 whose layers are all full) gets every layer
    full_attention and a sliding_window of seq_len (transformers' Olmo3Model fails without one)."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(**SHAPE, **OLMO, **layout)
    ours = _scrambled(cfg)
    assert save_hf(ours, None, tmp_path / "out")["architecture"] == architecture
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (raw["attention_bias"], raw["head_dim"], raw["num_key_value_heads"]) == (False, 12, 2)
    if architecture == "Olmo3ForCausalLM":
        assert raw["layer_types"] == ["full_attention" if w is None else "sliding_attention" for w in cfg.windows]
        assert raw["sliding_window"] == (cfg.sliding_window or cfg.seq_len)
        assert set(raw["rope_parameters"]) == {"full_attention", "sliding_attention"}
        assert "rope_scaling" not in raw  # (Olmo3Config would apply it to the full layers only)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == architecture
    layer = hf.model.layers[1]
    assert (layer.self_attn.q_norm.weight.shape, layer.self_attn.k_norm.weight.shape) == ((48,), (24,))
    torch.testing.assert_close(layer.post_feedforward_layernorm.weight, ours.blocks[1].ln2.weight, rtol=0, atol=0)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(idx)[0]
        assert expected.abs().max() > 1.0
        torch.testing.assert_close(hf(input_ids=idx).logits, expected, rtol=0, atol=1e-5)
    back = build_model(_config(tmp_path / "out"))
    init_from_pretrained(back)
    assert back.config.replace(init_from=None, hf_model_type=None) == ours.config.replace(hf_model_type=None)
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _config(path: Path) -> ModelConfig:
    """The ModelConfig model.init_from builds for ``path`` (its model fields: no tokenizer needed)."""
    return ModelConfig(init_from=f"hf:{path}", **model_fields(path))


def _olmo_dir(path: Path, family: str, **config) -> torch.nn.Module:
    """A transformers-built Olmo2ForCausalLM / Olmo3ForCausalLM with random weights (gains near 1),
    saved to ``path``."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=12, max_position_embeddings=24, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None, **config)
    torch.manual_seed(0)
    hf = (Olmo2ForCausalLM(Olmo2Config(**shape)) if family == "olmo2" else
          Olmo3ForCausalLM(Olmo3Config(sliding_window=5, **shape)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    hf.save_pretrained(path)
    return hf.eval()


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_a_transformers_olmo_imports_with_its_logits_and_gradients(family, tmp_path):
    """init_from of a transformers-built OLMo directory: the fields (OLMo 3 without layer_types gets
    Olmo3Config's three windowed layers of every four, and its rope_theta of 500000 where
    config.json has none), transformers' logits and the gradients of the norms it reorders and the
    projections' norms, in fp32."""
    hf = _olmo_dir(tmp_path / "hf", family, **({"rope_theta": 2e4} if family == "olmo2" else {}))
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    if family == "olmo3":  # what a config.json written without these says
        for key in ("layer_types", "rope_parameters", "rope_theta"):
            raw.pop(key, None)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    m = _config(tmp_path / "hf")
    assert (m.norm_position, m.qk_norm, m.qk_norm_scope, m.bias, m.hf_model_type) == (
        "reordered", True, "projection", False, family)
    assert (m.head_size, m.n_kv_head, m.seq_len) == (12, 2, 24)
    assert m.windows == ((5, 5, 5, None) if family == "olmo3" else (None,) * 4)
    assert m.rope_theta == (5e5 if family == "olmo3" else 2e4)
    assert config_from_hf(tmp_path / "hf").replace(dropout=0.0) == m.replace(init_from=None, hf_model_type=None,
                                                                              tie_embeddings=False)
    model = build_model(m)
    init_from_pretrained(model)
    idx = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(2))
    theirs = hf(input_ids=idx).logits
    assert theirs.abs().max() > 1.0
    # (transformers' rotary angles are fp32, largebatch's fp64: ~1e-5 on logits of ~10, as for Llama)
    torch.testing.assert_close(model.eval()(idx)[0], theirs, rtol=0, atol=5e-6 * float(theirs.detach().abs().max()))
    targets = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(3))
    for mod, logits_of in ((model, lambda x: model(x)[0]), (hf, lambda x: hf(input_ids=x).logits)):
        mod.train().zero_grad()
        F.cross_entropy(logits_of(idx).reshape(-1, 64), targets.reshape(-1)).backward()
    layer, block = hf.model.layers[1], model.blocks[1]
    for ours_grad, theirs_grad in ((block.attn.q_norm.weight.grad, layer.self_attn.q_norm.weight.grad),
                                   (block.attn.k_norm.weight.grad, layer.self_attn.k_norm.weight.grad),
                                   (block.attn.q.weight.grad, layer.self_attn.q_proj.weight.grad),
                                   (block.ln1.weight.grad, layer.post_attention_layernorm.weight.grad),
                                   (block.ln2.weight.grad, layer.post_feedforward_layernorm.weight.grad),
                                   (model.tok_emb.weight.grad, hf.model.embed_tokens.weight.grad)):
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-4, atol=1e-6)


def test_olmo_configs_largebatch_cannot_compute_are_refused_naming_the_field(tmp_path):
    """attention_bias (biases on q, k, v and o only), and an OLMo 3 whose full-attention layers rotate
    by another table than its windowed ones (its long-context YaRN, or a rope_scaling or top-level
    rope_theta, which Olmo3Config applies to the full layers only), refused in one line; tables that
    agree, or one for a layer type no layer has, are read."""
    _olmo_dir(tmp_path / "src", "olmo3")
    raw = json.loads((tmp_path / "src" / "config.json").read_text())

    def variant(name: str, **changes) -> Path:  # (None: the key left out)
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({k: v for k, v in {**raw, **changes}.items() if v is not None}))
        return path

    with pytest.raises(ConfigError, match=r"attention_bias=True; olmo3 then has biases on q, k, v and o_proj"):
        model_fields(variant("bias", attention_bias=True))
    yarn = {"sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
            "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5,
                               "original_max_position_embeddings": 8192}}
    with pytest.raises(ConfigError, match=r"full-attention and sliding-window layers rotate by different angles"):
        model_fields(variant("yarn", rope_parameters=yarn))
    with pytest.raises(ConfigError, match=r"rotate by different angles"):
        model_fields(variant("scaling", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    linear = {t: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4} for t in yarn}
    fields = model_fields(variant("linear", rope_parameters=linear))
    assert (fields["rope_scaling"], fields["rope_factor"], fields["rope_theta"]) == ("linear", 2.0, 1e4)
    # every layer full: the sliding table is never read
    fields = model_fields(variant("full", rope_parameters=yarn | {"full_attention": linear["full_attention"]},
                                  layer_types=["full_attention"] * 4))
    assert (fields["sliding_window"], fields["rope_scaling"]) == (None, "linear")
    # transformers 4's keys, read as Olmo3Config reads them: a top-level rope_theta reaches the full layers
    # only (the windowed ones keep 500000), a flat rope_parameters none; a missing eps is its 1e-5
    old = {k: None for k in ("rope_parameters", "rms_norm_eps")}
    with pytest.raises(ConfigError, match=r"'sliding_attention': \{'rope_theta': 500000.0.*'full_attention': "
                                          r"\{'rope_theta': 10000.0"):
        model_fields(variant("theta", **old, rope_theta=10000.0))
    fields = model_fields(variant("flat", **old | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}))
    assert (fields["rope_theta"], fields["norm_eps"]) == (5e5, 1e-5)
    assert model_fields(variant("theta-full", **old, rope_theta=1e4, layer_types=["full_attention"] * 4))[
        "rope_theta"] == 1e4
