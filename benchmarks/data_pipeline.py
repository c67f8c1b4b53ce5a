"""Data pipeline timings: cold vs cached build, batch assembly, and BERT masking vs a peer.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/data_pipeline.py [--corpus shakespeare]

Prints ratios measured interleaved in the same run (the machine may be shared):
* cold build (train BPE + tokenize) / cached build (memory-map the cache entry);
* BERT ``get_batch`` (per-row Philox streams keyed on the global index) / GPT ``get_batch``;
* our masking / HF ``DataCollatorForLanguageModeling.torch_mask_tokens`` (one global torch RNG,
  not reproducible per sample) on the same (B, T) tokens;
* with ``--one-file-mb N``: peak memory and time of tokenizing a corpus that is one N MB document
  (the plays repeated, as one large ``input.txt``), encoded in pieces (``write_documents``) / the
  same document handed to the tokenizer whole, each in a fresh process; the ids are compared too.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

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


def _one_file(tokenizer_json: str, text_mb: int, whole: bool, out: str, queue) -> None:
    """Child process: tokenize one ``text_mb`` MB document; put (peak RSS growth in bytes, seconds)."""
    import numpy as np
    from tokenizers import Tokenizer

    import largebatch.data.tokenizer as tokenizer_lib
    from largebatch.data.corpus import load_documents

    plays = "\n\n".join(d.text for d in load_documents("shakespeare"))
    text = (plays * (text_mb * 2**20 // len(plays) + 1))[: text_mb * 2**20]
    tokenizer = Tokenizer.from_str(tokenizer_json)
    if whole:  # the document in one encode call, as before documents were cut
        tokenizer_lib.ENCODE_CHARS = len(text) + 1
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    tokenizer_lib.write_documents(tokenizer, [text], 0, np.dtype(np.uint16), out)
    seconds = time.perf_counter() - start
    queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, seconds))


def one_file(tokenizer, text_mb: int) -> None:
    """Print peak memory and time of the pieces against the whole document, and whether ids agree."""
    context = multiprocessing.get_context("spawn")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for whole in (False, True):
            queue = context.Queue()
            out = str(Path(tmp) / f"whole-{whole}.bin")
            child = context.Process(target=_one_file, args=(tokenizer.to_str(), text_mb, whole, out, queue))
            child.start()
            results[whole] = queue.get()
            child.join()
        same = Path(tmp, "whole-False.bin").read_bytes() == Path(tmp, "whole-True.bin").read_bytes()
    (piece_rss, piece_s), (whole_rss, whole_s) = results[False], results[True]
    print(f"one {text_mb} MB document: pieces {piece_rss / 2**30:.2f} GiB {piece_s:.1f} s, whole "
          f"{whole_rss / 2**30:.2f} GiB {whole_s:.1f} s; memory whole/pieces {whole_rss / piece_rss:.1f}x, "
          f"time {whole_s / piece_s:.1f}x; same ids: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="shakespeare")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--one-file-mb", type=int, default=0,
                        help="also tokenize one document of this many MB, in pieces and whole (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as cache_dir:
        cfg = DataConfig(corpus=args.corpus, vocab_size=args.vocab_size, cache_dir=cache_dir)
        start = time.perf_counter()
        gpt = build_data(cfg, args.seq_len, "causal")
        cold = time.perf_counter() - start
        warm = timed(lambda: build_data(cfg, args.seq_len, "causal"), 5)
        bert = build_data(cfg, args.seq_len, "masked")
    print(f"corpus       {gpt.stats}")
    print(f"unigram      {gpt.unigram_loss():.4f} nats/token (val under train unigram)")
    print(f"build        cold {cold:.2f} s, cached {warm * 1e3:.1f} ms, ratio {cold / warm:.0f}x")
    if args.one_file_mb:
        one_file(gpt.tokenizer, args.one_file_mb)

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
