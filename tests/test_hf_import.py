"""``model.init_from = "hf:PATH"``: tiny real transformers models (random weights, saved with
save_pretrained, offline) loaded into largebatch must compute transformers' logits and gradients;
a real run exported and imported again must start where it ended; the run directory keeps its
tokenizer; bad directories are refused in one line before training."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from largebatch.cli import main as cli_main
from largebatch.export import load_run
from largebatch.models import build_model
from largebatch.train.config import load_config
from largebatch.train.hf_import import init_from_pretrained
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics

V, T = 64, 16
REPO = Path(__file__).resolve().parent.parent


def _word_tokenizer(path: Path, size: int) -> None:
    """A tokenizer.json with exactly ``size`` entries (the specials a BERT run needs included)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", "[PAD]", "[CLS]", "[SEP]", "[MASK]"]
    words += [f"w{i}" for i in range(size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _scramble(model: torch.nn.Module) -> None:
    """Weights far from the init (LayerNorms, biases, segment embeddings too): logits of order 1-10,
    so a wrong transpose, split, fold or activation shows far above 1e-5."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_gain = name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "LayerNorm.weight"))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if norm_gain else 0.0))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        CamembertConfig,
        CamembertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        RobertaConfig,
        RobertaForMaskedLM,
    )

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0))  # gelu_new, tied
    bert = BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=48,
                                      max_position_embeddings=T, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, layer_norm_eps=1e-7))
    # untied, as transformers trains it: the head's decoder.bias (the one its forward adds) and the
    # unused cls.predictions.bias no longer move together (scrambled apart here)
    bert_untied = BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=48,
                                             max_position_embeddings=T, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0, layer_norm_eps=1e-7,
                                             tie_word_embeddings=False))
    # RoBERTa: positions from pad_token_id + 1 = 2, so T positions take T + 2 rows; one segment
    roberta = RobertaForMaskedLM(RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=48,
                                               max_position_embeddings=T + 2, pad_token_id=1,
                                               type_vocab_size=1, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0, layer_norm_eps=1e-7))
    # CamemBERT: RoBERTa's layout under its own model_type; pad_token_id 3, so positions from row 4
    camembert = CamembertForMaskedLM(CamembertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=48,
                                                     max_position_embeddings=T + 4, pad_token_id=3,
                                                     type_vocab_size=1, hidden_dropout_prob=0.0,
                                                     attention_probs_dropout_prob=0.0, layer_norm_eps=1e-7))
    dirs = {}
    for name, hf in (("gpt", gpt), ("bert", bert), ("bert_untied", bert_untied), ("roberta", roberta),
                     ("camembert", camembert)):
        _scramble(hf)
        dirs[name] = root / name
        hf.save_pretrained(dirs[name])
        _word_tokenizer(dirs[name], V)
    return dirs, {"gpt": gpt.eval(), "bert": bert.eval(), "bert_untied": bert_untied.eval(),
                  "roberta": roberta.eval(), "camembert": camembert.eval()}


def _imported(path: Path, **overrides):
    cfg = load_config(None, {"model.init_from": f"hf:{path}", **overrides})
    model = build_model(cfg.model)
    init_from_pretrained(model)
    return cfg, model


@pytest.mark.parametrize("kind", ["gpt", "bert", "bert_untied", "roberta", "camembert"])
def test_logits_and_gradients_equal_transformers(hf_dirs, kind):
    dirs, hf_models = hf_dirs
    hf = hf_models[kind]
    cfg, model = _imported(dirs[kind])
    expected = {"gpt": ("pre", "gelu_tanh", 1e-5, 128), "bert": ("post", "gelu", 1e-7, 48),
                "roberta": ("post", "gelu", 1e-7, 48), "camembert": ("post", "gelu", 1e-7, 48)}[kind.split("_")[0]]
    assert cfg.model.seq_len == T  # RoBERTa: T + pad_token_id + 1 rows, the first ones never a position
    offset = {"roberta": 2, "camembert": 4}.get(kind, 0)
    if kind == "bert_untied":
        head = hf.cls.predictions
        assert not cfg.model.tie_embeddings and (head.decoder.bias - head.bias).abs().max() > 0.1
    assert (cfg.model.norm_position, cfg.model.activation, cfg.model.norm_eps, cfg.model.ffn) == expected
    assert cfg.data.tokenizer_file == str(dirs[kind] / "tokenizer.json")
    # (no pad id in RoBERTa's input: a padded position is not one largebatch's samples have)
    idx = torch.randint(offset, V, (3, T), generator=torch.Generator().manual_seed(2))
    theirs = hf(input_ids=idx).logits
    ours = model.eval()(idx)[0]
    assert theirs.abs().max() > 1.0  # logits far from zero: the comparison can fail
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # the activation matters at this scale: the exact GeLU in GPT-2's place is far off
    if kind == "gpt":
        wrong = build_model(cfg.model.replace(activation="gelu", init_from=None))
        wrong.load_state_dict(model.state_dict())
        assert (wrong.eval()(idx)[0] - theirs).abs().max() > 1e-4  # 10x the tolerance
    # train mode (dropout 0): the same loss and the same gradients, through the mapping
    targets = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(3))
    for m, logits_of in ((model, lambda x: model(x)[0]), (hf, lambda x: hf(input_ids=x).logits)):
        m.train().zero_grad()
        F.cross_entropy(logits_of(idx).reshape(-1, V), targets.reshape(-1)).backward()
    if kind == "gpt":
        pairs = [(model.tok_emb.weight.grad, hf.transformer.wte.weight.grad),
                 (model.blocks[1].mlp.fc1.weight.grad, hf.transformer.h[1].mlp.c_fc.weight.grad.t()),
                 (model.blocks[0].attn.k.weight.grad, hf.transformer.h[0].attn.c_attn.weight.grad[:, 32:64].t())]
    else:
        base = hf.roberta if offset else hf.bert
        layer = base.encoder.layer[1]
        pairs = [(model.tok_emb.weight.grad, base.embeddings.word_embeddings.weight.grad),
                 (model.blocks[1].attn.v.weight.grad, layer.attention.self.value.weight.grad),
                 (model.pos_emb.weight.grad, base.embeddings.position_embeddings.weight.grad[offset:])]
        if offset:
            pairs.append((model.head.norm.weight.grad, hf.lm_head.layer_norm.weight.grad))
    for ours_grad, theirs_grad in pairs:
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-4, atol=1e-6)


def _save_sharded(state: dict, path: Path, index: str) -> None:
    """``state`` as a sharded checkpoint: three shards (safetensors or torch pickles, by ``index``'s
    name) and the index naming each tensor's shard, as save_pretrained(max_shard_size=...) writes."""
    names = sorted(state)
    stem, suffix = ("model", "safetensors") if index.startswith("model.") else ("pytorch_model", "bin")
    weight_map = {}
    for i in range(3):
        shard = f"{stem}-{i + 1:05d}-of-00003.{suffix}"
        part = {k: state[k].contiguous() for k in names[i::3]}
        if suffix == "safetensors":
            from safetensors.torch import save_file

            save_file(part, str(path / shard), metadata={"format": "pt"})
        else:
            torch.save(part, path / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (path / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("kind, weights", [("gpt", "model.safetensors"), ("bert", "pytorch_model.bin"),
                                           ("gpt", "model.safetensors.index.json"),
                                           ("bert", "pytorch_model.bin.index.json")])
def test_a_tied_config_whose_stored_output_layer_differs_loads_untied_as_transformers(hf_dirs, kind, weights,
                                                                                     tmp_path):
    """config.json says tie_word_embeddings (the default) but the file holds an output projection that
    differs from the input embedding: transformers loads the two apart (with a warning). The GPT
    import refused it and the BERT import silently took the embedding for both: logits differed.
    Sharded checkpoints (an index and the shards it names) are read too, the two tensors in
    different shards."""
    from transformers import AutoModelForMaskedLM, GPT2LMHeadModel

    dirs, _ = hf_dirs
    path = tmp_path / kind
    shutil.copytree(dirs[kind], path)
    hf_class = GPT2LMHeadModel if kind == "gpt" else AutoModelForMaskedLM
    state = {k: v.clone() for k, v in hf_class.from_pretrained(dirs[kind]).state_dict().items()}
    embedding, output = (("transformer.wte.weight", "lm_head.weight") if kind == "gpt" else
                         ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"))
    state[output] = state[embedding] + 0.5 * torch.randn(state[embedding].shape,
                                                         generator=torch.Generator().manual_seed(4))
    (path / "model.safetensors").unlink()
    if weights.endswith(".index.json"):
        _save_sharded(state, path, weights)
        where = json.loads((path / weights).read_text())["weight_map"]
        assert where[embedding] != where[output]
    elif weights.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path / weights), metadata={"format": "pt"})
    else:
        torch.save(state, path / weights)
    assert json.loads((path / "config.json").read_text()).get("tie_word_embeddings", True)
    theirs_model = hf_class.from_pretrained(path).eval()
    with pytest.warns(UserWarning, match="loading them untied"):
        cfg, model = _imported(path)
    assert not cfg.model.tie_embeddings
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))
    theirs = theirs_model(input_ids=idx).logits
    pointers = [m.weight.data_ptr() for m in (theirs_model.get_output_embeddings(),
                                              theirs_model.get_input_embeddings())]
    assert pointers[0] != pointers[1]  # transformers keeps them apart: compared with the stored output layer
    # fp32 through two layers of two implementations (fused q/k/v here, separate there): on one CPU
    # one logit of 3072 (2.1) differed by 1.0014e-5, 4.8e-6 relative; the untied-vs-embedding error
    # this guards against (an output layer 0.5 x N(0, 1) away from the embedding) moves them by far more
    torch.testing.assert_close(model.eval()(idx)[0], theirs, rtol=1e-5, atol=1e-5)
    # an identical stored copy (what a tied save may hold) stays tied, with no warning
    state[output] = state[embedding].clone()
    for stale in path.glob("*model*"):
        stale.unlink()
    torch.save(state, path / "pytorch_model.bin")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*untied")
        cfg, _ = _imported(path)
    assert cfg.model.tie_embeddings


def test_a_checkpoint_transformers_sharded_loads_with_its_logits(hf_dirs, tmp_path):
    """save_pretrained(max_shard_size=...) (what transformers does to any model over its shard size:
    GPT-2 XL, BERT-large in fp32 with a small limit) writes model.safetensors.index.json and shards:
    read as one checkpoint (it was refused, 'sharded checkpoints are not read')."""
    dirs, hf_models = hf_dirs
    path = tmp_path / "sharded"
    hf_models["bert"].save_pretrained(path, max_shard_size="20KB")
    shutil.copy(dirs["bert"] / "tokenizer.json", path)
    assert not (path / "model.safetensors").exists() and len(list(path.glob("model-*.safetensors"))) > 3
    _, model = _imported(path)
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model.eval()(idx)[0], hf_models["bert"](input_ids=idx).logits, rtol=0, atol=1e-5)


