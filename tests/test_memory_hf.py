"""Hugging Face configs in the memory model: the GPT-2 presets, `config_from_hf` / `--hf-config`
against a float64 transcription of docs/papers.md: memory, refusals, and what transformers' eager
GPT-2 and BERT layers really keep (measured on CPU) against the closed form."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from largebatch.memory import (
    activation_bytes_per_layer,
    config_from_hf,
    config_layer_kwargs,
    hf_eager_bytes_per_layer,
    model_activation_bytes,
)
from largebatch.memory.cli import main as memory_main
from largebatch.memory.hf import hf_activation
from largebatch.models import preset

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("hf_memory", ROOT / "benchmarks" / "hf_memory.py")
hf_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_memory)


def paper_per_layer(s, b, h, a):
    """docs/papers.md: memory, no parallelism: s*b*h*(34 + 5*a*s/h) bytes (16-bit, 1-byte masks)."""
    s, b, h, a = map(float, (s, b, h, a))
    return s * b * h * (34 + 5 * a * s / h)


def breakdown_per_layer(s, b, h, a, d, m, gelu_extra=0):
    """The docs/papers.md breakdown with d-byte activations and m-byte dropout masks: attention
    11sbh + 5as^2b (QKV input, Q, K, V, projection input: 5 h values; softmax output, its mask, dropout
    output), MLP 19sbh (fc1 input h, GeLU input 4h, fc2 input 4h values; mask), LayerNorm inputs 2 h
    values. gelu_extra: more 4h-wide tensors kept per token (transformers' gelu_new: 3)."""
    s, b, h, a = map(float, (s, b, h, a))
    values = 5 * h + (h + 8 * h) + 2 * h + gelu_extra * 4 * h
    return s * b * (values * d + 2 * h * m) + a * s * s * b * (2 * d + m)


def gpt2_dict(**kw):
    return transformers.GPT2Config(**kw).to_dict()


def bert_dict(**kw):
    return transformers.BertConfig(**kw).to_dict()


def roberta_dict(**kw):
    return transformers.RobertaConfig(**kw).to_dict()


# (name, HF config dict, matching preset or None)
CONFIGS = [
    ("gpt2-tiny", gpt2_dict(vocab_size=64, n_positions=128, n_embd=128, n_layer=2, n_head=4), None),
    ("gpt2", gpt2_dict(), "gpt2-small"),
    ("gpt2-medium", gpt2_dict(n_layer=24, n_embd=1024, n_head=16), "gpt2-medium"),
    ("gpt2-large", gpt2_dict(n_layer=36, n_embd=1280, n_head=20), "gpt2-large"),
    ("gpt2-xl", gpt2_dict(n_layer=48, n_embd=1600, n_head=25), "gpt2-xl"),
    ("bert-tiny", bert_dict(vocab_size=64, hidden_size=128, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=512,
                            max_position_embeddings=128), None),
    ("bert-base", bert_dict(), "bert-base"),
    ("bert-large", bert_dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                             intermediate_size=4096), "bert-large"),
    # RoBERTa's 514 rows (positions from pad_token_id + 1 = 2) are BERT's 512 positions
    ("roberta-base", roberta_dict(vocab_size=30522, max_position_embeddings=514, pad_token_id=1,
                                  type_vocab_size=1), "bert-base"),
]


def test_gpt2_presets_are_the_released_sizes():
    for name, (L, h, a) in {"gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16),
                            "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}.items():
        c = preset(name)
        assert (c.kind, c.n_layer, c.n_embd, c.n_head, c.ffn, c.seq_len, c.vocab_size, c.dropout) == \
            ("gpt", L, h, a, 4 * h, 1024, 50257, 0.1), name
    c = preset("bert-large")  # Devlin et al. 2019
    assert (c.kind, c.n_layer, c.n_embd, c.n_head, c.ffn, c.seq_len, c.vocab_size) == \
        ("bert", 24, 1024, 16, 4096, 512, 30522)


# the released checkpoints' parameter counts (their safetensors' totals; tied matrices once)
RELEASED = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800,
            "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360}


def test_llama3_and_qwen3_presets_are_the_released_sizes():
    """Each preset counts its released checkpoint's parameters exactly, and is what config_from_hf
    reads from transformers' config of that model (written here from the published config.json: the
    context aside, which the presets set to the main pretraining stage's)."""
    from largebatch.memory.estimate import stage_parameters

    for name, count in RELEASED.items():
        assert stage_parameters(preset(name)) == count, name
    llama = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}).to_dict()
    assert config_from_hf(llama) == preset("llama3-8b")
    qwen = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}).to_dict()
    assert config_from_hf(qwen) == preset("qwen3-0.6b").replace(seq_len=40960)


def _printed_rows(out: str) -> dict[str, float]:
    """The 'per layer' MiB of each row of the printed table."""
    return {m.group(1).strip(): float(m.group(2))
            for m in re.finditer(r"^  (\S.*?)\s{2,}(\d+\.\d) MiB", out, re.M)}


