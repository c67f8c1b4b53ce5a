"""Byte-level BPE tokenizer (HF ``tokenizers``), trained on the training split only.

Byte-level BPE as in GPT-2 (Radford et al. 2019, Sec. 2.2; BPE: Sennrich et al. 2016): text is
mapped to its UTF-8 bytes, each byte to a printable symbol, and merges are learned on top, so
every string encodes losslessly (``decode(encode(s)) == s``) with no unknown token. The special
tokens take the first ids, in this order:

    0 <|endoftext|>  document separator (GPT-2 convention), also between documents in BERT samples
    1 [PAD]  2 [CLS]  3 [SEP]  4 [MASK]   (BERT, Devlin et al. 2019)

A user's tokenizer (``data.tokenizer_file``) separates documents with the first of
``DOCUMENT_SEPARATORS`` it has: ``<|endoftext|>`` (GPT-2), ``</s>`` (RoBERTa, T5, Llama-style
vocabularies) or ``[SEP]`` (BERT's WordPiece, which has no end-of-text token). Its masked-LM tokens
are BERT's names or else RoBERTa's (``MASKED_LM_NAMES``): ``<s>`` ... ``</s>`` around a sample,
``<mask>``, ``<pad>``, as in RoBERTa (Liu et al. 2019) and the byte-level BPE vocabularies after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump when training or encoding changes: the cache key includes it, so old caches are not reused.
TOKENIZER_VERSION = "bytebpe-1"

EOT, PAD, CLS, SEP, MASK = "<|endoftext|>", "[PAD]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (EOT, PAD, CLS, SEP, MASK)
EOS = "</s>"
DOCUMENT_SEPARATORS = (EOT, EOS, SEP)  # in order of preference
# masked-LM role -> the names a tokenizer may give it, in order of preference: BERT's, RoBERTa's
MASKED_LM_NAMES = {"cls": (CLS, "<s>"), "sep": (SEP, EOS), "mask": (MASK, "<mask>"), "pad": (PAD, "<pad>")}
MASKED_LM_ROLES = ("cls", "sep", "mask")  # what BERT samples need of a tokenizer
MASKED_LM_NEEDS = "[CLS], [SEP] and [MASK] (or RoBERTa's <s>, </s> and <mask>)"  # the roles, for messages


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
    tokenizer.train_from_iterator((piece for text in texts for piece in pieces(text, TRAIN_PIECE_CHARS)),
                                  trainer)
    return tokenizer


TRAIN_PIECE_CHARS = 1 << 16
"""Longest piece of a document handed to the tokenizer trainer at once (see pieces): the trainer
buffers a few hundred texts, and a corpus that is one large file is one document."""


def pieces(text: str, limit: int, drop_space: bool = False) -> Iterable[str]:
    """``text`` in consecutive pieces of at most ``limit`` characters (``text`` itself when it is not
    longer). Each cut lies just before a whitespace character that has a non-whitespace character on
    either side, where byte-level BPE's pre-tokenizer (and any whitespace-splitting one) always
    ends a word: encoding the pieces gives the ids of encoding the whole text, and training on them
    counts the same words. With ``drop_space`` the cuts are at single spaces, which are left out:
    for tokenizers that mark every text's start as a word start (SentencePiece-style "▁", see
    cut_mode), "a" + "word" encodes as "a word" does. Tokenizers hold ~200 bytes per character of
    text they encode at once, so a corpus that is one 1 GB file would need ~200 GB whole. A stretch
    of ``limit`` characters with no such whitespace (a very long unbroken word) is cut where the
    limit falls; only there can the ids differ from the whole text's."""
    start, end = 0, len(text)
    while end - start > limit:
        cut, found = _cut(text, start, start + limit, (" ",) if drop_space else (" ", "\n", None))
        yield text[start:cut]
        start = cut + 1 if drop_space and found else cut
    yield text[start:]


def _cut(text: str, start: int, stop: int, spaces: tuple) -> tuple[int, bool]:
    """(the last position in (start, stop) of one of ``spaces`` -- None: any other whitespace -- with
    non-whitespace on both sides, preferring the second half of the range; True) or (stop, False)."""
    low = start + (stop - start) // 2
    for space in spaces:
        if space is None:  # other whitespace (tabs, ideographic space, ...)
            for i in range(stop - 1, low, -1):
                if text[i].isspace() and not text[i - 1].isspace() and not text[i + 1].isspace():
                    return i, True
            continue
        i = text.rfind(space, low, stop)
        while i > low:
            if not text[i - 1].isspace() and not text[i + 1].isspace():
                return i, True
            i = text.rfind(space, low, i)
    return stop, False


CUT_PROBE = "Tell me, friend: 12 ships\nsailed on.\tThe end\u3000is near \u3000 yes 'tis"