def test_the_original_bert_layout_with_pooler_and_next_sentence_head_loads(tmp_path):
    """BertForPreTraining (the layout of the original BERT checkpoints: masked-LM head, pooler and
    next-sentence head) was refused for its 'unexpected' pooler and NSP tensors; transformers'
    AutoModelForMaskedLM loads the directory and leaves them. Now they are set aside, with a warning
    naming them, and the logits are AutoModelForMaskedLM's."""
    from transformers import AutoModelForMaskedLM, BertConfig, BertForPreTraining

    torch.manual_seed(0)
    pretraining = BertForPreTraining(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=48,
                                                max_position_embeddings=T, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))
    _scramble(pretraining)
    path = tmp_path / "bert-pretraining"
    pretraining.save_pretrained(path)
    _word_tokenizer(path, V)
    with pytest.warns(UserWarning, match=r"pooler.dense.weight, pooler.dense.bias, cls.seq_relationship.weight.*"
                                         r"not loaded"):
        _, model = _imported(path)
    theirs = AutoModelForMaskedLM.from_pretrained(path).eval()
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))
    logits = theirs(input_ids=idx).logits
    assert logits.abs().max() > 1.0
    torch.testing.assert_close(model.eval()(idx)[0], logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "roberta"])
def test_a_tied_directory_loads_untied_on_request(hf_dirs, kind, capsys, tmp_path, monkeypatch):
    """Pipeline parallel needs an untied model (the embedding and the output layer sit on different
    stages), and init_from refused ``model.tie_embeddings = false`` for a tied directory (every
    published GPT-2, BERT and RoBERTa): the two refusals left no way through. Now the output layer
    starts as a copy of the embedding, so the logits are the tied model's, and the pipeline check
    passes."""
    dirs, hf_models = hf_dirs
    cfg, model = _imported(dirs[kind], **{"model.tie_embeddings": False})
    assert not cfg.model.tie_embeddings
    output = model.lm_head.weight if kind == "gpt" else model.head.decoder.weight
    assert output.data_ptr() != model.tok_emb.weight.data_ptr() and torch.equal(output, model.tok_emb.weight)
    idx = torch.randint(2 if kind == "roberta" else 0, V, (3, T), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model.eval()(idx)[0], hf_models[kind](input_ids=idx).logits, rtol=0, atol=1e-5)
    monkeypatch.setenv("WORLD_SIZE", "2")  # --check as rank 0 of a 2-process torchrun
    monkeypatch.setenv("RANK", "0")
    code, err = _train_cli(capsys, f"--model.init_from=hf:{dirs[kind]}", "--parallel.pp=2", "--check",
                           f"--run.out_dir={tmp_path / 'run'}")
    assert code == 2 and "set model.tie_embeddings = false" in err, err  # the fix it names ...
    code, err = _train_cli(capsys, f"--model.init_from=hf:{dirs[kind]}", "--parallel.pp=2",
                           "--model.tie_embeddings=false", "--check", f"--run.out_dir={tmp_path / 'run'}")
    assert code == 0 and "tie_embeddings" not in err, err  # ... now passes


