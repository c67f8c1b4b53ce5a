"""`largebatch export --format hf` end to end: real tiny runs of the real trainer, exported, loaded
with transformers' Auto classes offline, logits compared with largebatch's own forward."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from largebatch.cli import main as cli_main
from largebatch.export import load_run
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer

TEXT = ("HAMLET: To be, or not to be, that is the question: whether 'tis nobler in the mind "
        "to suffer the slings and arrows of outrageous fortune.")


def tiny(cache, out, **extra) -> dict:
    """A 2-layer model on Shakespeare: ~8 steps in a couple of seconds. Dropout, untied biases and
    a non-default eps make a wrong mapping visible."""
    o = {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 48,
         "model.dropout": 0.1, "model.norm_eps": 1e-6, "data.vocab_size": 400,
         "data.cache_dir": str(cache), "schedule.lr_schedule": "cosine", "schedule.peak_lr": 2e-2,
         "schedule.warmup": 0.1, "schedule.batch_policy": "constant", "schedule.batch_size": 8,
         "run.micro_batch": 8, "run.total_tokens": 48 * 8 * 8, "run.eval_tokens": 48 * 8,
         "run.tensorboard": False, "run.progress": "off", "run.sample_tokens": 0,
         "run.out_dir": str(out), "run.peak_flops": 1e11, "run.device": "cpu", "run.plots": False}
    o.update(extra)
    return o


def train(overrides: dict):
    cfg = load_config(resolve_config(None), overrides)
    Trainer(cfg, overrides["run.out_dir"], log=lambda *_: None).fit()
    return Path(overrides["run.out_dir"])


@pytest.fixture(scope="module")
def cache(tiny_data_cache):
    return tiny_data_cache


@pytest.fixture(scope="module")
def gpt_run(cache, tmp_path_factory):
    return train(tiny(cache, tmp_path_factory.mktemp("runs") / "gpt"))


def export(run, out, *extra) -> int:
    return cli_main(["export", str(run), str(out), "--format", "hf", *extra])


def test_gpt_export_loads_in_transformers_with_the_same_logits(gpt_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf-gpt"
    records = []  # transformers' own warnings (its "transformers" logger does not propagate)
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        assert export(gpt_run, out) == 0
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    # the check reads its sentence (longer than the context) truncated: no warning about its length
    assert not [r for r in records if "sequence length" in r.getMessage()], records
    printed = capsys.readouterr().out
    assert "GPT2LMHeadModel" in printed and "logits match" in printed
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu"
    assert config["layer_norm_epsilon"] == 1e-6 and config["n_positions"] == 48
    assert config["resid_pdrop"] == 0.1 and config["tie_word_embeddings"] is True

    run = load_run(gpt_run)  # the reference: largebatch's model from the same checkpoint
    ours_ids = run.tokenizer.encode(TEXT).ids
    tok = AutoTokenizer.from_pretrained(out)
    assert tok(TEXT)["input_ids"] == ours_ids  # same ids, nothing added
    assert tok.decode(ours_ids) == TEXT and tok.eos_token == "<|endoftext|>"
    # truncation=True cuts at the model's context; the pad token is the config's pad_token_id
    assert tok.model_max_length == 48 and len(tok(TEXT * 4, truncation=True)["input_ids"]) == 48
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert tok.pad_token == "[PAD]" and hf.config.pad_token_id == tok.pad_token_id == 1
    assert hf.generation_config.pad_token_id == 1
    idx = torch.tensor([ours_ids[:48]])
    with torch.no_grad():
        ours, theirs = run.model(idx)[0], hf(input_ids=idx).logits
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())
    assert ours.std() > 0.1  # trained, non-trivial logits
    assert hf.transformer.wte.weight.data_ptr() == hf.lm_head.weight.data_ptr()  # still tied


def test_gpt_export_without_bias_and_untied_from_a_distributed_checkpoint(cache, tmp_path, capsys):
    """bias=False (zeros in transformers), untied output layer, and a .dcp checkpoint -- written by
    the trainer's own distributed save -- newer than the .pt one. Damaged .dcp checkpoints (no
    metadata, a truncated or overwritten shard) are skipped for the next older one, with a note."""
    from transformers import AutoModelForCausalLM

    from largebatch.checkpoint.distributed import save_distributed
    from largebatch.parallel.mesh import ParallelState

    run_dir = train(tiny(cache, tmp_path / "run", **{"model.bias": False,
                                                     "model.tie_embeddings": False}))
    pt = load_run(run_dir)
    model = pt.model
    with torch.no_grad():  # a distinguishable newer state, saved as step+1 in DCP format
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    extra = torch.load(pt.checkpoint, weights_only=False)
    extra = {k: v for k, v in extra.items() if k not in ("model", "optimizer")}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    save_distributed(run_dir, pt.step + 1, model, optimizer, extra, ParallelState())

    out = tmp_path / "hf"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert export(run_dir, out) == 0
    # one process loading a DCP checkpoint is the intent: torch's warning about it is not shown
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    reloaded = load_run(run_dir)
    assert reloaded.checkpoint.suffix == ".dcp"
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not hf.config.tie_word_embeddings
    assert float(hf.transformer.h[0].attn.c_attn.bias.detach().abs().max()) == 0.0
    idx = torch.tensor([reloaded.tokenizer.encode(TEXT).ids[:48]])
    with torch.no_grad():
        ref = model(idx)[0]
        assert torch.allclose(hf(input_ids=idx).logits, ref, atol=1e-5, rtol=0)
        assert torch.allclose(reloaded.model(idx)[0], ref, atol=0, rtol=0)
    # a damaged newest checkpoint (its DCP metadata gone) is skipped for the previous one, and the
    # note suggests only the complete ones
    for step in (pt.step + 2, pt.step + 3):  # (retention counts both formats: the .pt is the 4th)
        save_distributed(run_dir, step, model, optimizer, extra, ParallelState(), keep_last=4)
    dcps = sorted((run_dir / "checkpoints").glob("*.dcp"))
    assert len(dcps) == 3
    (dcps[2] / ".metadata").unlink()
    notes = []
    fallback = load_run(run_dir, log=notes.append)
    assert fallback.checkpoint == dcps[1]
    assert len(notes) == 1 and "skipping unreadable checkpoint" in notes[0]
    assert f"pick one of {[dcps[0].name, dcps[1].name]}" in notes[0], notes[0]
    # a truncated shard and one overwritten with garbage: DCP raises a BaseException for them
    shard = dcps[1] / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 3)
    garbage = dcps[0] / "__0_0.distcp"
    garbage.write_bytes(bytes(range(256)) * (garbage.stat().st_size // 256 + 1))
    capsys.readouterr()
    assert export(run_dir, tmp_path / "hf-fallback", "--no-verify") == 0
    printed = capsys.readouterr()
    assert f"exported {pt.checkpoint} (step {pt.step})" in printed.out
    notes = printed.err.strip().splitlines()
    assert len(notes) == 3 and all(n.startswith("note: skipping unreadable checkpoint") for n in notes)
    assert dcps[2].name in notes[0] and dcps[1].name in notes[1] and dcps[0].name in notes[2], notes
    # none intact: one line naming each and why
    pt.checkpoint.write_bytes(b"\x00" * 64)
    assert export(run_dir, tmp_path / "hf-none", "--no-verify") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and "Traceback" not in "".join(err)
    assert err[-1].startswith(f"largebatch export: error: RUN_DIR {str(run_dir)!r}: no checkpoint "
                              "could be read")
    assert all(f"{p.name}: " in err[-1] for p in (*dcps, pt.checkpoint))
    assert (tmp_path / "hf-fallback" / "model.safetensors").is_file()
    assert not (tmp_path / "hf-none").exists()


def test_exported_files_are_readable_as_the_umask_allows_and_a_replaced_out_keeps_its_mode_and_group(gpt_run, tmp_path):
    """Under umask 022 every file of the export is 0644: transformers wrote model.safetensors 0600
    (through a private temporary file) while the rest was 0644, so a serving container under another
    uid read the config but not the weights. Under umask 077 everything stays private."""
    for umask, expected in ((0o022, 0o644), (0o077, 0o600)):
        previous = os.umask(umask)
        try:
            out = tmp_path / f"hf-{umask:o}"
            assert export(gpt_run, out, "--no-verify") == 0
        finally:
            os.umask(previous)
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {expected}, {k: oct(v) for k, v in modes.items()}
    # OUT made beforehand for a group (setgid, group-writable), empty, then replaced with --force: the
    # export replaces the directory, which used to come back 0755 in the user's own group
    shared = tmp_path / "shared"
    shared.mkdir()
    group = next((g for g in os.getgroups() if g != os.getgid()), None)
    if group is None and os.geteuid() == 0:
        group = 4242  # root may give any group
    if group is not None:
        os.chown(shared, -1, group)
    shared.chmod(0o2770)
    expected_group = shared.stat().st_gid
    for extra in ((), ("--force",)):
        assert export(gpt_run, shared, "--no-verify", *extra) == 0
        assert stat.S_IMODE(shared.stat().st_mode) == 0o2770, oct(shared.stat().st_mode)
        assert {p.stat().st_gid for p in [shared, *shared.iterdir()]} == {expected_group}


def test_post_ln_bert_export_matches_bert_for_masked_lm(cache, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    run_dir = train(tiny(cache, tmp_path / "bert", **{"model.kind": "bert",
                                                      "model.norm_position": "post"}))
    out = tmp_path / "hf-bert"
    assert export(run_dir, out) == 0
    run = load_run(run_dir)
    tok = AutoTokenizer.from_pretrained(out)
    bare = run.tokenizer.encode(TEXT).ids
    cls, sep = run.tokenizer.token_to_id("[CLS]"), run.tokenizer.token_to_id("[SEP]")
    # the BERT samples were [CLS] text [SEP]: the exported tokenizer adds them, and only them
    assert tok(TEXT)["input_ids"] == [cls, *bare, sep]
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == bare
    assert tok.mask_token_id == run.tokenizer.token_to_id("[MASK]")
    # "... the [MASK] of ...": the ids training gives a masked word (the whole token, its leading
    # space included, replaced), not a lone space token before [MASK]
    tokens = tok.convert_ids_to_tokens(bare)
    for i in [i for i, t in enumerate(tokens) if t.startswith("\u0120") and len(t) > 1][:5]:
        masked = (tok.convert_tokens_to_string(tokens[:i]) + " [MASK]"
                  + tok.convert_tokens_to_string(tokens[i + 1:]))
        assert tok(masked, add_special_tokens=False)["input_ids"] == [*bare[:i], tok.mask_token_id, *bare[i + 1:]]
    # but only that space: a newline, a tab or a second space before the masked token are tokens of
    # their own in training (a mask that stripped all whitespace dropped them: ids the model never saw)
    for text, start in (("more\nKING HENRY", 5), ("end.\n\nKING", 6), ("to be:\tthe end", 7), ("the  crown", 5)):
        enc = run.tokenizer.encode(text)
        i = next(k for k, (s, e) in enumerate(enc.offsets) if s <= start < e)
        s, e = enc.offsets[i]
        own = text[s:e][: len(text[s:e]) - len(text[s:e].lstrip())]  # the token's own leading space, if any
        trained = [*enc.ids[:i], tok.mask_token_id, *enc.ids[i + 1:]]
        assert tok(text[:s] + own + "[MASK]" + text[e:], add_special_tokens=False)["input_ids"] == trained, text
        assert run.tokenizer.id_to_token(enc.ids[i - 1]) in ("\u010a", "\u0109", "\u0120"), text  # kept before it
    # the mask's offsets are its own characters (a literal Replace of " [MASK]" gave it the last one only)
    spans = tok("the [MASK] of [MASK]", add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert [spans[k] for k, i in enumerate(tok("the [MASK] of [MASK]", add_special_tokens=False)["input_ids"])
            if i == tok.mask_token_id] == [(4, 10), (14, 20)]
    # a byte-level vocabulary whose pre-tokenizer is a Sequence (Llama 3's: a split, then bytes) too
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from largebatch.integrations.hf_export import hf_tokenizer

    seq = Tokenizer.from_str(run.tokenizer.to_str())
    seq.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s*[\r\n]+|\s+(?!\S)|\s+|[^\s]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    exported = hf_tokenizer(seq, "bert", 48)
    enc = seq.encode("more\nKING HENRY", add_special_tokens=False)
    trained = [*enc.ids[:3], tok.mask_token_id, *enc.ids[4:]]
    assert seq.id_to_token(enc.ids[2]) == "\u010a" and enc.offsets[3][0] == 5  # "more", "\n", then "K..."
    masked = "more\n[MASK]" + "KING HENRY"[enc.offsets[3][1] - 5:]
    assert exported(masked, add_special_tokens=False)["input_ids"] == trained
    cut = tok(TEXT * 4, truncation=True)["input_ids"]  # the context, [CLS] and [SEP] included
    assert tok.model_max_length == 48 and len(cut) == 48 and (cut[0], cut[-1]) == (cls, sep)
    hf = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForMaskedLM" and hf.config.hidden_act == "gelu"
    assert hf.config.pad_token_id == tok.pad_token_id == run.tokenizer.token_to_id("[PAD]")
    ids = [cls, *bare[:46], sep]
    ids[5] = tok.mask_token_id
    idx = torch.tensor([ids])
    with torch.no_grad():
        ours, theirs = run.model(idx)[0], hf(input_ids=idx).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())
    assert ours.std() > 0.1

    # the family is chosen at export too (training never reads it): a resume of the finished run
    # with --model.hf_model_type rewrote config.toml while export read the checkpoint's field
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert cli_main(["train", "--resume", str(run_dir), "--model.hf_model_type=roberta"]) == 0
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # "already complete"
    as_roberta = tmp_path / "hf-roberta"
    assert export(run_dir, as_roberta, "--hf-model-type", "roberta") == 0
    hf = AutoModelForMaskedLM.from_pretrained(as_roberta).eval()
    assert type(hf).__name__ == "RobertaForMaskedLM" and hf.config.pad_token_id == tok.pad_token_id
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=idx).logits, ours, atol=1e-5, rtol=0)
    assert export(run_dir, tmp_path / "bad", "--hf-model-type", "llama") == 2
    assert export(run_dir, tmp_path / "bad", "--hf-model-type", "gpt2") == 2
    assert not (tmp_path / "bad").exists()


def test_an_export_flags_refusal_names_the_flag_and_a_fix_for_trained_weights(gpt_run, tmp_path, capsys):
    """``--hf-model-type roberta`` on a GPT run was told about ``model.hf_model_type`` (a field of a
    training config), and a tanh-GeLU BERT's to change its activation, which trained weights fix."""
    from largebatch.models.config import ModelConfig, hf_model_type_problem

    capsys.readouterr()
    assert export(gpt_run, tmp_path / "bad", "--hf-model-type", "roberta") == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--hf-model-type 'roberta': a 'gpt' model exports as gpt2 (or leave --hf-model-type out)")
    assert not (tmp_path / "bad").exists()
    tanh = ModelConfig(kind="bert", norm_position="post", activation="gelu_tanh", hf_model_type="roberta")
    assert hf_model_type_problem(tanh, "--hf-model-type", fixed=True).endswith(
        "use --hf-model-type bert (its head computes 'gelu_tanh'), or leave --hf-model-type out")
    assert hf_model_type_problem(tanh).endswith("use model.activation='gelu', or model.hf_model_type='bert'")
    assert hf_model_type_problem(tanh, fixed=True).endswith(  # (model.init_from's activation: not the user's)
        "use model.hf_model_type='bert' (its head computes 'gelu_tanh'), or leave it unset")


