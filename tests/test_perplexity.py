"""`largebatch perplexity` and largebatch.perplexity: every token scored once, each from the context
the windows promise -- the summed -ln p against each token's own forward on exactly that context in
float64 -- and the command on a real tiny run against transformers' logits on the exported model,
with bits per byte over the text's own UTF-8 bytes."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from largebatch.cli import main as cli_main
from largebatch.export import load_run
from largebatch.models import ModelConfig, build_model
from largebatch.models.gpt import GPT
from largebatch.perplexity import document_losses, windows
from largebatch.perplexity import perplexity as score

SEP = 3
TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief that thou, "
        "her maid, art far more fair than she. \u2014 Be not her maid, since she is envious; her vestal "
        "livery is but sick and green, and none but fools do wear it; cast it off.\n")


@pytest.mark.parametrize("seq_len", range(1, 9))
def test_windows_score_every_position_once_with_the_context_they_promise(seq_len):
    for length in range(0, 30):
        for stride in range(1, seq_len + 1):
            counted = []
            for lo, hi, scored in windows(length, seq_len, stride):
                assert 0 <= lo and hi - 1 - lo <= seq_len and 1 <= scored <= hi - 1 - lo  # reads <= seq_len
                for t in range(hi - scored, hi):  # position t is predicted from positions lo .. t - 1
                    assert t - lo >= min(t, seq_len - stride + 1), (length, seq_len, stride, lo, t)
                    counted.append(t)
            assert counted == list(range(1, length)), (length, seq_len, stride)
    for stride in (0, seq_len + 1):
        with pytest.raises(ValueError, match=f"stride={stride}: must be in"):
            list(windows(10, seq_len, stride))


def _model(**extra) -> torch.nn.Module:
    torch.manual_seed(0)  # dropout on: the scores must be eval mode's
    cfg = ModelConfig(kind="gpt", vocab_size=50, n_layer=2, n_head=4, n_embd=32, seq_len=8, dropout=0.3, **extra)
    model = build_model(cfg).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights far from the init: logits of order 1
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def _reference(model, ids: list[int], context) -> float:
    """-sum ln p(ids[t] | ids[context(t)]) in float64, one forward per token on exactly its context (in
    eval mode: dropout off)."""
    total = 0.0
    model.eval()
    with torch.no_grad():
        for t in range(1, len(ids)):
            logits = model(torch.tensor([ids[context(t):t]]))[0][0, -1].double()
            total -= torch.log_softmax(logits, dim=-1)[ids[t]].item()
    return total


class OwnForward(GPT):
    """A kind of a user's own whose forward is not GPT's: scored through its forward's logits."""

    def forward(self, idx, targets=None, reduction="mean", cache=None):
        return super().forward(idx, targets, reduction, cache)


@pytest.mark.parametrize("layout", [{}, {"position": "rope", "norm": "rmsnorm", "n_kv_head": 2},
                                    {"document_mask": True, "separator_id": SEP}, "own-forward", "hooked"],
                         ids=["gpt2", "llama", "documents", "own-forward", "hooked"])
