"""Data pipeline timings: cold vs cached build, batch assembly, and BERT masking vs a peer.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/data_pipeline.py [--corpus shakespeare]

Prints ratios measured interleaved in the same run (the machine may be shared):
* cold build (train BPE + tokenize) / cached build (memory-map the cache entry);
* BERT ``get_batch`` (per-row Philox streams keyed on the global index) / GPT ``get_batch``;
* our masking / HF ``DataCollatorForLanguageModeling.torch_mask_tokens`` (one global torch RNG,
  not reproducible per sample) on the same (B, T) tokens;
* with ``--one-file-mb N``: peak memory and time of tokenizing a corpus that is one N MB document
  (the plays repeated, as one large ``input.txt``), encoded in pieces (``write_documents``) / the
  same document handed to the tokenizer whole, each in a fresh process; the ids are compared too;
* with ``--mixture shakespeare=3,bible=1``: GPT ``get_batch`` of that data.mixture (each sample drawn
  from its corpus's own stream and order, the batch put back in index order) / of ``--corpus``;
* with ``--cached-start-mb N``: peak memory and time of a start that finds its cache entry
  (``build_data`` on a directory of N MB of text files: the plays copied under other names), against
  the corpus loaded whole (``load_documents``: what every start held before the corpus was read one
  file at a time), each in a fresh process.
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


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (Linux), in bytes: VmRSS (resident now), VmHWM (its peak)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def _reset_peak() -> int:
    """Reset this process's peak resident set to the current one (Linux: clear_refs 5); the current
    resident set, in bytes. The imports' transient peak would otherwise hide a smaller one."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _cached_start(corpus: str, cache: str, whole: bool, queue) -> None:
    """Child process: a start on ``corpus`` whose cache entry exists, or (``whole``) what a start did
    before the corpus was read one file at a time: the corpus loaded whole, split and keyed; put (peak
    RSS above the RSS before, in bytes; seconds)."""
    from largebatch.data.corpus import fingerprint, load_documents, split_documents

    before = _reset_peak()
    start = time.perf_counter()
    if whole:
        train, val = split_documents(load_documents(corpus), 0.1)
        keys = fingerprint(train), fingerprint(val)
        same_text = {doc.text: doc.name for doc in train}  # the copies of a validation text in training
        copies = [doc.name for doc in val if doc.text in same_text]
        assert keys and len(copies) <= len(val)
    else:
        data = build_data(DataConfig(corpus=corpus, vocab_size=512, cache_dir=cache), 128, "causal")
        assert data.stats.cache_hit
    seconds = time.perf_counter() - start
    queue.put((_status_bytes("VmHWM") - before, seconds))


def cached_start(text_mb: int) -> None:
    """Print a cache-hit start's peak memory and time on a directory of ``text_mb`` MB of text files,
    against the corpus loaded whole."""
    from largebatch.data.corpus import load_documents

    plays = load_documents("shakespeare")
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        corpus, cache = Path(tmp) / "corpus", str(Path(tmp) / "cache")
        written, copy = 0, 0
        while written < text_mb * 2**20:
            for doc in plays:
                path = corpus / f"copy{copy}" / f"{doc.name.split('/')[-1]}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(doc.text)
                written += len(doc.text.encode())
            copy += 1
        start = time.perf_counter()
        build_data(DataConfig(corpus=str(corpus), vocab_size=512, cache_dir=cache), 128, "causal")
        print(f"cached start {written / 2**20:.0f} MB in {copy * len(plays)} files: cache entry built in "
              f"{time.perf_counter() - start:.0f} s")
        results = {}
        for whole in (False, True, False, True):  # interleaved; the second of each is kept
            queue = context.Queue()
            child = context.Process(target=_cached_start, args=(str(corpus), cache, whole, queue))
            child.start()
            results[whole] = queue.get()
            child.join()
    (hit_rss, hit_s), (whole_rss, whole_s) = results[False], results[True]
    print(f"cached start a cache hit {hit_rss / 2**20:.0f} MiB {hit_s:.2f} s; the corpus loaded whole "
          f"{whole_rss / 2**20:.0f} MiB {whole_s:.2f} s; memory whole/hit {whole_rss / max(hit_rss, 1):.1f}x, "
          f"time {whole_s / hit_s:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="shakespeare")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--one-file-mb", type=int, default=0,
                        help="also tokenize one document of this many MB, in pieces and whole (0: skip)")
    parser.add_argument("--cached-start-mb", type=int, default=0,
                        help="also time a cache-hit start on a directory of this many MB of text, against "
                             "the corpus loaded whole (0: skip)")
    parser.add_argument("--mixture", default=None,
                        help="also time get_batch of this data.mixture, e.g. shakespeare=3,bible=1")
    parser.add_argument("--only-cached-start", action="store_true",
                        help="with --cached-start-mb: skip everything else")
    args = parser.parse_args()
    if args.cached_start_mb and args.only_cached_start:
        cached_start(args.cached_start_mb)
        return
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as cache_dir:
        cfg = DataConfig(corpus=args.corpus, vocab_size=args.vocab_size, cache_dir=cache_dir)
        start = time.perf_counter()
        gpt = build_data(cfg, args.seq_len, "causal")
        cold = time.perf_counter() - start
        warm = timed(lambda: build_data(cfg, args.seq_len, "causal"), 5)
        bert = build_data(cfg, args.seq_len, "masked")
        mixed = None
        if args.mixture:
            weights = {name: float(w) for name, w in (part.split("=") for part in args.mixture.split(","))}
            mixed = build_data(DataConfig(mixture=weights, vocab_size=args.vocab_size, cache_dir=cache_dir),
                               args.seq_len, "causal")
    print(f"corpus       {gpt.stats}")
    print(f"unigram      {gpt.unigram_loss():.4f} nats/token (val under train unigram)")
    print(f"build        cold {cold:.2f} s, cached {warm * 1e3:.1f} ms, ratio {cold / warm:.0f}x")
    if args.one_file_mb:
        one_file(gpt.tokenizer, args.one_file_mb)
    if args.cached_start_mb:
        cached_start(args.cached_start_mb)

    steps = [range(p, p + args.batch) for p in range(0, 20 * args.batch, args.batch)]
    t_gpt, t_bert, t_mixed = [], [], []
    for step in steps:  # interleaved
        t_gpt.append(timed(lambda: gpt.train.get_batch(step), 1))
        t_bert.append(timed(lambda: bert.train.get_batch(step), 1))
        if mixed is not None:
            t_mixed.append(timed(lambda: mixed.train.get_batch(step), 1))
    tokens = args.batch * args.seq_len
    g, b = statistics.median(t_gpt), statistics.median(t_bert)
    print(f"get_batch    gpt {g * 1e3:.2f} ms ({tokens / g / 1e6:.1f} M tok/s), "
          f"bert {b * 1e3:.2f} ms ({tokens / b / 1e6:.1f} M tok/s), bert/gpt {b / g:.1f}x")
    if mixed is not None:
        m = statistics.median(t_mixed)
        print(f"get_batch    mixture {args.mixture} {m * 1e3:.2f} ms ({tokens / m / 1e6:.1f} M tok/s), "
              f"mixture/gpt {m / g:.1f}x")

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
