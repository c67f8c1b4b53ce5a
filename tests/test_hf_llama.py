"""Llama in and out of transformers: a Llama-style largebatch GPT (RMSNorm, rotary positions, SwiGLU,
grouped-query attention) exports as a LlamaForCausalLM that transformers' Auto classes load with the
same logits and the same greedy continuation; a LlamaForCausalLM (and a window-free Mistral) built by
transformers loads through model.init_from with transformers' logits and gradients and trains on;
what neither architecture computes is refused in one line, before training where it can be."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from largebatch.cli import main as cli_main
from largebatch.export import load_run
from largebatch.integrations import ExportError
from largebatch.models import build_model
from largebatch.models.config import ModelConfig, default_hf_model_type
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.hf_import import init_from_pretrained, model_fields
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics
from largebatch.typed_config import ConfigError
from test_export import TEXT, export, tiny, train

LLAMA = {"model.norm": "rmsnorm", "model.position": "rope", "model.activation": "swiglu"}


@pytest.fixture(scope="module")
def cache(tiny_data_cache):
    return tiny_data_cache


@pytest.fixture(scope="module")
def llama_run(cache, tmp_path_factory):
    """A trained tiny Llama-style GPT: 4 query heads on 2 key/value heads, biases, untied, Llama 3's
    rope_theta, dropout 0.1 and eps 1e-6 (test_export.tiny): a wrong mapping of any shows."""
    return train(tiny(cache, tmp_path_factory.mktemp("runs") / "llama", **LLAMA, **{
        "model.n_head": 4, "model.n_kv_head": 2, "model.ffn_hidden": 80, "model.rope_theta": 5e5,
        "model.bias": True, "model.tie_embeddings": False}))


def test_a_llama_style_run_exports_as_llama_with_the_same_logits_and_greedy_tokens(llama_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf-llama"
    assert export(llama_run, out) == 0
    printed = capsys.readouterr().out
    assert "LlamaForCausalLM" in printed and "logits match" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_act"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["intermediate_size"]) == ("silu", 4, 2, 8, 80)
    assert config["rms_norm_eps"] == 1e-6 and config["max_position_embeddings"] == 48
    assert config["rope_theta"] == 5e5 and config["rope_parameters"] == {"rope_theta": 5e5, "rope_type": "default"}
    assert config["attention_bias"] is True and config["mlp_bias"] is True
    assert config["tie_word_embeddings"] is False and config["attention_dropout"] == 0.1

    run = load_run(llama_run)
    ours_ids = run.tokenizer.encode(TEXT).ids
    tok = AutoTokenizer.from_pretrained(out)
    assert tok(TEXT)["input_ids"] == ours_ids and tok.eos_token == "<|endoftext|>"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 0, 1)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.model.layers[0].self_attn.k_proj.out_features == 16
    idx = torch.tensor([ours_ids[:48]])
    with torch.no_grad():
        ours, theirs = run.model(idx)[0], hf(input_ids=idx).logits
    assert ours.std() > 0.1  # trained, non-trivial logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # greedy decoding: largebatch's generate and transformers' (its KV cache) pick the same 24 tokens
    prompt = idx[:, :16]
    hf.generation_config.eos_token_id = None  # (transformers would stop at <|endoftext|>; ours does not)
    theirs_tokens = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    assert torch.equal(run.model.generate(prompt, 24, temperature=0), theirs_tokens)
    # a rope model written as GPT-2 is refused, naming the type that fits
    assert export(llama_run, tmp_path / "bad", "--hf-model-type", "gpt2") == 2
    err = capsys.readouterr().err.strip()
    assert "model.position='rope'" in err and err.endswith("use --hf-model-type llama, or leave --hf-model-type out")
    assert "so the export is refused;" in err and "would be" not in err  # (the export itself, not a plan)
    assert not (tmp_path / "bad").exists()


def _scrambled(cfg: ModelConfig) -> torch.nn.Module:
    """A largebatch model with weights far from the init (norm gains near 1): logits of order 1-10."""
    model = build_model(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def test_a_tied_bias_free_multi_query_model_goes_out_and_back_unchanged(tmp_path):
    """bias=False, tied, one key/value head: the export computes largebatch's logits, and init_from of
    it builds the same model again, tensor for tensor."""
    from transformers import AutoModelForCausalLM

    from largebatch.integrations.hf_export import save_hf

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=1, ffn_hidden=48, seq_len=16, vocab_size=64,
                      bias=False, norm_eps=1e-5, rope_theta=1e4, **{k[6:]: v for k, v in LLAMA.items()})
    assert default_hf_model_type(cfg) == "llama"
    ours = _scrambled(cfg)
    assert save_hf(ours, None, tmp_path / "out")["architecture"] == "LlamaForCausalLM"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["attention_bias"], config["mlp_bias"], config["tie_word_embeddings"]) == (False, False, True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    _same_logits_and_back(ours, hf, tmp_path / "out")


def _same_logits_and_back(ours: torch.nn.Module, hf, out: Path) -> None:
    """transformers' model of the export ``out`` gives ``ours``'s logits (order 1 and more), and
    init_from of ``out`` builds ``ours`` again: its config and every tensor."""
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(idx)[0]
        assert expected.abs().max() > 1.0
        torch.testing.assert_close(hf(input_ids=idx).logits, expected, rtol=0, atol=1e-5)
    back = build_model(model_fields_config(out))
    init_from_pretrained(back)
    assert back.config.replace(init_from=None, hf_model_type=None) == ours.config
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_qwen2_layout_goes_out_as_qwen2_and_back_unchanged(tmp_path):
    """Biases on q, k and v alone (model.bias=False, model.qkv_bias=True), untied, 2 key/value heads:
    the export is a Qwen2ForCausalLM computing largebatch's logits (LlamaForCausalLM, whose biases are
    on every Linear layer or none, is refused for it), and init_from of it builds the same model."""
    from transformers import AutoModelForCausalLM

    from largebatch.integrations.hf_export import save_hf
    from largebatch.models.config import hf_model_type_problem

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=48, seq_len=16, vocab_size=64,
                      bias=False, qkv_bias=True, tie_embeddings=False, norm_eps=1e-6, rope_theta=1e6,
                      **{k[6:]: v for k, v in LLAMA.items()})
    assert default_hf_model_type(cfg) == "qwen2"
    # biases everywhere but q, k and v: neither computes it, and each says what would fit it
    from largebatch.models.config import hf_layout_problem

    problem = hf_layout_problem(cfg.replace(bias=True, qkv_bias=False))
    assert "model.bias=True, model.qkv_bias=False: no transformers architecture" in problem, problem
    assert "LlamaForCausalLM computes" in problem and "Qwen2ForCausalLM computes" in problem, problem
    assert "model.bias=False, model.qkv_bias=True" in problem, problem
    problem = hf_model_type_problem(cfg.replace(hf_model_type="llama"))
    assert "model.bias=False, model.qkv_bias=True" in problem and "model.hf_model_type='qwen2'" in problem, problem
    ours = _scrambled(cfg)
    assert save_hf(ours, None, tmp_path / "out")["architecture"] == "Qwen2ForCausalLM"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["use_sliding_window"], config["num_key_value_heads"]) == ("qwen2", False, 2)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.model.layers[0].self_attn.o_proj.bias is None
    torch.testing.assert_close(hf.model.layers[1].self_attn.k_proj.bias, ours.blocks[1].attn.k.bias, rtol=0, atol=0)
    _same_logits_and_back(ours, hf, tmp_path / "out")


def test_a_qwen3_layout_goes_out_as_qwen3_and_back_unchanged(tmp_path):
    """No biases, each query and key head normalised (model.qk_norm), heads of 12 on a 32-wide
    stream (model.head_size), 2 key/value heads: the export is a Qwen3ForCausalLM computing
    largebatch's logits (Llama and Qwen2, which have no q/k norms, are refused for it, and GPT-2,
    whose heads are n_embd / n_head wide), and init_from of it builds the same model."""
    from transformers import AutoModelForCausalLM

    from largebatch.integrations.hf_export import save_hf
    from largebatch.models.config import hf_layout_problem, hf_model_type_problem

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, head_size=12, qk_norm=True, ffn_hidden=48,
                      seq_len=16, vocab_size=64, bias=False, tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6,
                      **{k[6:]: v for k, v in LLAMA.items()})
    assert default_hf_model_type(cfg) == "qwen3"
    problem = hf_model_type_problem(cfg.replace(hf_model_type="llama"))
    assert "model.qk_norm=True" in problem and "model.hf_model_type='qwen3'" in problem, problem
    # q/k norms with q/k/v biases: Qwen2 has the biases, Qwen3 the norms; neither both
    problem = hf_layout_problem(cfg.replace(qkv_bias=True))
    assert "model.qk_norm=True" in problem and "Qwen3ForCausalLM computes" in problem, problem
    assert "model.qk_norm=False" in problem and "model.bias=False, model.qkv_bias=None" in problem, problem
    plain = ModelConfig(n_layer=1, n_embd=32, n_head=4, head_size=12, seq_len=16, vocab_size=64, hf_model_type="gpt2")
    problem = hf_model_type_problem(plain)
    assert "model.head_size=12" in problem and "model.head_size=None" in problem, problem
    assert "each n_embd / n_head values wide" in problem, problem  # (why GPT-2 cannot)
    problem = hf_model_type_problem(plain.replace(n_head=3))  # (3 does not divide 32: None alone cannot be)
    assert "model.head_size=None with a model.n_head that divides model.n_embd=32" in problem, problem
    # a pre-LN BERT with both: every reason at once, not one per retraining
    from largebatch.integrations.hf_export import check_exportable

    with pytest.raises(ExportError, match=r"only post-LN BERT exports.*and besides.*model.head_size=None, "
                                          r"model.qk_norm=False"):
        check_exportable(ModelConfig(kind="bert", n_layer=1, n_embd=32, n_head=4, head_size=12, qk_norm=True))
    ours = _scrambled(cfg)
    assert save_hf(ours, None, tmp_path / "out")["architecture"] == "Qwen3ForCausalLM"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["attention_bias"], config["use_sliding_window"]) == \
        ("qwen3", 12, False, False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.model.layers[0].self_attn.q_proj.weight.shape == (48, 32)
    torch.testing.assert_close(hf.model.layers[1].self_attn.k_norm.weight, ours.blocks[1].attn.k_norm.weight,
                               rtol=0, atol=0)
    _same_logits_and_back(ours, hf, tmp_path / "out")


@pytest.mark.parametrize("layout, architecture", [
    ({"full_attention_layers": ()}, "MistralForCausalLM"),
    ({"full_attention_layers": (0, 2)}, "MinistralForCausalLM"),
    ({"full_attention_layers": (1,), "qkv_bias": True}, "Qwen2ForCausalLM"),
    ({"full_attention_layers": (0,), "qkv_bias": True}, "Qwen2ForCausalLM"),
    ({"full_attention_layers": (2,), "qk_norm": True}, "Qwen3ForCausalLM")])
def test_sliding_windows_go_out_as_their_family_and_back_unchanged(layout, architecture, tmp_path):
    """A window of 5 of the 16 positions on every layer (Mistral), or on the layers
    full_attention_layers leaves (Ministral without biases, Qwen2 with q/k/v biases, Qwen3 with q/k
    norms, each by layer_types, and by max_window_layers where the windowed layers are the last ones):
    the export is that family's model computing largebatch's logits with transformers' own masks, and
    init_from of it builds the same model. Llama and GPT-2, which have no
    window, are refused for it naming the window."""
    from transformers import AutoModelForCausalLM

    from largebatch.integrations.hf_export import save_hf
    from largebatch.models.config import hf_model_type_problem

    cfg = ModelConfig(n_layer=3, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=48, seq_len=16, vocab_size=64,
                      bias=False, norm_eps=1e-6, sliding_window=5, **layout, **{k[6:]: v for k, v in LLAMA.items()})
    problem = hf_model_type_problem(cfg.replace(hf_model_type="llama"))
    assert "model.sliding_window=5" in problem and "model.sliding_window=None" in problem, problem
    if cfg.window_layout == "some" and not cfg.qk_norm and not cfg.qkv_biased:  # Mistral windows every layer
        problem = hf_model_type_problem(cfg.replace(hf_model_type="mistral"))
        assert "model.full_attention_layers=[0, 2]" in problem and "model.full_attention_layers=[]" in problem
    ours = _scrambled(cfg)
    assert save_hf(ours, None, tmp_path / "out")["architecture"] == architecture
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["sliding_window"] == 5
    if architecture != "MistralForCausalLM":
        assert config["layer_types"] == ["full_attention" if i in cfg.full_attention_layers else "sliding_attention"
                                         for i in range(3)]
    if architecture.startswith("Qwen"):  # for readers without layer_types: Qwen2Config's rule, where it can say it
        suffix = cfg.full_attention_layers == (0,)  # (windowed layers 1 and 2: the layers from 1 on)
        assert config["max_window_layers"] == (1 if suffix else 3)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == architecture
    _same_logits_and_back(ours, hf, tmp_path / "out")
    # the windows matter: the same weights without them compute other logits
    plain = build_model(cfg.replace(sliding_window=None, full_attention_layers=())).eval()
    plain.load_state_dict(ours.state_dict())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (plain(idx)[0] - hf(input_ids=idx).logits).abs().max() > 1e-2


@pytest.mark.parametrize("biases", ["none", "qkv"])
def test_heads_of_another_size_go_out_as_llama_and_qwen2_and_back(biases, tmp_path):
    """model.head_size (heads of 12 on a 32-wide stream) without q/k norms: a LlamaForCausalLM or
    Qwen2ForCausalLM with ``head_dim`` 12 computing largebatch's logits, and back tensor for tensor."""
    from transformers import AutoModelForCausalLM

    from largebatch.integrations.hf_export import save_hf

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, head_size=12, ffn_hidden=48, seq_len=16,
                      vocab_size=64, bias=False, qkv_bias=True if biases == "qkv" else None, rope_theta=1e4,
                      **{k[6:]: v for k, v in LLAMA.items()})
    ours = _scrambled(cfg)
    architecture = save_hf(ours, None, tmp_path / "out")["architecture"]
    assert architecture == ("Qwen2ForCausalLM" if biases == "qkv" else "LlamaForCausalLM")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == 12
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.model.layers[0].self_attn.o_proj.weight.shape == (32, 48)
    _same_logits_and_back(ours, hf, tmp_path / "out")


