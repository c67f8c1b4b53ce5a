"""Worker code for tests/test_pipeline.py: `largebatch train` runs INSIDE 2 spawned gloo ranks (1 thread
each), one spawn for every case; each run writes its metrics, the tests compare them with one-process
runs of the same config."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer

# (name, model kind, optimizer, pp_schedule, virtual stages per rank)
CASES = [("gpt-gpipe-lamb", "gpt", "lamb", "gpipe", 1), ("gpt-gpipe-lans", "gpt", "lans", "gpipe", 1),
         ("gpt-1f1b-lans", "gpt", "lans", "1f1b", 1),  # 1F1B with LAMB: the resumed case below
         ("gpt-interleaved-lamb", "gpt", "lamb", "interleaved-1f1b", 2),
         ("gpt-interleaved-lans", "gpt", "lans", "interleaved-1f1b", 2),
         ("gpt-interleaved-zb-lamb", "gpt", "lamb", "interleaved-zb", 2),
         ("bert-1f1b-lamb", "bert", "lamb", "1f1b", 1)]
STOP_AT = 5  # the resumed case stops after this many steps


def overrides(cache: str, out: str, kind: str = "gpt", optim: str = "lamb", **extra) -> dict:
    """A 4-layer model, a Seesaw batch doubling within ~10 steps, clipping that binds."""
    o = {"model.kind": kind, "model.n_layer": 4, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 32,
         "model.tie_embeddings": False, "data.vocab_size": 512, "data.cache_dir": cache,
         "schedule.batch_policy": "seesaw", "schedule.batch_size": 8, "schedule.peak_lr": 3e-2,
         "schedule.final_lr": 0.2, "optim.name": optim, "optim.grad_clip": 0.5, "run.micro_batch": 2,
         "run.total_tokens": 3072, "run.eval_tokens": 160, "run.eval_every_tokens": 3072,
         "run.progress": "off", "run.sample_tokens": 0, "run.peak_flops": 1e11, "run.tensorboard": False,
         "run.out_dir": out}
    o.update(extra)
    return o


def train(o: dict, out: str | Path, resume: bool = False) -> None:
    Trainer(load_config(resolve_config(None), o), out, resume=resume, log=lambda *_: None).fit()


def run_all(out_dir: str, cache: str) -> None:
    out = Path(out_dir)
    for name, kind, optim, schedule, virtual in CASES:
        train(overrides(cache, str(out / name), kind, optim, **{
            "parallel.pp": 2, "parallel.pp_schedule": schedule, "parallel.pp_virtual_stages": virtual}), out / name)
    # stopped after STOP_AT steps on pp = 2 with uneven stages (1 + 3 layers), then resumed on pp = 2; a
    # copy of the stopped run is resumed on one process by the test
    pp = {"parallel.pp": 2, "parallel.pp_split": [1]}
    train(overrides(cache, str(out / "resume"), **pp, **{"run.max_steps": STOP_AT}), out / "resume")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(out / "resume", out / "resume-on-one")
    dist.barrier()
    train(overrides(cache, str(out / "resume"), **pp), out / "resume", resume=True)