def _corpus(tmp: Path) -> Path:
    """Real English text that can be deleted after training: this repository's documentation."""
    corpus = tmp / "corpus"
    corpus.mkdir()
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        shutil.copy(path, corpus / path.name)
    return corpus


def _tiny(corpus: Path, cache: Path, out: Path, **extra) -> dict:
    o = {"data.corpus": str(corpus), "data.cache_dir": str(cache), "data.vocab_size": 400,
         "data.val_fraction": 0.2, "schedule.lr_schedule": "cosine", "schedule.peak_lr": 2e-2,
         "schedule.warmup": 0.1, "schedule.batch_policy": "constant", "schedule.batch_size": 8,
         "run.micro_batch": 4, "run.total_tokens": 32 * 8 * 4, "run.eval_tokens": 32 * 8,
         "run.eval_every_tokens": 32 * 8 * 4,
         "run.tensorboard": False, "run.progress": "off", "run.sample_tokens": 0,
         "run.out_dir": str(out), "run.peak_flops": 1e11, "run.device": "cpu",
         "optim.name": "lamb", "run.plots": False}
    o.update(extra)
    return o


def _train(overrides: dict, config=None) -> Path:
    cfg = load_config(config, overrides)
    Trainer(cfg, overrides["run.out_dir"], log=lambda *_: None).fit()
    return Path(overrides["run.out_dir"])


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """A tiny GPT (tanh GeLU, untied) trained, exported, and the export trained on from hf:."""
    tmp = tmp_path_factory.mktemp("trip")
    corpus, cache = _corpus(tmp), tmp / "cache"
    shape = {"model.kind": "gpt", "model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2,
             "model.seq_len": 32, "model.activation": "gelu_tanh", "model.tie_embeddings": False}
    original = _train({**_tiny(corpus, cache, tmp / "original"), **shape})
    assert (original / "tokenizer.json").is_file()
    assert cli_main(["export", str(original), str(tmp / "hf"), "--format", "hf"]) == 0
    assert json.loads((tmp / "hf" / "config.json").read_text())["activation_function"] == "gelu_new"
    continued = _tiny(corpus, cache, tmp / "continued", **{"model.init_from": f"hf:{tmp / 'hf'}"})
    _train(continued)
    return tmp, original, continued


