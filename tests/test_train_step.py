"""The training step as a GPU needs it, checked on CPU: no host read of a device value in a step
that does not log (counted at the dispatcher, where every .item(), float(t), int(t) and bool(t)
lands as aten._local_scalar_dense), no blocking host-to-device copy (``torch.tensor(values,
device=...)``, which on CUDA waits for the queue as a read does), and the reads it defers still stop
a run at the right step."""

from __future__ import annotations

import json

import pytest
import torch

from largebatch.train.cli import main, resolve_config
from largebatch.train.config import load_config
from largebatch.train.deferred import HostReads
from largebatch.train.loop import Trainer
from test_train import tiny_overrides


def _trainer(cache, out, **extra) -> Trainer:
    o = tiny_overrides(cache, out, **{"run.log_every_steps": 100, **extra})
    return Trainer(load_config(resolve_config(None), o), out, log=lambda *_: None)


@pytest.mark.parametrize("optim", [
    {"optim.name": "lamb"},
    {"optim.name": "lans", "optim.grad_clip": 0.5},
    {"optim.name": "lars"},
    {"optim.name": "adamw", "optim.fused": True, "optim.grad_clip": 0.5},
])
def test_a_step_that_does_not_log_reads_nothing_from_the_device(tmp_path, reference_run, optim):
    trainer = _trainer(reference_run[0], tmp_path / "run", **optim)
    try:
        trainer.train_step()  # the first step creates the optimizer state
        start = [p.detach().clone() for p in trainer.raw_model.parameters()]
        with HostReads() as reads:
            record = trainer.train_step()  # two micro-batches: the noise-scale inputs are taken too
        assert reads.scalar == 0 and reads.calls == [], (reads.scalar, reads.calls)
        assert isinstance(record["loss"], torch.Tensor) and len(trainer.deferred.noise_inputs) == 2
        moved = [not torch.equal(a, p) for a, p in zip(start, trainer.raw_model.parameters())]
        assert all(moved)  # the step did update every parameter
        assert trainer.noise.updates == 0
        logged = trainer.log_record(record)  # the log reads what the steps left on the device
        assert isinstance(logged["loss"], float) and logged["loss"] > 0
        assert trainer.noise.updates == 2 and not trainer.deferred.noise_inputs
    finally:
        trainer._close()


def test_deferred_nonfinite_stop_names_the_first_bad_step(tmp_path, reference_run, capsys):
    """With reads deferred to every 4th step, a diverging run still stops naming the step where the
    loss first went non-finite (the same step a run that reads every step names) and writes no
    checkpoint of the diverged model."""
    messages = []
    for every in (1, 4):
        o = tiny_overrides(reference_run[0], tmp_path / f"nan{every}", **{
            "schedule.peak_lr": 1e30, "schedule.batch_policy": "constant", "optim.name": "adamw",
            "run.log_every_steps": every, "run.checkpoint_every_tokens": 32 * 8})
        assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 1
        err = capsys.readouterr().err
        messages.append(err[err.index("at step"):].split(",")[0])
        assert "Traceback" not in err and "Last good checkpoint: " in err
    assert messages[0] == messages[1], messages
    step = int(messages[0].split()[-1])
    saved = sorted((tmp_path / "nan4" / "checkpoints").glob("step_*"))
    assert all(int(p.stem.split("_")[1]) < step for p in saved), (saved, step)


def test_group_lr_multipliers_scale_the_schedule_and_survive_resume(tmp_path, reference_run):
    """Each group's LR is the scheduled LR x its lr_mult: a first Adam-type step moves a no-decay
    tensor by lr x mult x m^/(sqrt(v^) + eps), so its displacement is mult times the one at mult 1,
    while every other tensor moves as before; the multipliers are in the checkpoint and a resumed
    step equals the uninterrupted one."""
    cache, deltas = reference_run[0], {}
    for mult in (1.0, 0.25):
        trainer = _trainer(cache, tmp_path / f"m{mult}", **{"optim.name": "adamw",
                                                            "optim.no_decay_lr_mult": mult})
        start = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
        trainer.train_step()
        lr = trainer.schedule.lr(0)
        assert [g["lr"] for g in trainer.optimizer.param_groups] == [
            lr * (mult if g["weight_decay"] == 0 else 1.0) for g in trainer.optimizer.param_groups]
        deltas[mult] = {n: (p.detach() - start[n]).double() for n, p in trainer.raw_model.named_parameters()}
        no_decay = {n for g in trainer.optimizer.param_groups if g["weight_decay"] == 0 for n in g["names"]}
        trainer._close()
    assert no_decay and len(no_decay) < len(deltas[1.0])
    for name, delta in deltas[1.0].items():
        if name in no_decay:
            torch.testing.assert_close(deltas[0.25][name], 0.25 * delta, rtol=1e-5, atol=1e-12)
        else:
            assert torch.equal(deltas[0.25][name], delta), name

    out = tmp_path / "lans"
    extra = {"optim.name": "lans", "optim.no_decay_lr_mult": 0.5, "optim.unadapted_lr_mult": 0.1}
    trainer = _trainer(cache, out, **extra)
    trainer.train_step()
    trainer.save()
    ref = trainer.log_record(trainer.train_step())["loss"]
    ref_params = [p.detach().clone() for p in trainer.raw_model.parameters()]
    mults = [g["lr_mult"] for g in trainer.optimizer.param_groups]
    trainer._close()
    assert sorted(mults) == [0.5 * 0.1, 1.0]  # no decay + no trust ratio; decay + trust ratio
    cfg = load_config(resolve_config(None), tiny_overrides(cache, out, **{
        **extra, "run.log_every_steps": 100}))
    resumed = Trainer(cfg, out, resume=True, log=lambda *_: None)
    try:
        assert [g["lr_mult"] for g in resumed.optimizer.param_groups] == mults
        assert resumed.log_record(resumed.train_step())["loss"] == ref
        assert all(torch.equal(a, p) for a, p in zip(ref_params, resumed.raw_model.parameters()))
    finally:
        resumed._close()


