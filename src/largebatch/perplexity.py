"""``largebatch perplexity RUN_DIR``: how well does a trained GPT run predict a text?

    largebatch perplexity runs/a --text "To be, or not to be, that is the question."
    largebatch perplexity runs/a --corpus bible
    largebatch perplexity runs/a --split val --stride 64 --json

Reads the newest intact checkpoint of RUN_DIR (any layout it was trained in), or the one
``--checkpoint`` names, and scores every token of each document once, as the run read its documents:
the document separator, then the document's tokens, each predicted from the tokens before it in the
document. A document longer than the model's seq_len is read in windows: each ends --stride tokens
after the one before, reads the seq_len tokens before its end, and scores the tokens after the one
before's end. The default stride is seq_len: windows that do not overlap (but a document's last
window, ending at the document's end, reads a whole seq_len of context for its fewer new tokens).
With a smaller stride every token sees at least seq_len - stride + 1 tokens before it (or all of
them, near the document's start), at about seq_len / stride times the compute; a document within one
window scores the same at any stride. Compare numbers scored at the same seq_len and stride. A
document is never read together with another.

Per document and in total it reports
  loss            nats a token: the mean of -ln p(token | the tokens before it)
  perplexity      exp(loss)
  bits per byte   the summed -log2 p over the documents' UTF-8 bytes. Loss and perplexity are per
                  token, so they change with the tokenizer (a larger vocabulary has fewer, harder
                  tokens); bits per byte do not, so runs with different vocabularies compare on it.

Options:
  --text TEXT            score this text (one document)
  --corpus SPEC          score a corpus: a text file (one document; '-': standard input), a directory
                         or glob pattern of them, JSON Lines, Parquet or Arrow files (a document per
                         record), or a named corpus (shakespeare, bible) -- what data.corpus takes
  --split val            score the run's own validation documents, all of them (the trainer's
                         validation loss reads run.eval_tokens of them)
  --text-field NAME      the JSON Lines / Parquet field that holds the text (default: text)
  --stride N             tokens a window moves on (1 .. seq_len; default seq_len)
  --batch-size N         windows read at once (default 8)
  --json                 one JSON object on stdout: the totals and each document's tokens, bytes,
                         summed -ln p (nll), loss, perplexity and bits per byte, with the checkpoint
                         and its step
  --device DEV           cpu (default), cuda or cuda:N
  --tokenizer PATH       the run's tokenizer.json when the run cannot give it
  --checkpoint STEP      score the run's checkpoint at optimizer step STEP (or its name or path)
  --ema                  score the checkpoint's weight average (run.ema_decay)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from largebatch.arguments import not_utf8, run_command, run_dir_parser, whole_number
from largebatch.export import weights_label
from largebatch.integrations import ExportError

ENCODE_BATCH = 1 << 20
"""Characters of documents encoded at once (the tokenizer holds ~200 bytes a character while it
encodes); a longer document is encoded alone, in pieces (largebatch.data.tokenizer.write_documents)."""


class PerplexityError(ValueError):
    """A bad argument or a run or text that cannot be scored: one line, exit 2."""


def windows(length: int, seq_len: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """The windows over a document of ``length`` tokens (position 0 its separator): ``(lo, hi, scored)``,
    where the model reads positions lo .. hi - 2, predicts positions lo + 1 .. hi - 1, and the last
    ``scored`` of those predictions count. Window k ends at hi = min(1 + k stride, length) and reads
    the seq_len positions before it (lo = max(0, hi - 1 - seq_len)): every position 1 .. length - 1
    is counted once, and a position t is predicted from at least min(t, seq_len - stride + 1)
    positions before it (``stride`` in 1 .. seq_len)."""
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride}: must be in [1, seq_len={seq_len}]")
    first = 1
    while first < length:
        hi = min(first + stride, length)
        yield max(0, hi - 1 - seq_len), hi, hi - first
        first = hi


SCORE_CHUNK = 4096
"""Scored positions whose logits are made at once: (SCORE_CHUNK, vocabulary) floats, 0.8 GB at GPT-2's
50,257 in fp32, however many windows a forward reads and however few of their positions it scores."""


def _plain_gpt(model) -> bool:
    """Whether ``model``'s forward is GPT's own (hidden_states then lm_head) and no hook runs around it:
    its output layer can then be applied to the scored positions only."""
    from largebatch.models.gpt import GPT

    if model._forward_hooks or model._forward_pre_hooks:  # (FSDP2's gathers, a user's hooks): through __call__
        return False
    return isinstance(model, GPT) and type(model).forward is GPT.forward and \
        type(model).hidden_states is GPT.hidden_states and type(model).output_logits is GPT.output_logits


def _scored_losses(model, idx, targets):
    """-ln p of each scored target (targets != -100), summed per row in float64: (B,)."""
    import torch
    import torch.nn.functional as F

    rows, columns = (targets != -100).nonzero(as_tuple=True)
    sums = torch.zeros(idx.size(0), dtype=torch.float64, device=idx.device)
    if _plain_gpt(model):  # the output layer on the scored positions only, a chunk at a time
        hidden = model.hidden_states(idx)[rows, columns]  # (N, C)
        logits_of = lambda part: model.lm_head(hidden[part])  # noqa: E731
    else:  # a kind of its own: its forward's logits, read a chunk of positions at a time
        full = model(idx)[0]
        logits_of = lambda part: full[rows[part], columns[part]]  # noqa: E731
    chosen = targets[rows, columns]
    for start in range(0, len(rows), SCORE_CHUNK):
        part = slice(start, start + SCORE_CHUNK)
        logits = logits_of(part)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (16-bit: in fp32)
        nll = F.cross_entropy(logits, chosen[part], reduction="none")
        sums.index_add_(0, rows[part], nll.double())
    return sums


def document_losses(model, documents: Iterable[Sequence[int]], stride: int | None = None, batch_size: int = 8,
                    progress: Callable[[int], None] | None = None,
                    seq_len: int | None = None) -> list[tuple[float, int]]:
    """For each document (its token ids, the separator first), the summed -ln p of its tokens after the
    first and their count: each token's -ln p in the logits' dtype (fp32 for 16-bit ones), summed in
    float64. The document is read in ``windows`` of the model's seq_len moved ``stride`` on (default
    seq_len), ``batch_size`` windows (of any documents) to a forward. ``model``: a causal model of the
    registry (``forward(idx)`` -> (logits, ...)), on the device it runs on; it is scored in eval mode
    (dropout off) and left in the mode it was in.
    GPT's own output layer is applied to the scored positions only. ``progress``, if given, is called
    with the tokens scored so far after each forward. ``seq_len``: windows shorter than the model's
    (the positions a checkpoint stopped in a short phase has trained)."""

    if seq_len is not None and not 1 <= seq_len <= model.config.seq_len:
        raise ValueError(f"seq_len={seq_len}: must be in [1, {model.config.seq_len}] (the model's seq_len)")
    seq_len = seq_len or model.config.seq_len
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride}: must be in [1, seq_len={seq_len}]")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        return _document_losses(model, documents, stride, batch_size, progress, seq_len, device)
    finally:
        model.train(training)


def _document_losses(model, documents, stride, batch_size, progress, seq_len, device):
    import numpy as np
    import torch

    sums: list[float] = []
    counts: list[int] = []
    pending: list[tuple[int, np.ndarray, int]] = []
    scored = 0

    def flush() -> None:
        nonlocal scored
        width = max(len(w) - 1 for _, w, _ in pending)
        idx = torch.zeros((len(pending), width), dtype=torch.long)
        targets = torch.full((len(pending), width), -100, dtype=torch.long)
        for row, (_, window, count) in enumerate(pending):
            ids = torch.from_numpy(window.astype(np.int64))
            idx[row, :len(ids) - 1] = ids[:-1]
            targets[row, len(ids) - 1 - count:len(ids) - 1] = ids[len(ids) - count:]
        with torch.no_grad():  # right padding is never read by a causal row
            rows = _scored_losses(model, idx.to(device), targets.to(device)).tolist()
        for (document, _, count), value in zip(pending, rows):
            sums[document] += value
            scored += count
        pending.clear()
        if progress is not None:
            progress(scored)

    for document, ids in enumerate(documents):
        ids = np.asarray(ids)
        sums.append(0.0)
        counts.append(max(len(ids) - 1, 0))
        for lo, hi, count in windows(len(ids), seq_len, stride):
            pending.append((document, ids[lo:hi], count))
            if len(pending) == batch_size:
                flush()
    if pending:
        flush()
    return list(zip(sums, counts))


def build_parser() -> argparse.ArgumentParser:
    p = run_dir_parser("largebatch perplexity", __doc__,
                       "largebatch perplexity RUN_DIR (--text TEXT | --corpus SPEC | --split val) [options]")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--text", help=argparse.SUPPRESS)
    source.add_argument("--corpus", help=argparse.SUPPRESS)
    source.add_argument("--split", choices=["val"], help=argparse.SUPPRESS)
    p.add_argument("--text-field", default="text", help=argparse.SUPPRESS)
    p.add_argument("--stride", type=whole_number("--stride", 1), help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=whole_number("--batch-size", 1), default=8, help=argparse.SUPPRESS)
    return p


def _stdin_document():
    from largebatch.data.corpus import Document

    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        raise PerplexityError(f"--corpus '-': standard input is not UTF-8 text (invalid byte at offset "
                              f"{err.start}): convert it to UTF-8") from None
    if not text.strip():
        raise PerplexityError("--corpus '-': standard input is empty: pipe the text to score")
    return [Document("stdin", text)]


def _val_documents(loaded) -> tuple[str, Iterable]:
    """The run's validation documents (their names from the checkpoint, their text from its corpus)."""
    from largebatch.data.build import source_document
    from largebatch.data.corpus import Document, DocumentSource, is_token_array_path

    data = loaded.config.get("data", {})
    separator, field = data.get("document_separator"), data.get("text_field", "text")
    if data.get("val_corpus"):
        spec = data["val_corpus"]
        if is_token_array_path(spec):
            raise PerplexityError(f"--split val: the run's data.val_corpus {spec!r} is token ids, which keep no "
                                  "text to count bytes in: pass its text with --corpus")
        return f"val ({spec})", DocumentSource(spec, separator, field)
    names = loaded.val_documents
    if names is None:
        raise PerplexityError("--split val: the checkpoint does not record the run's validation documents: "
                              "pass them with --corpus")
    specs = list(data.get("mixture") or {}) or [data.get("corpus", "shakespeare")]
    arrays = [spec for spec in specs if is_token_array_path(spec)]
    if arrays:
        raise PerplexityError(f"--split val: the run's corpus {arrays[0]!r} is token ids, which keep no text to "
                              "count bytes in: pass the text they were made from with --corpus")
    wanted = set(names)
    mixture = bool(data.get("mixture"))
    sources = [(spec, DocumentSource(spec, separator, field)) for spec in specs]

    def name_of(spec: str, doc) -> str:  # a mixture's documents are named under their corpus
        return source_document(spec, doc.name) if mixture else doc.name

    found = {name_of(spec, doc) for spec, source in sources for doc in source} & wanted  # before any scoring
    missing = sorted(wanted - found)
    if missing:
        raise PerplexityError(f"--split val: {len(missing)} of the run's {len(wanted)} validation documents are no "
                              f"longer in its corpus ({', '.join(map(repr, missing[:3]))}"
                              f"{' ...' if len(missing) > 3 else ''}): the corpus changed since the run; pass the "
                              "text with --corpus")

    def documents():
        for spec, source in sources:
            for doc in source:
                name = name_of(spec, doc)
                if name in wanted:
                    yield Document(name, doc.text)
    return "val", documents()


