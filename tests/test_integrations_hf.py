"""TokenScheduleCallback drives a real transformers.Trainer's LR (tiny GPT-2 on Shakespeare bytes);
TokenLR passed to Trainer directly; largebatch.schedules does not import transformers."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from largebatch.data.corpus import shakespeare_documents
from largebatch.schedules import Cosine, Seesaw, TokenLR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from largebatch.integrations.hf import TokenScheduleCallback  # noqa: E402

SEQ, PER_DEVICE, ACCUM, STEPS = 16, 2, 3, 10
TOKENS_PER_STEP = SEQ * PER_DEVICE * ACCUM
PEAK, TOTAL, WARMUP, FRACTION = 1e-3, STEPS * TOKENS_PER_STEP, 3 * TOKENS_PER_STEP, 0.1


def cosine_ref(t):
    if t < WARMUP:
        return PEAK * t / WARMUP
    s = min(1.0, (t - WARMUP) / (TOTAL - WARMUP))
    return FRACTION * PEAK + (1 - FRACTION) * PEAK * (1 + math.cos(math.pi * s)) / 2


class ByteText(torch.utils.data.Dataset):
    """Hamlet as bytes, in sequences of SEQ tokens (a vocabulary of 256)."""

    def __init__(self):
        text = next(d.text for d in shakespeare_documents() if d.name.endswith("hamlet"))
        ids = torch.tensor(list(text.encode()[: 64 * SEQ]), dtype=torch.long)
        self.rows = ids.view(-1, SEQ)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class RecordLR(transformers.TrainerCallback):
    """The LR of every optimizer group right after each optimizer step (the LR that step used)."""

    def __init__(self):
        self.lrs = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append([group["lr"] for group in optimizer.param_groups])


def train(tmp_path, callbacks, learning_rate=PEAK, **extra):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM, learning_rate=learning_rate, logging_steps=1,
        report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        lr_scheduler_type="linear", warmup_steps=2, **{"save_strategy": "no", **extra})  # (LR: the callback's)
    record = RecordLR()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ByteText(),
                                   callbacks=[*callbacks, record])
    trainer.train()
    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    return record.lrs, logged


def test_callback_drives_trainers_lr(tmp_path):
    callback = TokenScheduleCallback(Cosine(PEAK, TOTAL, WARMUP, FRACTION), seq_len=SEQ)
    # Trainer built at half the schedule's peak: every group is scaled by 0.5 (a multiplier)
    lrs, logged = train(tmp_path, [callback], learning_rate=0.5 * PEAK)
    assert len(lrs) == len(logged) == STEPS
    for k in range(STEPS):
        expected = 0.5 * cosine_ref(k * TOKENS_PER_STEP)
        assert len(lrs[k]) == 2  # Trainer's decay / no-decay groups
        for lr in lrs[k]:
            assert lr == pytest.approx(expected, rel=1e-12, abs=1e-18), k
        assert logged[k] == pytest.approx(expected, rel=1e-12, abs=1e-18), k
    assert lrs[1][0] > 0 and lrs[-1][0] < lrs[WARMUP // TOKENS_PER_STEP][0]  # warmup, then decay


def test_callback_on_seesaw_warns_and_applies_the_base_schedule(tmp_path):
    seesaw = Seesaw(Cosine(PEAK, TOTAL, WARMUP, FRACTION), batch_size=PER_DEVICE * ACCUM,
                    ratio=0.5)
    with pytest.warns(UserWarning, match="cannot change the batch size.*Seesaw.*Cosine"):
        callback = TokenScheduleCallback(seesaw)  # clock from state.num_input_tokens_seen
    lrs, logged = train(tmp_path, [callback], include_num_input_tokens_seen=True)
    for k in range(STEPS):
        assert lrs[k][0] == pytest.approx(cosine_ref(k * TOKENS_PER_STEP), rel=1e-12, abs=1e-18)
        assert logged[k] == lrs[k][0]
    with pytest.raises(ValueError, match="include_num_input_tokens_seen=True"):
        train(tmp_path, [TokenScheduleCallback(Cosine(PEAK, TOTAL))])


@pytest.mark.parametrize("seq_len", [None, SEQ], ids=["counted-tokens", "step-clock"])
def test_callback_clock_survives_resume_from_checkpoint(tmp_path, seq_len):
    """Trainer stopped after 4 steps (a checkpoint at step 4) and resumed by a new Trainer with a new
    callback: the resumed steps take the LRs of the uninterrupted schedule. The counted-token clock
    is the count at the end of the previous step (restored from trainer_state.json on resume), not
    the count at the next step's begin, which transformers 4.x had already advanced by a micro-batch."""
    schedule = Cosine(PEAK, TOTAL, WARMUP, FRACTION)
    extra = dict(include_num_input_tokens_seen=True, save_strategy="steps", save_steps=4)
    train(tmp_path, [TokenScheduleCallback(schedule, seq_len=seq_len)], **extra)
    assert (tmp_path / "checkpoint-4").is_dir()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "resumed"), max_steps=STEPS, per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM, learning_rate=PEAK, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, include_num_input_tokens_seen=True)
    record = RecordLR()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ByteText(),
                                   callbacks=[TokenScheduleCallback(schedule, seq_len=seq_len), record])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert len(record.lrs) == STEPS - 4
    for k, lrs in enumerate(record.lrs, start=4):
        assert lrs[0] == pytest.approx(cosine_ref(k * TOKENS_PER_STEP), rel=1e-12, abs=1e-18), k


def test_token_lr_as_trainers_scheduler(tmp_path):
    # the other route: TokenLR is a torch LRScheduler, so Trainer steps it like its own
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK)
    scheduler = TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION), TOKENS_PER_STEP)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True)
    record = RecordLR()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ByteText(),
                                   callbacks=[record], optimizers=(optimizer, scheduler))
    trainer.train()
    for k in range(STEPS):
        assert record.lrs[k][0] == pytest.approx(cosine_ref(k * TOKENS_PER_STEP), rel=1e-12,
                                                 abs=1e-18)


def test_schedules_do_not_import_transformers():
    code = ("import sys, largebatch.schedules, largebatch.integrations; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "False"