def test_next_batch_is_built_on_a_background_thread_and_changes_nothing(tmp_path, reference_run):
    """Across a Seesaw batch doubling, every step after the first takes the micro-batches built on
    the prefetch thread during the step before, and the losses equal those of a trainer that builds
    every batch when it needs it."""
    import threading

    losses = {}
    for prefetching in (True, False):
        trainer = _trainer(reference_run[0], tmp_path / f"p{prefetching}",
                           **{"run.total_tokens": 32 * 8 * 8})
        built_on = []
        get_batch = trainer.prefetch.get_batch

        def recording(indices, get_batch=get_batch, built_on=built_on):
            built_on.append((threading.current_thread().name, list(indices)))
            return get_batch(indices)

        trainer.prefetch.get_batch = recording
        trainer.prefetch.background_above_s = 0.0  # on the thread however cheap the build
        if not prefetching:
            trainer.prefetch.prefetch = lambda chunks: None
        try:
            steps = 6
            records = [trainer.log_record(trainer.train_step()) for _ in range(steps)]
            assert [r["batch_size"] for r in records] == [8] * 5 + [16]  # across the first doubling
            losses[prefetching] = [r["loss"] for r in records]
            if prefetching:
                assert trainer.prefetch.hits == steps - 1 and trainer.prefetch.misses == 1
                threads = [name for name, _ in built_on]
                assert threads[:2] == ["MainThread"] * 2  # step 1's two micro-batches
                assert all(n.startswith("largebatch-prefetch") for n in threads[2:]), threads
            else:
                assert trainer.prefetch.hits == 0 and {n for n, _ in built_on} == {"MainThread"}
        finally:
            trainer._close()
    assert losses[True] == losses[False]


def test_prefetch_uses_the_thread_only_for_batches_slower_than_the_handoff():
    """A build cheaper than ``background_above_s`` is done when the batch is asked for (a thread
    handoff costs more than it saves); a slower one is prepared on the thread; the batches are the
    same either way, and a slow build that turns fast goes back to the asking thread."""
    import threading
    import time

    from largebatch.data.prefetch import Prefetcher

    slow_steps = {3, 4, 5}  # the batches of these steps take 20 ms to build, the others ~0
    built_on = []

    def get_batch(indices):
        built_on.append(threading.current_thread().name)
        if indices[0] // 2 in slow_steps:
            time.sleep(0.02)
        return {"input_ids": torch.tensor([list(indices)])}

    prefetcher = Prefetcher(get_batch, background_above_s=0.01)
    try:
        seen = []
        for step in range(8):
            seen.append(prefetcher.get([[2 * step, 2 * step + 1]])[0]["input_ids"].tolist())
            prefetcher.prefetch([[2 * step + 2, 2 * step + 3]])
        assert seen == [[[2 * i, 2 * i + 1]] for i in range(8)]
        # fast builds: on the asking thread; the first slow one (step 3's, asked for) is measured
        # there too; then steps 4, 5 and 6 are built ahead on the thread, and step 6's fast build
        # turns the prefetcher back to the asking thread
        assert built_on[:4] == ["MainThread"] * 4
        assert all(name.startswith("largebatch-prefetch") for name in built_on[4:7]), built_on
        assert built_on[7:] == ["MainThread"], built_on
        assert (prefetcher.hits, prefetcher.misses) == (3, 5)
    finally:
        prefetcher.close()


def test_host_reads_counts_each_kind_of_read():
    """The counter the step checks rely on sees every way a value reaches the host, and nothing else."""
    t = torch.arange(4.0)
    with HostReads() as reads:
        (t * 2 + 1).sum()  # device work only
    assert reads.scalar == 0 and reads.calls == [] and reads.total == 0
    with HostReads() as reads:
        t[0].item(), float(t[1]), int(t[2]), bool(t[3]), t.tolist(), t.cpu()
    assert reads.scalar == 4  # item, float, int, bool: one aten._local_scalar_dense each
    assert sorted(reads.calls) == sorted(["item", "__float__", "__int__", "__bool__", "tolist", "cpu"])
    assert reads.total == 5  # and the one .tolist() read