def cut_mode(tokenizer: Tokenizer) -> str | None:
    """How a long document can be cut for ``tokenizer`` without changing its ids, tried on
    CUT_PROBE: "before" (just before a whitespace character: byte-level BPE, WordPiece, any
    whitespace splitter), "drop" (at a single space, left out: tokenizers that prepend "▁" to every
    text, as SentencePiece conversions do), or None (neither holds: documents are encoded whole)."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    whole = ids(CUT_PROBE)
    cuts = [i for i in range(1, len(CUT_PROBE) - 1) if CUT_PROBE[i].isspace()
            and not CUT_PROBE[i - 1].isspace() and not CUT_PROBE[i + 1].isspace()]
    if all(ids(CUT_PROBE[:i]) + ids(CUT_PROBE[i:]) == whole for i in cuts):
        return "before"
    if all(ids(CUT_PROBE[:i]) + ids(CUT_PROBE[i + 1:]) == whole for i in cuts if CUT_PROBE[i] == " "):
        return "drop"
    return None


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens present in ``tokenizer`` (a user file may lack some), the document
    separator included, and every other token the file marks special ([UNK], <s>, <pad>, ...): none
    is ever a masked-LM target or a random replacement, as in transformers' masking collator, which
    leaves out all of a tokenizer's special tokens."""
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    for token, token_id in masked_lm_tokens(tokenizer).values():
        ids.setdefault(token, token_id)
    separator = document_separator(tokenizer)
    if separator is not None:
        ids[separator[0]] = separator[1]
    for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items()):
        if added.special:
            ids.setdefault(added.content, token_id)
    return {token: i for token, i in ids.items() if i is not None}


def masked_lm_tokens(tokenizer: Tokenizer) -> dict[str, tuple[str, int]]:
    """Masked-LM role ("cls", "sep", "mask", "pad") -> (token, id), for each role ``tokenizer`` has a
    name for: the first of ``MASKED_LM_NAMES[role]`` in it ([CLS] before <s>, and so on)."""
    return _roles(tokenizer.token_to_id)


def masked_lm_ids(special_ids: dict[str, int]) -> dict[str, int]:
    """Masked-LM role -> id among ``special_ids`` (special_token_ids' answer), by the same preference
    as masked_lm_tokens; a role with no name there is left out."""
    return {role: token_id for role, (_, token_id) in _roles(special_ids.get).items()}


def _roles(id_of) -> dict[str, tuple[str, int]]:
    """Role -> (its first name that ``id_of`` finds, that id)."""
    found = {}
    for role, names in MASKED_LM_NAMES.items():
        named = next(((token, i) for token in names if (i := id_of(token)) is not None), None)
        if named is not None:
            found[role] = named
    return found


def masked_lm_missing(roles) -> str:
    """The roles of MASKED_LM_ROLES absent from ``roles`` (a masked_lm_ids or masked_lm_tokens
    answer), each as its names ("[MASK] or <mask>"), joined for a message; "" when none is."""
    return ", ".join(" or ".join(MASKED_LM_NAMES[r]) for r in MASKED_LM_ROLES if r not in roles)


def document_separator(tokenizer: Tokenizer) -> tuple[str, int] | None:
    """(token, id) of the first of DOCUMENT_SEPARATORS in ``tokenizer``; None when it has none."""
    for token in DOCUMENT_SEPARATORS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    return None


def separator_id(tokenizer: Tokenizer, configured: int | None = None) -> int | None:
    """The id that starts a document: ``configured`` (model.separator_id) where set, else the
    tokenizer's ``document_separator``; None when neither gives one."""
    if configured is not None:
        return configured
    found = document_separator(tokenizer)
    return None if found is None else found[1]


def no_separator_message(field: str, value) -> str:
    """The error for a tokenizer that has no document separator, naming the field and the fix."""
    return (f"{field}={value!r} has none of {', '.join(DOCUMENT_SEPARATORS)} to separate documents: "
            f"add one as a special token (tokenizers: tokenizer.add_special_tokens([{EOT!r}])), or "
            "leave the field out to train a tokenizer on the corpus")


