"""BERT masked-language-model corruption, reproducible from (seed, global sample index).

Devlin et al. 2019, Sec. 3.1 ("Task #1: Masked LM") and Appendix A.1: choose 15% of the token
positions for prediction; replace a chosen token by [MASK] 80% of the time, by a random token 10%
of the time, and keep it unchanged 10% of the time. The loss is taken on the chosen positions
only, so every other label is -100 (PyTorch's ``ignore_index``).

Choices made here, all documented in docs/data.md:

* Selection is an independent Bernoulli(p) per position (as in HF ``DataCollatorForLanguageModeling``)
  rather than an exact count; a row where nothing was chosen gets its lowest-draw position, so
  every sample carries at least one prediction.
* Special tokens (<|endoftext|>, [CLS], [SEP], [PAD], [MASK]) are never chosen, and random
  replacements are drawn uniformly from the NON-special ids.
* Each row draws from its own counter-based Philox stream (Salmon et al. 2011) keyed on
  (seed, global sample index). The corruption of a sample therefore does not depend on which
  batch, rank or micro-batch it lands in, an exact resume reproduces it, and because the key is
  the global index (not the sample id) a sample seen again in a later epoch gets a fresh mask
  (dynamic masking, Liu et al. 2019 "RoBERTa", Sec. 4.1).
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def mask_tokens(tokens: np.ndarray, keys: np.ndarray, *, seed: int, mask_id: int,
                special_ids: np.ndarray, replacement_ids: np.ndarray,
                mlm_probability: float = 0.15, mask_token_fraction: float = 0.8,
                random_token_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Corrupt ``tokens`` (B, T) for MLM; row b uses the stream keyed on (seed, keys[b]).

    ``replacement_ids`` are the ids a random replacement is drawn from. Returns
    ``(input_ids, labels)``, both (B, T) int64; labels are the original tokens at the chosen
    positions and -100 elsewhere."""
    tokens = np.asarray(tokens, dtype=np.int64)  # (B, T)
    batch, length = tokens.shape
    input_ids = tokens.copy()
    labels = np.full_like(tokens, IGNORE_INDEX)
    maskable = ~np.isin(tokens, special_ids)  # (B, T)
    for row in range(batch):
        rng = np.random.Generator(np.random.Philox(key=[seed, int(keys[row])]))
        select_draw = rng.random(length)  # (T,) position chosen when < mlm_probability
        action_draw = rng.random(length)  # (T,) [MASK] / random / keep
        random_ids = replacement_ids[rng.integers(0, len(replacement_ids), length)]  # (T,)
        chosen = maskable[row] & (select_draw < mlm_probability)
        if not chosen.any() and maskable[row].any():
            chosen[np.where(maskable[row], select_draw, np.inf).argmin()] = True
        to_mask = chosen & (action_draw < mask_token_fraction)
        to_random = chosen & ~to_mask & (action_draw < mask_token_fraction + random_token_fraction)
        labels[row, chosen] = tokens[row, chosen]
        input_ids[row, to_mask] = mask_id
        input_ids[row, to_random] = random_ids[to_random]
    return input_ids, labels