def test_continued_run_starts_where_the_original_ended(round_trip):
    from largebatch.data import build_data

    _, original, continued = round_trip
    cfg = load_config(None, continued)
    assert (cfg.model.n_layer, cfg.model.activation, cfg.model.tie_embeddings) == (2, "gelu_tanh", False)
    data = build_data(cfg.data, seq_len=cfg.model.seq_len, objective="causal")
    batch = data.train.get_batch(range(8))  # the first step's batch of a fresh start
    final = load_run(original).model  # the original run's final model, from its checkpoint
    with torch.no_grad():
        reference = float(final(batch["input_ids"], batch["targets"])[1])
    assert _losses(Path(continued["run.out_dir"]))[0] == pytest.approx(reference, rel=1e-6, abs=1e-6)


@pytest.mark.distributed
def test_torchrun_ddp_from_hf_equals_one_process(round_trip):
    from test_train_distributed import _torchrun

    tmp, _, continued = round_trip  # before test_export_after_the_cache_and_corpus_are_gone
    _torchrun({**continued, "run.out_dir": str(tmp / "ddp")})  # 2 ranks x micro-batch 4 = batch 8
    assert _losses(tmp / "ddp") == pytest.approx(_losses(Path(continued["run.out_dir"])), rel=1e-5, abs=1e-5)