def id_space(tokenizer: Tokenizer) -> int:
    """The ids ``tokenizer`` can produce, as a vocabulary size: its largest id + 1, added tokens
    included. A tokenizer.json may leave ids unused (a WordPiece or WordLevel file with gaps, a special
    token added at 65541), so its count of entries can be smaller: an embedding of that many rows, or
    a stream dtype chosen by it, would not hold every id."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(max(ids, default=-1) + 1, tokenizer.get_vocab_size(with_added_tokens=True))


def token_bytes(tokenizer: Tokenizer, size: int | None = None) -> np.ndarray | None:
    """The UTF-8 bytes of text each id stands for, (``size`` or id_space,) int64, for a byte-level
    tokenizer that keeps the text as it is (its decoder ByteLevel, no normalizer, no space added before
    the text: GPT-2's, this project's, Llama 3's): each character of a vocabulary entry is one byte
    (GPT-2 maps every byte to one printable character), an added token that is not special is its own
    text, and a special token (the document separator, [PAD]) is no text: 0. An id the tokenizer does
    not have: 0. None for another tokenizer, where a token's bytes are not the text's own: WordPiece or
    a SentencePiece-style vocabulary (a token's text depends on its neighbours), or a byte-level one
    that normalises the text first (Qwen2's NFC) or adds a space before it (the tokens then count
    bytes the text may not have)."""
    import json

    spec = json.loads(tokenizer.to_str())
    decoder, pre = spec.get("decoder") or {}, spec.get("pre_tokenizer") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    prefix = any(p.get("type") == "ByteLevel" and p.get("add_prefix_space")
                 for p in [pre, *(pre.get("pretokenizers") or [])])
    normalizer = spec.get("normalizer") or {}
    normalises = bool(normalizer) and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"))
    if "ByteLevel" not in kinds or normalises or prefix:
        return None
    table = np.zeros(size if size is not None else id_space(tokenizer), dtype=np.int64)
    added = tokenizer.get_added_tokens_decoder()
    for token, token_id in tokenizer.get_vocab(with_added_tokens=False).items():
        if token_id < len(table) and token_id not in added:
            table[token_id] = len(token)
    for token_id, token in added.items():
        if token_id < len(table):
            table[token_id] = 0 if token.special else len(token.content.encode("utf-8"))
    return table


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


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list:
    """``tokenizer``'s encodings of ``texts`` taken as text: no special tokens added, and a special
    token's string written in a text (``"<|endoftext|>"``, ``"[MASK]"`` in a document about
    tokenizers, or in code) encoded as the characters it is, as GPT-2's training data and
    tiktoken's ``encode_ordinary`` treat it. Matched as the token, it cut a document in two or put
    an unlabelled ``[MASK]`` into a BERT sample. A transformers tokenizer exported from a run still
    reads such strings as its special tokens (its ``split_special_tokens=False``), as prompts expect."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        return tokenizer.encode_batch(texts, add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = before


def special_strings(tokenizer: Tokenizer) -> list[str]:
    """The strings of ``tokenizer``'s special tokens (what ``encode_texts`` encodes as text)."""
    return [added.content for added in tokenizer.get_added_tokens_decoder().values() if added.special]


ENCODE_CHARS = 1 << 22
"""Characters of text encoded at a time when writing a token stream: the tokenizer's Encoding
objects cost ~100 bytes a token, so encoding a whole split at once took ~80x the corpus in memory.
A document longer than this is encoded in pieces (see pieces), so the bound holds for a corpus that
is one large file too."""


def write_documents(tokenizer: Tokenizer, texts: Iterable[str], eot_id: int, dtype: np.dtype,
                    path: str | Path, progress: Callable[[int], None] | None = None) -> int:
    """Write one flat token stream to ``path`` and return its length: every document preceded by the
    separator ``eot_id`` (<|endoftext|> or see document_separator), so the first token of a document
    is always predicted from the separator, as in GPT-2 training data. Documents are encoded a batch
    of about ``ENCODE_CHARS`` characters at a time (memory: one batch, not the corpus), a longer
    document in pieces that encode to the same ids as the whole (see pieces and cut_mode; whole
    where the tokenizer allows no such cut). ``progress``, if given, is called with the characters
    encoded so far after each batch."""
    written = encoded = 0
    with open(path, "wb") as out:
        def flush(batch: list[str], starts: list[bool]) -> None:
            nonlocal written, encoded
            encodings = encode_texts(tokenizer, batch)
            stream = np.empty(sum(len(e.ids) + first for e, first in zip(encodings, starts)), dtype=dtype)
            position = 0
            for encoding, first in zip(encodings, starts):
                if first:
                    stream[position] = eot_id
                    position += 1
                stream[position: position + len(encoding.ids)] = encoding.ids
                position += len(encoding.ids)
            out.write(stream.data)  # (ndarray.tofile hides the errno of a full disk)
            written += len(stream)
            if progress is not None:
                encoded += sum(len(text) for text in batch)
                progress(encoded)

        batch, starts, chars, mode = [], [], 0, "unknown"
        for text in texts:
            if len(text) > ENCODE_CHARS and mode == "unknown":
                mode = cut_mode(tokenizer)
            limit = len(text) if mode is None else ENCODE_CHARS
            for index, piece in enumerate(pieces(text, limit, drop_space=mode == "drop")):
                batch.append(piece)
                starts.append(index == 0)
                chars += len(piece)
                if chars >= ENCODE_CHARS:
                    flush(batch, starts)
                    batch, starts, chars = [], [], 0
        if batch:
            flush(batch, starts)
    return written