def model_fields_config(path: Path) -> ModelConfig:
    """The ModelConfig model.init_from builds for ``path`` (no tokenizer needed: model fields only)."""
    fields = model_fields(path)
    fields["ffn_hidden"] = None if fields["ffn_hidden"] == 4 * fields["n_embd"] else fields["ffn_hidden"]
    return ModelConfig(init_from=f"hf:{path}", **fields)


def _llama_dir(path: Path, vocab: int, tokenizer: Path | None = None, family: str = "llama", **config):
    """A LlamaForCausalLM (or MistralForCausalLM, Qwen2ForCausalLM: q/k/v biases; Qwen3ForCausalLM:
    heads of 12 on a 32-wide stream, q and k norms) built and saved by transformers, weights
    scrambled: 4 query heads on 1 key/value head, tied, rope_theta 20000, eps 1e-5."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MinistralConfig,
        MinistralForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, max_position_embeddings=48, rms_norm_eps=1e-5, rope_theta=2e4,
                 tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, **config)
    torch.manual_seed(0)
    hf = {"mistral": lambda: MistralForCausalLM(MistralConfig(sliding_window=None, **shape)),
          # sliding windows (WINDOW of the 48 positions): Mistral's on every layer, Ministral's on the
          # layers layer_types names (its layers need head_dim written), Qwen2's from max_window_layers on
          "mistral-window": lambda: MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **shape)),
          "ministral": lambda: MinistralForCausalLM(MinistralConfig(
              sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"], head_dim=8, **shape)),
          "qwen2-window": lambda: Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                                               max_window_layers=1, **shape)),
          "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **shape)),
          "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(use_sliding_window=False, head_dim=QWEN3_HEAD, **shape)),
          "llama": lambda: LlamaForCausalLM(LlamaConfig(attention_bias=False, mlp_bias=False, **shape))}[family]()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    hf.save_pretrained(path)
    if tokenizer is not None:
        shutil.copy(tokenizer, path / "tokenizer.json")
    return hf.eval()


QWEN3_HEAD = 12  # (hidden_size / num_attention_heads is 8)
WINDOW = 5  # the windowed families' sliding window, of 48 positions


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mistral-window", "ministral",
                                    "qwen2-window"])
def test_a_transformers_llama_imports_with_its_logits_and_gradients_and_trains_on(llama_run, cache, family, tmp_path):
    """init_from of a transformers-built directory: the fields, transformers' logits and gradients in
    fp32; "-window" and Ministral: sliding windows of WINDOW positions (on every layer, on layer 1 by
    layer_types, on layers max_window_layers = 1 and up), against transformers' own masks."""
    from largebatch.data import build_data

    tokenizer = llama_run / "tokenizer.json"
    vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    V = len(vocab)
    directory = tmp_path / "hf"
    hf = _llama_dir(directory, V, tokenizer, family=family)
    cfg = load_config(None, {"model.init_from": f"hf:{directory}"})
    m = cfg.model
    assert (m.kind, m.norm, m.position, m.activation, m.norm_position) == ("gpt", "rmsnorm", "rope", "swiglu", "pre")
    assert (m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.ffn, m.seq_len, m.vocab_size) == (2, 32, 4, 1, 48, 48, V)
    assert (m.rope_theta, m.norm_eps, m.bias, m.tie_embeddings) == (2e4, 1e-5, False, True)
    # Qwen2: biases on q, k and v alone; Qwen3: heads of head_dim values, each query and key head
    # normalised; each exports as its own type
    assert (m.qkv_biased, m.hf_model_type) == (family.startswith("qwen2"), family.removesuffix("-window"))
    assert m.windows == {"mistral-window": (WINDOW, WINDOW), "ministral": (None, WINDOW),
                         "qwen2-window": (None, WINDOW)}.get(family, (None, None))
    assert (m.head_size, m.qk_norm) == ((QWEN3_HEAD, True) if family == "qwen3" else (None, False))
    # head_size given as none: the directory's heads of hidden / heads (8 here), not the default
    # config's own n_embd / n_head (64): accepted where the directory has those, refused naming none
    # where it has others; a number is compared as given
    none = {"model.init_from": f"hf:{directory}", "model.head_size": None}
    if family == "qwen3":
        with pytest.raises(ConfigError, match=f"model.head_size=None but hf:.* has {QWEN3_HEAD} "):
            load_config(None, none)
        assert load_config(None, {**none, "model.head_size": QWEN3_HEAD}).model.head_size == QWEN3_HEAD
    else:
        assert load_config(None, none).model.head_size is None
        assert load_config(None, {**none, "model.head_size": 8}).model.head_size is None
    # qkv_bias given as the network has it (none: as bias) is the same model; the other way is refused
    qwen2 = family.startswith("qwen2")
    same = load_config(None, {"model.init_from": f"hf:{directory}", "model.qkv_bias": qwen2}).model
    assert same.qkv_biased == m.qkv_biased
    with pytest.raises(ConfigError, match=f"model.qkv_bias={not qwen2} but"):
        load_config(None, {"model.init_from": f"hf:{directory}", "model.qkv_bias": not qwen2})
    # the windows are the run's to choose (no weight depends on them), with a note naming both; the
    # exempt layers stay the directory's unless given, and go with the window
    notes: list[str] = []
    other = load_config(None, {"model.init_from": f"hf:{directory}", "model.sliding_window": 7}, warn=notes.append)
    assert (other.model.sliding_window, other.model.full_attention_layers) == (7, m.full_attention_layers)
    assert any("model.sliding_window=7" in n and f"(config.json: {m.sliding_window!r}" in n for n in notes), notes
    if family == "llama":  # a Llama given a window exports as the family that has one
        assert other.model.hf_model_type == "mistral"
    if m.sliding_window is not None:
        none = load_config(None, {"model.init_from": f"hf:{directory}", "model.sliding_window": None}).model
        assert none.window_layout == "none"
    notes.clear()
    assert load_config(None, {"model.init_from": f"hf:{directory}", "model.sliding_window": m.sliding_window},
                       warn=notes.append).model.windows == m.windows
    assert not notes
    assert cfg.data.tokenizer_file == str(directory / "tokenizer.json")
    model = build_model(m)
    init_from_pretrained(model)
    idx = torch.randint(0, V, (3, 48), generator=torch.Generator().manual_seed(2))
    theirs = hf(input_ids=idx).logits
    assert theirs.abs().max() > 1.0
    # transformers computes the rotary angles position x inv_freq in fp32 (largebatch in fp64): angles
    # off by ~position x 6e-8, which with these large weights moves logits of ~7 by ~1e-5 (in float64
    # too); a wrong mapping is off by ~1, a wrong rope_theta by > 1e-3 (below)
    torch.testing.assert_close(model.eval()(idx)[0], theirs, rtol=0, atol=5e-6 * float(theirs.detach().abs().max()))
    # the rotary base matters: Llama 1's 10000 in place of 20000 is far off
    wrong = build_model(m.replace(rope_theta=1e4, init_from=None))
    wrong.load_state_dict(model.state_dict())
    assert (wrong.eval()(idx)[0] - theirs).abs().max() > 1e-3
    targets = torch.randint(0, V, (3, 48), generator=torch.Generator().manual_seed(3))
    for mod, logits_of in ((model, lambda x: model(x)[0]), (hf, lambda x: hf(input_ids=x).logits)):
        mod.train().zero_grad()
        F.cross_entropy(logits_of(idx).reshape(-1, V), targets.reshape(-1)).backward()
    layer = hf.model.layers[1]
    for ours_grad, theirs_grad in ((model.blocks[1].attn.k.weight.grad, layer.self_attn.k_proj.weight.grad),
                                   (model.blocks[1].mlp.gate.weight.grad, layer.mlp.gate_proj.weight.grad),
                                   (model.blocks[0].ln1.weight.grad, hf.model.layers[0].input_layernorm.weight.grad),
                                   (model.tok_emb.weight.grad, hf.model.embed_tokens.weight.grad),
                                   *(((model.blocks[1].attn.v.bias.grad, layer.self_attn.v_proj.bias.grad),)
                                     if qwen2 else ()),
                                   *(((model.blocks[1].attn.q_norm.weight.grad, layer.self_attn.q_norm.weight.grad),
                                      (model.blocks[1].attn.k_norm.weight.grad, layer.self_attn.k_norm.weight.grad),
                                      (model.blocks[1].attn.proj.weight.grad, layer.self_attn.o_proj.weight.grad))
                                     if family == "qwen3" else ())):
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-4, atol=1e-6)
    if m.window_layout != "none":  # the window matters: without it the logits are far off
        plain = build_model(m.replace(sliding_window=None, full_attention_layers=(), init_from=None,
                                      hf_model_type=None))
        plain.load_state_dict(model.state_dict())
        assert (plain.eval()(idx)[0] - theirs).abs().max() > 1e-2
    if family != "llama":
        return  # (the same network: the training below runs once)
    # untied on request (pipeline parallel needs it): the output layer starts as a copy, same logits
    untied = build_model(load_config(None, {"model.init_from": f"hf:{directory}", "model.tie_embeddings": False}).model)
    init_from_pretrained(untied)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(untied.eval()(idx)[0], model.eval()(idx)[0], rtol=0, atol=0)
    # trains on: the first step's loss is transformers' loss on that batch, and training lowers it
    o = {k: v for k, v in tiny(cache, tmp_path / "run").items() if not k.startswith("model.")}
    o.update({"model.init_from": f"hf:{directory}", "model.dropout": 0.0, "run.total_tokens": 48 * 8 * 4})
    lines: list[str] = []
    Trainer(load_config(resolve_config(None), o), o["run.out_dir"], log=lines.append).fit()
    assert f"init_from: the model starts from hf:{directory}'s weights (model_type llama)" in lines
    losses = [r["loss"] for r in read_metrics(o["run.out_dir"]) if r["kind"] == "train"]
    data = build_data(load_config(None, o).data, seq_len=48, objective="causal")
    batch = data.train.get_batch(range(8))
    with torch.no_grad():
        reference = float(F.cross_entropy(hf(input_ids=batch["input_ids"]).logits.reshape(-1, V),
                                          batch["targets"].reshape(-1)))
    assert len(losses) == 4 and losses[0] == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < losses[0]


