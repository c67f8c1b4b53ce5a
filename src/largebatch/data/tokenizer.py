"""Byte-level BPE tokenizer (HF ``tokenizers``), trained on the training split only.

Byte-level BPE as in GPT-2 (Radford et al. 2019, Sec. 2.2; BPE: Sennrich et al. 2016): text is
mapped to its UTF-8 bytes, each byte to a printable symbol, and merges are learned on top, so
every string encodes losslessly (``decode(encode(s)) == s``) with no unknown token. The special
tokens take the first ids, in this order:

    0 <|endoftext|>  document separator (GPT-2 convention), also between documents in BERT samples
    1 [PAD]  2 [CLS]  3 [SEP]  4 [MASK]   (BERT, Devlin et al. 2019)

A user's tokenizer (``data.tokenizer_file``) separates documents with the first of
``DOCUMENT_SEPARATORS`` it has: ``<|endoftext|>`` (GPT-2), ``</s>`` (RoBERTa, T5, Llama-style
vocabularies) or ``[SEP]`` (BERT's WordPiece, which has no end-of-text token).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump when training or encoding changes: the cache key includes it, so old caches are not reused.
TOKENIZER_VERSION = "bytebpe-1"

EOT, PAD, CLS, SEP, MASK = "<|endoftext|>", "[PAD]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (EOT, PAD, CLS, SEP, MASK)
EOS = "</s>"
DOCUMENT_SEPARATORS = (EOT, EOS, SEP)  # in order of preference


def new_byte_level_bpe() -> Tokenizer:
    """An untrained byte-level BPE tokenizer (no normalizer, so it round-trips any text)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE with ``vocab_size`` entries (special tokens and 256 bytes included)."""
    tokenizer = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens present in ``tokenizer`` (a user file may lack some), the document
    separator included (never masked)."""
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    separator = document_separator(tokenizer)
    if separator is not None:
        ids[separator[0]] = separator[1]
    return {token: i for token, i in ids.items() if i is not None}


def document_separator(tokenizer: Tokenizer) -> tuple[str, int] | None:
    """(token, id) of the first of DOCUMENT_SEPARATORS in ``tokenizer``; None when it has none."""
    for token in DOCUMENT_SEPARATORS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    return None


def no_separator_message(field: str, value) -> str:
    """The error for a tokenizer that has no document separator, naming the field and the fix."""
    return (f"{field}={value!r} has none of {', '.join(DOCUMENT_SEPARATORS)} to separate documents: "
            f"add one as a special token (tokenizers: tokenizer.add_special_tokens([{EOT!r}])), or "
            "leave the field out to train a tokenizer on the corpus")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: uint16 up to 65,536 entries, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def plain(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` with truncation and padding switched off (in place; returned): a tokenizer.json
    may carry either (many published ones do), and encoding a corpus or a task must keep every
    token of every text and add none -- truncation cut each document at its length, padding filled
    the stream with [PAD] targets."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


ENCODE_CHARS = 1 << 22
"""Characters of text encoded at a time when writing a token stream: the tokenizer's Encoding
objects cost ~100 bytes a token, so encoding a whole split at once took ~80x the corpus in memory."""


def write_documents(tokenizer: Tokenizer, texts: Iterable[str], eot_id: int, dtype: np.dtype,
                    path: str | Path) -> int:
    """Write one flat token stream to ``path`` and return its length: every document preceded by the
    separator ``eot_id`` (<|endoftext|> or see document_separator), so the first token of a document
    is always predicted from the separator, as in GPT-2 training data. Documents are encoded a batch
    of about ``ENCODE_CHARS`` characters at a time (memory: one batch, not the corpus)."""
    written = 0
    with open(path, "wb") as out:
        def flush(batch: list[str]) -> None:
            nonlocal written
            encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
            stream = np.empty(sum(len(e.ids) + 1 for e in encodings), dtype=dtype)
            position = 0
            for encoding in encodings:
                stream[position] = eot_id
                stream[position + 1: position + 1 + len(encoding.ids)] = encoding.ids
                position += 1 + len(encoding.ids)
            out.write(stream.data)  # (ndarray.tofile hides the errno of a full disk)
            written += len(stream)

        batch, chars = [], 0
        for text in texts:
            batch.append(text)
            chars += len(text)
            if chars >= ENCODE_CHARS:
                flush(batch)
                batch, chars = [], 0
        if batch:
            flush(batch)
    return written