def test_each_documents_loss_is_its_tokens_own_forwards_in_float64(layout, monkeypatch):
    """Stride 1: every token reads the seq_len tokens before it (fewer at the start); strides 3 and
    seq_len: the windows' rule, from its definition. Documents of 1
    (the separator alone), 2, 9 and 30 tokens, batched 1, 3 and 8 windows to a forward (rows of other
    documents and of other lengths beside each)."""
    model, s = _model(**(layout if isinstance(layout, dict) else {})), 8
    if layout == "own-forward":
        model.__class__ = OwnForward
    if layout == "hooked":  # a forward hook on the model (a user's; FSDP2's gathers): it runs
        model.register_forward_hook(lambda module, args, out: (out[0] * 0.7, out[1]))
    monkeypatch.setattr("largebatch.perplexity.SCORE_CHUNK", 5)  # the output layer 5 positions at a time
    g = torch.Generator().manual_seed(2)
    documents = [[SEP] + torch.randint(4, 50, (n - 1,), generator=g).tolist() for n in (1, 2, 9, 30)]
    # stride 1: the seq_len tokens before each one; else each window ends `stride` after the last and
    # reads seq_len tokens back from its end (a document's last window ends at the document's end)
    contexts = {1: lambda t, n: max(0, t - s)}
    for stride in (3, s):
        contexts[stride] = lambda t, n, k=stride: max(0, min(1 + k * ((t - 1) // k + 1), n) - 1 - s)
    for stride, context in contexts.items():
        for batch_size in (1, 3, 8):
            model.train()
            got = document_losses(model, [np.array(d, dtype=np.uint16) for d in documents], stride, batch_size)
            assert model.training  # left in the mode it was in
            assert [count for _, count in got] == [0, 1, 8, 29]
            for (nll, _), ids in zip(got, documents):
                reference = _reference(model, ids, lambda t, n=len(ids): context(t, n))
                assert nll == pytest.approx(reference, rel=1e-12, abs=1e-12), (stride, batch_size)


# --- the command, on a real tiny run ------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_run(tiny_data_cache, tmp_path_factory):
    from test_export import tiny, train

    return train(tiny(tiny_data_cache, tmp_path_factory.mktemp("runs") / "gpt", **{
        "model.seq_len": 32, "run.total_tokens": 32 * 8 * 6}))


def perplexity(capsys, *args) -> tuple[int, str, str]:
    code = cli_main(["perplexity", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _transformers_nll(hf, ids: list[int], seq_len: int) -> float:
    """Windows ending seq_len apart, each reading seq_len tokens back from its end and scoring the
    tokens after the previous one's end, by transformers' forward on the exported model, in float64."""
    total = 0.0
    with torch.no_grad():
        for first in range(1, len(ids), seq_len):
            end = min(first + seq_len, len(ids))
            context = ids[max(0, end - 1 - seq_len):end]
            logits = hf(torch.tensor([context[:-1]])).logits[0, -(end - first):].double()
            total -= torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[first:end])[:, None]).sum().item()
    return total


def test_a_text_scores_as_transformers_reads_it_and_bits_per_byte_count_its_bytes(gpt_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    code, out, err = perplexity(capsys, gpt_run, "--text", TEXT, "--json")
    assert code == 0, err
    result = json.loads(out)
    tokenizer = load_run(gpt_run).tokenizer
    ids = [0] + tokenizer.encode(TEXT, add_special_tokens=False).ids  # <|endoftext|>, then the text
    assert len(ids) - 1 > 3 * 32  # several windows
    assert cli_main(["export", str(gpt_run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()
    nll = _transformers_nll(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), ids, 32)
    size = len(TEXT.encode("utf-8"))
    assert size > len(TEXT)  # (the dash is 3 bytes)
    assert result["tokens"] == len(ids) - 1 and result["bytes"] == size and result["stride"] == 32
    assert result["loss"] == pytest.approx(nll / (len(ids) - 1), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-4)
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / size, rel=1e-5)
    assert result["step"] == 6 and [d["name"] for d in result["documents"]] == ["text"]
    code, out, err = perplexity(capsys, gpt_run, "--text", TEXT)
    assert code == 0 and out.splitlines()[1].startswith(f"loss {result['loss']:.4f} nats a token")
    assert f"bits per byte {result['bits_per_byte']:.4f}" in out and "stride 32" in err and "tokens/s" in err


def test_a_corpus_scores_each_document_alone_and_the_runs_validation_split(gpt_run, tmp_path, capsys, monkeypatch):
    from largebatch.data.corpus import load_documents

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    (folder / "b.jsonl").write_text(json.dumps({"body": TEXT[:60]}) + "\n" + json.dumps({"body": TEXT[60:]}) + "\n")
    code, out, err = perplexity(capsys, gpt_run, "--corpus", folder, "--text-field", "body", "--stride", 8, "--json")
    assert code == 0, err
    result = json.loads(out)
    rows = {d["name"]: d for d in result["documents"]}
    assert sorted(rows) == ["a", "b:1", "b:2"]
    alone = {}
    for name, text in (("a", TEXT), ("b:1", TEXT[:60]), ("b:2", TEXT[60:])):
        code, out, _ = perplexity(capsys, gpt_run, "--text", text, "--stride", 8, "--json")
        alone[name] = json.loads(out)
        assert rows[name]["nll"] == pytest.approx(alone[name]["nll"], rel=1e-6)  # never read with another
        assert rows[name]["bytes"] == len(text.encode())
    assert result["tokens"] == sum(r["tokens"] for r in rows.values())
    assert result["bits_per_byte"] == pytest.approx(sum(r["nll"] for r in rows.values()) / math.log(2)
                                                    / sum(r["bytes"] for r in rows.values()), rel=1e-12)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(TEXT.encode())))
    code, out, _ = perplexity(capsys, gpt_run, "--corpus", "-", "--stride", 8, "--json")
    assert code == 0 and json.loads(out)["nll"] == pytest.approx(alone["a"]["nll"], rel=1e-9)

    # the run's validation documents, all of them, read from its corpus again
    names = load_run(gpt_run).val_documents
    code, out, err = perplexity(capsys, gpt_run, "--split", "val", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert sorted(d["name"] for d in result["documents"]) == sorted(names) and len(names) >= 2
    texts = {d.name: d.text for d in load_documents("shakespeare")}
    assert result["bytes"] == sum(len(texts[n].encode()) for n in names)


def test_a_mixtures_validation_documents_under_their_names(tiny_data_cache, tmp_path, capsys):
    """data.mixture: the run's validation documents of each corpus, named as the run names them (under
    their corpus), each scoring as the same text given alone."""
    from largebatch.data.corpus import load_documents
    from test_export import tiny, train

    plays = load_documents("shakespeare")
    for k, name in enumerate(("comedies", "histories")):
        (tmp_path / name).mkdir()
        for j, play in enumerate(plays[10 * k:10 * k + 10]):
            (tmp_path / name / f"play{j}.txt").write_text(play.text[:4000])
    mixture = {str(tmp_path / "comedies"): 0.5, str(tmp_path / "histories"): 0.5}
    run = train(tiny(tmp_path / "cache", tmp_path / "run", **{"data.mixture": mixture, "run.total_tokens": 48 * 8 * 2}))
    names = load_run(run).val_documents
    code, out, err = perplexity(capsys, run, "--split", "val", "--json")
    assert code == 0, err
    rows = json.loads(out)["documents"]
    assert sorted(r["name"] for r in rows) == sorted(names) and len(names) == 2
    for row in rows:
        corpus, _, stem = row["name"].rpartition("/")
        assert corpus in mixture
        code, out, _ = perplexity(capsys, run, "--text", (Path(corpus) / f"{stem}.txt").read_text(), "--json")
        assert json.loads(out)["nll"] == pytest.approx(row["nll"], rel=1e-9)


def test_a_masked_language_model_is_refused_in_one_line(tiny_data_cache, tmp_path, capsys):
    from largebatch.train.metrics import read_metrics
    from test_export import tiny, train

    run = train(tiny(tiny_data_cache, tmp_path / "bert", **{"model.kind": "bert", "run.total_tokens": 48 * 8 * 2}))
    assert not any("val_bpb" in r for r in read_metrics(run))  # no bits per byte for a masked LM
    assert json.loads((run / "summary.json").read_text())["final_val_bpb"] is None
    for command, words in (("perplexity", "a masked language model"), ("generate", "a masked language model")):
        code = cli_main([command, str(run), *(["--text", "x"] if command == "perplexity" else [])])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, words", [
    ([], "give one of --text, --corpus and --split val (given: none)"),
    (["--text", "a", "--corpus", "x"], "not allowed with argument"),
    (["--text", ""], "--text is empty"),
    (["--text", "a", "--stride", "33"], "--stride 33: must be in [1, 32]"),
    (["--text", "a", "--stride", "0"], "--stride must be >= 1"),
    (["--text", "a", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["--split", "train"], "invalid choice: 'train'"),
    (["--corpus", "{tmp}/missing.txt"], "does not exist"),
    (["--corpus", "{tmp}/latin1.txt"], "is not UTF-8 text"),
    (["--text", "a", "--device", "tpu"], "--device 'tpu'"),
    (["--text", "a", "--checkpoint", "999"], "999"),
    (["--text", "a", "--ema"], "weight average"),
    (["--corpus", "{tmp}/ids.npy"], "--corpus '{tmp}/ids.npy' is token ids, which keep no text to count bytes in"),
    (["--text", "ROM\udcc9O"], "--text is not UTF-8 text"),  # a terminal's latin-1 bytes, as Python passes them
    (["--corpus", "broken"], "--corpus 'broken': the notes are gone"),  # a registered corpus that fails to load
])
def test_bad_input_gives_one_line_errors(gpt_run, tmp_path, capsys, monkeypatch, args, words):
    from largebatch.data.corpus import CORPORA, CorpusError, NamedCorpus

    def gone():
        raise CorpusError("the notes are gone")

    monkeypatch.setitem(CORPORA, "broken", NamedCorpus(gone, "a corpus whose files were removed"))
    (tmp_path / "latin1.txt").write_bytes("ROMÉO:".encode("latin-1"))
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.uint16))
    words = words.format(tmp=tmp_path)
    code, out, err = perplexity(capsys, gpt_run, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err, err


def test_a_tokenizer_of_another_vocabulary_is_refused(gpt_run, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(999)] + ["ROMEO"]
    big = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.add_special_tokens(["<|endoftext|>"])
    big.save(str(tmp_path / "tokenizer.json"))
    run = tmp_path / "copy"
    import shutil

    shutil.copytree(gpt_run, run)
    (run / "tokenizer.json").unlink()
    code, _, err = perplexity(capsys, run, "--text", "ROMEO", "--tokenizer", tmp_path / "tokenizer.json")
    assert code == 2 and "token id 1001, which is not in the model's vocabulary (400)" in err, err


def test_perplexity_is_listed(capsys):
    assert cli_main([]) == 0 and "perplexity" in capsys.readouterr().out
    assert cli_main(["perplexity", "--help"]) == 0 and "bits per byte" in capsys.readouterr().out
    assert Path(__file__).exists()


# --- the trainer's bits per byte ----------------------------------------------------------------

def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's map of the 256 bytes to printable characters, from its definition: the printable
    Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves, the other 68 bytes, in order,
    for the characters from chr(256) on. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def test_the_trainers_bits_per_byte_count_the_evaluated_texts_bytes(tiny_data_cache, tmp_path):
    """val_bpb = val_loss x (evaluated targets) / (their text's UTF-8 bytes) / ln 2, at each phase's
    sequence length (two phases: 16 then 48 tokens). The targets are the first run.eval_tokens //
    seq_len samples of a validation split built apart from the run, their bytes read through GPT-2's
    byte alphabet written from its definition (checked first: a document's tokens give back its UTF-8
    exactly); the separators are no text. In every evaluation record, for the weight average too, and
    in the summary."""
    from largebatch.data import build_data
    from largebatch.data.corpus import load_documents
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.train.loop import Trainer
    from largebatch.train.metrics import read_metrics
    from test_export import tiny

    out = tmp_path / "run"
    phases = tmp_path / "phases.toml"
    phases.write_text("[[phases]]\nseq_len = 16\ntotal_tokens = 1536\n\n[[phases]]\nseq_len = 48\n"
                      "total_tokens = 1536\n")
    cfg = load_config(resolve_config(str(phases)), tiny(tiny_data_cache, out, **{
        "run.ema_decay": 0.9, "run.eval_tokens": 480, "run.eval_every_tokens": 512,
        "run.checkpoint_every_tokens": 1024, "run.keep_checkpoints": 5}))
    summary = Trainer(cfg, out, log=lambda *_: None).fit()
    data = build_data(cfg.data, 16)
    tokenizer, alphabet = data.tokenizer, _gpt2_byte_alphabet()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    def text_bytes(ids) -> bytes:
        return b"".join(b"" if i in special else bytes(alphabet[c] for c in tokenizer.id_to_token(i)) for i in ids)

    document = load_documents("shakespeare")[0].text[:3000] + " \u2014 caf\u00e9 \u4e2d\u6587"
    assert text_bytes(tokenizer.encode(document, add_special_tokens=False).ids) == document.encode("utf-8")
    ratio = {}
    for seq_len in (16, 48):
        targets = build_data(cfg.data, seq_len).val.get_batch(range(480 // seq_len))["targets"].flatten().tolist()
        ratio[seq_len] = len(targets) / len(text_bytes(targets)) / math.log(2)
    assert ratio[16] != pytest.approx(ratio[48], rel=1e-3)  # two slices of other texts
    records = [r for r in read_metrics(out) if r["kind"] == "val"]
    assert {r["seq_len"] for r in records} == {16, 48} and len(records) >= 4
    for r in records:
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * ratio[r["seq_len"]], rel=1e-12)
        assert r["val_bpb_ema"] == pytest.approx(r["val_loss_ema"] * ratio[r["seq_len"]], rel=1e-12)
    assert summary["final_val_bpb"] == records[-1]["val_bpb"]
    assert summary["final_val_bpb_ema"] == records[-1]["val_bpb_ema"]

    # `largebatch perplexity` on the checkpoint in the first phase reads the 16 positions it trained
    logged = []
    result = score(out, text=TEXT, checkpoint=8, log=logged.append)
    assert result["step"] == 8 and result["seq_len"] == 16 and result["stride"] == 16
    assert any("trained sequences of 16 tokens only" in line for line in logged), logged
    assert score(out, text=TEXT, log=logged.append)["seq_len"] == 48  # the end of the run: all of them


def test_bits_per_byte_are_left_out_where_a_tokens_bytes_are_not_its_own(tmp_path):
    """WordPiece ('##' pieces, spaces the decoder adds) and a SentencePiece-style vocabulary ('▁' for
    a space the decoder strips at the start) have no fixed bytes per token: no table, so no val_bpb.
    A byte-level one's added token that is not special is its own text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.implementations import SentencePieceBPETokenizer

    from largebatch.data.tokenizer import token_bytes, train_tokenizer

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer, wordpiece.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    assert token_bytes(wordpiece) is None
    sentencepiece = SentencePieceBPETokenizer()
    sentencepiece.train_from_iterator(["to be or not to be"] * 10, vocab_size=40)
    assert token_bytes(Tokenizer.from_str(sentencepiece.to_str())) is None
    byte_level = train_tokenizer(["to be or not to be, caf\u00e9"] * 10, 300)
    idle = Tokenizer.from_str(byte_level.to_str())
    idle.normalizer = normalizers.Sequence([])  # a normaliser that does nothing: the text as it is
    assert np.array_equal(token_bytes(idle), token_bytes(byte_level))
    normalising = Tokenizer.from_str(byte_level.to_str())
    normalising.normalizer = normalizers.NFC()  # (Qwen2's): the tokens count the normalised text's bytes
    assert token_bytes(normalising) is None
    spaced = Tokenizer.from_str(byte_level.to_str())
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # a space the text may not have
    assert token_bytes(spaced) is None
    byte_level.add_tokens(["<br/>"])
    table = token_bytes(byte_level)
    assert table[byte_level.token_to_id("<br/>")] == 5 and table[byte_level.token_to_id("<|endoftext|>")] == 0
    ids = byte_level.encode("not to be, caf\u00e9<br/>", add_special_tokens=False).ids
    assert table[ids].sum() == len("not to be, caf\u00e9<br/>".encode())


def test_a_tokenizer_that_does_not_give_the_text_back_is_noted(gpt_run, tmp_path, capsys, monkeypatch):
    """Bits per byte divide by the text's bytes: a tokenizer that lower-cases (here the run's own with a
    Lowercase normaliser) scores less than the text, so the command says so."""
    from tokenizers import Tokenizer, normalizers

    tokenizer = Tokenizer.from_file(str(gpt_run / "tokenizer.json"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    code, _, err = perplexity(capsys, gpt_run, "--text", "ROMEO: But soft!", "--tokenizer", tmp_path / "tokenizer.json")
    assert code == 0 and "does not give 'text' back as it is" in err, err
    code, _, err = perplexity(capsys, gpt_run, "--text", "ROMEO: But soft!")
    assert code == 0 and "back as it is" not in err, err
    monkeypatch.setattr("largebatch.perplexity.ENCODE_BATCH", 40)  # a long document: its first tokens checked
    monkeypatch.setattr("largebatch.perplexity.ROUND_TRIP_TOKENS", 12)
    code, _, err = perplexity(capsys, gpt_run, "--text", "ROMEO: " + "but soft " * 10, "--tokenizer",
                              tmp_path / "tokenizer.json")
    assert code == 0 and "does not give 'text' back as it is" in err, err
    code, _, err = perplexity(capsys, gpt_run, "--text", "romeo: " + "but soft " * 10, "--tokenizer",
                              tmp_path / "tokenizer.json")
    assert code == 0 and "back as it is" not in err, err
    (tmp_path / "corpus").mkdir()  # the first document comes back (lower case); the second does not
    (tmp_path / "corpus" / "a.txt").write_text("but soft!")
    (tmp_path / "corpus" / "b.txt").write_text("ROMEO: But soft!")
    code, _, err = perplexity(capsys, gpt_run, "--corpus", tmp_path / "corpus",
                              "--tokenizer", tmp_path / "tokenizer.json")
    assert code == 0 and "does not give 'b' back as it is" in err and err.count("back as it is") == 1, err