def perplexity(run_dir: str | Path, text: str | None = None, corpus: str | None = None, split: str | None = None,
               text_field: str = "text", stride: int | None = None, batch_size: int = 8, device: str = "cpu",
               tokenizer_file: str | Path | None = None, checkpoint: str | int | None = None, ema: bool = False,
               log=print) -> dict[str, Any]:
    """Score ``text``, the corpus ``corpus`` or the run's validation documents (``split="val"``) with the
    run's newest checkpoint (or ``checkpoint``): a dict with the tokens, bytes, loss, perplexity and
    bits per byte in total and for each document, the checkpoint, its step and the time taken. See
    the module's docstring for the arguments."""
    import numpy as np
    import torch

    from largebatch.data import tokenizer as tokenizer_lib
    from largebatch.data.corpus import CorpusError, Document, DocumentSource, is_token_array_path
    from largebatch.export import open_run, partial_note, trained_positions
    from largebatch.models.registry import model_spec

    given = [name for name, value in (("--text", text), ("--corpus", corpus), ("--split", split)) if value is not None]
    if len(given) != 1:
        raise PerplexityError(f"give one of --text, --corpus and --split val (given: {', '.join(given) or 'none'})")
    if split is not None and split != "val":
        raise PerplexityError(f"--split {split!r}: only 'val' (the run's validation documents) is kept")
    if text is not None and not text:
        raise PerplexityError("--text is empty: give the text to score")
    loaded, dev = open_run(run_dir, device, tokenizer_file, checkpoint, ema, log)
    model, tokenizer, config = loaded.model, loaded.tokenizer, loaded.model.config
    if model_spec(config.kind).objective != "causal":
        raise PerplexityError(f"RUN_DIR {str(run_dir)!r} trained a {config.kind} model (a masked language model): "
                              "it predicts masked tokens from both sides, so a text's left-to-right perplexity is "
                              "not its loss; `largebatch fill-mask` shows what it predicts, `largebatch finetune` "
                              "judges it downstream")
    where_from = f"--corpus {corpus!r}" if corpus is not None else "--split val"

    def named(exc: Exception) -> PerplexityError:  # the corpus reader's words name the trainer's field
        words = str(exc) if corpus is None else str(exc).replace("data.text_field", "--text-field")
        return PerplexityError(f"{where_from}: {words}")

    try:  # (before the tokenizer: a run whose text cannot be had needs no tokenizer to be told so)
        if text is not None:
            label, source = "text", [Document("text", text)]
        elif corpus == "-":
            label, source = "stdin", _stdin_document()
        elif corpus is not None:
            if is_token_array_path(corpus):
                raise PerplexityError(f"--corpus {corpus!r} is token ids, which keep no text to count bytes in: "
                                      "pass the text they were made from")
            label, source = corpus, DocumentSource(corpus, None, text_field)
        else:
            label, source = _val_documents(loaded)
    except CorpusError as exc:  # (a named corpus loads here: its package missing)
        raise named(exc) from None
    if tokenizer is None:
        raise PerplexityError(f"RUN_DIR {str(run_dir)!r}: its tokenizer cannot be recovered: pass --tokenizer PATH")
    seq_len = config.seq_len
    trained = trained_positions(loaded)
    if trained is not None and trained < seq_len:
        log(f"note: this checkpoint has trained sequences of {trained} tokens only (the run's phases: its "
            f"model.seq_len is {seq_len}), so the windows are {trained} tokens long")
        seq_len = trained
    if stride is not None and not 1 <= stride <= seq_len:
        raise PerplexityError(f"--stride {stride}: must be in [1, {seq_len}] (the "
                              + ("model's seq_len)" if seq_len == config.seq_len else "positions it trained)"))
    if batch_size < 1:
        raise PerplexityError(f"--batch-size {batch_size}: must be >= 1")
    note = partial_note(loaded, "scores")
    if note:
        log(f"note: {note}")
    separator = tokenizer_lib.separator_id(tokenizer, config.separator_id)
    if separator is None:
        raise PerplexityError("the run's tokenizer has no document separator (<|endoftext|>) to start each "
                              "document from, as the run's documents started")
    tokenizer = tokenizer_lib.plain(tokenizer)
    dtype = tokenizer_lib.token_dtype(max(config.vocab_size, tokenizer_lib.id_space(tokenizer)))
    rows: list[dict[str, Any]] = []
    lossy: list[str] = []  # the first document the tokenizer does not give back (one note)

    def finished(doc, ids: np.ndarray) -> np.ndarray:
        if not lossy and not _gives_back(tokenizer, ids[1:], doc.text):
            lossy.append(doc.name)
            log(f"note: the run's tokenizer does not give {doc.name!r} back as it is (it normalises, lower-cases, "
                "drops or replaces characters): bits per byte over the text's bytes then count only what it "
                "keeps, and compare only with runs whose tokenizer does the same")
        if ids.size and int(ids.max()) >= config.vocab_size:
            raise PerplexityError(f"document {doc.name!r} has token id {int(ids.max())}, which is not in the model's "
                                  f"vocabulary ({config.vocab_size:,}): pass --tokenizer PATH to the tokenizer.json "
                                  "the run trained with")
        rows.append({"name": doc.name, "tokens": len(ids) - 1, "bytes": len(doc.text.encode("utf-8"))})
        return ids

    def encoded(path: Path) -> Iterator[np.ndarray]:
        # each document encoded as the run's data was (tokenizer.encode_texts: special-token strings as
        # text), after its separator; documents a batch of ENCODE_BATCH characters at a time (the
        # tokenizer encodes a batch in parallel), a longer one alone in pieces (write_documents)
        batch: list = []
        chars = 0

        def flush() -> Iterator[np.ndarray]:
            encodings = tokenizer_lib.encode_texts(tokenizer, [doc.text for doc in batch])
            for doc, encoding in zip(batch, encodings):
                yield finished(doc, np.array([separator, *encoding.ids], dtype=np.int64))
            batch.clear()

        try:
            for doc in source:
                where = "--text" if text is not None else f"document {doc.name!r}"
                if (problem := not_utf8(doc.text, where)) is not None:  # (bytes a terminal or a JSON escape made)
                    raise PerplexityError(problem)
                if len(doc.text) > ENCODE_BATCH:
                    yield from flush()
                    chars = 0
                    tokenizer_lib.write_documents(tokenizer, [doc.text], separator, dtype, path)
                    yield finished(doc, np.fromfile(path, dtype=dtype))
                    continue
                batch.append(doc)
                chars += len(doc.text)
                if chars >= ENCODE_BATCH:
                    yield from flush()
                    chars = 0
            yield from flush()
        except CorpusError as exc:
            raise named(exc) from None

    last = [time.perf_counter()]

    def progress(done: int) -> None:
        if time.perf_counter() - last[0] >= 30:
            last[0] = time.perf_counter()
            log(f"scored {done:,} tokens of {len(rows):,} document(s) so far")

    model = model.to(dev)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="largebatch-perplexity-") as scratch:
        results = document_losses(model, encoded(Path(scratch) / "document.bin"), stride, batch_size, progress,
                                  seq_len)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    if not rows:
        raise PerplexityError(f"{label}: no documents to score")
    for row, (nll, count) in zip(rows, results):
        row.update(_measures(nll, count, row["bytes"]))
    nll = math.fsum(n for n, _ in results)
    tokens, size = sum(r["tokens"] for r in rows), sum(r["bytes"] for r in rows)
    if tokens == 0:
        raise PerplexityError(f"{label}: its documents have no tokens to score")
    return {"run_dir": str(run_dir), "checkpoint": str(loaded.checkpoint), "step": loaded.step, "ema": ema,
            "source": label, "seq_len": seq_len, "stride": stride or seq_len, "documents": rows,
            "tokens": tokens, "bytes": size, **_measures(nll, tokens, size), "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else None}


ROUND_TRIP_TOKENS = 1 << 16
"""A document longer than ENCODE_BATCH characters is checked on its first this many tokens."""


def _gives_back(tokenizer, ids, text: str) -> bool:
    """Whether decoding ``ids`` (a document's, separator left out) gives ``text`` back; a long document's
    first ROUND_TRIP_TOKENS tokens against the start of its text (the last few characters left out: the
    cut may fall inside a character's bytes)."""
    if len(text) <= ENCODE_BATCH:
        return tokenizer.decode(ids.tolist(), skip_special_tokens=False) == text
    start = tokenizer.decode(ids[:ROUND_TRIP_TOKENS].tolist(), skip_special_tokens=False)[:-8]
    return text.startswith(start)


def _measures(nll: float, tokens: int, size: int) -> dict[str, float | None]:
    loss = nll / tokens if tokens else None
    return {"nll": nll, "loss": loss, "perplexity": None if loss is None else _exp(loss),
            "bits_per_byte": nll / math.log(2) / size if size else None}


def _exp(value: float) -> float | None:
    return math.exp(value) if value < 709 else None  # (JSON has no infinity)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(build_parser(), argv, _scored, (PerplexityError, ExportError))


def _scored(args: argparse.Namespace) -> int:
    """The command's work: score, then print the measures (the closing line on stderr)."""
    result = perplexity(args.run_dir, args.text, args.corpus, args.split, args.text_field, args.stride,
                        args.batch_size, args.device, args.tokenizer, args.checkpoint, args.ema,
                        log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        docs = result["documents"]
        print(f"{result['source']}: {len(docs):,} document(s), {result['tokens']:,} tokens, {result['bytes']:,} bytes "
              f"({result['bytes'] / result['tokens']:.2f} bytes a token)")
        ppl = "over 1e307" if result["perplexity"] is None else f"{result['perplexity']:.2f}"
        print(f"loss {result['loss']:.4f} nats a token   perplexity {ppl}   "
              f"bits per byte {result['bits_per_byte']:.4f}")
    rate = result["tokens_per_second"]
    print(f"{weights_label(result)}: windows of {result['seq_len']} tokens, stride {result['stride']}; "
          f"{result['seconds']:.2f} s"
          + (f" ({rate:,.0f} tokens/s)" if rate else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
