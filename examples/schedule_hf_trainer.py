"""A largebatch LR schedule inside transformers.Trainer, offline: tiny GPT-2 on Hamlet.

    .venv/bin/python examples/schedule_hf_trainer.py              # ~30 s on 2 CPU cores
    .venv/bin/python examples/schedule_hf_trainer.py --seesaw     # see what Trainer cannot do

A GPT2LMHeadModel built from a config (no download), a byte-level BPE tokenizer trained here on
the first 600 lines of Hamlet from the bundled Shakespeare corpus (largebatch.data) and wrapped as a
transformers tokenizer, and ``TokenScheduleCallback`` applying a warmup-stable-decay schedule keyed
on tokens (WSD, MiniCPM: Hu et al. 2024) to Trainer's optimizer. Prints the LR Trainer logged
next to the schedule's value at the same token count, and the held-out loss on the next 150 lines.
With ``--seesaw`` the schedule is Seesaw: Trainer's batch is fixed, so the callback warns and
applies Seesaw's base schedule (the constant-batch schedule Seesaw is equivalent to).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from largebatch.data.corpus import shakespeare_documents  # noqa: E402
from largebatch.data.tokenizer import EOT, train_tokenizer  # noqa: E402
from largebatch.schedules import WSD, Seesaw  # noqa: E402

SEQ_LEN, BATCH, ACCUM, VOCAB, PEAK_LR = 64, 8, 2, 512, 3e-3


class Packed(torch.utils.data.Dataset):
    """Token ids cut into sequences of SEQ_LEN; labels = inputs (the model shifts them)."""

    def __init__(self, ids: list[int]):
        usable = len(ids) // SEQ_LEN * SEQ_LEN
        self.rows = torch.tensor(ids[:usable], dtype=torch.long).view(-1, SEQ_LEN)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps")
    parser.add_argument("--seesaw", action="store_true", help="pass a Seesaw schedule")
    parser.add_argument("--output-dir", default=None, help="Trainer's output_dir (default: temp)")
    args = parser.parse_args(argv)
    import tempfile

    import transformers

    from largebatch.integrations.hf import TokenScheduleCallback

    torch.set_num_threads(1)  # tiny matrices: more threads only spin on shared cores
    transformers.logging.set_verbosity_error()
    hamlet = next(d.text for d in shakespeare_documents() if d.name == "shakespeare/hamlet")
    lines = [line for line in hamlet.splitlines() if line.strip()]
    train_text, eval_text = "\n".join(lines[:600]), "\n".join(lines[600:750])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer([train_text], VOCAB), eos_token=EOT)
    train_set = Packed(tokenizer(train_text)["input_ids"])
    eval_set = Packed(tokenizer(eval_text)["input_ids"])

    tokens_per_step = BATCH * ACCUM * SEQ_LEN  # one rank
    total = args.steps * tokens_per_step
    # final_lr is a fraction of the peak: the cooldown ends at 0.1 x 3e-3
    schedule = WSD(PEAK_LR, total, warmup_tokens=total // 10, final_lr=0.1, cooldown_fraction=0.3)
    if args.seesaw:
        schedule = Seesaw(schedule, batch_size=BATCH * ACCUM, ratio=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback = TokenScheduleCallback(schedule, seq_len=SEQ_LEN)
    for warning in caught:
        print(f"warning: {warning.message}")

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    with tempfile.TemporaryDirectory() as tmp:
        training_args = transformers.TrainingArguments(
            output_dir=args.output_dir or tmp, max_steps=args.steps, learning_rate=PEAK_LR,
            per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
            logging_steps=max(1, args.steps // 8), logging_first_step=True, report_to="none",
            save_strategy="no",
            use_cpu=True, disable_tqdm=True, seed=0, weight_decay=0.01)
        trainer = transformers.Trainer(model=model, args=training_args, train_dataset=train_set,
                                       eval_dataset=eval_set, callbacks=[callback])
        trainer.remove_callback(transformers.PrinterCallback)  # the table below says it all
        start = time.perf_counter()
        trainer.train()
        evaluation = trainer.evaluate()
    base = schedule.lr_schedule if args.seesaw else schedule
    print(f"{len(train_set)} training sequences of {SEQ_LEN} tokens, {args.steps} steps of "
          f"{tokens_per_step} tokens ({time.perf_counter() - start:.1f} s)")
    print(f"{'step':>5} {'tokens':>8} {'Trainer logged lr':>18} {'schedule(tokens)':>17} "
          f"{'loss':>7}")
    for entry in trainer.state.log_history:
        if "learning_rate" in entry:
            step = entry["step"] - 1  # logged after the step: its LR was set at its start
            tokens = step * tokens_per_step
            print(f"{step:5d} {tokens:8,} {entry['learning_rate']:18.3e} {base(tokens):17.3e} "
                  f"{entry['loss']:7.3f}")
    print(f"held-out loss (next 150 lines of Hamlet): {evaluation['eval_loss']:.3f}")
    return evaluation


if __name__ == "__main__":
    main()
