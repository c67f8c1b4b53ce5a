"""The sample order as a pure function of the global sample index.

Training consumes one stream of global sample indices 0, 1, 2, ...; a step of B samples at data
position p takes indices p .. p+B-1. Index g belongs to epoch e = g // n and maps to sample
``permutation_e[g % n]``, where ``permutation_e`` is seeded by (seed, e) alone. So the sample
order never depends on the batch schedule: changing the batch size (Seesaw, Sec. "Seesaw" in
docs/papers.md; batch ramps) only changes how many indices form a step, and the whole data state of a
run is the one integer p (exact resume = restore p).

A mixture of corpora (``data.mixture``) keeps this: ``MixtureSampler`` says which corpus a global
index draws from and which of that corpus's draws it is, again from the index alone, and each
corpus's own Sampler maps the draw to a sample.

Data parallel: ``shard_indices`` gives rank r of w ranks the CONTIGUOUS block r of a step's
indices (like Megatron-LM's per-rank micro-batch slices), so the ranks' blocks concatenated in
rank order are exactly the single-process step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np


class Sampler:
    """``ids(start, count)``: the sample ids at global indices start .. start+count-1."""

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"Sampler num_samples={num_samples} is invalid: need >= 1 sample")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._permutations: dict[int, np.ndarray] = {}  # epoch -> permutation, last two kept

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the samples in ``epoch`` (identity when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        if epoch not in self._permutations:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            if len(self._permutations) >= 2:  # a step straddles at most two epochs
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = rng.permutation(self.num_samples)
        return self._permutations[epoch]

    def ids_of(self, global_indices: Sequence[int] | range) -> np.ndarray:
        """Sample ids (int64) of arbitrary global indices."""
        indices = np.asarray(global_indices, dtype=np.int64).reshape(-1)
        if indices.size and indices.min() < 0:
            raise ValueError(f"global sample indices must be >= 0, got {int(indices.min())}")
        epochs, offsets = np.divmod(indices, self.num_samples)
        ids = np.empty_like(indices)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            ids[in_epoch] = self.permutation(int(epoch))[offsets[in_epoch]]
        return ids

    def ids(self, start: int, count: int) -> list[int]:
        """Sample ids of global indices start .. start+count-1."""
        if start < 0 or count < 0:
            raise ValueError(f"ids(start={start}, count={count}): both must be >= 0")
        return self.ids_of(range(start, start + count)).tolist()


MIXTURE_PERIOD_LIMIT = 1_000_000
"""The longest period of a mixture's pattern: weights whose exact shares need a longer one are
rounded to shares of this many draws (off by at most 1 in 2,000,000 of the stream each)."""


def mixture_counts(weights: Sequence[float]) -> list[int]:
    """Each source's draws in one period of the mixture: whole numbers in the ratio of ``weights``
    (positive; they need not sum to 1). Weights that are ratios of small numbers (0.7/0.3, 3/1,
    1/3 each) give the exact shares, in the shortest period that holds them; others are rounded to
    shares of MIXTURE_PERIOD_LIMIT draws (largest remainders). ValueError if a weight would get no
    draw at all."""
    if not weights or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"mixture weights must be positive finite numbers, got {list(weights)}")
    given = list(weights)
    weights = [w / max(given) for w in given]  # in (0, 1]: their sum cannot overflow (1e308 each)
    shares = [Fraction(w).limit_denominator(1000) for w in weights]  # 0.7 -> 7/10 (its float is not)
    total = sum(shares)
    shares = [share / total for share in shares]
    period = math.lcm(*(share.denominator for share in shares))
    if period <= MIXTURE_PERIOD_LIMIT and all(share > 0 and abs(float(share) / (w / sum(weights)) - 1) < 1e-9
                                              for share, w in zip(shares, weights)):
        return [int(share * period) for share in shares]
    exact = [w / sum(weights) * MIXTURE_PERIOD_LIMIT for w in weights]  # largest remainders
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[:MIXTURE_PERIOD_LIMIT - sum(counts)]:
        counts[i] += 1
    if min(counts) == 0:
        raise ValueError(f"a mixture weight is below 1 in {MIXTURE_PERIOD_LIMIT:,} of the total "
                         f"({given}): raise it or leave that corpus out")
    return counts


class MixtureSampler:
    """Which source a global sample index draws from, and which of that source's draws it is, as a
    pure function of the index (so a mixture keeps the one-integer data state: exact resume, any
    batch schedule, any data-parallel split).

    One period of ``sum(counts)`` indices holds ``counts[d]`` draws of source ``d``, spread as
    evenly as a divisor (Sainte-Lague) apportionment spreads seats: draw ``j`` of source ``d`` sits
    at the rank of ``(j + 1/2) / counts[d]`` among all sources' such points (ties to the lower
    source). So every prefix of the stream holds each source's share to within about one draw per
    source, and the pattern repeats each period. Index ``g`` is draw
    ``(g // P) * counts[d] + before[g % P]`` of its source ``d``, which its own Sampler maps to a
    sample (each source runs through its own epochs: a small source with a large weight repeats)."""

    def __init__(self, counts: Sequence[int]):
        if not counts or any(int(c) != c or c < 1 for c in counts):
            raise ValueError(f"MixtureSampler counts={list(counts)} is invalid: give each source >= 1 draw")
        self.counts = np.asarray(counts, dtype=np.int64)
        self.period = int(self.counts.sum())
        # (2j + 1) / (2c) in float64: a quotient of exact integers is rounded correctly, so equal
        # fractions give equal floats, and distinct ones (denominators <= 2 * period) stay apart
        source = np.repeat(np.arange(len(self.counts)), self.counts)
        draw = np.concatenate([np.arange(c) for c in self.counts])
        order = np.lexsort((source, (2 * draw + 1) / (2 * self.counts[source])))
        self.pattern = source[order]  # (P,) the source of each position of a period
        self.before = draw[order]  # (P,) the draws of the same source before it in the period

    def sources_of(self, global_indices: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """(source, the index among that source's draws) of each global index, as int64 arrays."""
        indices = np.asarray(global_indices, dtype=np.int64).reshape(-1)
        if indices.size and indices.min() < 0:
            raise ValueError(f"global sample indices must be >= 0, got {int(indices.min())}")
        periods, offsets = np.divmod(indices, self.period)
        sources = self.pattern[offsets]
        return sources, periods * self.counts[sources] + self.before[offsets]


def shard_indices(indices: Sequence[int] | range, rank: int, world_size: int
                  ) -> Sequence[int] | range:
    """Rank ``rank``'s contiguous share of one step's global indices (a range stays a range).

    ``indices`` (length B) must split evenly: rank r gets indices[r*B/w : (r+1)*B/w], so the
    concatenation over ranks 0..w-1 is ``indices`` itself."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_indices rank={rank}, world_size={world_size}: need "
                         f"world_size >= 1 and 0 <= rank < world_size")
    if len(indices) % world_size:
        raise ValueError(f"a step of {len(indices)} samples does not split over world_size="
                         f"{world_size} ranks: make the batch size a multiple of {world_size}")
    share = len(indices) // world_size
    return indices[rank * share: (rank + 1) * share]


def step_indices(position: int, batch_size: int, rank: int = 0, world_size: int = 1) -> range:
    """This rank's global indices of the step of ``batch_size`` samples at data ``position``."""
    return shard_indices(range(position, position + batch_size), rank, world_size)
