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
        output_dir=str(tmp_path), per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM, learning_rate=learning_rate, logging_steps=1,
        report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        lr_scheduler_type="linear", warmup_steps=2,  # (the LR: the callback's)
        **{"save_strategy": "no", "max_steps": STEPS, **extra})
    record = RecordLR()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ByteText(),
                                   callbacks=[*callbacks, record])
    trainer.train()
    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    return record.lrs, logged


def test_callback_drives_trainers_lr(tmp_path):
    callback = TokenScheduleCallback(Cosine(PEAK, TOTAL, WARMUP, FRACTION), seq_len=SEQ)
    # Trainer built at half the schedule's peak: every group is scaled by 0.5 (a multiplier), said once
    with pytest.warns(UserWarning, match=r"learning_rate=0.0005 is not the schedule's peak_lr=0.001: .* x 0.5 "):
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


def test_step_clock_counts_the_short_last_step_of_each_epoch(tmp_path):
    """An epoch of 32 batches at accumulation 3 is 11 steps: 10 of 3 batches and one of 2 (Trainer's
    chunking). The step clock follows the batches really fed, as the counted-token clock does; it
    ran a batch ahead per epoch (the full budget reached before the run ended)."""
    steps, batches = 25, len(ByteText()) // PER_DEVICE  # 25 steps: two epochs and 3 steps
    assert batches % ACCUM
    fed, chunks = [0], []  # micro-batches fed before each step, from Trainer's rule, epoch by epoch
    while len(chunks) < steps:
        chunks += [ACCUM] * (batches // ACCUM) + [batches % ACCUM]
    for size in chunks[:steps - 1]:
        fed.append(fed[-1] + size)
    batch_tokens = PER_DEVICE * SEQ
    schedule = Cosine(PEAK, fed[-1] * batch_tokens, 3 * TOKENS_PER_STEP, FRACTION)

    def reference(t):  # the float64 cosine of `schedule`
        warmup, total = 3 * TOKENS_PER_STEP, fed[-1] * batch_tokens
        if t < warmup:
            return PEAK * t / warmup
        s = min(1.0, (t - warmup) / (total - warmup))
        return FRACTION * PEAK + (1 - FRACTION) * PEAK * (1 + math.cos(math.pi * s)) / 2

    expected = [reference(n * batch_tokens) for n in fed]
    for seq_len in (SEQ, None):
        lrs, _ = train(tmp_path / str(seq_len), [TokenScheduleCallback(schedule, seq_len=seq_len)],
                       max_steps=steps, include_num_input_tokens_seen=True)
        assert [lr[0] for lr in lrs] == pytest.approx(expected, rel=1e-12, abs=1e-18), seq_len


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


ACCELERATE_SCRIPT = '''
import json, os, sys
import torch
from accelerate import Accelerator
from largebatch.optim import LAMB
from largebatch.schedules import Cosine, TokenLR

torch.set_num_threads(1)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
per_rank, seq = 4, 16  # sequences per micro-batch per rank, tokens per sequence
tokens_per_step = per_rank * accelerator.num_processes * 2 * seq  # every rank, both micro-batches
schedule = Cosine(1e-2, 8 * tokens_per_step, 2 * tokens_per_step, final_lr=0.1)
out = {}
for prepared in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = LAMB(model.parameters(), lr=1e-2)
    scheduler = TokenLR(optimizer, schedule, tokens_per_step=tokens_per_step)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank)
    if prepared:  # accelerate's convention for schedulers: stepped once per process per step
        model, optimizer, loader, wrapped = accelerator.prepare(model, optimizer, loader, scheduler)
    else:  # the documented way: TokenLR stays out of prepare and steps once per optimizer step
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        wrapped = scheduler
    lrs = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if prepared or accelerator.sync_gradients:
                wrapped.step()
            optimizer.zero_grad()
        if len(lrs) == 6 and accelerator.sync_gradients:
            break
    out[str(prepared)] = {"lrs": lrs, "clock": scheduler.tokens_seen}
out["expected"] = [schedule(k * tokens_per_step) for k in range(6)]
out["tokens_per_step"] = tokens_per_step
if accelerator.is_main_process:
    print("RESULT " + json.dumps(out), flush=True)
# exit without the interpreter's teardown, where gloo's threads can abort a finished rank
# (largebatch.parallel.mesh.end_process does this for the trainer's ranks)
accelerator.wait_for_everyone()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


@pytest.mark.distributed
def test_token_lr_under_accelerate_counts_each_step_once(tmp_path):
    """Under accelerate with 2 processes, TokenLR kept out of ``accelerator.prepare`` and stepped when
    ``accelerator.sync_gradients`` (docs/schedules.md) takes the schedule's LR at every step's
    global tokens. Prepared, accelerate steps it once per process on each optimizer step (its
    convention for step-counted schedulers), so the token clock runs at twice the tokens: why the
    docs keep it out."""
    import json

    pytest.importorskip("accelerate")
    from processes import src_env

    script = tmp_path / "accelerate_token_lr.py"
    script.write_text(ACCELERATE_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=src_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    tokens_per_step, expected = out["tokens_per_step"], out["expected"]
    assert expected == pytest.approx([cosine_at(k * tokens_per_step, tokens_per_step) for k in range(6)],
                                     rel=1e-12)
    assert out["False"]["lrs"] == pytest.approx(expected, rel=1e-12)
    assert out["False"]["clock"] == 6 * tokens_per_step
    assert out["True"]["clock"] == 2 * 6 * tokens_per_step  # accelerate's: once per process


def cosine_at(t, tokens_per_step, steps=8):
    """float64 cosine with warmup (2 steps) to 10% over ``steps`` steps of ``tokens_per_step`` tokens."""
    peak, warmup, total = 1e-2, 2 * tokens_per_step, steps * tokens_per_step
    if t < warmup:
        return peak * t / warmup
    s = min(1.0, (t - warmup) / (total - warmup))
    return 0.1 * peak + 0.9 * peak * (1 + math.cos(math.pi * s)) / 2


TRAINER_SCRIPT = '''
import json, math, os, sys
import torch, transformers
from largebatch.integrations.hf import TokenScheduleCallback
from largebatch.schedules import Cosine

torch.set_num_threads(1)
seq, per_device, accum, steps = 8, 4, 2, 6
rows = torch.arange(256 * seq).remainder(256).view(-1, seq)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return len(rows)

    def __getitem__(self, i):
        return {"input_ids": rows[i], "labels": rows[i]}


class RecordLR(transformers.TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


out = {}
for split in (False, True):
    ranks = 1 if split else 2  # split: the ranks share one batch of per_device sequences
    tokens_per_step = per_device * accum * ranks * seq
    schedule = Cosine(1e-2, steps * tokens_per_step, 2 * tokens_per_step, final_lr=0.1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=seq, n_embd=16,
                                                                 n_layer=1, n_head=2))
    args = transformers.TrainingArguments(
        output_dir=sys.argv[1] + f"/split{split}", max_steps=steps, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accum, learning_rate=1e-2, report_to="none", save_strategy="no",
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=0,
        accelerator_config={"split_batches": split})
    record = RecordLR()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(),
                                   callbacks=[TokenScheduleCallback(schedule, seq_len=seq), record])
    trainer.train()
    out[str(split)] = {"lrs": record.lrs, "tokens_per_step": tokens_per_step}
if int(os.environ["RANK"]) == 0:
    print("RESULT " + json.dumps(out), flush=True)
torch.distributed.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


@pytest.mark.distributed
def test_step_clock_under_ddp_and_split_batches(tmp_path):
    """Trainer on 2 processes: each rank's batch counts once per rank, except under
    accelerator_config split_batches, where the ranks split one batch (the clock ran at twice the
    tokens there, reaching the final LR at half the run)."""
    import json

    from processes import src_env

    script = tmp_path / "trainer_clock.py"
    script.write_text(TRAINER_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], env=src_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    for split, ranks in (("False", 2), ("True", 1)):
        tokens_per_step = out[split]["tokens_per_step"]
        assert tokens_per_step == 4 * 2 * ranks * 8
        expected = [cosine_at(k * tokens_per_step, tokens_per_step, steps=6) for k in range(6)]
        assert out[split]["lrs"] == pytest.approx(expected, rel=1e-12), split