@pytest.mark.parametrize("name, raw, preset_name", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_hf_config_gives_the_paper_formula_and_the_preset(name, raw, preset_name, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    offset = 2 if name.startswith("roberta") else 0  # RoBERTa's rows 0, 1: never a position
    s, h, a = raw["n_positions"] if "n_positions" in raw else raw["max_position_embeddings"] - offset, \
        raw.get("n_embd", raw.get("hidden_size")), raw.get("n_head", raw.get("num_attention_heads"))
    L = raw.get("n_layer", raw.get("num_hidden_layers"))
    b, t = 2, (4 if a % 4 == 0 else 5)  # gpt2-xl has 25 heads
    for source in (tmp_path, tmp_path / "config.json", raw):  # directory, file, dict
        c = config_from_hf(source)
        kw = config_layer_kwargs(c)
        assert activation_bytes_per_layer(s, b, **kw) == pytest.approx(paper_per_layer(s, b, h, a), rel=1e-12)
        assert activation_bytes_per_layer(s, b, tp=t, sequence_parallel=True, recompute="selective",
                                          **kw) == pytest.approx(34 * s * b * h / t, rel=1e-12)
    if c.kind == "gpt":  # whole model: L layers + embedding mask + output layer (docs/papers.md)
        v = raw["vocab_size"]
        assert model_activation_bytes(c, b) == pytest.approx(
            L * paper_per_layer(s, b, h, a) + s * b * h + 4 * s * b * h * (1 + v / h), rel=1e-12)
    if preset_name:
        expected = preset(preset_name)
        if c.kind == "bert":  # transformers' BERT is post-LN; the presets are pre-LN
            expected = expected.replace(norm_position="post")
        else:  # GPT-2's gelu_new is the tanh GeLU (the presets keep the exact one: the same bytes and FLOPs)
            expected = expected.replace(activation="gelu_tanh")
        assert c == expected
    assert memory_main(["--hf-config", str(tmp_path), "--micro-batch", str(b)]) == 0
    rows = _printed_rows(capsys.readouterr().out)
    assert rows["no parallelism"] == pytest.approx(paper_per_layer(s, b, h, a) / 2**20, abs=0.051)
    if preset_name:
        assert memory_main(["--model", preset_name, "--micro-batch", str(b)]) == 0
        assert _printed_rows(capsys.readouterr().out) == rows


def test_preset_cli_prints_the_paper_table(capsys):
    assert memory_main(["--model", "gpt2-medium"]) == 0
    rows = _printed_rows(capsys.readouterr().out)
    assert rows["no parallelism"] == pytest.approx(paper_per_layer(1024, 1, 1024, 16) / 2**20, abs=0.051)
    assert rows["tensor parallel + selective recompute"] == 34 * 1024 * 1024 / 2**20


@pytest.mark.parametrize("raw, match", [
    (transformers.MixtralConfig().to_dict(), r"model_type='mixtral': not supported.*mixture-of-experts"),
    (transformers.GemmaConfig().to_dict(), r"model_type='gemma': not supported.*GeGLU"),
    # sliding layers without a window: transformers' own Qwen2 fails to build their mask
    ({**transformers.Qwen2Config(num_hidden_layers=2).to_dict(),
      "layer_types": ["full_attention", "sliding_attention"]},
     r"'qwen2' has layer_types naming sliding layers with use_sliding_window=False.*transformers' own model"),
    ({**transformers.LlamaConfig().to_dict(), "model_type": "ministral", "sliding_window": 0},
     r"'ministral' has sliding_window=0; it must be a positive number"),
    ({**transformers.LlamaConfig().to_dict(), "hidden_size": 100, "head_dim": None},
     r"hidden_size=100, num_attention_heads=32 and no head_dim.*must divide hidden_size"),
    ({**transformers.LlamaConfig().to_dict(), "head_dim": 0}, r"head_dim=0; it must be a positive integer"),
    (transformers.LlamaConfig(hidden_act="gelu").to_dict(), r"'llama' has hidden_act='gelu'.*SwiGLU"),
    (transformers.LlamaConfig(num_key_value_heads=3).to_dict(), r"num_key_value_heads=3.*to divide"),
    ({**transformers.LlamaConfig().to_dict(), "attention_dropout": None}, r"'attention_dropout'=None: expected"),
    ({"model_type": "mamba"}, r"model_type='mamba': not supported; the memory model describes GPT-2"),
    ({"architectures": ["FooForCausalLM"]}, r"architectures=\['FooForCausalLM'\] \(no model_type\)"),
    (roberta_dict(max_position_embeddings=2), r"max_position_embeddings=2 leaves no position after the 2 rows"),
    (gpt2_dict(activation_function="relu"), r"'activation_function'='relu': not supported"),
    (gpt2_dict(attn_pdrop=0.0), r"attn_pdrop = 0 while resid_pdrop, embd_pdrop > 0.*all to 0"),
    (gpt2_dict(reorder_and_upcast_attn=True), r"'reorder_and_upcast_attn'=True: not supported"),
    (bert_dict(position_embedding_type="relative_key"),
     r"'position_embedding_type'='relative_key': not supported.*use 'absolute'"),
    (bert_dict(is_decoder=True, add_cross_attention=True), r"'add_cross_attention'=True"),
    ({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_positions": 8, "vocab_size": 8},
     r"field 'n_embd' is missing"),
    (gpt2_dict(n_embd=100, n_head=3), r"n_head=3 does not divide n_embd=100"),
])
def test_unsupported_configs_are_refused_by_name(raw, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(raw)


def test_bad_paths_and_cli_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="no such file; give a config.json or a directory"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(transformers.MixtralConfig().to_dict()))
    assert memory_main(["--hf-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("largebatch memory: error: hf config model_type='mixtral'") and err.count("\n") == 1
    assert memory_main(["--hf-config", str(tmp_path), "--config", "x.toml"]) == 2
    assert "give one" in capsys.readouterr().err
    assert memory_main(["--hf-config", str(tmp_path), "--model", "gpt2-xl"]) == 2
    assert capsys.readouterr().err.startswith("largebatch memory: error: --model 'gpt2-xl' and --hf-config")


def test_config_from_hf_does_not_import_transformers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(gpt2_dict()))
    code = ("import sys; from largebatch.memory import config_from_hf, hf_eager_bytes_per_layer; "
            f"config_from_hf({str(tmp_path)!r}); hf_eager_bytes_per_layer({str(tmp_path)!r}, 1); "
            "assert 'transformers' not in sys.modules, 'imported'")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# Measured: transformers' eager layers on CPU (dropout 0.1, training), per layer, against the
# closed form (ratio band) and against the breakdown with transformers' extra tensors (1%).
# F.dropout on CPU keeps a d-byte mask; "bool" runs torch.native_dropout (CUDA's F.dropout mask).
MEASURED = [  # kind, s, b, h, a, dtype, bool masks, band for measured / closed form
    ("gpt2", 128, 4, 128, 4, torch.float32, False, (1.60, 1.70)),
    ("gpt2", 64, 4, 256, 8, torch.float32, False, (1.67, 1.77)),
    ("gpt2", 128, 4, 128, 4, torch.bfloat16, False, (1.51, 1.61)),
    ("gpt2", 128, 4, 128, 4, torch.float32, True, (1.42, 1.52)),
    ("bert", 128, 4, 128, 4, torch.float32, False, (1.15, 1.21)),
    ("bert", 128, 4, 128, 4, torch.bfloat16, False, (1.09, 1.14)),
    ("bert", 128, 4, 128, 4, torch.float32, True, (0.99, 1.02)),
    ("roberta", 128, 4, 128, 4, torch.float32, False, (1.15, 1.21)),
    ("gpt2-pytorch-tanh", 128, 4, 128, 4, torch.float32, False, (1.15, 1.21)),  # one kernel: no extra
]


@pytest.mark.parametrize("kind, s, b, h, a, dtype, bool_masks, band", MEASURED, ids=[
    f"{m[0]}-s{m[1]}-h{m[3]}-a{m[4]}-{str(m[5])[6:]}-{'bool' if m[6] else 'float'}-masks" for m in MEASURED])
def test_measured_hf_eager_layers(kind, s, b, h, a, dtype, bool_masks, band):
    torch.manual_seed(0)
    d = dtype.itemsize
    if bool_masks:
        with hf_memory.bool_mask_dropout():
            tensors, allocator = hf_memory.measured_per_layer(kind, s, b, h, a, dtype)
    else:
        tensors, allocator = hf_memory.measured_per_layer(kind, s, b, h, a, dtype)
    closed = breakdown_per_layer(s, b, h, a, d, m=1)
    if d == 2:
        assert closed == pytest.approx(paper_per_layer(s, b, h, a), rel=1e-12)
    assert band[0] <= tensors / closed <= band[1], tensors / closed
    # which tensors make the difference: d-byte dropout masks on CPU, 3 more 4h tensors for gelu_new
    hf_terms = breakdown_per_layer(s, b, h, a, d, m=1 if bool_masks else d,
                                   gelu_extra=3 if kind == "gpt2" else 0)
    assert tensors == pytest.approx(hf_terms, rel=0.01)
    if allocator is not None:
        assert allocator == pytest.approx(hf_terms, rel=0.02)
    raw = hf_memory.hf_config(kind, 1, s, h, a).to_dict()
    assert hf_eager_bytes_per_layer(raw, b, dtype_bytes=d, device="cuda" if bool_masks else "cpu") \
        == pytest.approx(hf_terms, rel=1e-12)


def test_the_documented_cli_line_is_what_the_code_prints(tmp_path, capsys):
    # docs/memory.md shows this command's output; the tiny config is written as the docs say
    raw = gpt2_dict(vocab_size=64, n_positions=128, n_embd=128, n_layer=2, n_head=4)
    (tmp_path / "tiny-gpt2.json").write_text(json.dumps(raw))
    assert memory_main(["--hf-config", str(tmp_path / "tiny-gpt2.json"), "--micro-batch", "4",
                        "--dtype-bytes", "4"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "HF eager" in line or "bool dropout" in line]
    assert len(lines) == 2 and "~1.65x" in lines[0] and "~1.47x" in lines[1]
    docs = (ROOT / "docs" / "memory.md").read_text()
    for line in lines:
        assert line in docs
    # with --attention sdpa the model is not transformers' eager one: no comparison with it
    assert memory_main(["--hf-config", str(tmp_path / "tiny-gpt2.json"), "--micro-batch", "4",
                        "--dtype-bytes", "4", "--attention", "sdpa"]) == 0
    assert "HF eager" not in capsys.readouterr().out


def test_a_transformers_bert_head_runs_on_every_position(tmp_path, capsys):
    """transformers' BertForMaskedLM computes its head and fp32 logits on every position, where
    largebatch's runs on the masked ones: --hf-config planned a BERT's head at 15% of the positions
    (measured 27.27 MiB against 12.80 estimated at vocabulary 8192). The whole model's forward bytes
    (dropout off) against the estimate with the head on all positions, and the CLI's estimate."""
    import transformers

    from largebatch.memory import Setup, config_from_hf, measure_forward_bytes

    torch.manual_seed(0)
    s, b, v = 128, 4, 8192
    raw = {"model_type": "bert", "vocab_size": v, "max_position_embeddings": s, "hidden_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512,
           "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    model = transformers.BertForMaskedLM(transformers.BertConfig(**raw, attn_implementation="eager")).train()
    ids = torch.randint(0, v, (b, s))
    labels = torch.where(torch.rand(b, s) < 0.15, ids, torch.full_like(ids, -100))
    for _ in range(2):  # (the first forward also allocates what torch keeps for later ones)
        out, measured = measure_forward_bytes(lambda: tuple(model(input_ids=ids, labels=labels).values()))
        del out
    config = config_from_hf(raw)
    every = Setup(micro_batch=b, dtype_bytes=4, hf_activation="gelu", mask_fraction=1.0).estimate(config, "none")
    assert measured.tensor_bytes == pytest.approx(every.activations, rel=0.01)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "vocab_size": 32768, "max_position_embeddings": 512}))
    assert memory_main(["--hf-config", str(path), "--micro-batch", "8", "--dtype-bytes", "4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Per device, no recompute"))
    config = config_from_hf({**raw, "vocab_size": 32768, "max_position_embeddings": 512})
    expected = Setup(micro_batch=8, dtype_bytes=4, hf_activation="gelu", mask_fraction=1.0).estimate(config, "none")
    assert line.endswith(str(expected)) and expected.activations > Setup(
        micro_batch=8, dtype_bytes=4, hf_activation="gelu").estimate(config, "none").activations + 0.3 * 2**30


@pytest.mark.parametrize("text, fragment", [
    ("[1, 2]", "holds a JSON list, not an object of fields"),
    (json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64,
                 "vocab_size": 100, "attn_pdrop": None}), "field 'attn_pdrop'=None: expected a dropout probability"),
    (json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64,
                 "vocab_size": 100, "n_inner": 0}), "field 'n_inner'=0: expected the MLP's width"),  # (ffn_hidden)
])
def test_a_config_json_of_another_shape_is_one_line(text, fragment, tmp_path, capsys):
    """(A list raised AttributeError, a null dropout TypeError: tracebacks.)"""
    path = tmp_path / "config.json"
    path.write_text(text)
    assert memory_main(["--hf-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_transformers_config_objects_and_activation_names():
    """``config_from_hf(GPT2Config(...))`` was a TypeError from inside pathlib, and GPT-2's gelu_new
    came back as the exact GeLU (``hf:`` imports it as gelu_tanh); a misspelt ``Setup.hf_activation``
    ("gelu-new") was counted as a fused GeLU: 3 f d bytes per token fewer than GPT-2's eager layer."""
    transformers = pytest.importorskip("transformers")
    from largebatch.memory import Setup, hf_eager_layer_bytes
    from largebatch.train.hf_import import HF_ACTIVATIONS
    for act, ours in HF_ACTIVATIONS.items():
        gpt = config_from_hf(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, activation_function=act))
        bert = config_from_hf(transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                                      intermediate_size=256, hidden_act=act))
        assert (gpt.n_layer, gpt.n_embd, gpt.activation) == (2, 64, ours)
        assert (bert.kind, bert.ffn, bert.activation) == ("bert", 256, ours)
    with pytest.raises(ValueError, match=r"hf config 3: expected a config.json path"):
        config_from_hf(3)
    g = preset("gpt2-small")
    fused = Setup(micro_batch=8, hf_activation="gelu").estimate(g, "none").total
    pointwise = Setup(micro_batch=8, hf_activation="gelu_new").estimate(g, "none").total
    s, b, f, d, L = 1024, 8, 4 * 768, 2, 12
    assert pointwise - fused == pytest.approx(L * s * b * 3 * f * d, rel=1e-12)
    for bad in ("gelu-new", "relu"):
        with pytest.raises(ValueError, match=rf"Setup.hf_activation='{bad}': not a transformers activation"):
            Setup(micro_batch=8, hf_activation=bad)
        with pytest.raises(ValueError, match=rf"activation='{bad}'"):
            hf_eager_layer_bytes(g, bad, 8)


