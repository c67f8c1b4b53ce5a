"""The sample order as a pure function of the global sample index.

Training consumes one stream of global sample indices 0, 1, 2, ...; a step of B samples at data
position p takes indices p .. p+B-1. Index g belongs to epoch e = g // n and maps to sample
``permutation_e[g % n]``, where ``permutation_e`` is seeded by (seed, e) alone. So the sample
order never depends on the batch schedule: changing the batch size (Seesaw, Sec. "Seesaw" in
docs/papers.md; batch ramps) only changes how many indices form a step, and the whole data state of a
run is the one integer p (exact resume = restore p).

Data parallel: ``shard_indices`` gives rank r of w ranks the CONTIGUOUS block r of a step's
indices (like Megatron-LM's per-rank micro-batch slices), so the ranks' blocks concatenated in
rank order are exactly the single-process step.
"""

from __future__ import annotations

from collections.abc import Sequence

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