def test_hf_model_type_refused_before_training_where_the_export_would_refuse_it(cache, tmp_path, capsys):
    """A pre-LN BERT (the default) with hf_model_type set trained to its end, and then its export was
    refused; a GPT's or a tanh-GeLU RoBERTa's was refused at once. All three now are."""
    base = ["train", "--check", f"--run.out_dir={tmp_path / 'run'}", f"--data.cache_dir={cache}"]
    for args, words in ((["bert-demo", "--model.hf_model_type=roberta"], ["norm_position='pre'",
                                                                         "set model.norm_position='post'"]),
                        (["--model.hf_model_type=roberta"], ["a 'gpt' model exports as gpt2 (or leave it unset)"])):
        assert cli_main([*base[:1], *args, *base[1:]]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def roberta_style_tokenizer(path: Path) -> str:
    """A byte-level BPE trained as RoBERTa's was: its special tokens <s>, <pad>, </s>, <unk>, <mask>
    take ids 0-4, and no [CLS]/[SEP]/[MASK]/<|endoftext|> exists."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from largebatch.data.corpus import shakespeare_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [d.text[:20000] for d in shakespeare_documents()[:6]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))
    return str(path)


def test_a_roberta_style_tokenizer_trains_bert_and_gpt_and_exports_its_own_tokens(cache, tmp_path):
    """RoBERTa's names for the masked-LM tokens (<s> ... </s>, <mask>, <pad>) are BERT's [CLS] ...
    [SEP], [MASK], [PAD]: a BERT run on such a tokenizer builds its samples with them (it was refused
    for lacking [CLS]), and both exports declare them, so transformers' tokenizer frames text and
    masks as training did. A GPT export declares the document separator </s> as eos (it declared
    none), <s> as bos and <pad> as pad."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling

    from largebatch.data import IGNORE_INDEX, build_data

    path = roberta_style_tokenizer(tmp_path / "roberta.json")
    s, pad, e, unk, mask = range(5)
    run_dir = train(tiny(cache, tmp_path / "bert", **{"model.kind": "bert", "model.norm_position": "post",
                                                      "data.tokenizer_file": path}))
    run = load_run(run_dir)
    cfg = load_config(resolve_config(None), tiny(cache, tmp_path / "x", **{"model.kind": "bert",
                                                                            "data.tokenizer_file": path}))
    data = build_data(cfg.data, 48, "masked")
    batch = data.train.get_batch(range(64))
    inputs, labels = batch["input_ids"], batch["labels"]
    assert (inputs[:, 0] == s).all() and (inputs[:, -1] == e).all()
    masked = labels != IGNORE_INDEX
    assert (inputs[masked] == mask).float().mean() > 0.6  # 80% of the targets become <mask>
    assert not masked[torch.isin(inputs, torch.tensor([s, pad, e, unk]))].any()
    out = tmp_path / "hf-bert"
    assert export(run_dir, out) == 0
    tok = AutoTokenizer.from_pretrained(out)
    bare = run.tokenizer.encode(TEXT).ids
    assert tok(TEXT)["input_ids"] == [s, *bare, e]
    assert (tok.cls_token, tok.sep_token, tok.mask_token, tok.pad_token, tok.unk_token) == \
        ("<s>", "</s>", "<mask>", "<pad>", "<unk>")
    assert tok.mask_token_id == mask and tok.pad_token_id == pad
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")  # RoBERTa's are its bos and eos (were None)
    # a pair as RoBERTa's tokenizer gives it: </s></s> between, one segment (no token_type_ids)
    first, second = run.tokenizer.encode("To be").ids, run.tokenizer.encode(" or not").ids
    pair = tok("To be", " or not")
    assert pair["input_ids"] == [s, *first, e, e, *second, e] and "token_type_ids" not in pair
    hf = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert (hf.config.pad_token_id, hf.config.bos_token_id, hf.config.eos_token_id) == (pad, s, e)
    collated = DataCollatorForLanguageModeling(tok)([tok(TEXT), tok(TEXT[:40])])  # pads, masks: runs
    assert collated["input_ids"][1, -1] == pad
    ids = [s, *bare[:46], e]
    ids[5] = mask
    with torch.no_grad():
        ours, theirs = run.model(torch.tensor([ids]))[0], hf(input_ids=torch.tensor([ids])).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())

    gpt_dir = train(tiny(cache, tmp_path / "gpt", **{"data.tokenizer_file": path,
                                                     "run.total_tokens": 48 * 8 * 2}))
    assert export(gpt_dir, tmp_path / "hf-gpt") == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf-gpt")
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert tok(TEXT)["input_ids"] == bare
    config = json.loads((tmp_path / "hf-gpt" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (s, e, pad)


def test_a_wordpiece_vocabulary_keeps_its_unknown_token():
    """A BERT WordPiece vocabulary (one a run took through model.init_from) exports with its own
    [UNK] as transformers' unk_token, the id its model emits for an unknown word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from largebatch.integrations.hf_export import hf_tokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "question", "##s"]
    raw = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = hf_tokenizer(raw, "bert", 16)
    assert (tok.unk_token, tok.unk_token_id) == ("[UNK]", 1)
    assert tok("the questions zebra")["input_ids"] == [2, 5, 6, 7, 1, 3]
    assert tok("the [MASK] questions", add_special_tokens=False)["input_ids"] == [5, 4, 6, 7]
    # a pair: segment B after [SEP] is type 1, as BERT's tokenizers give it (it was all 0)
    pair = tok("the", "questions")
    assert pair["input_ids"] == [2, 5, 3, 6, 7, 3] and pair["token_type_ids"] == [0, 0, 0, 1, 1, 1]


def test_pre_ln_bert_is_refused_naming_the_setting(cache, tmp_path, capsys):
    run_dir = train(tiny(cache, tmp_path / "bert-pre", **{"model.kind": "bert",
                                                          "run.total_tokens": 48 * 8 * 2}))
    out = tmp_path / "out"
    assert export(run_dir, out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "model.norm_position='pre'" in err and "--model.norm_position=post" in err
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("case", ["missing_run", "empty_run", "no_checkpoint", "format", "non_empty_out",
                                  "out_is_run", "out_is_cwd", "tokenizer", "tokenizer_not_json",
                                  "tokenizer_not_the_runs", "tokenizer_not_tokenizers", "run_tokenizer_damaged",
                                  "out_parent_is_file"])
def test_bad_input_gives_one_line_errors(case, gpt_run, tmp_path, capsys, monkeypatch):
    out, args = tmp_path / "out", []
    run = gpt_run
    bad = tmp_path / "bad.json"
    if case == "missing_run":
        run, expect = tmp_path / "nope", "is not a directory"
    elif case == "empty_run":  # not the working directory ('.')
        run, expect = "", "RUN_DIR is '': pass a run directory"
    elif case == "no_checkpoint":
        run = tmp_path / "empty_run"
        run.mkdir()
        expect = "has no checkpoint"
    elif case == "out_is_cwd":  # `export RUN . --force` replaced the directory the shell is in
        (tmp_path / "mine.txt").write_text("mine")
        monkeypatch.chdir(tmp_path)
        out, args, expect = Path("."), ["--format", "hf", "--force"], "is the working directory or holds it"
    elif case == "out_is_run":
        out, args, expect = run.parent, ["--format", "hf", "--force"], "would delete the run"
    elif case == "tokenizer":
        args = ["--format", "hf", "--tokenizer", str(tmp_path / "missing.json")]
        expect = "missing.json' does not exist"
    elif case in ("tokenizer_not_json", "tokenizer_not_tokenizers"):
        bad.write_text("vocab: not JSON\n" if case == "tokenizer_not_json" else '{"vocab": [1, 2]}')
        args = ["--format", "hf", "--tokenizer", str(bad)]
        expect = f"--tokenizer {str(bad)!r} is not a readable tokenizers file"
    elif case == "tokenizer_not_the_runs":  # another vocabulary than the run's own copy: its ids mean
        # other text (the export's check fed both models the same wrong ids and passed)
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        other = Tokenizer(models.BPE())
        other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        other.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        other.save(str(bad))
        args = ["--format", "hf", "--tokenizer", str(bad)]
        expect = f"--tokenizer {str(bad)!r} is not the vocabulary this run trained with"
    elif case == "run_tokenizer_damaged":  # a copy of the run whose kept tokenizer is cut short
        run = tmp_path / "run"
        shutil.copytree(gpt_run, run)
        text = (run / "tokenizer.json").read_text()
        (run / "tokenizer.json").write_text(text[: len(text) // 2])
        expect = f"{str(run / 'tokenizer.json')!r} is not a readable tokenizers file"
    elif case == "out_parent_is_file":
        (tmp_path / "file").write_text("mine")
        out = tmp_path / "file" / "sub" / "out"
        expect = f"{str(tmp_path / 'file')!r} is a file, not a directory"
    elif case == "format":
        args, expect = ["--format", "gguf"], "--format 'gguf' is unknown: use one of hf"
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expect = "--force"
    argv = ["export", str(run), str(out), *(args or ["--format", "hf"])]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err and "Traceback" not in err, err
    assert not out.exists() or case in ("non_empty_out", "out_is_run", "out_is_cwd")
    if case == "out_is_cwd":
        assert (tmp_path / "mine.txt").read_text() == "mine"
    if case == "run_tokenizer_damaged":
        assert "--tokenizer PATH" in err
    if case == "out_parent_is_file":
        assert (tmp_path / "file").read_text() == "mine"
    if case == "non_empty_out":
        assert (out / "keep.txt").read_text() == "mine"
        # --force replaces it; --tokenizer takes the run's tokenizer from a file
        trained = tmp_path / "tokenizer-copy.json"  # the run's tokenizer, from another file
        shutil.copyfile(run / "tokenizer.json", trained)
        assert export(run, out, "--force", "--tokenizer", str(trained)) == 0
        assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_missing_transformers_names_the_extra(gpt_run, tmp_path):
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from largebatch.cli import main\n"
            f"raise SystemExit(main(['export', {str(gpt_run)!r}, {str(tmp_path / 'o')!r}, '--format', 'hf']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        ("largebatch export: error: export --format hf needs 'transformers', part of the [hf] "
         "extra: pip install 'largebatch[hf]'")]


def test_a_model_transformers_writes_in_shards_exports(gpt_run, tmp_path, monkeypatch):
    """A model over save_pretrained's max_shard_size (50 GB) is written as an index and shards; the
    export took the missing model.safetensors for a failed write. The limit is lowered here so a
    tiny model shards: the export succeeds and transformers loads the shards with the same logits."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    save = PreTrainedModel.save_pretrained
    monkeypatch.setattr(PreTrainedModel, "save_pretrained",
                        lambda self, *a, **k: save(self, *a, **{**k, "max_shard_size": "20KB"}))
    out = tmp_path / "sharded"
    assert export(gpt_run, out) == 0
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").is_file()
    run = load_run(gpt_run)
    idx = torch.tensor([run.tokenizer.encode(TEXT).ids[:48]])
    with torch.no_grad():
        ours, theirs = run.model(idx)[0], AutoModelForCausalLM.from_pretrained(out).eval()(idx).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0)


def test_an_unfinished_run_exports_with_a_note(cache, tmp_path, capsys):
    """A stopped run's newest checkpoint is a partly trained model: `export` said nothing of it
    (finetune did); it now says how far the run got, on stderr."""
    stopped = train(tiny(cache, tmp_path / "stopped", **{"run.max_steps": 2}))
    assert cli_main(["export", str(stopped), str(tmp_path / "hf"), "--format", "hf", "--no-verify"]) == 0
    budget = load_config(stopped / "config.toml").run.total_tokens
    assert (f"note: the newest readable checkpoint is at {2 * 8 * 48:,} of the run's {budget:,} tokens: this "
            "exports a partly trained model") in capsys.readouterr().err


def test_gpt_tokenizer_without_pad_declares_no_pad_token(gpt_run, tmp_path):
    """A tokenizer without [PAD] (one passed with --tokenizer) exports no pad token and
    pad_token_id null, as GPT-2: no pad token the model has no row for."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tokenizer.token_to_id("[PAD]") is None and tokenizer.get_vocab_size() <= 400
    file = tmp_path / "no-pad.json"
    tokenizer.save(str(file))
    out, run = tmp_path / "hf", tmp_path / "run"
    shutil.copytree(gpt_run, run)  # a run from before the trainer kept its tokenizer: --tokenizer says it
    (run / "tokenizer.json").unlink()
    assert export(run, out, "--tokenizer", str(file), "--no-verify") == 0
    tok, config = AutoTokenizer.from_pretrained(out), AutoConfig.from_pretrained(out)
    assert tok.pad_token is None and config.pad_token_id is None
    assert tok.eos_token_id == config.eos_token_id == 0


def test_an_export_killed_mid_write_leaves_nothing_for_good(gpt_run, tmp_path, capsys):
    """An export SIGKILLed while it writes (or verifies) leaves its hidden staging directory beside
    OUT; the next export into that OUT removes it (its writer no longer runs on this host), and
    keeps a live writer's."""
    import os
    import signal
    import socket
    import time

    out = tmp_path / "hf-gpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen([sys.executable, "-m", "largebatch", "export", str(gpt_run), str(out),
                               "--format", "hf"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    pattern = f".{out.name}.export-*"
    while not list(tmp_path.glob(f"{pattern}/*")) and writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    (killed,) = tmp_path.glob(pattern)
    live = tmp_path / f".{out.name}.export-{socket.gethostname()}-{os.getppid()}"  # a running writer's
    live.mkdir()
    assert export(gpt_run, out) == 0, capsys.readouterr().err
    assert not killed.exists() and live.is_dir() and (out / "config.json").is_file()


def test_a_stop_while_force_replaces_out_leaves_one_whole_export(gpt_run, tmp_path, monkeypatch):
    """--force deleted the old OUT before it renamed the new one in, and a stop meanwhile (Ctrl-C while
    an OUT of many files was deleted) left neither: the old export half deleted, the new one removed
    with its staging directory. The old OUT is renamed aside first now: a stop before the new one is
    in place puts it back whole; a stop while it is deleted leaves the new export whole."""
    from largebatch.export import export as export_run

    out = tmp_path / "out"
    assert export(gpt_run, out, "--no-verify") == 0
    (out / "notes.txt").write_text("the old export")
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    rename, rmtree = Path.rename, shutil.rmtree

    def stopped_before_the_new_one_is_in(self, target):
        if Path(target) == out and self.name.startswith(".out.export-") and "-old-" not in self.name:
            raise KeyboardInterrupt  # what a SIGINT handler raises, at the worst moment
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped_before_the_new_one_is_in)
    with pytest.raises(KeyboardInterrupt):
        export_run(gpt_run, out, force=True, verify=False, log=lambda *_: None)
    monkeypatch.setattr(Path, "rename", rename)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert not list(tmp_path.glob(".out.*"))

    def stopped_while_the_old_one_is_deleted(path, *args, **kwargs):
        if "-old-" in Path(path).name and Path(path).exists():
            raise KeyboardInterrupt
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stopped_while_the_old_one_is_deleted)
    with pytest.raises(KeyboardInterrupt):
        export_run(gpt_run, out, force=True, verify=False, log=lambda *_: None)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    new = {p.name for p in out.iterdir()}
    assert "notes.txt" not in new and {"config.json", "model.safetensors", "tokenizer.json"} <= new
    assert (out / "model.safetensors").read_bytes() == old["model.safetensors"]  # the same checkpoint
    assert export(gpt_run, out, "--no-verify", "--force") == 0  # and the next export clears what was left
    assert not list(tmp_path.glob(".out.*"))