def test_numpy_integers_and_the_bert_head_share():
    """numpy integers (a sweep over ``np.arange``) were refused as "not a positive integer"; a
    ``mask_fraction`` of 2 was accepted and doubled the BERT head's bytes."""
    import numpy as np

    from largebatch.memory import Setup, cheapest_plan, estimate
    from largebatch.models import ModelConfig
    g = preset("gpt2-small")
    assert estimate(g, np.int64(2), tp=np.int64(4), dp=np.int32(2)) == estimate(g, 2, tp=4, dp=2)
    assert cheapest_plan(g, Setup(micro_batch=2), np.int64(60 * 2**30)) == cheapest_plan(g, Setup(micro_batch=2),
                                                                                      60 * 2**30)
    # gpt3-175b's sizes as int32 (what an np.arange sweep gives): their products passed 2^31 and wrapped,
    # to -1 GiB a layer and a 16 GiB model, and a plan "fitted" 80 GiB at micro-batch 64 (nothing does)
    from largebatch.memory import activation_bytes_per_layer, model_activation_bytes

    s, b, h, a = 2048, 64, 12288, 96
    paper = s * b * h * (34 + 5 * a * s / h)  # Table 2, no parallelism, 16-bit values and 1-byte masks
    assert activation_bytes_per_layer(*map(np.int32, (s, b, h, a))) == pytest.approx(paper, rel=1e-12)
    big = preset("gpt3-175b")
    assert model_activation_bytes(big, np.int32(b)) == model_activation_bytes(big, b) > 96 * paper
    assert estimate(big, np.int32(b), tp=8, pp=8, sequence_parallel=True) == estimate(
        big, b, tp=8, pp=8, sequence_parallel=True)
    assert cheapest_plan(big, Setup(tp=8, pp=8, sequence_parallel=True, micro_batch=np.int32(b)), 80 * 2**30) is None
    c = ModelConfig(n_layer=np.int64(2), ffn_hidden=np.int64(256))
    assert type(c.n_layer) is int and type(c.ffn_hidden) is int and c == ModelConfig(n_layer=2, ffn_hidden=256)
    for bad in (0, 2, float("nan")):
        with pytest.raises(ValueError, match=r"mask_fraction=.*in \(0, 1\]"):
            Setup(mask_fraction=bad).estimate(preset("bert-base"), "none")


