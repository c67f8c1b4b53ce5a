"""`largebatch fill-mask`: a BERT run's most likely tokens at each mask of a text, the tokens and
probabilities transformers' fill-mask pipeline gives on the run's export (its model and softmax; its
tokenizer is the export's, so the encoding is checked against one written out here), and one-line
refusals of what it cannot do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from largebatch.cli import main as cli_main
from test_export import export, roberta_style_tokenizer, tiny, train

TEXT = "KING HENRY: My lord, the [MASK] is come.\nNow is the winter of our [MASK]."


@pytest.fixture(scope="module")
def bert_run(tiny_data_cache, tmp_path_factory):
    # post-LN (it exports), trained long enough that its predictions are far from uniform
    out = tmp_path_factory.mktemp("runs") / "bert"
    return train(tiny(tiny_data_cache, out, **{"model.kind": "bert", "model.norm_position": "post",
                                              "run.total_tokens": 48 * 8 * 80}))


def _expected_ids(tokenizer, text: str, mask: str, cls: str, sep: str) -> list[int]:
    """The ids training would give ``text`` with its masks (written out from the data pipeline's rule:
    [CLS] body [SEP], a masked token replaced whole, its leading space included): the pieces between
    the masks encoded alone, the one space before each mask dropped."""
    pieces = text.split(mask)
    ids = [tokenizer.token_to_id(cls)]
    for n, piece in enumerate(pieces):
        if n < len(pieces) - 1 and piece.endswith(" "):
            piece = piece[:-1]
        ids += tokenizer.encode(piece, add_special_tokens=False).ids if piece else []
        if n < len(pieces) - 1:
            ids.append(tokenizer.token_to_id(mask))
    return ids + [tokenizer.token_to_id(sep)]


def _fill(run: Path, capsys, *args: str) -> tuple[int, str, str]:
    code = cli_main(["fill-mask", str(run), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_fill_mask_gives_what_transformers_fill_mask_pipeline_gives_on_the_export(bert_run, tmp_path, capsys):
    import transformers

    code, out, err = _fill(bert_run, capsys, "--text", TEXT, "--top-k", "7", "--json")
    assert code == 0, err
    ours = json.loads(out)
    assert len(ours["masks"]) == 2 and all(len(m["candidates"]) == 7 for m in ours["masks"])
    assert export(bert_run, tmp_path / "hf") == 0
    capsys.readouterr()
    pipe = transformers.pipeline("fill-mask", model=str(tmp_path / "hf"), top_k=7, device="cpu")
    theirs = pipe(TEXT)  # one list of candidates per mask
    assert len(theirs) == 2
    tok = pipe.tokenizer
    ids = tok(TEXT)["input_ids"]
    from largebatch.export import load_run
    assert ids == _expected_ids(load_run(bert_run, log=lambda *_: None).tokenizer, TEXT, "[MASK]", "[CLS]", "[SEP]")
    assert [i for i, t in enumerate(ids) if t == tok.mask_token_id] == [m["position"] for m in ours["masks"]]
    assert ours["tokens"] == len(ids)
    for mask, their in zip(ours["masks"], theirs):
        probabilities = [c["probability"] for c in mask["candidates"]]
        assert probabilities == pytest.approx([t["score"] for t in their], rel=1e-4, abs=1e-7)
        for rank, (c, t) in enumerate(zip(mask["candidates"], their)):
            near = [abs(probabilities[rank] - probabilities[j]) < 1e-5 * probabilities[rank]
                    for j in (rank - 1, rank + 1) if 0 <= j < len(probabilities)]
            if not any(near):  # (two candidates within float noise may rank either way)
                assert (c["token_id"], c["text"]) == (t["token"], t["token_str"]), (rank, mask, their)
    top = ours["masks"][0]["candidates"][0]
    assert top["probability"] > 0.04  # (trained: far above uniform's 1 / 400)
    # the text filled with each mask's most likely token, as the export's tokenizer decodes it
    filled = list(ids)
    for mask in ours["masks"]:
        filled[mask["position"]] = mask["candidates"][0]["token_id"]
    assert ours["filled"] == tok.decode(filled, skip_special_tokens=True)
    # the plain output: the filled text, then one line per mask
    code, out, err = _fill(bert_run, capsys, "--text", TEXT)
    assert code == 0 and out.startswith(ours["filled"] + "\n"), err
    lines = out.splitlines()[-2:]
    assert lines[0].startswith(f"[MASK] 1 (token {ours['masks'][0]['position']}): {json.dumps(top['text'])} ")
    assert len(lines[1].split("  ")) == 5  # (the default --top-k)
    assert "2 mask(s)" in err


def test_fill_mask_refuses_what_it_cannot_do_in_one_line(bert_run, tiny_data_cache, tmp_path, capsys):
    for args, words in ((["--text", "no mask here"], "has no [MASK] token: write [MASK] where"),
                        (["--text", "the [MASK] " + "word " * 60], "the model reads at most 48 (its model.seq_len)"),
                        (["--text", "[MASK]", "--top-k", "0"], "--top-k"),
                        (["--text", "a [MASK]", "--device", "tpu"], "--device")):
        code, out, err = _fill(bert_run, capsys, *args)
        assert code == 2 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "latin1.txt").write_bytes("ROM\xc9O [MASK]".encode("latin-1"))
    code, out, err = _fill(bert_run, capsys, "--text-file", str(tmp_path / "latin1.txt"))
    assert code == 2 and "--text-file" in err and "cannot be read (not UTF-8 text)" in err, err
    (tmp_path / "text.txt").write_text(TEXT + "\n")  # as it is, its final newline included
    code, out, err = _fill(bert_run, capsys, "--text-file", str(tmp_path / "text.txt"), "--json")
    assert code == 0 and json.loads(out)["text"] == TEXT + "\n", err
    code, out, err = _fill(bert_run, capsys, "--text", "ROM\udcc9O [MASK]")  # a terminal's latin-1 bytes
    assert code == 2 and "--text is not UTF-8 text" in err, err
    from largebatch.fill_mask import FillMaskError, fill_mask

    with pytest.raises(FillMaskError, match="must be a str"):
        fill_mask(bert_run, b"the [MASK]", log=lambda *_: None)
    import numpy as np
    result = fill_mask(bert_run, "the [MASK]", top_k=np.int64(3), log=lambda *_: None)  # (numpy's integers too)
    assert result["top_k"] == 3 and len(result["masks"][0]["candidates"]) == 3
    assert fill_mask(bert_run, "the [MASK]", top_k=10**6, log=lambda *_: None)["top_k"] == 400  # (the vocabulary)
    gpt = train(tiny(tiny_data_cache, tmp_path / "gpt"))
    code, out, err = _fill(gpt, capsys, "--text", "the [MASK] of")
    assert code == 2 and "a causal language model" in err and "largebatch generate" in err, err


def test_the_python_function_matches_a_float64_softmax_of_the_models_logits(bert_run):
    """fill_mask's probabilities against the model's own logits at the masked positions, softmaxed in
    float64 (the encoding checked above), ranked the same."""
    from largebatch.export import load_run
    from largebatch.fill_mask import fill_mask
    from largebatch.integrations.hf_export import masked_lm_encoder

    result = fill_mask(bert_run, TEXT, top_k=3, log=lambda *_: None)
    loaded = load_run(bert_run, log=lambda *_: None)
    encoder, _, _ = masked_lm_encoder(loaded.tokenizer, "bert")
    ids = encoder.encode(TEXT).ids
    with torch.no_grad():
        logits = loaded.model.eval()(torch.tensor([ids]))[0][0].double()
    for mask in result["masks"]:
        p = torch.softmax(logits[mask["position"]], dim=-1)
        expected = p.topk(3)
        assert [c["token_id"] for c in mask["candidates"]] == expected.indices.tolist()
        assert [c["probability"] for c in mask["candidates"]] == pytest.approx(expected.values.tolist(), rel=1e-5)


def test_a_pre_ln_bert_on_a_roberta_style_tokenizer_fills_its_mask_token(tiny_data_cache, tmp_path, capsys):
    """A pre-LN BERT (it does not export) with RoBERTa's <mask>, <s> and </s>: the text encoded as
    training would, the probabilities a float64 softmax of its logits; a tokenizer.json that pads
    (many published ones do) changes nothing; --checkpoint reads an earlier step's weights."""
    from tokenizers import Tokenizer

    from largebatch.export import load_run
    from largebatch.fill_mask import fill_mask

    path = roberta_style_tokenizer(tmp_path / "roberta.json")
    run = train(tiny(tiny_data_cache, tmp_path / "run", **{
        "model.kind": "bert", "data.tokenizer_file": path, "run.total_tokens": 48 * 8 * 12,
        "run.checkpoint_every_tokens": 48 * 8 * 6}))
    text = "What, my dear lady <mask>! are you yet living?"
    result = fill_mask(run, text, top_k=4, log=lambda *_: None)
    assert result["mask_token"] == "<mask>" and len(result["masks"]) == 1
    tokenizer = Tokenizer.from_file(path)
    ids = _expected_ids(tokenizer, text, "<mask>", "<s>", "</s>")
    assert result["tokens"] == len(ids) and result["masks"][0]["position"] == ids.index(tokenizer.token_to_id("<mask>"))
    loaded = load_run(run, log=lambda *_: None)
    with torch.no_grad():
        logits = loaded.model.eval()(torch.tensor([ids]))[0][0, result["masks"][0]["position"]].double()
    expected = torch.softmax(logits, dim=-1).topk(4)
    assert [c["token_id"] for c in result["masks"][0]["candidates"]] == expected.indices.tolist()
    assert [c["probability"] for c in result["masks"][0]["candidates"]] == pytest.approx(expected.values.tolist(),
                                                                                          rel=1e-5)
    padded = tmp_path / "padded.json"
    tokenizer.enable_padding(length=40, pad_id=tokenizer.token_to_id("<pad>"), pad_token="<pad>")
    tokenizer.save(str(padded))
    again = fill_mask(run, text, top_k=4, tokenizer_file=padded, log=lambda *_: None)
    assert again["masks"] == result["masks"] and again["tokens"] == len(ids)
    earlier = fill_mask(run, text, top_k=4, checkpoint=6, log=lambda *_: None)
    assert earlier["step"] == 6 and result["step"] == 12
    assert earlier["masks"][0]["candidates"] != result["masks"][0]["candidates"]


def test_a_lowercasing_byte_level_tokenizer_keeps_the_whitespace_before_a_mask(tmp_path):
    """A byte-level BPE whose normalizer lowercases (so " [MASK]" normalizes to " [mask]"): the one
    space before a mask belongs to the masked token, but a newline, a tab or a second space are
    tokens training keeps; they were all dropped (RoBERTa's lstrip), here and in the export."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from largebatch.data.corpus import shakespeare_documents
    from largebatch.integrations.hf_export import hf_tokenizer, masked_lm_encoder

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([d.text[:20000] for d in shakespeare_documents()[:4]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[CLS]", "[SEP]", "[MASK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    encoder, _, _ = masked_lm_encoder(tok, "bert")
    exported = hf_tokenizer(tok, "bert", 64)
    for text in ("More\n[MASK] is", "more [MASK] is", "more  [MASK] is", "More\t[MASK] IS", "[MASK] at the start"):
        expected = _expected_ids(tok, text, "[MASK]", "[CLS]", "[SEP]")
        assert encoder.encode(text).ids == expected, text
        assert exported(text)["input_ids"] == expected, text