def test_out_a_link_to_a_directory_and_out_written_meanwhile(gpt_run, tmp_path, capsys, monkeypatch):
    """OUT a symbolic link to a directory ("latest -> export-7") ended in a traceback (rmtree
    refuses links), even to an empty one: the export is now written through the link. Two exports
    into one new OUT both said they succeeded, the second replacing the first without --force: OUT
    is now checked again before the rename, and one written meanwhile is kept (one line, exit 2)."""
    from transformers import AutoConfig

    from largebatch.integrations import hf_export

    target = tmp_path / "export-7"
    target.mkdir()
    link = tmp_path / "latest"
    link.symlink_to(target)
    assert export(gpt_run, link, "--no-verify") == 0
    assert link.is_symlink() and (target / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(link).n_layer == 2
    assert export(gpt_run, link, "--no-verify", "--force") == 0 and link.is_symlink()

    out = tmp_path / "raced"
    save = hf_export.save_hf

    def another_export_finishes_first(*args, **kwargs):
        info = save(*args, **kwargs)
        out.mkdir()
        (out / "config.json").write_text("{}")  # what the other export renamed into place
        return info

    monkeypatch.setattr(hf_export, "save_hf", another_export_finishes_first)
    capsys.readouterr()
    assert export(gpt_run, out, "--no-verify") == 2
    err = capsys.readouterr().err
    assert f"OUT '{out}' was written while this export ran" in err and "Traceback" not in err
    assert (out / "config.json").read_text() == "{}" and not list(tmp_path.glob(".raced.export-*"))


def test_a_checkpoint_deleted_while_it_is_read_is_not_damaged(gpt_run, tmp_path, capsys, monkeypatch):
    """A run still training deletes checkpoints past keep_checkpoints while export reads the one it
    listed: with one kept, the export failed ("no checkpoint could be read ... No such file") where
    a newer checkpoint had just been written. It now lists the checkpoints again."""
    from largebatch import export as export_module

    run = tmp_path / "live"
    shutil.copytree(gpt_run, run)
    *others, newest = sorted((run / "checkpoints").glob("*.pt"))
    for other in others:  # keep_checkpoints = 1: the one listed is the only older one
        other.unlink()
    older = newest.with_name("step_00000001.pt")
    shutil.copy(newest, older)
    newest.rename(newest.with_name("hold"))  # the newest is written while the older is read
    real = export_module._load_checkpoint

    def retention_meanwhile(path, ema=False):
        if path == older and older.exists():
            (run / "checkpoints" / "hold").rename(newest)
            older.unlink()
            raise FileNotFoundError(2, "No such file or directory", str(older))
        return real(path, ema)

    monkeypatch.setattr(export_module, "_load_checkpoint", retention_meanwhile)
    loaded = load_run(run, log=print)
    assert loaded.checkpoint == newest
    assert "skipping unreadable" not in capsys.readouterr().out


def test_checkpoint_exports_an_earlier_checkpoint_and_refuses_one_the_run_does_not_keep(cache, gpt_run, tmp_path,
                                                                                         capsys):
    """`--checkpoint STEP` (or its name, or its path) exports that checkpoint, not the newest; a step
    retention deleted, a missing name and another run's file are one-line errors naming the kept steps."""
    from transformers import AutoModelForCausalLM

    from largebatch.models import ModelConfig, build_model
    from largebatch.typed_config import from_dict

    run = train(tiny(cache, tmp_path / "run", **{"run.checkpoint_every_tokens": 2 * 8 * 48,
                                                  "run.keep_checkpoints": 3}))
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_00000004.pt", "step_00000006.pt", "step_00000008.pt"], kept

    def logits_of(name, idx):  # the reference: the checkpoint file read directly into a fresh model
        raw = torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=False)
        model = build_model(from_dict(ModelConfig, raw["config"]["model"]))
        model.load_state_dict(raw["model"])
        with torch.no_grad():
            return model.eval()(idx)[0]

    idx = torch.tensor([list(range(5, 53))])
    for which, step in (("4", 4), ("step_00000006.pt", 6), (str(run / "checkpoints" / "step_00000004.pt"), 4)):
        out = tmp_path / f"hf-{step}"
        assert export(run, out, "--checkpoint", which, "--force") == 0
        captured = capsys.readouterr()
        name = f"step_{step:08d}.pt"
        assert f"{name} (step {step})" in captured.out
        assert (f"note: checkpoint {name} is at {step * 8 * 48:,} of the run's {8 * 8 * 48:,} tokens: this "
                "exports a partly trained model, the one --checkpoint chose") in captured.err
        with torch.no_grad():
            theirs = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=idx).logits
        assert torch.allclose(theirs, logits_of(name, idx), atol=1e-5, rtol=0)
        assert not torch.allclose(theirs, logits_of("step_00000008.pt", idx), atol=1e-3, rtol=0)
    assert export(run, tmp_path / "hf-8", "--checkpoint=8") == 0  # the newest, chosen: no note
    assert "note:" not in capsys.readouterr().err

    for which, expect in (
            ("2", "--checkpoint 2: no checkpoint at step 2; RUN_DIR"),
            ("step_00000002.pt", "--checkpoint 'step_00000002.pt' does not exist"),
            (str(next((gpt_run / "checkpoints").iterdir())), "is not one of this run's checkpoints"),
            (" ", "--checkpoint is empty")):
        assert export(run, tmp_path / "refused", "--checkpoint", which) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expect in err, err
        if which != " ":
            assert "keeps checkpoints at steps 4, 6, 8" in err
        assert not (tmp_path / "refused").exists()