def test_a_run_from_a_relative_hf_dir_resumes_after_the_dir_moves(round_trip, monkeypatch, capsys):
    """The saved data.tokenizer_file is relative to where the run started: after the directory moves
    (or from another working directory) the resume reads the run's own tokenizer.json and continues
    the uninterrupted trajectory; an override is judged by its vocabulary, not its path."""
    tmp, _, continued = round_trip  # before test_export_after_the_cache_and_corpus_are_gone
    work = tmp / "work"
    shutil.copytree(tmp / "hf", work / "hf")
    monkeypatch.chdir(work)
    run = tmp / "moved-run"
    o = {**continued, "model.init_from": "hf:hf", "run.out_dir": str(run), "run.max_steps": 2}
    _train(o)
    assert load_config(run / "config.toml", resolve_init=False).data.tokenizer_file == "hf/tokenizer.json"
    shutil.move(work / "hf", tmp / "hf-moved")
    monkeypatch.chdir(run)  # no hf/ here
    (tmp / "other-vocab").mkdir()
    _word_tokenizer(tmp / "other-vocab", 400)
    other = tmp / "other-vocab" / "tokenizer.json"
    code, err = _train_cli(capsys, "--resume", str(run), f"--data.tokenizer_file={other}")
    assert code == 2 and "data.tokenizer_file=" in err and "not the vocabulary this run trained with" in err
    code, err = _train_cli(capsys, "--resume", str(run), f"--data.tokenizer_file={tmp / 'nowhere.json'}")
    assert code == 2 and "does not exist" in err
    code, err = _train_cli(capsys, "--resume", str(run), "--run.progress=off")
    assert code == 0, err
    assert "continues with its own copy" in err
    assert _losses(run) == _losses(Path(continued["run.out_dir"]))


def test_export_after_the_cache_and_corpus_are_gone(round_trip):
    tmp, original, _ = round_trip
    shutil.rmtree(tmp / "cache")
    shutil.rmtree(tmp / "corpus")  # the tokenizer could not be trained again
    assert cli_main(["export", str(original), str(tmp / "hf-again"), "--format", "hf"]) == 0
    assert ((tmp / "hf-again" / "model.safetensors").read_bytes()
            == (tmp / "hf" / "model.safetensors").read_bytes())


def _train_cli(capsys, *args) -> tuple[int, str]:
    code = cli_main(["train", *args])
    return code, capsys.readouterr().err.strip()