def _variant(tmp_path: Path, source: Path, name: str, **changes) -> Path:
    """A copy of ``source``'s config.json with ``changes`` (None removes the field)."""
    path = tmp_path / name
    path.mkdir()
    raw = json.loads((source / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return path


def test_llama_configs_largebatch_cannot_compute_are_refused_naming_the_field(tmp_path, capsys):
    source = tmp_path / "llama"
    _llama_dir(source, 64)
    # transformers 4's layout: rope_theta at the top, rope_scaling beside it
    old = _variant(tmp_path, source, "v4", rope_parameters=None, rope_theta=3e4, rope_scaling=None)
    assert model_fields(old)["rope_theta"] == 3e4
    cases = {"yarn": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
                      ["rope_parameters with rope_type='yarn'", "'default', 'linear' and 'llama3'"]),
             "v4-dynamic": ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
                            ["rope_scaling with rope_type='dynamic'"]),
             "llama3-short": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
                              ["rope_type='llama3' without low_freq_factor, high_freq_factor"]),
             "biases": ({"attention_bias": True, "mlp_bias": False},
                        ["attention_bias=True and mlp_bias=False", "one model.bias"]),
             "qwen3-biases": ({"model_type": "qwen3", "attention_bias": True},
                              ["attention_bias=True", "q, k, v and o_proj", "model.bias covers the MLP"]),
             "head-dim-zero": ({"head_dim": 0}, ["head_dim=0", "positive integer"]),
             "gelu": ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "SwiGLU"]),
             "partial": ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor=0.5"]),
             "qwen2-layers": ({"model_type": "qwen2", "sliding_window": 16,
                               "layer_types": ["full_attention", "sliding_attention"]},
                              ["sliding_window=16", "use_sliding_window=False", "transformers' own model"]),
             "ministral-layers": ({"model_type": "ministral", "sliding_window": 16, "layer_types": ["full_attention"]},
                                  ["layer_types=['full_attention']", "each of the num_hidden_layers=2"])}
    for name, (changes, words) in cases.items():
        with pytest.raises(ConfigError) as err:
            model_fields(_variant(tmp_path, source, name, **changes))
        assert all(w in str(err.value) for w in words), str(err.value)
    # a head_dim other than hidden_size / num_attention_heads is model.head_size (and as many is none);
    # Qwen3 without the key has Qwen3Config's 128
    assert model_fields(_variant(tmp_path, source, "head-dim", head_dim=16))["head_size"] == 16
    assert model_fields(_variant(tmp_path, source, "head-dim-same", head_dim=8))["head_size"] is None
    qwen3 = model_fields(_variant(tmp_path, source, "qwen3-128", model_type="qwen3", head_dim=None))
    assert (qwen3["head_size"], qwen3["qk_norm"], qwen3["bias"], qwen3["hf_model_type"]) == (128, True, False, "qwen3")
    # a Qwen2 whose layer_types are all full attention has no window, whatever use_sliding_window says
    # (Qwen2Config builds layer_types from it only where they are not written)
    full = _variant(tmp_path, source, "qwen2-full", model_type="qwen2", use_sliding_window=True, sliding_window=16,
                    max_window_layers=0, layer_types=["full_attention", "full_attention"])
    assert model_fields(full)["position"] == "rope"
    # windows as transformers builds its layers: Qwen2's and Qwen3's from max_window_layers on (or by
    # layer_types), Mistral's on every layer, 4096 where config.json has no such key
    for family in ("qwen2", "qwen3"):
        windowed = _variant(tmp_path, source, f"{family}-window", model_type=family, use_sliding_window=True,
                            sliding_window=16, max_window_layers=1, layer_types=None)
        assert (model_fields(windowed)["sliding_window"], model_fields(windowed)["full_attention_layers"]) == (16, (0,))
    # a Mistral config.json with layer_types is read as transformers' AutoConfig reads it: a Ministral,
    # the window on the layers layer_types names
    typed = model_fields(_variant(tmp_path, source, "mistral-types", model_type="mistral", sliding_window=16,
                                  layer_types=["full_attention", "sliding_attention"]))
    assert (typed["sliding_window"], typed["full_attention_layers"], typed["hf_model_type"]) == (16, (0,), "ministral")
    # windows on no layer (max_window_layers past the last, or every layer full_attention) are none
    for name, changes in (("qwen2-past", {"max_window_layers": 2, "layer_types": None}),
                          ("qwen2-all-full", {"layer_types": ["full_attention"] * 2})):
        fields = model_fields(_variant(tmp_path, source, name, model_type="qwen2", use_sliding_window=True,
                                       sliding_window=16, **changes))
        assert (fields["sliding_window"], fields["full_attention_layers"]) == (None, ())
    wide = _variant(tmp_path, source, "wide", model_type="mistral", sliding_window=48)
    assert (model_fields(wide)["sliding_window"], model_fields(wide)["hf_model_type"]) == (48, "mistral")
    assert model_fields(_variant(tmp_path, source, "nokey", model_type="mistral", sliding_window=None,
                                 max_position_embeddings=8192))["sliding_window"] == 4096
    # and in one line from the command line, before training
    capsys.readouterr()  # (save_pretrained's progress bars)
    assert cli_main(["train", f"--model.init_from=hf:{tmp_path / 'biases'}", f"--run.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "attention_bias=True" in err, err


def test_a_layout_no_transformers_architecture_computes_is_refused(cache, tmp_path, capsys):
    """hf_model_type set: refused before training, naming the fields and the fix; unset: the model
    trains (a research layout) and its export is refused naming the fields."""
    from largebatch.integrations.hf_export import check_exportable

    base = ["--check", f"--run.out_dir={tmp_path / 'run'}", f"--data.cache_dir={cache}"]
    llama = [f"--{k}={v}" for k, v in LLAMA.items()]
    for args, words in (((*llama, "--model.hf_model_type=gpt2"),
                         ["model.hf_model_type='gpt2' with model.norm='rmsnorm', model.position='rope', "
                          "model.activation='swiglu'", "GPT2LMHeadModel computes LayerNorm", "after training",
                          "or use model.hf_model_type='llama'"]),
                        (("--model.position=rope", "--model.hf_model_type=gpt2"),
                         ["model.position='rope'", "set model.position='learned'"]),
                        (("--model.norm=rmsnorm", "--model.hf_model_type=llama"),
                         ["model.position='learned', model.activation='gelu'", "LlamaForCausalLM computes RMSNorm",
                          "set model.position='rope', model.activation='swiglu'"]),
                        (("--model.n_kv_head=2", "--model.hf_model_type=gpt2"),
                         ["model.n_kv_head=2", "set model.n_kv_head=None"])):
        assert cli_main(["train", *args, *base]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    for args in ((*llama, "--model.hf_model_type=llama"), ("--model.position=rope",)):  # the latter: no export
        assert cli_main(["train", *args, *base]) == 0
    capsys.readouterr()
    # (rope with LayerNorm, GeLU and biases is GPT-NeoX's layout: tests/test_gpt_neox.py; without biases, none)
    for fields, differs in (({"position": "rope", "bias": False}, "(train with model.position='learned')"),
                            ({"norm": "rmsnorm"}, "(train with model.norm='layernorm')"),
                            ({"norm": "rmsnorm", "position": "rope"}, "(train with model.activation='swiglu')"),
                            ({"kind": "bert", "norm_position": "post", "norm": "rmsnorm"},
                             "compute LayerNorm, learned positions")):
        cfg = ModelConfig(**fields)
        assert default_hf_model_type(cfg) == ("bert" if "kind" in fields else "gpt2")
        with pytest.raises(ExportError, match="no transformers architecture computes these") as err:
            check_exportable(cfg)
        assert differs in str(err.value), str(err.value)


def test_an_untied_llama_without_its_output_layer_is_refused(tmp_path):
    """LlamaConfig unties by default: a config.json without tie_word_embeddings whose weights hold no
    lm_head is missing that tensor (transformers loads it at random), not a tied model."""
    source = tmp_path / "tied"
    _llama_dir(source, 64)  # tied: its safetensors hold no lm_head.weight
    raw = json.loads((source / "config.json").read_text())
    del raw["tie_word_embeddings"]
    (source / "config.json").write_text(json.dumps(raw))
    cfg = model_fields_config(source)
    assert not cfg.tie_embeddings
    with pytest.raises(ConfigError) as err:
        init_from_pretrained(build_model(cfg))
    assert "lm_head.weight" in str(err.value), str(err.value)



def test_a_rotary_directory_trains_at_another_context_length(llama_run, tmp_path):
    """Rotary positions hold no table of max_position_embeddings rows: model.seq_len may be set past
    it (a context extension) or below it, and the first positions' logits are transformers' own;
    a phase longer than a rotary model's seq_len names raising it as the fix."""
    tokenizer = llama_run / "tokenizer.json"
    V = len(json.loads(tokenizer.read_text())["model"]["vocab"])
    directory = tmp_path / "hf"
    hf = _llama_dir(directory, V, tokenizer)  # max_position_embeddings 48
    for seq_len in (96, 16):
        cfg = load_config(None, {"model.init_from": f"hf:{directory}", "model.seq_len": seq_len}).model
        assert cfg.seq_len == seq_len
        model = build_model(cfg)
        init_from_pretrained(model)
        idx = torch.randint(0, V, (2, min(seq_len, 48)), generator=torch.Generator().manual_seed(3))
        theirs = hf(input_ids=idx).logits
        torch.testing.assert_close(model.eval()(idx)[0], theirs, rtol=0,
                                   atol=5e-6 * float(theirs.detach().abs().max()))


def test_a_llama_trained_with_attention_dropout_is_noted(llama_run, tmp_path):
    """Llama's one dropout rate (attention_dropout, 0 by default) gives way to the run's, said in a
    note as for GPT-2's and BERT's rates; the default 0 against a run without dropout says nothing."""
    tokenizer = llama_run / "tokenizer.json"
    V = len(json.loads(tokenizer.read_text())["model"]["vocab"])
    plain, dropped = tmp_path / "plain", tmp_path / "dropped"
    _llama_dir(plain, V, tokenizer)
    _llama_dir(dropped, V, tokenizer, attention_dropout=0.1)
    notes = []
    load_config(None, {"model.init_from": f"hf:{plain}"}, warn=notes.append)
    assert not [n for n in notes if "dropout" in n], notes
    load_config(None, {"model.init_from": f"hf:{dropped}"}, warn=notes.append)
    assert [n for n in notes if "attention_dropout=0.1" in n and "--model.dropout=0.1" in n], notes


def test_a_rotary_directory_takes_another_rope_theta_for_a_context_extension(llama_run, tmp_path):
    """The route the resume refusal names: from an export (a rotary directory), a new run at a longer
    model.seq_len and another model.rope_theta (no weight depends on either)."""
    tokenizer = llama_run / "tokenizer.json"
    V = len(json.loads(tokenizer.read_text())["model"]["vocab"])
    directory = tmp_path / "hf"
    _llama_dir(directory, V, tokenizer)  # rope_theta 20000, 48 positions
    notes: list[str] = []
    cfg = load_config(None, {"model.init_from": f"hf:{directory}", "model.seq_len": 96,
                             "model.rope_theta": 5e5}, warn=notes.append).model
    assert (cfg.seq_len, cfg.rope_theta) == (96, 5e5)
    init_from_pretrained(build_model(cfg))
    assert [n for n in notes if "model.rope_theta=500000.0 (config.json: 20000.0)" in n], notes
    # a rope scaling too, under the default recipe (learned positions until the directory's are read)
    notes.clear()
    cfg = load_config(None, {"model.init_from": f"hf:{directory}", "model.rope_scaling": "linear",
                             "model.rope_factor": 2.0}, warn=notes.append).model
    assert (cfg.position, cfg.rope_scaling, cfg.rope_factor) == ("rope", "linear", 2.0)
    assert [n for n in notes if "model.rope_scaling='linear' (config.json: 'none')" in n], notes
    init_from_pretrained(build_model(cfg))
    # a scaling config.json gives that the model refuses: named with the file
    bands = _variant(tmp_path, directory, "equal-bands", rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0})
    with pytest.raises(ConfigError, match=r"equal-bands/config.json gives a model largebatch refuses: "
                                          r"ModelConfig.rope_high_freq_factor=4.0 must exceed"):
        load_config(None, {"model.init_from": f"hf:{bands}"})
    # where the directory has learned positions, a scaling is refused by name
    gpt2 = tmp_path / "gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, vocab_size=V)).save_pretrained(gpt2)
    shutil.copy(tokenizer, gpt2 / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"model.rope_scaling='linear' but hf:.*gpt2 has learned positions"):
        load_config(None, {"model.init_from": f"hf:{gpt2}", "model.rope_scaling": "linear"})


def test_the_rope_table_is_read_as_transformers_reads_it(tmp_path):
    """Which of config.json's rope keys decides, against transformers' own reading of the same file
    (LlamaConfig's rope_parameters): transformers 4's rope_scaling over 5's rope_parameters, the
    base from the table over the top-level rope_theta, a top-level original_max_position_embeddings
    over the table's, max_position_embeddings where neither gives one."""
    from transformers import LlamaConfig

    source = tmp_path / "llama"
    _llama_dir(source, 64)
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    cases = {"both": {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
                      "rope_scaling": llama3},
             "theta-in-table": {"rope_parameters": None, "rope_theta": 1e4,
                                "rope_scaling": {**llama3, "rope_theta": 5e5}},
             "default-and-scaling": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                     "rope_scaling": llama3},
             "top-original": {"rope_parameters": {**llama3, "rope_theta": 5e5}, "original_max_position_embeddings": 8},
             "no-original": {"rope_parameters": {k: v for k, v in llama3.items()
                                                 if k != "original_max_position_embeddings"}}}
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from largebatch.models.layers import Rotary

    for name, changes in cases.items():
        path = _variant(tmp_path, source, name, **changes)
        theirs = LlamaRotaryEmbedding(LlamaConfig.from_pretrained(path)).inv_freq  # (what its model rotates by)
        ours = Rotary(model_fields_config(path))
        # the frequencies w, from the tables' row of position 1: cos(w), sin(w) (w <= 1 < pi)
        angles = torch.atan2(ours.sin[1, : ours.head_dim // 2].double(), ours.cos[1, : ours.head_dim // 2].double())
        torch.testing.assert_close(angles, theirs.double(), rtol=1e-6, atol=0, msg=name)


def test_llama3_and_linear_rope_scaling_is_the_formula():
    """model.rope_scaling against the formula written out here in float64 (Llama 3.1's frequency
    bands; linear interpolation), at a head size and base that reach all three bands."""
    from largebatch.models.layers import scaled_frequencies

    d, theta = 64, 5e5
    w = [theta ** (-2 * i / d) for i in range(d // 2)]
    factor, low, high, original = 32.0, 1.0, 4.0, 8192
    want = []
    for f in w:
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            want.append(f)
        elif wavelength > original / low:
            want.append(f / factor)
        else:
            a = (original / wavelength - low) / (high - low)
            want.append((1 - a) * f / factor + a * f)
    got = scaled_frequencies(torch.tensor(w, dtype=torch.float64), "llama3", factor, low, high, original)
    assert got.tolist() == pytest.approx(want, rel=1e-14)
    kept = sum(g == f for g, f in zip(got.tolist(), w))
    divided = sum(g == pytest.approx(f / factor, rel=1e-14) for g, f in zip(got.tolist(), w))
    assert kept > 0 and divided > 0 and kept + divided < d // 2  # the three bands all occur
    linear = scaled_frequencies(torch.tensor(w, dtype=torch.float64), "linear", 4.0, low, high, original)
    assert linear.tolist() == pytest.approx([f / 4.0 for f in w], rel=1e-15)


def test_a_rope_factor_the_scaling_does_not_read_is_refused_naming_the_scaling(tmp_path, capsys):
    """--model.rope_factor=32 without rope_scaling trained unscaled, silently; a llama3 band under
    the linear scaling likewise. The defaults (a copy of a run's config.toml writes every field) pass,
    and a run's saved config with such a factor still loads (its export, --resume)."""
    from largebatch.cli import main as cli_main
    from largebatch.train.config import ConfigError

    rope = {"model.position": "rope", "model.norm": "rmsnorm"}
    for given, scaling in (({"model.rope_factor": 32.0}, "none"), ({"model.rope_original_seq_len": 4096}, "none"),
                           ({"model.rope_low_freq_factor": 2.0}, "linear"),
                           ({"model.rope_high_freq_factor": 8.0}, "linear")):
        name = next(iter(given))
        with pytest.raises(ConfigError, match=rf"{name}=.* with model.rope_scaling='{scaling}': it is read "
                                              rf"with rope_scaling .* only, so it would change nothing"):
            load_config(None, {**rope, "model.rope_scaling": scaling, **given})
    load_config(None, {**rope, "model.rope_scaling": "linear", "model.rope_factor": 4.0})
    load_config(None, {**rope, "model.rope_scaling": "llama3", "model.rope_factor": 32.0,
                       "model.rope_low_freq_factor": 2.0})
    load_config(None, {**rope, "model.rope_factor": 8.0, "model.rope_original_seq_len": 8192})  # (the defaults)
    # from a transformers directory without a scaling: its rope_scaling is the one that does not read it
    from test_export import roberta_style_tokenizer

    directory = tmp_path / "llama"
    _llama_dir(directory, 400, Path(roberta_style_tokenizer(tmp_path / "tokenizer.json")))
    with pytest.raises(ConfigError, match=r"model.rope_factor=32.0 with model.rope_scaling='none'"):
        load_config(None, {"model.init_from": f"hf:{directory}", "model.rope_factor": 32.0})
    load_config(None, {"model.init_from": f"hf:{directory}", "model.rope_scaling": "linear",
                       "model.rope_factor": 32.0})  # (a scaling given with it: read)
    saved = load_config(None, {**rope, "model.rope_factor": 32.0}, resolve_init=False)  # (a --resume's)
    assert ModelConfig(**{**saved.model.__dict__}).rope_factor == 32.0  # (an export's: the model alone)
    assert cli_main(["train", "llama-demo", "--model.rope_factor=32", "--check",
                     f"--run.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "model.rope_factor=32.0 with model.rope_scaling='none'" in err and "or leave model.rope_factor" in err, err


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},  # Llama 3.2
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 2e4, "factor": 4.0}}])
def test_a_scaled_rope_llama_imports_with_its_logits_and_goes_out_and_back(rope, tmp_path):
    """A LlamaForCausalLM with Llama 3.2's rope scaling (or a linear one), built by transformers:
    init_from reads the scaling, gives its logits at every position, and the export writes it back
    (transformers' model of the export gives largebatch's logits; init_from of it, the same model)."""
    from largebatch.integrations.hf_export import save_hf

    source = tmp_path / "llama"
    hf = _llama_dir(source, 64, head_dim=8, **rope)
    fields = model_fields(source)
    table = rope["rope_parameters"]
    assert (fields["rope_scaling"], fields["rope_factor"]) == (table["rope_type"], table["factor"])
    cfg = model_fields_config(source)
    ours = build_model(cfg)
    init_from_pretrained(ours)
    ours.eval().config = cfg.replace(init_from=None, hf_model_type=None)  # (a run of its own from here)
    idx = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(input_ids=idx).logits, rtol=0, atol=2e-5)
    plain = build_model(cfg.replace(rope_scaling="none"))  # (the scaling changes the logits)
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain.eval()(idx)[0], ours(idx)[0], atol=1e-3)
    from transformers import AutoModelForCausalLM

    save_hf(ours, None, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written["rope_parameters"][k] for k in table} == table
    assert written["rope_scaling"] == written["rope_parameters"]  # (transformers 4's key too: GGUF conversion)
    _same_logits_and_back(ours, AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), tmp_path / "out")