def test_a_tokenizer_given_for_a_run_without_its_own_copy_is_checked_where_it_can_be(gpt_run, tmp_path, capsys):
    """A run directory without tokenizer.json (a run from before the trainer kept one, or a lost copy)
    and `--tokenizer FILE`: where the run's data.tokenizer_file still exists, another vocabulary is
    refused as against a kept copy; where nothing is left to compare, the file is taken with a note
    saying it is unchecked (a same-size vocabulary would give wrong text silently), and the export
    goes on."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from largebatch.export import ExportError, check_given_tokenizer

    run = tmp_path / "run"
    shutil.copytree(gpt_run, run)
    own = tmp_path / "own.json"
    shutil.move(run / "tokenizer.json", own)
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    theirs = Tokenizer.from_file(str(own))
    notes: list[str] = []
    recorded = {"data": {"tokenizer_file": str(own)}}
    check_given_tokenizer(theirs, own, recorded, run, notes.append)  # the same vocabulary: taken, no note
    assert notes == []
    with pytest.raises(ExportError, match=r"--tokenizer '.*other.json' is not the vocabulary this run trained "
                                          r"with \(its data.tokenizer_file='.*own.json'"):
        check_given_tokenizer(other, tmp_path / "other.json", recorded, run, notes.append)
    check_given_tokenizer(other, tmp_path / "other.json", {"data": {}}, run, notes.append)
    assert len(notes) == 1 and "is taken as the run's tokenizer unchecked" in notes[0]
    # end to end: the run trained its own tokenizer on its corpus, so the note, and the export goes on
    assert export(run, tmp_path / "hf", "--tokenizer", str(own)) == 0
    assert "is taken as the run's tokenizer unchecked" in capsys.readouterr().err
    (run / "tokenizer.json").write_text(own.read_text())  # with the kept copy: compared, no note
    assert export(run, tmp_path / "hf2", "--tokenizer", str(own)) == 0
    assert "unchecked" not in capsys.readouterr().err
