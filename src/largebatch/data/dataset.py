"""Packed fixed-length samples over one memory-mapped token stream.

Packing follows GPT-2 / Megatron-LM style pretraining data: documents are concatenated into one
stream with a separator token (<|endoftext|> before every document) and cut into equal-length
samples with no padding, so every token of a step is a training token.

* GPT (next-token prediction): sample i is the window stream[i*T : i*T + T + 1] of T+1 tokens;
  ``input_ids`` are its first T tokens and ``targets`` its last T (shifted by one). Consecutive
  windows share one boundary token, so every stream token but the first is a target exactly once
  per epoch. A trailing remainder shorter than a window is dropped.
* BERT (masked LM, no next-sentence prediction): sample i is [CLS] + stream[i*(T-2) : (i+1)*(T-2)]
  + [SEP], i.e. contiguous text across document boundaries ("FULL-SENTENCES" packing, Liu et al.
  2019 "RoBERTa", Sec. 4.2), then corrupted by ``masking.mask_tokens``.

``get_batch`` takes GLOBAL sample indices (positions in the training stream, see sampler.py) and
maps them through the dataset's ``Sampler`` to sample ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch

from .masking import mask_tokens
from .sampler import MixtureSampler, Sampler
from .tokenizer import masked_lm_ids, masked_lm_missing


class PackedDataset:
    """Common part: the token stream, the sample order and decoding."""

    kind = "?"

    def __init__(self, tokens: np.ndarray, seq_len: int, window: int, stride: int, *,
                 split: str, seed: int, shuffle: bool, tokenizer=None):
        self.tokens = tokens  # (N,) uint16/uint32, usually a np.memmap
        self.seq_len = seq_len
        self.split = split
        self.tokenizer = tokenizer
        self._window, self._stride = window, stride
        num_samples = (len(tokens) - window) // stride + 1 if len(tokens) >= window else 0
        if num_samples < 1:
            raise ValueError(
                f"the {split} split has {len(tokens)} tokens, fewer than one {self.kind} sample "
                f"of seq_len={seq_len} ({window} tokens): lower seq_len, use a larger corpus, or move "
                f"text between the splits (data.val_documents names the validation documents, "
                f"val_fraction sets their share, val_corpus gives a file of its own)")
        self.sampler = Sampler(num_samples, seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return self.sampler.num_samples

    def sample_ids(self, start: int, count: int) -> list[int]:
        """Sample ids at global indices start .. start+count-1 (the deterministic order)."""
        return self.sampler.ids(start, count)

    def windows(self, sample_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The raw token windows of ``sample_ids``: (B, window) int64."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        if sample_ids.size and (sample_ids.min() < 0 or sample_ids.max() >= len(self)):
            raise IndexError(f"sample ids must be in [0, {len(self)}) for the {self.split} split")
        starts = sample_ids * self._stride  # (B,)
        return np.asarray(self.tokens[starts[:, None] + np.arange(self._window)], dtype=np.int64)

    def get_batch(self, global_indices: Sequence[int] | range) -> dict[str, torch.Tensor]:
        return self.batch(self.sampler.ids_of(global_indices), global_indices)

    def batch(self, sample_ids: np.ndarray, keys: Sequence[int] | range) -> dict[str, torch.Tensor]:
        """The samples ``sample_ids``; ``keys`` (one per sample: its global index) seed what is drawn
        per sample (BERT's masks)."""
        raise NotImplementedError

    def unigram_counts(self, vocab_size: int) -> np.ndarray:
        """How often each id occurs in the stream (float64; counted once, then kept)."""
        if getattr(self, "_counts", None) is None or len(self._counts) < vocab_size:
            from .build import token_counts

            self._counts = token_counts(self.tokens, vocab_size).astype(np.float64)
        return self._counts

    def decode(self, ids) -> str:
        """Text of token ids (a list, array or tensor) via the tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this corpus was given as token ids without a tokenizer: set "
                             "data.tokenizer_file to a tokenizer.json to decode")
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                     skip_special_tokens=False)


class GPTDataset(PackedDataset):
    """Next-token samples: {"input_ids": (B, T), "targets": (B, T)}, targets shifted by one."""

    kind = "gpt"

    def __init__(self, tokens: np.ndarray, seq_len: int, **kwargs):
        super().__init__(tokens, seq_len, window=seq_len + 1, stride=seq_len, **kwargs)

    def batch(self, sample_ids: np.ndarray, keys: Sequence[int] | range) -> dict[str, torch.Tensor]:
        windows = self.windows(sample_ids)  # (B, T+1)
        return {"input_ids": torch.from_numpy(windows[:, :-1].copy()),  # (B, T)
                "targets": torch.from_numpy(windows[:, 1:].copy())}  # (B, T)


class BERTDataset(PackedDataset):
    """Masked-LM samples: {"input_ids": (B, T), "labels": (B, T)}, labels -100 where unmasked."""

    kind = "bert"
    MIN_SEQ_LEN = 3  # [CLS] text [SEP]

    def __init__(self, tokens: np.ndarray, seq_len: int, *, special_ids: dict[str, int],
                 vocab_size: int, mask_seed: int, mlm_probability: float = 0.15,
                 mask_token_fraction: float = 0.8, random_token_fraction: float = 0.1, **kwargs):
        if seq_len < self.MIN_SEQ_LEN:
            raise ValueError(f"seq_len={seq_len} is too short for BERT ([CLS] text [SEP]): use >= {self.MIN_SEQ_LEN}")
        roles = masked_lm_ids(special_ids)
        if masked_lm_missing(roles):
            raise ValueError(f"BERT needs the special tokens {masked_lm_missing(roles)} in the tokenizer: "
                             f"use the trained tokenizer or a data.tokenizer_file that has them")
        super().__init__(tokens, seq_len, window=seq_len - 2, stride=seq_len - 2, **kwargs)
        self.cls_id, self.sep_id, self.mask_id = roles["cls"], roles["sep"], roles["mask"]
        self.special_id_array = np.array(sorted(special_ids.values()), dtype=np.int64)
        # random replacements: the tokenizer's ids (a file may leave ids unused), else every id
        ids = (np.fromiter(self.tokenizer.get_vocab(with_added_tokens=True).values(), dtype=np.int64)
               if self.tokenizer is not None else np.arange(vocab_size))
        self.replacement_ids = np.setdiff1d(ids[ids < vocab_size], self.special_id_array)
        self.mask_seed = mask_seed
        self.mlm_probability = mlm_probability
        self.mask_token_fraction = mask_token_fraction
        self.random_token_fraction = random_token_fraction

    @staticmethod
    def predicted_fraction(seq_len: int, mlm_probability: float) -> float:
        """The expected share of a sequence's positions chosen for prediction (BERT's output layer
        runs on those only): each of the n = seq_len - 2 positions between [CLS] and [SEP] with
        probability p, and one when none was (masking.mask_tokens), so n p + (1 - p)^n of seq_len.
        Special tokens inside the text (document separators) are never chosen either; they are not
        subtracted here."""
        n = seq_len - 2
        return (mlm_probability * n + (1 - mlm_probability) ** n) / seq_len

    def batch(self, sample_ids: np.ndarray, keys: Sequence[int] | range) -> dict[str, torch.Tensor]:
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)  # (B,)
        body = self.windows(sample_ids)  # (B, T-2)
        tokens = np.concatenate([np.full((len(keys), 1), self.cls_id), body,
                                 np.full((len(keys), 1), self.sep_id)], axis=1)  # (B, T)
        input_ids, labels = mask_tokens(
            tokens, keys, seed=self.mask_seed, mask_id=self.mask_id,
            special_ids=self.special_id_array, replacement_ids=self.replacement_ids,
            mlm_probability=self.mlm_probability, mask_token_fraction=self.mask_token_fraction,
            random_token_fraction=self.random_token_fraction)
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}


class MixtureDataset:
    """Several packed datasets (one per corpus of ``data.mixture``) drawn in proportion to their
    weights: global index ``g`` is a draw of the source ``MixtureSampler`` gives it, mapped through
    that source's own Sampler (its own epochs and order), and keyed by ``g`` itself (BERT's mask of
    a sample depends on its global index, as in one corpus). ``mixture``: the draw order (one
    MixtureSampler of the weights' draws, shared by a run's training and validation mixtures)."""

    def __init__(self, sources: Sequence[PackedDataset], mixture: MixtureSampler, names: Sequence[str]):
        if len(sources) != len(mixture.counts) or len(sources) != len(names) or len(sources) < 2:
            raise ValueError("MixtureDataset needs two or more sources, with one count and one name each")
        self.sources, self.names = list(sources), list(names)
        self.labels = corpus_labels(self.names)
        self.mixture = mixture
        self.shares = mixture.counts / mixture.period  # (D,) each source's share of the draws
        first = self.sources[0]
        self.seq_len, self.split, self.tokenizer, self.kind = first.seq_len, first.split, first.tokenizer, first.kind
        # global indices before a source would repeat a sample: the position of the first draw past
        # some source's size (an evaluation takes at most this many, so no validation sample counts twice)
        firsts = []
        for d, source in enumerate(self.sources):
            k, c = len(source), int(mixture.counts[d])  # the source's first repeated draw; its draws per period
            positions = np.flatnonzero(mixture.pattern == d)  # its draws' positions in a period
            firsts.append((k // c) * mixture.period + int(positions[k % c]))
        self._length = min(firsts)

    def __len__(self) -> int:
        """Global indices before a source would repeat a sample (see __init__)."""
        return self._length

    def get_batch(self, global_indices: Sequence[int] | range) -> dict[str, torch.Tensor]:
        keys = np.asarray(global_indices, dtype=np.int64).reshape(-1)
        which, draws = self.mixture.sources_of(keys)
        parts, order = [], []
        for d in np.unique(which):
            mine = np.flatnonzero(which == d)
            source = self.sources[int(d)]
            parts.append(source.batch(source.sampler.ids_of(draws[mine]), keys[mine]))
            order.append(mine)
        if len(parts) == 1:
            return parts[0]
        back = torch.from_numpy(np.argsort(np.concatenate(order), kind="stable"))  # to the indices' order
        return {name: torch.cat([part[name] for part in parts])[back] for name in parts[0]}

    def sources_of(self, global_indices: Sequence[int] | range) -> np.ndarray:
        """The source (its position in ``names``) of each global index."""
        return self.mixture.sources_of(global_indices)[0]

    def unigram_counts(self, vocab_size: int) -> np.ndarray:
        """The mixture's token frequencies as counts: each source's relative frequencies weighted by
        its share of the draws, scaled to the sources' total tokens."""
        total = sum(len(source.tokens) for source in self.sources)
        mixed = np.zeros(vocab_size, dtype=np.float64)
        for share, source in zip(self.shares, self.sources):
            counts = source.unigram_counts(vocab_size)
            mixed += share * counts[:vocab_size] / max(counts.sum(), 1.0)
        return mixed * total

    def decode(self, ids) -> str:
        return self.sources[0].decode(ids)


def corpus_labels(names: Sequence[str]) -> list[str]:
    """Short distinct names of a mixture's corpora for metric names (``val_loss/<label>``): a named
    corpus's own name, a path's with each run of other characters than letters, digits and ``_.+-``
    as one ``_`` (``corpora/web/*.jsonl.gz``: ``corpora_web_.jsonl.gz``); ``_2``, ``_3``, ... after
    a label that comes again."""
    labels: list[str] = []
    for name in names:
        label = re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("_") or "corpus"
        base, k = label, 2
        while label in labels:
            label, k = f"{base}_{k}", k + 1
        labels.append(label)
    return labels
