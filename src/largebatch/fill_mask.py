"""``largebatch fill-mask RUN_DIR``: what does a BERT run predict? Fill in masked tokens of a text.

    largebatch fill-mask runs/bert --text "KING HENRY: My lord, the [MASK] is come."
    largebatch fill-mask runs/bert --text "Now is the [MASK] of our [MASK]." --top-k 10 --json

Reads the newest intact checkpoint of RUN_DIR (any layout it was trained in), or the one
``--checkpoint`` names, with the run's tokenizer, and runs the masked language model on
``[CLS] text [SEP]`` as it trained (Devlin et al. 2019, §3.1: the model predicts each masked token
from both sides). Each mask token in the text ([MASK], or <mask> for a RoBERTa-style tokenizer) gets
the model's most likely tokens at that position, with their probabilities, from one forward pass
(each mask is predicted with the others still masked, as in training). The text is encoded as the
run's transformers export encodes it (a byte-level tokenizer's space before the mask belongs to the
masked token, as training masks a whole token), so transformers' ``pipeline("fill-mask")`` on
``largebatch export``'s directory gives the same tokens and probabilities.

stdout: the text with each mask filled by its most likely token, then one line per mask with its
candidates and their probabilities; the timing goes to stderr.

Options:
  --text TEXT          the text, with one or more mask tokens where the model should fill in one
  --text-file PATH     read the text from a file ('-': standard input) instead, as it is
  --top-k K            candidates shown per mask (default 5)
  --json               one JSON object on stdout: the filled text, each mask's position among the
                       tokens and its candidates (token id, token, decoded text, probability), with
                       the checkpoint, step and the time taken
  --device DEV         cpu (default), cuda or cuda:N
  --tokenizer PATH     the run's tokenizer.json when the run cannot give it
  --checkpoint STEP    fill from the run's checkpoint at optimizer step STEP (or its name or path)
  --ema                fill from the checkpoint's weight average (run.ema_decay)
"""

from __future__ import annotations

import argparse
import json
import numbers
import sys
import time
from pathlib import Path
from typing import Any

from largebatch.arguments import not_utf8, read_text_file, run_command, run_dir_parser, whole_number
from largebatch.export import weights_label
from largebatch.integrations import ExportError