def test_a_padded_embedding_keeps_its_rows_and_a_larger_tokenizer_is_refused(hf_dirs, tmp_path, capsys):
    """An embedding with rows past the tokenizer (what a largebatch export of a run with
    model.vocab_size above the tokenizer's writes, or GPT-2 padded to 50304) loads whole: the
    same logits as transformers; a tokenizer with more ids than rows is refused in one line."""
    dirs, hf_models = hf_dirs
    padded, larger = tmp_path / "padded", tmp_path / "larger"
    for path, size in ((padded, V - 8), (larger, V + 8)):
        shutil.copytree(dirs["gpt"], path)
        _word_tokenizer(path, size)
    cfg, model = _imported(padded)
    assert cfg.model.vocab_size == V and cfg.data.tokenizer_file == str(padded / "tokenizer.json")
    idx = torch.randint(0, V - 8, (2, T), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(model.eval()(idx)[0], hf_models["gpt"](input_ids=idx).logits, rtol=0, atol=1e-5)
    out = f"--run.out_dir={tmp_path / 'run'}"
    assert _train_cli(capsys, f"--model.init_from=hf:{padded}", "--check", out)[0] == 0
    code, err = _train_cli(capsys, f"--model.init_from=hf:{larger}", "--check", out)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"has ids up to {V + 7}" in err and f"vocab_size={V} embedding rows" in err, err


def test_bad_directories_are_one_line_before_training(hf_dirs, tmp_path, capsys):
    dirs, _ = hf_dirs
    out = f"--run.out_dir={tmp_path / 'run'}"
    mixtral = tmp_path / "mixtral"
    mixtral.mkdir()
    (mixtral / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_key_value_heads": 2}))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(dirs["gpt"], no_weights)
    (no_weights / "model.safetensors").unlink()
    extra = tmp_path / "extra"
    shutil.copytree(dirs["gpt"], extra)
    from safetensors.torch import load_file, save_file

    state = load_file(str(extra / "model.safetensors"))
    save_file({**state, "transformer.h.0.attn.rotary.weight": torch.zeros(3)}, str(extra / "model.safetensors"))
    lost_shard = tmp_path / "lost-shard"
    shutil.copytree(dirs["gpt"], lost_shard)
    (lost_shard / "model.safetensors").unlink()
    _save_sharded(state, lost_shard, "model.safetensors.index.json")
    (lost_shard / "model-00002-of-00003.safetensors").unlink()
    vocab_only = tmp_path / "vocab-only"  # GPT-2 / RoBERTa's slow-tokenizer files, no tokenizer.json
    shutil.copytree(dirs["gpt"], vocab_only)
    (vocab_only / "tokenizer.json").unlink()
    (vocab_only / "vocab.json").write_text(json.dumps({"a": 0}))
    (vocab_only / "merges.txt").write_text("#version: 0.2\n")
    cases = [((f"--model.init_from=hf:{vocab_only}", "--check"),
              ["has no tokenizer.json", "has vocab.json, merges.txt",
               f"AutoTokenizer; d = {str(vocab_only)!r}; AutoTokenizer.from_pretrained(d).save_pretrained(d)"]),
             ((f"--model.init_from=hf:{vocab_only}", f"--data.tokenizer_file={vocab_only / 'vocab.json'}",
               "--check"), ["vocab.json is not a tokenizer.json", "AutoTokenizer.from_pretrained(d)"]),
             ((f"--model.init_from=hf:{lost_shard}", "--check"),
              ["model.safetensors.index.json names model-00002-of-00003.safetensors, which does not exist",
               "copy every shard"]),
             ((f"--model.init_from=hf:{mixtral}",), ["model_type='mixtral'", "mixture-of-experts", "gpt2", "qwen2"]),
             ((f"--model.init_from=hf:{dirs['gpt']}", "--model.n_layer=3"),
              ["model.n_layer=3", "has 2", "remove model.n_layer"]),
             (("bert-lans-demo", f"--model.init_from=hf:{dirs['bert']}"),
              [f"longer than model.seq_len = {T}", f"model.init_from='hf:{dirs['bert']}' sets it: shorten the "
               f"phase to at most {T}"]),
             ((f"--model.init_from=hf:{dirs['gpt']}", f"--model.seq_len={T // 2}"),
              [f"model.seq_len={T // 2}", f"has {T}", "declare [[phases]] with a smaller seq_len"]),
             ((f"--model.init_from=hf:{no_weights}", "--check"),
              ["holds no model.safetensors or model.safetensors.index.json or pytorch_model.bin"]),
             ((f"--model.init_from=hf:{extra}", "--check"), ["unexpected h.0.attn.rotary.weight"]),
             ((f"--model.init_from={dirs['gpt']}",), ["give hf:PATH"])]
    for args, words in cases:
        code, err = _train_cli(capsys, *args, out)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    code, err = _train_cli(capsys, f"--model.init_from=hf:{dirs['bert']}", "--check", out)
    assert code == 0, err  # a shipped recipe's model fields give way to the directory's
    # data.tokenizer_file naming a directory that holds the tokenizer.json, as without init_from
    code, err = _train_cli(capsys, f"--model.init_from=hf:{vocab_only}", f"--data.tokenizer_file={dirs['gpt']}",
                           "--check", out)
    assert code == 0, err


@pytest.mark.parametrize("recipe, hf, kind, objective", [("bert-demo", "gpt", "gpt", "causal language model"),
                                                         ("gpt-demo", "bert", "bert", "masked language model"),
                                                         ("bert-demo", "bert", None, None)])
def test_a_recipe_whose_kind_gives_way_is_noted_in_one_line(recipe, hf, kind, objective, hf_dirs, tmp_path, capsys):
    """A shipped BERT recipe started from a GPT directory trains a GPT (the directory's weights
    cannot be a BERT): allowed, as every shipped model field gives way, but said once, before the run."""
    dirs, _ = hf_dirs
    code, err = _train_cli(capsys, recipe, f"--model.init_from=hf:{dirs[hf]}", "--check",
                           f"--run.out_dir={tmp_path / 'run'}")
    assert code == 0, err
    assert load_config(REPO / "configs" / f"{recipe}.toml", {"model.init_from": f"hf:{dirs[hf]}"},
                       warn=lambda _: None).model.kind == hf
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    if kind is None:
        assert notes == [], err
        return
    recipe_kind = "bert" if recipe.startswith("bert") else "gpt"
    assert len(notes) == 1, err
    assert all(w in notes[0] for w in (f"{recipe}.toml trains a {recipe_kind!r}", f"holds a {kind!r}",
                                       f"trains that {kind} ({objective})")), notes[0]


def test_safetensors_shards_win_over_an_older_pytorch_model_bin(hf_dirs, tmp_path):
    """save_pretrained leaves a pytorch_model.bin of an earlier save beside newer safetensors shards;
    transformers loads the shards (its order: model.safetensors, its index, pytorch_model.bin, its
    index). The import read the stale .bin, with logits 6.9 away and no message."""
    from transformers import AutoModelForCausalLM

    dirs, hf_models = hf_dirs
    path = tmp_path / "stale"
    shutil.copytree(dirs["gpt"], path)
    (path / "model.safetensors").unlink()
    torch.save({k: v * 0.5 for k, v in hf_models["gpt"].state_dict().items()}, path / "pytorch_model.bin")
    hf_models["gpt"].save_pretrained(path, max_shard_size="20KB")  # the newer weights, sharded
    assert (path / "model.safetensors.index.json").is_file() and (path / "pytorch_model.bin").is_file()
    theirs = AutoModelForCausalLM.from_pretrained(path).eval()
    _, model = _imported(path)
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model.eval()(idx)[0], theirs(input_ids=idx).logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(model(idx)[0], hf_models["gpt"](input_ids=idx).logits, rtol=0, atol=1e-5)


def test_roberta_with_a_tanh_gelu_is_refused_as_its_head_computes_the_exact_one(hf_dirs, tmp_path, capsys):
    """transformers' RoBERTa head applies the exact GeLU whatever hidden_act says; largebatch's BERT
    has one activation, so a RoBERTa with hidden_act gelu_new imported with logits 2e-3 away."""
    dirs, _ = hf_dirs
    path = tmp_path / "roberta-tanh"
    shutil.copytree(dirs["roberta"], path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu_new"}))
    code, err = _train_cli(capsys, f"--model.init_from=hf:{path}", "--check", f"--run.out_dir={tmp_path / 'run'}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "hidden_act='gelu_new'" in err and "only hidden_act='gelu' maps exactly" in err


def test_a_segment_b_row_that_is_dropped_is_warned_of_and_the_dropout_rates_noted(hf_dirs, tmp_path, capsys):
    """BERT's segment embedding: row 0 is folded into the positions, the others were dropped
    silently. And the directory's dropout rates give way to the run's model.dropout, said in a note."""
    dirs, _ = hf_dirs
    with pytest.warns(UserWarning, match=r"segment \(token-type\) embedding has 2 rows.*other rows are dropped"):
        _imported(dirs["bert"])
    with warnings.catch_warnings():  # RoBERTa's one row: nothing to say
        warnings.simplefilter("error")
        _imported(dirs["roberta"])
    path = tmp_path / "bert-dropout"
    shutil.copytree(dirs["bert"], path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "hidden_dropout_prob": 0.1,
                                                  "attention_probs_dropout_prob": 0.1}))
    notes = []
    load_config(REPO / "configs" / "bert-demo.toml", {"model.init_from": f"hf:{path}"}, warn=notes.append)
    assert notes == [f"note: hf:{path} was trained with hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1 "
                     "(config.json); this run trains with model.dropout=0, and an export writes that rate; "
                     "set --model.dropout=0.1 to keep the model's"], notes
    notes.clear()  # set by the user: no note
    load_config(None, {"model.init_from": f"hf:{path}", "model.dropout": 0.05}, warn=notes.append)
    assert notes == []


@pytest.mark.parametrize("kind", ["roberta", "camembert"])
def test_a_run_from_the_roberta_family_exports_as_that_family(hf_dirs, kind, tmp_path):
    """A run continued from RobertaForMaskedLM exported as BertForMaskedLM, so
    RobertaForSequenceClassification.from_pretrained(export) found none of the encoder's weights
    (41 missing keys: a random model). init_from now sets model.hf_model_type and the export writes
    that family: its logits are the original model's, and every encoder weight loads by name."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from largebatch.integrations.hf_export import save_hf

    dirs, hf_models = hf_dirs
    cfg, model = _imported(dirs[kind])
    assert cfg.model.hf_model_type == kind
    tokenizer = Tokenizer.from_file(str(dirs[kind] / "tokenizer.json"))
    out = tmp_path / "export"
    info = save_hf(model.eval(), tokenizer, out)
    assert info["architecture"] == {"roberta": "RobertaForMaskedLM", "camembert": "CamembertForMaskedLM"}[kind]
    config = json.loads((out / "config.json").read_text())
    pad = tokenizer.token_to_id("[PAD]")  # the run's pad token: positions from pad + 1
    assert (config["model_type"], config["type_vocab_size"], config["pad_token_id"],
            config["max_position_embeddings"]) == (kind, 1, pad, T + pad + 1)
    from transformers import AutoModelForMaskedLM

    exported = AutoModelForMaskedLM.from_pretrained(out).eval()
    idx = torch.randint(5, V, (3, T), generator=torch.Generator().manual_seed(2))  # no special ids
    theirs = hf_models[kind](input_ids=idx).logits
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(exported(input_ids=idx).logits, theirs, rtol=0, atol=1e-5)
    classifier, loading = AutoModelForSequenceClassification.from_pretrained(out, num_labels=2,
                                                                             output_loading_info=True)
    assert type(classifier).__name__.startswith(type(hf_models[kind]).__name__.replace("ForMaskedLM", ""))
    assert all(k.startswith("classifier.") for k in loading["missing_keys"]), loading["missing_keys"]
    assert all(k.startswith("lm_head.") for k in loading["unexpected_keys"]), loading["unexpected_keys"]
    # one segment: a pair is <cls> A <sep> <sep> B <sep> without token_type_ids (a type id 1 would
    # index past the one-row segment embedding), whatever the special tokens are called
    pair = AutoTokenizer.from_pretrained(out)("w5 w6", "w7")
    assert "token_type_ids" not in pair and pair["input_ids"].count(tokenizer.token_to_id("[SEP]")) == 3

    # the export's family is yours to choose: BertForMaskedLM, the same logits
    cfg, model = _imported(dirs[kind], **{"model.hf_model_type": "bert"})
    assert save_hf(model.eval(), tokenizer, tmp_path / "as-bert")["architecture"] == "BertForMaskedLM"
    as_bert = AutoModelForMaskedLM.from_pretrained(tmp_path / "as-bert").eval()
    torch.testing.assert_close(as_bert(input_ids=idx).logits, theirs, rtol=0, atol=1e-5)


def test_hf_model_type_is_checked_against_the_kind_and_the_activation(capsys, tmp_path):
    for args, words in ((("--model.hf_model_type=roberta",), ["hf_model_type='roberta'", "a 'gpt' model",
                                                            "gpt2 (or leave it unset)"]),
                        (("bert-demo", "--model.hf_model_type=roberta", "--model.norm_position=post",
                          "--model.activation=gelu_tanh"), ["activation='gelu_tanh'", "exact GeLU",
                                                            "hf_model_type='bert'"]),
                        (("--model.hf_model_type=llama",), ["hf_model_type", "llama"])):
        code, err = _train_cli(capsys, *args, "--check", f"--run.out_dir={tmp_path / 'run'}")
        assert code == 2 and len(err.splitlines()) == 1, err
        assert all(w in err for w in words), err