# ---------------------------------------------------------------------------------- Llama family
def llama_reference(s, b, h, a, a_kv, f, d, *, eager, dropout, m, policy="none", dh=None, qk_norm=False,
                    window=False, olmo=False):
    """What one transformers LlamaDecoderLayer keeps, in float64 from the saved tensors its graph
    holds (docs/memory.md), not from the code under test. Per token: two RMSNorms, each its fp32
    input (4 h bytes: the input itself in fp32), the d-byte normalised tensor the gain needs, a
    4-byte rsqrt; the Q/K/V and MLP inputs, q after the rotation, the o_proj input (4 h values);
    K and V at all a heads in eager attention (repeat_kv's copies are what Q K^T and P V keep),
    at a_kv heads through sdpa (enable_gqa) or inside selective recompute's checkpoint (its inputs);
    SwiGLU's gate output, SiLU output, up output and down input (4 f values). The core (policy
    "none"): eager, the fp32 softmax (4 bytes a score) and what P V keeps -- the cast to d bytes
    (no copy in fp32), or with dropout its mask (m bytes) and output (d); sdpa a 4-byte log-sum-exp
    per head. "full": the layer input. Heads of ``dh`` values (Qwen3's head_dim; h / a when None): q
    and the o_proj input are a dh wide, K and V a dh (eager) or a_kv dh. ``qk_norm`` (Qwen3): q_norm
    and k_norm are written out as the layer norms, per head an fp32 input (4 dh bytes), the d-byte
    normalised tensor and a 4-byte rsqrt. ``window``: a sliding window shorter than s (Mistral's), whose
    mask sdpa reads: transformers then passes no enable_gqa (K and V at all a heads, as eager keeps
    them) and sdpa keeps its mask converted to the queries' dtype, s values a token (policy "none").
    ``olmo`` (Olmo2RMSNorm, OLMo 2 and 3): every norm multiplies the fp32 normalised tensor by its
    gain and then casts, so keeps that tensor in fp32 (4 bytes a value, not d); q_norm and k_norm
    normalise the whole projections (a dh and a_kv dh values), one rsqrt a token each."""
    s, b, h, a, a_kv, f, d, m = map(float, (s, b, h, a, a_kv, f, d, m))
    dh = h / a if dh is None else float(dh)
    if policy == "full":
        return s * b * h * d
    normalised = 4.0 if olmo else d
    norms = 2 * (4 * h + h * normalised + 4)
    masked_sdpa = window and not eager and policy == "none"
    # (one key/value head: repeat_kv's expand and reshape are a view, which sdpa reads uncopied; eager's
    # matmuls keep a copy at all heads all the same)
    repeated = policy == "none" and (eager or (masked_sdpa and a_kv > 1))
    k_and_v = 2 * a * dh * d if repeated else 2 * a_kv * dh * d
    per_token = norms + 2 * h * d + 2 * a * dh * d + k_and_v + 4 * f * d
    if olmo:
        per_token += (a + a_kv) * dh * (4 + normalised) + 2 * 4
    elif qk_norm:
        per_token += (a + a_kv) * (4 * dh + dh * d + 4)
    if policy == "none":
        if not eager:
            per_token += 4 * a + (s * d if masked_sdpa else 0.0)
        else:
            per_token += a * s * 4 + (a * s * (m + d) if dropout else (a * s * d if d != 4 else 0.0))
    return s * b * per_token


LLAMA_TYPES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
               "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM)}


def llama_dict(model_type="llama", *, n_layer=1, s=64, h=64, a=4, a_kv=2, f=160, dropout=0.0, v=64, **kw):
    config_class = LLAMA_TYPES[model_type][0]
    return config_class(vocab_size=v, hidden_size=h, num_hidden_layers=n_layer, num_attention_heads=a,
                        num_key_value_heads=a_kv, intermediate_size=f, max_position_embeddings=s,
                        attention_dropout=dropout, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                        **kw).to_dict()


def llama_model(raw, attn, dtype):
    config_class, model_class = LLAMA_TYPES[raw["model_type"]]
    torch.manual_seed(0)
    # (layer_types, when written, follows num_hidden_layers)
    config = config_class(**{k: v for k, v in raw.items() if k not in ("model_type", "layer_types")},
                          attn_implementation=attn)
    return model_class(config).to(dtype).train()


def llama_measured_per_layer(raw, b, attn, dtype, policy="none"):
    """Tensor bytes one layer leaves for backward: (3 layers - 1 layer) / 2 (embedding and head cancel)."""
    from largebatch.memory import apply_recompute, measure_forward_bytes

    ids = torch.randint(0, raw["vocab_size"], (b, raw["max_position_embeddings"]))
    held = {}
    for n_layer in (1, 3):
        model = llama_model({**raw, "num_hidden_layers": n_layer}, attn, dtype)
        apply_recompute(model, policy)
        loss = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
        measure_forward_bytes(loss)  # warm-up: one-time dispatch caches are not activations
        _, held[n_layer] = measure_forward_bytes(loss)
    return (held[3].tensor_bytes - held[1].tensor_bytes) / 2


LLAMA_MEASURED = [  # model type, attn, dtype, a_kv, dropout, bool masks, policy
    ("llama", "eager", torch.float32, 2, 0.1, False, "none"),   # K/V repeated, d-byte CPU masks
    ("llama", "eager", torch.bfloat16, 2, 0.1, True, "none"),   # fp32 softmax, cast consumed by dropout
    ("llama", "eager", torch.bfloat16, 2, 0.0, False, "none"),  # fp32 softmax + its bf16 cast
    ("llama", "eager", torch.float32, 4, 0.0, False, "none"),   # no GQA: repeat_kv copies nothing
    ("llama", "eager", torch.float32, 1, 0.0, False, "none"),   # one K/V head: eager copies it to all heads
    ("llama", "sdpa", torch.float32, 2, 0.0, False, "none"),    # enable_gqa: K/V at a_kv heads
    ("llama", "sdpa", torch.bfloat16, 2, 0.0, False, "none"),
    ("llama", "eager", torch.bfloat16, 2, 0.1, False, "selective"),  # the checkpoint keeps un-repeated K/V
    ("qwen2", "eager", torch.bfloat16, 2, 0.0, False, "none"),  # q/k/v biases keep nothing
    ("qwen3", "eager", torch.float32, 2, 0.1, False, "none"),   # heads of 24 on a 64-wide stream, q/k norms
    ("qwen3", "eager", torch.bfloat16, 2, 0.0, False, "none"),  # the norms' fp32 copies of a bf16 input
    ("qwen3", "sdpa", torch.bfloat16, 2, 0.0, False, "none"),
    ("qwen3", "eager", torch.bfloat16, 2, 0.1, False, "selective"),
    # Mistral with a window of 8 of the 64 positions: sdpa reads the mask (no enable_gqa, a float copy)
    ("mistral", "sdpa", torch.float32, 2, 0.0, False, "none"),
    ("mistral", "sdpa", torch.bfloat16, 2, 0.0, False, "none"),
    ("mistral", "eager", torch.float32, 2, 0.0, False, "none"),   # the mask is added, not kept
    ("mistral", "sdpa", torch.float32, 1, 0.0, False, "none"),    # one K/V head: repeat_kv's view, no copy
    ("mistral", "sdpa", torch.float32, 2, 0.0, False, "selective"),  # the checkpoint keeps un-repeated K/V
    # OLMo 2: the norms keep fp32 normalised tensors, the q and k norms span the projections (heads of 24)
    ("olmo2", "eager", torch.float32, 2, 0.1, False, "none"),
    ("olmo2", "eager", torch.bfloat16, 2, 0.0, False, "none"),
    ("olmo2", "sdpa", torch.bfloat16, 2, 0.0, False, "none"),
    ("olmo2", "eager", torch.bfloat16, 2, 0.1, False, "selective"),
    # OLMo 3: those layers with the window of 8 on layers 0-2 (Olmo3Config's default types), sdpa as Mistral's
    ("olmo3", "sdpa", torch.bfloat16, 2, 0.0, False, "none"),
]
WINDOW = 8
QWEN3_HEAD = 24  # (not hidden_size / num_attention_heads = 16)


