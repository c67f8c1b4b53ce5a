"""``largebatch generate RUN_DIR``: what does the model write? Sample text from a trained GPT run.

    largebatch generate runs/a --prompt "ROMEO:"
    largebatch generate runs/a --prompt "ROMEO:" --samples 3 --max-new-tokens 200 --top-p 0.95
    largebatch generate runs/a --prompt-file prompt.txt --temperature 0 --json

Reads the newest intact checkpoint of RUN_DIR (any layout it was trained in: one process, DDP,
FSDP2, tensor or pipeline parallel), or the one ``--checkpoint`` names, with the run's tokenizer,
and continues the prompt. Each new token reads the earlier positions' keys and values from a cache
(``largebatch.models.layers.KVCache``): one position per layer, not the whole context again. That
holds while prompt and sample fit the model's seq_len; past it the context is the last seq_len
tokens, read whole for every new token (as the run trained, and as slow as without the cache).

A sample ends at the run's document separator (``<|endoftext|>``: the model has started another
document) or after --max-new-tokens. The defaults are the trainer's end-of-run sample's
(--temperature 0.8, --top-k 50, the run's run.seed and run.sample_tokens): ``largebatch generate
RUN_DIR --prompt P`` writes summary.json's sample again when P is the run's run.sample_prompt (on the
device type the run sampled on, for a run whose sample used fp32 weights). The text (the prompt and
its continuation) goes to stdout, samples separated by a line of dashes; the timing goes to stderr.

Options:
  --prompt TEXT           the text to continue (default: none -- the model starts a document after
                          its separator token)
  --prompt-file PATH      read the prompt from a file ('-': standard input) instead, as it is
                          (a final newline included)
  --max-new-tokens N      at most N tokens per sample (default: the run's run.sample_tokens, or 80)
  --samples N             samples drawn from the prompt, as one batch (default 1)
  --temperature T         softmax temperature; 0 is greedy (default 0.8)
  --top-k K               draw from the K most likely tokens only (default 50; 0 for all)
  --top-p P               then from the most likely tokens whose probabilities add up to P (nucleus
                          sampling; default 1: all of them)
  --seed S                the random seed (default: the run's run.seed)
  --no-stop               go on past the document separator
  --json                  one JSON object on stdout: each sample's text (prompt included), its new token
                          ids and whether it ended at the separator, with the checkpoint, step, the
                          context the model reads (its seq_len) and tokens/s
  --device DEV            cpu (default), cuda or cuda:N
  --tokenizer PATH        the run's tokenizer.json when the run cannot give it
  --checkpoint STEP       sample from the run's checkpoint at optimizer step STEP (or its name or path)
  --ema                   sample from the checkpoint's weight average (run.ema_decay)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from largebatch.arguments import finite_float, not_utf8, read_text_file, run_command, run_dir_parser, whole_number
from largebatch.export import weights_label
from largebatch.integrations import ExportError


class GenerateError(ValueError):
    """A bad argument or a run that cannot generate: one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    p = run_dir_parser("largebatch generate", __doc__, "largebatch generate RUN_DIR [options]")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help=argparse.SUPPRESS)
    prompt.add_argument("--prompt-file", help=argparse.SUPPRESS)
    p.add_argument("--max-new-tokens", type=whole_number("--max-new-tokens", 0), help=argparse.SUPPRESS)
    p.add_argument("--samples", type=whole_number("--samples", 1), default=1, help=argparse.SUPPRESS)
    p.add_argument("--temperature", type=finite_float, default=0.8, help=argparse.SUPPRESS)
    p.add_argument("--top-k", type=whole_number("--top-k", 0), default=50, help=argparse.SUPPRESS)
    p.add_argument("--top-p", type=finite_float, default=1.0, help=argparse.SUPPRESS)
    # what torch.manual_seed takes
    p.add_argument("--seed", type=whole_number("--seed", -2**63, 2**64, "in [-2^63, 2^64)"), help=argparse.SUPPRESS)
    p.add_argument("--no-stop", action="store_true", help=argparse.SUPPRESS)
    return p


def _check(args: argparse.Namespace) -> None:
    if args.temperature < 0:
        raise GenerateError(f"--temperature {args.temperature:g}: must be >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p {args.top_p:g}: must be in (0, 1] (1 keeps every token)")


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt or ""
    try:
        return read_text_file(args.prompt_file, "--prompt-file")
    except ValueError as exc:
        raise GenerateError(str(exc)) from None