def test_a_llama3_context_longer_than_first_trained_is_noted_unless_seq_len_is_given():
    """Llama 3.1 and 3.2 declare 131072 positions (Qwen3 40960): init_from makes that the run's sequence length
    unless --model.seq_len is given, which a note says, naming the context first trained on."""
    from types import SimpleNamespace

    from largebatch.train.hf_import import context_note

    long = ModelConfig(init_from="hf:llama-3.2", seq_len=131072, rope_scaling="llama3", rope_factor=32.0,
                       **{k[6:]: v for k, v in LLAMA.items()})
    note = context_note(SimpleNamespace(model=long), set())
    assert "model.seq_len=131072 is hf:llama-3.2's max_position_embeddings" in note and "e.g. 8192" in note
    assert context_note(SimpleNamespace(model=long), {"model.seq_len"}) is None
    assert context_note(SimpleNamespace(model=long.replace(seq_len=8192)), set()) is None
    # without a scaling, a context past 8192 (Qwen3's 40960) is noted too; learned positions never
    qwen3 = long.replace(rope_scaling="none", seq_len=40960, head_size=128, qk_norm=True)
    note = context_note(SimpleNamespace(model=qwen3), set())
    assert "model.seq_len=40960" in note and "e.g. 4096; the model's rotary positions take any length" in note
    assert context_note(SimpleNamespace(model=qwen3.replace(seq_len=8192)), set()) is None
    assert context_note(SimpleNamespace(model=ModelConfig(init_from="hf:gpt2", seq_len=16384)), set()) is None
