"""Runs end on their token budget: the last step of a run (and of each phase) takes only the
sequences still needed, in multiples of the data-parallel ranks. Checked on the schedule's own
plans, on GPT and BERT runs (Seesaw batch growth, phases, a budget that is not a whole number of
batches), on exact resume, against a float64 gradient written from the definition, and under a
2-rank torchrun."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from largebatch.schedules import ConstantBatch, Cosine, Seesaw, trim_to_budget
from largebatch.train.cli import main, resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics
from test_train import _run, _train_losses, tiny_overrides
from test_train_phases import write_config

SEQ = 32


def _train(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


@pytest.mark.parametrize("budget_seqs, dp", [(197, 1), (197, 2), (200, 4), (3, 1)])
def test_the_schedules_steps_consume_the_budget(budget_seqs, dp):
    """Seesaw growing 8 -> 64: the steps sum to the budget (rounded up to dp sequences), only the
    last is short, and it keeps the LR of its start token."""
    total = budget_seqs * SEQ
    sched = Seesaw(Cosine(1e-2, total, total // 10, final_lr=0.1), batch_size=8, ratio=0.5,
                   micro_batch=2, dp_size=dp)
    steps = list(sched.steps(SEQ))
    needed = -(-budget_seqs // dp) * dp
    assert sum(s.batch_size for s in steps) == needed
    assert all(s.batch_size == sched.batch_size(s.tokens_seen) for s in steps[:-1])
    last = steps[-1]
    left = budget_seqs - last.tokens_seen // SEQ
    assert last.batch_size == min(sched.batch_size(last.tokens_seen), -(-left // dp) * dp)
    assert last.batch_size % dp == 0 and last.lr == sched.lr(last.tokens_seen)
    assert last.micro_batches == -(-last.batch_size // (2 * dp))
    assert len(steps) == sum(p.steps for p in sched.phases(SEQ))  # the step count is unchanged


def test_trim_rounds_a_partial_sequence_up_and_keeps_whole_steps():
    assert trim_to_budget(16, 5 * SEQ, SEQ) == 5
    assert trim_to_budget(16, 5 * SEQ + 1, SEQ) == 6        # a partial sequence: the next whole one
    assert trim_to_budget(16, 5 * SEQ, SEQ, granularity=4) == 8
    assert trim_to_budget(16, 100 * SEQ, SEQ) == 16
    sched = ConstantBatch(Cosine(1e-2, 100 * SEQ + 7, 0), batch_size=16)
    assert [s.batch_size for s in sched.steps(SEQ)] == [16] * 6 + [5]  # 96 + 5 sequences >= budget
    with pytest.raises(ValueError, match="tokens_left=0"):
        trim_to_budget(16, 0, SEQ)


def test_gpt_seesaw_run_ends_on_a_budget_that_is_not_a_whole_batch(reference_run, tmp_path):
    """197 sequences through Seesaw batches of 8, 16 and 32: tokens seen == the budget, the last
    step takes the 21 sequences left (micro-batches of 4 and a last of 1), and a run stopped before
    it resumes exactly."""
    cache = reference_run[0]
    budget = SEQ * 197
    o = tiny_overrides(cache, tmp_path / "full", **{"run.total_tokens": budget})
    summary = _run(o)
    records = _train(tmp_path / "full")
    assert summary["tokens"] == budget and records[-1]["tokens"] == budget
    assert sum(r["batch_size"] for r in records) == 197
    assert len({r["batch_size"] for r in records[:-1]}) >= 2  # the batch grew (Seesaw)
    last = records[-1]["batch_size"]
    assert last == 197 - sum(r["batch_size"] for r in records[:-1]) and last % 4  # a partial micro-batch
    assert records[-1]["micro_batches"] == -(-records[-1]["batch_size"] // 4)
    stopped = tiny_overrides(cache, tmp_path / "stopped", **{"run.total_tokens": budget,
                                                            "run.max_steps": len(records) - 1})
    assert _run(stopped)["stopped_early"]
    stopped["run.max_steps"] = None
    resumed = _run(stopped, resume=True)
    assert _train_losses(tmp_path / "stopped") == _train_losses(tmp_path / "full")
    assert resumed["tokens"] == budget and resumed["final_val_loss"] == summary["final_val_loss"]


def test_trimmed_step_gradient_is_the_mean_over_its_real_sequences(reference_run, tmp_path):
    """float64: the last step (5 sequences, micro-batches 4 + 1) accumulates the gradient of the mean
    loss over those 5 sequences, computed here per sequence from the definition."""
    o = tiny_overrides(reference_run[0], tmp_path / "run", **{
        "run.total_tokens": SEQ * 197, "model.dropout": 0.0, "run.log_every_steps": 1000})
    trainer = Trainer(load_config(resolve_config(None), o), tmp_path / "run", log=lambda *_: None)
    try:
        trainer.raw_model.double()
        seen = []
        trainer.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: seen.append([p.grad.clone() for p in trainer._live_params()]))
        pos, total = trainer.pos, trainer.phase.total_tokens
        while total - pos.tokens >= trainer.schedule.batch_size(pos.tokens) * SEQ:
            trainer.train_step()
        n_real = (total - pos.tokens) // SEQ
        assert 0 < n_real < trainer.schedule.batch_size(pos.tokens) and n_real % 4
        reference = copy.deepcopy(trainer.raw_model)
        batch = trainer.data.train.get_batch(range(pos.samples, pos.samples + n_real))
        per_sequence = [F.cross_entropy(reference(batch["input_ids"][i:i + 1])[0][0],
                                        batch["targets"][i]) for i in range(n_real)]
        torch.stack(per_sequence).mean().backward()
        expected = [p.grad for p in reference.parameters() if p.requires_grad]
        seen.clear()
        record = trainer.train_step()
        assert record["batch_size"] == n_real and pos.tokens == total
        assert len(seen) == 1
        for got, want in zip(seen[0], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    finally:
        trainer._close()


def test_bert_phases_each_end_on_their_budget(tiny_data_cache, tmp_path):
    """BERT, two phases (seq 32 then 64), each with a budget that is not a whole batch: each phase's
    last step is trimmed, the next phase starts at exactly the first one's budget."""
    config = write_config(tmp_path, tiny_data_cache)
    text = config.read_text()
    text = text.replace("total_tokens = 2048\nschedule = { batch_size = 16 }",
                        "total_tokens = 2144\nschedule = { batch_size = 16 }")  # 67 sequences of 32
    text = text.replace("total_tokens = 2048\nmicro_batch = 4", "total_tokens = 2240\nmicro_batch = 4")  # 35 of 64
    config.write_text(text)
    run = tmp_path / "run"
    assert main([str(config), f"--run.out_dir={run}"]) == 0
    records = _train(run)
    phase0 = [r for r in records if r["phase"] == 0]
    phase1 = [r for r in records if r["phase"] == 1]
    assert [r["batch_size"] for r in phase0] == [16] * 4 + [3]
    assert [r["batch_size"] for r in phase1] == [8] * 4 + [3]
    assert phase1[0]["tokens"] == 2144 + 8 * 64  # the phase began exactly at phase 0's budget
    assert phase1[-1]["micro_batches"] == 1
    assert json.loads((run / "summary.json").read_text())["tokens"] == 2144 + 2240


@pytest.mark.distributed
def test_torchrun_ddp_trims_like_one_process(tmp_path, tiny_data_cache):
    """2-rank DDP with a budget of 198 sequences (even: both ranks take 3 of the last 6): the same
    steps, losses and tokens as one process."""
    from test_train_distributed import _losses, _overrides, _torchrun

    budget = SEQ * 198
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    o = _overrides(tiny_data_cache, single, **{"run.total_tokens": budget})
    Trainer(load_config(resolve_config(None), o), single, log=lambda *_: None).fit()
    _torchrun(_overrides(tiny_data_cache, ddp, **{"run.total_tokens": budget}))
    ref, ours = _train(single), _train(ddp)
    assert sum(r["batch_size"] for r in ref) == 198 and ref[-1]["tokens"] == budget
    assert [r["batch_size"] for r in ours] == [r["batch_size"] for r in ref]
    assert _losses(ddp) == pytest.approx(_losses(single), rel=1e-5, abs=1e-5)
    assert json.loads((ddp / "summary.json").read_text())["tokens"] == budget