def generate(run_dir: str | Path, prompt: str = "", max_new_tokens: int | None = None, samples: int = 1,
             temperature: float = 0.8, top_k: int | None = 50, top_p: float | None = None,
             seed: int | None = None, stop: bool = True, device: str = "cpu",
             tokenizer_file: str | Path | None = None, checkpoint: str | int | None = None,
             ema: bool = False, log=print) -> dict[str, Any]:
    """Continue ``prompt`` ``samples`` times from the run's newest checkpoint (or ``checkpoint``):
    a dict with each sample's text (the prompt and its continuation), new token ids and whether it
    ended at the separator, the checkpoint, its step, and the time taken. See the module's docstring
    for the arguments; ``max_new_tokens`` None is the run's run.sample_tokens (80 where that is 0)."""
    import torch

    from largebatch.export import open_run, partial_note, trained_positions
    from largebatch.models.registry import model_spec

    loaded, dev = open_run(run_dir, device, tokenizer_file, checkpoint, ema, log)
    model, tokenizer = loaded.model, loaded.tokenizer
    config = model.config
    if model_spec(config.kind).objective != "causal":
        raise GenerateError(f"RUN_DIR {str(run_dir)!r} trained a {config.kind} model (a masked language "
                            "model): it fills in masked tokens and does not write text left to right; "
                            "`largebatch fill-mask` shows what it predicts, `largebatch finetune` judges it downstream")
    if tokenizer is None:
        raise GenerateError(f"RUN_DIR {str(run_dir)!r}: its tokenizer cannot be recovered: pass --tokenizer PATH")
    note = partial_note(loaded, "samples from")
    if note:
        log(f"note: {note}")
    trained = trained_positions(loaded)
    if trained is not None and trained < config.seq_len:  # a checkpoint in a short phase: its later positions
        log(f"note: this checkpoint has trained sequences of {trained} tokens only (the run's phases: its "
            f"model.seq_len is {config.seq_len}), so the model reads the last {trained} tokens")
        model.config = config = config.replace(seq_len=trained)  # (generate's context and cache follow it)
    from largebatch.data.tokenizer import plain
    from largebatch.data.tokenizer import separator_id as find_separator

    if (problem := not_utf8(prompt, "--prompt")) is not None:
        raise GenerateError(problem)
    separator_id = find_separator(tokenizer, config.separator_id)
    # as the run's text was encoded: no special tokens a tokenizer's post-processor adds (<s>, [CLS]),
    # no padding or truncation a tokenizer.json may carry
    ids = plain(tokenizer).encode(prompt, add_special_tokens=False).ids if prompt else []
    if not ids:
        if separator_id is None:
            raise GenerateError("the prompt is empty and the run's tokenizer has no document separator to "
                                "start from: give --prompt TEXT")
        ids = [separator_id]  # a document's start, as the run saw every document begin
    if max(ids) >= config.vocab_size:
        raise GenerateError(f"the prompt's token id {max(ids)} is not in the model's vocabulary "
                            f"({config.vocab_size}): pass --tokenizer PATH to the tokenizer.json the run "
                            "trained with")
    if len(ids) > config.seq_len:
        log(f"note: the prompt has {len(ids):,} tokens; the model reads its last {config.seq_len:,} "
            "(model.seq_len)")
    if seed is None:
        seed = int(loaded.config.get("run", {}).get("seed", 1337))
    if max_new_tokens is None:  # the run's own sample length (its sample_tokens 0: none drawn), else 80
        max_new_tokens = int(loaded.config.get("run", {}).get("sample_tokens") or 80)
    stop_id = separator_id if stop else None
    model = model.to(dev).eval()
    idx = torch.tensor([ids] * samples, dtype=torch.long, device=dev)
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k or None,
                         top_p=None if top_p is None or top_p >= 1 else top_p, stop_id=stop_id)
    if dev.type == "cuda":  # (the kernels run after the calls return)
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    rows = []
    for row in out[:, len(ids):].tolist():
        ended = stop_id is not None and stop_id in row
        new = row[:row.index(stop_id) + 1] if ended else row
        rows.append({"text": tokenizer.decode(ids + new), "new_ids": new, "ended_at_separator": ended})
    made = sum(len(r["new_ids"]) for r in rows)
    return {"run_dir": str(run_dir), "checkpoint": str(loaded.checkpoint), "step": loaded.step, "ema": ema,
            "prompt": prompt, "prompt_tokens": len(ids), "context": config.seq_len, "seed": seed,
            "temperature": temperature, "top_k": top_k or None, "top_p": top_p, "samples": rows, "seconds": seconds,
            "tokens_per_second": made / seconds if seconds > 0 else None}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(build_parser(), argv, _generated, (GenerateError, ExportError))


def _generated(args: argparse.Namespace) -> int:
    """The command's work: generate, then print the samples (the closing line on stderr)."""
    _check(args)
    result = generate(args.run_dir, _prompt_text(args), args.max_new_tokens, args.samples,
                      args.temperature, args.top_k, args.top_p, args.seed, not args.no_stop, args.device,
                      args.tokenizer, args.checkpoint, args.ema, log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n----------\n".join(r["text"] for r in result["samples"]))
    rate = result["tokens_per_second"]
    made = sum(len(r["new_ids"]) for r in result["samples"])
    print(f"{weights_label(result)}: {len(result['samples'])} sample(s), {made} new tokens in {result['seconds']:.2f} s"
          + (f" ({rate:,.0f} tokens/s)" if rate else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