@pytest.mark.parametrize("model_type, attn, dtype, a_kv, dropout, bool_masks, policy", LLAMA_MEASURED, ids=[
    f"{m[0]}-{m[1]}-{str(m[2])[6:]}-kv{m[3]}-p{m[4]}{'-bool' if m[5] else ''}-{m[6]}" for m in LLAMA_MEASURED])
def test_measured_hf_llama_layers(model_type, attn, dtype, a_kv, dropout, bool_masks, policy):
    """A tiny real LlamaForCausalLM (Qwen2ForCausalLM) on CPU: the bytes one layer keeps, to the
    byte, against the float64 reference and against hf_eager_layer_bytes of config_from_hf."""
    from largebatch.memory import hf_eager_layer_bytes

    s, b, h, a, f, d = 64, 2, 64, 4, 160, dtype.itemsize
    qwen3 = {"head_dim": QWEN3_HEAD} if model_type in ("qwen3", "olmo2", "olmo3") else {}
    window = {"sliding_window": WINDOW} if model_type in ("mistral", "olmo3") else {}
    raw = llama_dict(model_type, s=s, h=h, a=a, a_kv=a_kv, f=f, dropout=dropout, **qwen3, **window)
    with hf_memory.bool_mask_dropout() if bool_masks else contextlib.nullcontext():
        measured = llama_measured_per_layer(raw, b, attn, dtype, policy)
    m = 1 if bool_masks else d
    reference = llama_reference(s, b, h, a, a_kv, f, d, eager=attn == "eager", dropout=dropout > 0, m=m,
                                policy=policy, dh=qwen3.get("head_dim"), qk_norm=bool(qwen3), window=bool(window),
                                olmo=model_type.startswith("olmo"))
    assert measured == pytest.approx(reference, rel=1e-9)
    config = config_from_hf(raw).replace(attention="explicit" if attn == "eager" else "sdpa")
    estimate = hf_eager_layer_bytes(config, "silu", b, policy, dtype_bytes=d, device="cuda" if bool_masks else "cpu")
    assert estimate == pytest.approx(measured, rel=0.01)
    if attn == "eager" and policy == "none":
        assert hf_eager_bytes_per_layer(raw, b, dtype_bytes=d, device="cuda" if bool_masks else "cpu") == estimate


def test_a_transformers_llama_whole_model_against_the_estimate():
    """The whole model's forward bytes (2 layers, GQA, eager, fp32) against Setup's estimate with the
    Llama terms: the closed form's output layer (lm_head input, fp32 log-softmax) is transformers',
    with its final RMSNorm's fp32 input copy and rsqrt added; left over: the rotary cos/sin
    (2 s d_head 4 bytes, once)."""
    from largebatch.memory import Setup, measure_forward_bytes

    s, b = 64, 2
    raw = llama_dict(n_layer=2, s=s, v=256)
    model = llama_model(raw, "eager", torch.float32)
    ids = torch.randint(0, 256, (b, s))
    for _ in range(2):  # (the first forward also allocates what torch keeps for later ones)
        out, measured = measure_forward_bytes(lambda: tuple(model(input_ids=ids, labels=ids, use_cache=False).values()))
        del out
    estimate = Setup(micro_batch=b, dtype_bytes=4, hf_activation="silu").estimate(config_from_hf(raw), "none")
    assert measured.tensor_bytes == pytest.approx(estimate.activations, rel=0.01)
    # what the closed form alone misses: the Llama terms less the closed form's, in each of the 2 layers
    config = config_from_hf(raw)
    closed = Setup(micro_batch=b, dtype_bytes=4).estimate(config, "none")
    layer = llama_reference(s, b, 64, 4, 2, 160, 4, eager=True, dropout=False, m=0)
    final_norm = s * b * (4 * 64 + 4)  # transformers' final RMSNorm keeps (4 + d) h + 4 bytes a token, not d h
    assert estimate.activations - closed.activations == pytest.approx(
        2 * (layer - activation_bytes_per_layer(s, b, **config_layer_kwargs(config, dtype_bytes=4))) + final_norm,
        rel=1e-12)


WHOLE_MODELS = [  # model type, attention, dtype, policy: where the masks recomputed layers keep differ
    ("llama", "eager", torch.float32, "full"),       # the causal float (b, 1, s, s) mask
    ("llama", "sdpa", torch.float32, "full"),        # none (is_causal)
    ("mistral", "sdpa", torch.bfloat16, "full"),     # the window's bool (1, 1, s, s) mask
    ("olmo3", "eager", torch.bfloat16, "selective"),  # two float masks: the causal and the sliding one
    ("olmo3", "sdpa", torch.float32, "full"),
    ("olmo2", "eager", torch.bfloat16, "none"),      # no mask kept; the final norm's fp32 normalised tensor
]


@pytest.mark.parametrize("model_type, attn, dtype, policy", WHOLE_MODELS,
                         ids=[f"{m}-{a}-{str(d)[6:]}-{p}" for m, a, d, p in WHOLE_MODELS])