class FillMaskError(ValueError):
    """A bad argument or a run that cannot fill masks: one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    p = run_dir_parser("largebatch fill-mask", __doc__,
                       "largebatch fill-mask RUN_DIR (--text TEXT | --text-file PATH) [options]")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help=argparse.SUPPRESS)
    text.add_argument("--text-file", help=argparse.SUPPRESS)
    p.add_argument("--top-k", type=whole_number("--top-k", 1), default=5, help=argparse.SUPPRESS)
    return p


def fill_mask(run_dir: str | Path, text: str, top_k: int = 5, device: str = "cpu",
              tokenizer_file: str | Path | None = None, checkpoint: str | int | None = None,
              ema: bool = False, log=print) -> dict[str, Any]:
    """The ``top_k`` most likely tokens at each mask token of ``text`` under the run's newest
    checkpoint (or ``checkpoint``): a dict with the text filled by each mask's most likely token,
    each mask's token position and candidates (``token_id``, ``token``, ``text``, ``probability``),
    the checkpoint, its step and the time taken. See the module's docstring for the arguments."""
    import torch

    from largebatch.data.tokenizer import plain
    from largebatch.export import open_run, partial_note, trained_positions
    from largebatch.integrations.hf_export import masked_lm_encoder
    from largebatch.models.registry import model_spec

    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 1:
        raise FillMaskError(f"--top-k {top_k!r}: must be a whole number >= 1")
    if not isinstance(text, str):
        raise FillMaskError(f"text {text!r}: must be a str, with one or more mask tokens")
    top_k = int(top_k)
    loaded, dev = open_run(run_dir, device, tokenizer_file, checkpoint, ema, log)
    model, tokenizer, config = loaded.model, loaded.tokenizer, loaded.model.config
    if model_spec(config.kind).objective != "masked":
        raise FillMaskError(f"RUN_DIR {str(run_dir)!r} trained a {config.kind} model (a causal language model): "
                            "it predicts the next token, not masked ones; `largebatch generate` continues a text")
    if tokenizer is None:
        raise FillMaskError(f"RUN_DIR {str(run_dir)!r}: its tokenizer cannot be recovered: pass --tokenizer PATH")
    if (problem := not_utf8(text, "--text")) is not None:
        raise FillMaskError(problem)
    try:  # (no padding or truncation a tokenizer.json may carry: the text's own tokens)
        encoder, special, _ = masked_lm_encoder(plain(tokenizer), config.kind)
    except ExportError as exc:  # (its words name --tokenizer: the same fix here)
        raise FillMaskError(str(exc)) from None
    mask = special["mask_token"]
    mask_id = encoder.token_to_id(mask)
    ids = encoder.encode(text).ids  # [CLS] text [SEP]
    positions = [i for i, token in enumerate(ids) if token == mask_id]
    if not positions:
        raise FillMaskError(f"the text {_short(text)} has no {mask} token: write {mask} where the model should "
                            f"fill in a token (e.g. --text \"the {mask} of it\")")
    context = trained_positions(loaded) or config.seq_len
    if len(ids) > context:
        why = ("its model.seq_len" if context == config.seq_len else
               "the longest sequence this checkpoint has trained (the run's phases)")
        raise FillMaskError(f"the text is {len(ids):,} tokens with {special['cls_token']} and {special['sep_token']}; "
                            f"the model reads at most {context:,} ({why}): shorten the text")
    if max(ids) >= config.vocab_size:
        raise FillMaskError(f"the text's token id {max(ids)} is not in the model's vocabulary "
                            f"({config.vocab_size}): pass --tokenizer PATH to the tokenizer.json the run "
                            "trained with")
    note = partial_note(loaded, "fills from")
    if note:
        log(f"note: {note}")
    model = model.to(dev).eval()
    start = time.perf_counter()
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids], dtype=torch.long, device=dev))  # (1, T, v): every position
        probabilities = torch.softmax(logits[0, positions].float(), dim=-1)  # (masks, v)
        top = probabilities.topk(min(top_k, probabilities.shape[-1]), dim=-1)
    scores, tokens = top.values.tolist(), top.indices.tolist()
    seconds = time.perf_counter() - start
    masks = [{"position": position,
              "candidates": [{"token_id": token, "token": encoder.id_to_token(token),
                              "text": encoder.decode([token], skip_special_tokens=False), "probability": score}
                             for token, score in zip(row_tokens, row_scores)]}
             for position, row_tokens, row_scores in zip(positions, tokens, scores)]
    filled = list(ids)
    for position, row_tokens in zip(positions, tokens):
        filled[position] = row_tokens[0]
    return {"run_dir": str(run_dir), "checkpoint": str(loaded.checkpoint), "step": loaded.step, "ema": ema,
            "text": text, "tokens": len(ids), "mask_token": mask, "top_k": len(tokens[0]),
            "filled": encoder.decode(filled, skip_special_tokens=True), "masks": masks, "seconds": seconds}


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(build_parser(), argv, _filled, (FillMaskError, ExportError))


def _filled(args: argparse.Namespace) -> int:
    """The command's work: fill the masks, then print the text and the candidates (timing on stderr)."""
    if args.text_file is not None:
        try:
            args.text = read_text_file(args.text_file, "--text-file")
        except ValueError as exc:
            raise FillMaskError(str(exc)) from None
    result = fill_mask(args.run_dir, args.text, args.top_k, args.device, args.tokenizer, args.checkpoint,
                       args.ema, log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(result["filled"])
        for n, entry in enumerate(result["masks"], 1):
            shown = "  ".join(f"{json.dumps(c['text'])} {c['probability']:.4f}" for c in entry["candidates"])
            print(f"{result['mask_token']} {n} (token {entry['position']}): {shown}")
    print(f"{weights_label(result)}: {len(result['masks'])} mask(s), {result['tokens']} tokens in "
          f"{result['seconds']:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
