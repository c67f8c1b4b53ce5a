"""Data pipeline timings: cold vs cached build, batch assembly, and BERT masking vs a peer.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/data_pipeline.py [--corpus shakespeare]

Prints ratios measured interleaved in the same run (the machine may be shared):
* cold build (train BPE + tokenize) / cached build (memory-map the cache entry);
* BERT ``get_batch`` (per-row Philox streams keyed on the global index) / GPT ``get_batch``;
* our masking / HF ``DataCollatorForLanguageModeling.torch_mask_tokens`` (one global torch RNG,
  not reproducible per sample) on the same (B, T) tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from largebatch.data import DataConfig, build_data, mask_tokens  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="shakespeare")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as cache_dir:
        cfg = DataConfig(corpus=args.corpus, vocab_size=args.vocab_size, cache_dir=cache_dir)
        start = time.perf_counter()
        gpt = build_data(cfg, args.seq_len, "gpt")
        cold = time.perf_counter() - start
        warm = timed(lambda: build_data(cfg, args.seq_len, "gpt"), 5)
        bert = build_data(cfg, args.seq_len, "bert")
    print(f"corpus       {gpt.stats}")
    print(f"unigram      {gpt.unigram_loss():.4f} nats/token (val under train unigram)")
    print(f"build        cold {cold:.2f} s, cached {warm * 1e3:.1f} ms, ratio {cold / warm:.0f}x")

    steps = [range(p, p + args.batch) for p in range(0, 20 * args.batch, args.batch)]
    t_gpt, t_bert = [], []
    for step in steps:  # interleaved
        t_gpt.append(timed(lambda: gpt.train.get_batch(step), 1))
        t_bert.append(timed(lambda: bert.train.get_batch(step), 1))
    tokens = args.batch * args.seq_len
    g, b = statistics.median(t_gpt), statistics.median(t_bert)
    print(f"get_batch    gpt {g * 1e3:.2f} ms ({tokens / g / 1e6:.1f} M tok/s), "
          f"bert {b * 1e3:.2f} ms ({tokens / b / 1e6:.1f} M tok/s), bert/gpt {b / g:.1f}x")

    try:
        from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast
    except ImportError:
        print("masking      (transformers not installed: no peer timing)")
        return
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=bert.tokenizer, mask_token="[MASK]",
                                          pad_token="[PAD]", cls_token="[CLS]",
                                          sep_token="[SEP]")
    collator = DataCollatorForLanguageModeling(hf_tokenizer, mlm_probability=0.15)
    ours, peer = [], []
    dataset = bert.train
    for step in steps:  # interleaved, the same real (B, T) tokens for both
        tokens = gpt.train.get_batch(step)["input_ids"]
        keys = torch.tensor(list(step)).numpy()
        ours.append(timed(lambda: mask_tokens(
            tokens.numpy(), keys, seed=0, mask_id=dataset.mask_id,
            special_ids=dataset.special_id_array, replacement_ids=dataset.replacement_ids), 1))
        peer.append(timed(lambda: collator.torch_mask_tokens(tokens.clone()), 1))
    o, p = statistics.median(ours), statistics.median(peer)
    print(f"masking      ours {o * 1e3:.2f} ms, HF collator {p * 1e3:.2f} ms, ours/HF {o / p:.1f}x "
          f"(ours: reproducible per (seed, global index); HF: one global RNG)")


if __name__ == "__main__":
    main()