def test_the_masks_recomputed_transformers_layers_keep_are_counted(model_type, attn, dtype, policy):
    """A whole 4-layer transformers model (s 128, b 2, heads of 16; OLMo 3 and Mistral with a window of
    8, OLMo 3 on layers 0-2) against Setup's estimate: what is left is what the estimate leaves out on
    purpose -- the rotary cos/sin tables (2 s d_h values each: in the activations' dtype for Llama's
    family, fp32 for OLMo's, two tables for OLMo 3's two layer types), the int64 labels, a scalar, and
    under recomputation the position ids the checkpoints keep (s int64). Without the masks' terms
    (hf_mask_bytes) an eager model under selective or full recompute was short by b s^2 d per mask
    kind (OLMo 3: two), an sdpa one with a window under full recompute by s^2; OLMo's final norm
    keeps its normalised tensor in fp32 (2 h bytes a token more than Llama's in bf16)."""
    from largebatch.memory import Setup, apply_recompute, measure_forward_bytes

    s, b, d_h = 128, 2, 16
    window = {"sliding_window": WINDOW} if model_type in ("mistral", "olmo3") else {}
    raw = llama_dict(model_type, n_layer=4, s=s, v=256, head_dim=d_h, **window)
    model = llama_model(raw, attn, dtype)
    apply_recompute(model, policy)
    ids = torch.randint(0, 256, (b, s))
    for _ in range(2):  # (the first forward also allocates what torch keeps for later ones)
        out, measured = measure_forward_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
        del out
    d = dtype.itemsize
    config = config_from_hf(raw).replace(attention="explicit" if attn == "eager" else "sdpa")
    estimate = Setup(micro_batch=b, dtype_bytes=d, hf_activation="silu").estimate(config, policy).activations
    olmo = model_type.startswith("olmo")
    tables = (2 if model_type == "olmo3" else 1) * 2 * s * d_h * (4 if olmo else d)
    left = measured.tensor_bytes - estimate - tables - b * s * 8 - 4
    assert left == (0 if policy == "none" else s * 8), (measured.tensor_bytes, estimate, left)


def test_a_recomputed_transformers_gpt2_keeps_its_causal_mask():
    """GPT-2's eager layers read the model's float (b, 1, s, s) causal mask too: what selective
    recomputation saves, measured on a whole 4-layer GPT2LMHeadModel (s 128, b 2, fp32, no dropout),
    is what Setup's estimate saves, the mask its checkpoints keep included (b s^2 4 = 131,072 bytes,
    which the estimate once left out)."""
    from largebatch.memory import Setup, apply_recompute, measure_forward_bytes

    s, b = 128, 2
    raw = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=s, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None).to_dict()
    ids = torch.randint(0, 256, (b, s))
    measured, estimated = {}, {}
    for policy in ("none", "selective"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            **{k: v for k, v in raw.items() if k != "model_type"}, attn_implementation="eager")).train()
        apply_recompute(model, policy)
        for _ in range(2):
            out, held = measure_forward_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
            del out
        measured[policy] = held.tensor_bytes
        estimated[policy] = Setup(micro_batch=b, dtype_bytes=4, hf_activation="gelu_new").estimate(
            config_from_hf(raw), policy).activations
    saved = measured["none"] - measured["selective"]
    assert saved == estimated["none"] - estimated["selective"]
    assert saved == 4 * (b * 4 * s * s * 4) - b * s * s * 4  # the 4 layers' softmax outputs, less the mask


@pytest.mark.parametrize("attn, policy", [("sdpa", "none"), ("sdpa", "selective"), ("eager", "none")])
def test_a_transformers_mistral_with_a_window_whole_model_against_the_estimate(attn, policy):
    """A 2-layer MistralForCausalLM with a window of 8 of 64 positions (fp32): the whole model's bytes
    kept for backward, less the same model's without the window, against Setup's estimate of both
    (transformers' Llama terms): sdpa keeps per layer K/V at all heads and the mask's float copy, a
    recomputed sdpa layer's checkpoint the shared bool mask (s^2 bytes, once), eager nothing more --
    and largebatch's own mask is not counted for transformers' layers."""
    from largebatch.memory import Setup, apply_recompute, measure_forward_bytes

    s, b = 64, 2
    held, estimates = {}, {}
    for window in (None, WINDOW):
        raw = llama_dict("mistral", n_layer=2, s=s, v=256, sliding_window=window)
        model = llama_model(raw, attn, torch.float32)
        apply_recompute(model, policy)
        ids = torch.randint(0, 256, (b, s))
        loss = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
        measure_forward_bytes(loss)
        _, held[window] = measure_forward_bytes(loss)
        config = config_from_hf(raw).replace(attention="explicit" if attn == "eager" else "sdpa")
        estimates[window] = Setup(micro_batch=b, dtype_bytes=4, hf_activation="silu").estimate(config, policy)
    grown = held[WINDOW].tensor_bytes - held[None].tensor_bytes
    expected = {("sdpa", "none"): 2 * (s * b * s * 4 + 2 * (64 - 32) * 4 * s * b), ("sdpa", "selective"): s * s,
                ("eager", "none"): 0}[attn, policy]
    assert grown == expected
    assert estimates[WINDOW].activations - estimates[None].activations == expected


def test_llama_family_configs():
    """LlamaForCausalLM, MistralForCausalLM, MinistralForCausalLM and Qwen2ForCausalLM configs as the
    Llama-style GPT; a scaled rope and the biases change no kept tensor (the yarn model keeps the
    unscaled one's bytes: test above's terms hold for it), so they are read, not refused."""
    g = config_from_hf(transformers.LlamaConfig(num_key_value_heads=8).to_dict())
    assert (g.kind, g.n_layer, g.n_embd, g.n_head, g.kv_heads, g.ffn, g.seq_len, g.vocab_size) == \
        ("gpt", 32, 4096, 32, 8, 11008, 2048, 32000)
    assert (g.norm, g.position, g.activation, g.norm_position, g.dropout, g.tie_embeddings, g.bias) == \
        ("rmsnorm", "rope", "swiglu", "pre", 0.0, False, False)
    mistral = config_from_hf(transformers.MistralConfig(sliding_window=None).to_dict())
    assert (mistral.kv_heads, mistral.ffn, mistral.seq_len) == (8, 14336, 131072)
    assert (mistral.sliding_window, mistral.window_layout) == (None, "none")
    # sliding windows as transformers builds its layers: Mistral's on every layer (4096 by default),
    # Qwen2's and Qwen3's with use_sliding_window from max_window_layers on, Ministral's by layer_types
    wide = config_from_hf(transformers.MistralConfig(sliding_window=131072).to_dict())
    assert wide.replace(sliding_window=None) == mistral and wide.sliding_window == 131072
    assert config_from_hf(transformers.MistralConfig().to_dict()).windows == (4096,) * 32
    for family in (transformers.Qwen2Config, transformers.Qwen3Config):
        windowed = config_from_hf(family(use_sliding_window=True, sliding_window=1024, max_window_layers=4,
                                         num_hidden_layers=6).to_dict())
        assert windowed.windows == (None,) * 4 + (1024,) * 2
        assert config_from_hf(family(sliding_window=1024, num_hidden_layers=6).to_dict()).window_layout == "none"
    pattern = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    ministral = config_from_hf(transformers.MinistralConfig(num_hidden_layers=6, sliding_window=512,
                                                            layer_types=pattern).to_dict())
    assert (ministral.sliding_window, ministral.full_attention_layers) == (512, (2, 5))
    qwen = config_from_hf(transformers.Qwen2Config(num_key_value_heads=4).to_dict())
    assert qwen.kv_heads == 4 and (qwen.bias, qwen.qkv_biased) == (False, True)
    # the parameter count: a real tiny Qwen2ForCausalLM's, its q/k/v biases included
    from largebatch.memory.estimate import stage_parameters

    for tied in (True, False):
        raw = llama_dict("qwen2", n_layer=2, tie_word_embeddings=tied)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{
            k: v for k, v in raw.items() if k not in ("model_type", "layer_types")}))
        counted = {id(p): p.numel() for p in model.parameters()}  # (a tied matrix once)
        assert stage_parameters(config_from_hf(raw)) == sum(counted.values())
    # no model_type: the architecture names it, and the type's own fields are read as the type's
    for model_type, architecture in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                     ("qwen3", "Qwen3ForCausalLM")):
        raw = llama_dict(model_type)
        assert config_from_hf({**raw, "model_type": None, "architectures": [architecture]}) == config_from_hf(raw)
    # Qwen3 without head_dim has Qwen3Config's 128; its q/k norms; its parameters, a real tiny model's
    raw = {k: v for k, v in llama_dict("qwen3", n_layer=2, tie_word_embeddings=True).items() if k != "head_dim"}
    qwen3 = config_from_hf({**raw, "model_type": None, "architectures": ["Qwen3ForCausalLM"]})
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.bias, qwen3.qkv_biased) == (128, True, False, False)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{
        k: v for k, v in raw.items() if k not in ("model_type", "layer_types")}))
    assert stage_parameters(qwen3) == sum({id(p): p.numel() for p in model.parameters()}.values())
    # attention_bias (q, k, v and o_proj; no MLP biases): counted as q, k and v's, o_proj's h a layer left out
    biased = config_from_hf(llama_dict("qwen3", n_layer=2, attention_bias=True))
    assert (biased.bias, biased.qkv_biased) == (False, True)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0, "original_max_position_embeddings": 16}
    assert config_from_hf(llama_dict(rope_parameters=yarn)) == config_from_hf(llama_dict()).replace(rope_theta=5e5)
    assert config_from_hf(llama_dict(attention_bias=True)).bias
    assert hf_activation(llama_dict(hidden_act="swish")) == "swish" and hf_activation(llama_dict()) == "silu"
    b, d = 2, 2
    c = config_from_hf(llama_dict(dropout=0.1))
    assert c.dropout == 0.1
    # the sdpa path with dropout on CPU is torch's unfused math kernel: refused, not guessed
    from largebatch.memory import hf_eager_layer_bytes
    with pytest.raises(ValueError, match=r"attention='sdpa' with attention_dropout on CPU"):
        hf_eager_layer_bytes(c.replace(attention="sdpa"), "silu", b, dtype_bytes=d, device="cpu")
    with pytest.raises(ValueError, match=r"activation='gelu' with model.activation='swiglu'"):
        hf_eager_layer_bytes(c, "gelu", b)
    with pytest.raises(ValueError, match=r"activation='silu' with model.activation='gelu'"):
        hf_eager_layer_bytes(preset("gpt2-small"), "silu", b)


def test_the_memory_command_on_a_llama_config(tmp_path, capsys):
    """--hf-config on a Llama config.json: the eager line's ratio and MiB from the reference, the
    estimates and the plan with the Llama terms; with --attention sdpa the sdpa layers' line."""
    from largebatch.memory import Setup
    s, b, h, a, a_kv, f = 256, 4, 128, 8, 2, 352
    raw = llama_dict(n_layer=4, s=s, h=h, a=a, a_kv=a_kv, f=f, v=1000)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = config_from_hf(tmp_path)
    closed = activation_bytes_per_layer(s, b, **config_layer_kwargs(config, dtype_bytes=2))
    eager = llama_reference(s, b, h, a, a_kv, f, 2, eager=True, dropout=False, m=0)
    assert memory_main(["--hf-config", str(tmp_path), "--micro-batch", str(b)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("HF eager layers"))
    assert f"~{eager / closed:.2f}x" in line and f"({eager / 2**20:.1f} MiB per layer; K/V repeated" in line
    assert "transformers Llama layers, eager or sdpa (silu;" in out
    total = next(x for x in out.splitlines() if x.startswith("Per device, no recompute"))
    assert total.endswith(str(Setup(micro_batch=b, hf_activation="silu").estimate(config, "none")))
    assert memory_main(["--hf-config", str(tmp_path), "--micro-batch", str(b), "--attention", "sdpa"]) == 0
    out = capsys.readouterr().out
    sdpa = llama_reference(s, b, h, a, a_kv, f, 2, eager=False, dropout=False, m=0)
    closed = activation_bytes_per_layer(s, b, **config_layer_kwargs(config.replace(attention="sdpa")))
    line = next(x for x in out.splitlines() if x.startswith("HF sdpa layers"))
    assert f"~{sdpa / closed:.2f}x" in line and "HF eager" not in out
    # the estimates and the plan count the sdpa layers with their terms too (the closed form had
    # counted largebatch's own RMSNorm, which keeps its input only), sharded ones with the closed form
    total = next(x for x in out.splitlines() if x.startswith("Per device, no recompute"))
    sdpa_config = config.replace(attention="sdpa")
    assert total.endswith(str(Setup(micro_batch=b, hf_activation="silu").estimate(sdpa_config, "none")))
    assert "transformers Llama layers, eager or sdpa (silu;" in out
    assert memory_main(["--hf-config", str(tmp_path), "--micro-batch", str(b), "--attention", "sdpa",
                        "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "estimates and the plan: closed form" in out
    total = next(x for x in out.splitlines() if x.startswith("Per device, no recompute"))
    assert total.endswith(str(Setup(micro_batch=b, tp=2).estimate(sdpa_config, "none")))
    # a budget the unsharded layers miss: what would fit is sharded (counted by the closed form)
    big = llama_dict(n_layer=32, s=8192, h=4096, a=32, a_kv=8, f=14336, v=128256)
    (tmp_path / "config.json").write_text(json.dumps(big))
    assert memory_main(["--hf-config", str(tmp_path), "--attention", "sdpa", "--micro-batch", "1",
                        "--seq-len", "4096", "--budget-gib", "40"]) == 1  # (nothing fits as it is)
    fits = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Would fit"))
    assert "--tp 2 --sequence-parallel" in fits or "--tp 4 --sequence-parallel" in fits, fits


# ------------------------------------------------------------------------------- GPT-NeoX (Pythia)
def neox_reference(s, b, h, a, f, d, *, parallel, eager, dropout, policy, m, sigma, gelu_new=False):
    """What one transformers GPTNeoXLayer keeps, in float64 from the saved tensors its graph holds
    (docs/memory.md), not from the code under test. Per token: the LayerNorms' inputs (the parallel
    layer's two norms read the layer input, one tensor; the sequential one's second reads
    attention output + input), a mean and a 1/std each (sigma bytes: the input's dtype on CPU), their
    outputs (the fused query_key_value input, the MLP input); q and k, new tensors from the partial
    rotation's concatenation; the dense input; the GeLU input and the dense_4h_to_h input (gelu_new:
    three f-wide intermediates more); with dropout the two residual-branch masks (m bytes). V: eager,
    P V's contiguous copy of the strided chunk (the fused output is freed); sdpa, the chunk view keeps
    the whole fused (3 h) output, and sdpa's own output besides the dense input's copy. The core
    (policy "none"): eager, the fp32 softmax and what P V keeps -- its d-byte cast (none in fp32), or
    with dropout the mask (m) and the dropout output (d); sdpa a 4-byte log-sum-exp per head.
    "selective": the checkpoint keeps the attention function's inputs, v a view of the fused output
    (3 h d), and no core. "full": the layer input."""
    s, b, h, a, f, d, m, sigma = map(float, (s, b, h, a, f, d, m, sigma))
    if policy == "full":
        return s * b * h * d
    per_token = (1 if parallel else 2) * h * d + 4 * sigma + 2 * h * d + 2 * h * d + h * d
    per_token += (2 + (3 if gelu_new else 0)) * f * d + (2 * h * m if dropout else 0.0)
    if policy == "selective":
        per_token += 3 * h * d
    elif eager:
        per_token += h * d + a * s * 4 + (a * s * (m + d) if dropout else (a * s * d if d != 4 else 0.0))
    else:
        per_token += 3 * h * d + h * d + 4 * a
    return s * b * per_token


def neox_dict(*, n_layer=1, s=24, h=64, a=4, f=96, v=64, parallel=True, dropout=0.0, fraction=0.25, act="gelu"):
    return transformers.GPTNeoXConfig(
        vocab_size=v, hidden_size=h, num_hidden_layers=n_layer, num_attention_heads=a, intermediate_size=f,
        max_position_embeddings=s, use_parallel_residual=parallel, attention_dropout=dropout, hidden_dropout=dropout,
        hidden_act=act, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": fraction}).to_dict()


def neox_model(raw, attn, dtype):
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(**{k: v for k, v in raw.items() if k != "model_type"},
                                        attn_implementation=attn)
    return transformers.GPTNeoXForCausalLM(config).to(dtype).train()


NEOX_MEASURED = [  # parallel residual, attention, dtype, dropout, bool masks, activation
    (True, "eager", torch.float32, 0.0, False, "gelu"),       # fp32 softmax, no cast
    (True, "eager", torch.bfloat16, 0.1, False, "gelu"),      # bf16 masks and LayerNorm statistics on CPU
    (False, "eager", torch.float32, 0.1, True, "gelu"),       # 1-byte masks (CUDA's), fp32 statistics: the GPU terms
    (False, "eager", torch.bfloat16, 0.0, False, "gelu_new"),  # the softmax's bf16 cast; gelu_new's intermediates
    (True, "sdpa", torch.bfloat16, 0.0, False, "gelu"),       # the fused output kept through v's view
    (False, "sdpa", torch.float32, 0.0, False, "gelu"),
]


@pytest.mark.parametrize("parallel, attn, dtype, dropout, bool_masks, act", NEOX_MEASURED, ids=[
    f"{'parallel' if m[0] else 'sequential'}-{m[1]}-{str(m[2])[6:]}-p{m[3]}{'-bool' if m[4] else ''}-{m[5]}"
    for m in NEOX_MEASURED])
def test_measured_hf_neox_layers(parallel, attn, dtype, dropout, bool_masks, act):
    """A tiny real GPTNeoXForCausalLM on CPU (h 64, 4 heads, a quarter of each head rotated, s 24, b 2):
    the bytes one layer keeps under recompute none, selective and full -- (3 layers - 1 layer) / 2 --
    to the byte against the float64 reference and against hf_eager_layer_bytes of config_from_hf."""
    from largebatch.memory import apply_recompute, hf_eager_layer_bytes, measure_forward_bytes

    s, b, h, a, f, d = 24, 2, 64, 4, 96, dtype.itemsize
    raw = neox_dict(s=s, h=h, a=a, f=f, parallel=parallel, dropout=dropout, act=act)
    config = config_from_hf(raw).replace(attention="explicit" if attn == "eager" else "sdpa")
    assert (config.norm_position, config.rope_fraction, config.norm, config.position) == (
        "parallel" if parallel else "pre", 0.25, "layernorm", "rope")
    assert hf_activation(raw) == act
    ids = torch.randint(0, raw["vocab_size"], (b, s))
    models = {n: neox_model({**raw, "num_hidden_layers": n}, attn, dtype) for n in (1, 3)}
    m, device = (1, "cuda") if bool_masks else (d, "cpu")
    for policy in ("none", "selective", "full"):
        held = {}
        for n, model in models.items():
            apply_recompute(model, policy)
            loss = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
            with hf_memory.bool_mask_dropout() if bool_masks else contextlib.nullcontext():
                if policy == "none":  # warm-up: one-time dispatch caches are not activations
                    measure_forward_bytes(loss)
                _, held[n] = measure_forward_bytes(loss)
        measured = (held[3].tensor_bytes - held[1].tensor_bytes) / 2
        reference = neox_reference(s, b, h, a, f, d, parallel=parallel, eager=attn == "eager", dropout=dropout > 0,
                                   policy=policy, m=m, sigma=d, gelu_new=act == "gelu_new")
        assert measured == reference, (policy, measured, reference)
        assert hf_eager_layer_bytes(config, act, b, policy, dtype_bytes=d, device=device) == measured, policy
    if attn == "eager":
        assert hf_eager_bytes_per_layer(raw, b, dtype_bytes=d, device=device) == hf_eager_layer_bytes(
            config, act, b, dtype_bytes=d, device=device)


def test_a_transformers_gpt_neox_whole_model_against_the_estimate():
    """A whole 4-layer GPTNeoXForCausalLM (parallel layers, s 64, b 2, eager, fp32, no dropout) against
    Setup's estimate with the GPT-NeoX terms, under each recompute policy: recomputed layers keep the
    model's float (b, 1, s, s) causal mask as GPT-2's do (hf_mask_bytes). Left over, what the estimate
    leaves out on purpose: the rotary cos/sin tables (2 s r values, r = 4 rotated values a head), the
    final LayerNorm's mean and 1/std (8 bytes a token), the int64 labels, a scalar, and under
    recomputation the position ids the checkpoints keep (s int64)."""
    from largebatch.memory import Setup, apply_recompute, measure_forward_bytes

    s, b = 64, 2
    raw = neox_dict(n_layer=4, s=s, v=256)
    model = neox_model(raw, "eager", torch.float32)
    ids = torch.randint(0, 256, (b, s))
    for policy in ("none", "selective", "full"):
        apply_recompute(model, policy)
        for _ in range(2):  # (the first forward also allocates what torch keeps for later ones)
            out, measured = measure_forward_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
            del out
        estimate = Setup(micro_batch=b, dtype_bytes=4, hf_activation="gelu").estimate(config_from_hf(raw), policy)
        left = measured.tensor_bytes - estimate.activations - 2 * s * 4 * 4 - s * b * 8 - b * s * 8 - 4
        assert left == (0 if policy == "none" else s * 8), (policy, measured.tensor_bytes, estimate.activations)


def test_the_memory_command_on_a_gpt_neox_config(tmp_path, capsys):
    """--hf-config on a GPT-NeoX config.json: the eager line's MiB is neox_layer_bytes' (the fp32 softmax
    of transformers' eager layer dominates at s 2048), and a refused model type names GPT-NeoX among the
    families described."""
    from largebatch.memory import hf_eager_layer_bytes

    raw = neox_dict(n_layer=12, s=2048, h=768, a=12, f=3072, v=50304)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert memory_main(["--hf-config", str(tmp_path), "--micro-batch", "4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("HF eager layers"))
    layer = hf_eager_layer_bytes(config_from_hf(raw), "gelu", 4, seq_len=2048, device="cpu")
    assert layer == 2048 * 4 * (7 * 768 * 2 + 4 * 2 + 2 * 3072 * 2 + 12 * 2048 * (4 + 2))
    assert f"({layer / 2**20:.1f} MiB per layer" in line
    with pytest.raises(ValueError, match=r"GPT-NeoX \(Pythia\)"):
        config_from_hf({"model_type": "mamba"})
