"""The training loop: GPT or BERT pretraining keyed on tokens, with exact resume.

Read top to bottom, a run is:
  1. setup     -- device, seeds, data (tokenizer trained on the training split), model,
                  recomputation, optional compile, optimizer, joint LR/batch schedule
  2. resume    -- model, optimizer, schedule, noise-scale estimator, data position and every RNG
  3. the loop  -- at the top of each iteration: evaluate, checkpoint, maybe stop; then one
                  optimizer step accumulated over micro-batches, loss normalised by the step's
                  target tokens, so a step is the same whatever the micro-batch split; the next
                  step's batch is built meanwhile (data.prefetch), and what the step leaves on
                  the device is read only when it logs (train.deferred)
  4. the end   -- final evaluation and checkpoint, plots, a generated sample, the summary

Time is tokens: the schedule gives the LR and the batch size (in sequences) at the tokens seen so
far; the data order is keyed on the global sample index, so a batch-size change (Seesaw) only
changes how many samples form a step, and a resumed run continues bit-identically.
The gradient noise scale (McCandlish et al. 2018, App. A) is estimated from the first
micro-batch's gradient and the accumulated step's gradient.

The Trainer's other parts have modules of their own: phase switching (train.phases.PhaseSwitch),
evaluation (train.evaluate.Evaluation), and what it logs and reports (train.report.Reporting).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from largebatch.checkpoint import (
    CheckpointError,
    checkpoint_dp_size,
    gather_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from largebatch.checkpoint.files import atomic_write_text
from largebatch.data import build_data
from largebatch.data.prefetch import Prefetcher
from largebatch.data.tokenizer import document_separator
from largebatch.models import build_model, model_spec
from largebatch.models.flops import measure_peak_flops
from largebatch.optim.core import is_dtensor
from largebatch.parallel import (
    clip_grad_norm_,
    global_grad_norm,
    gradient_sync,
    init_distributed,
    parallelize,
    quiet_fsdp_view_warning,
    seed_ranks,
    settle_ddp_buckets,
    shard_optimizer,
    unwrap,
)
from largebatch.parallel.batch import LocalGradNorm, global_sum, noise_scale_inputs, rank_samples
from largebatch.parallel.materialize import build_on_meta, materialize, meta_init_applies
from largebatch.parallel.mesh import set_collective_timeout
from largebatch.parallel.pipeline import padded_micro_batches, pipeline_parallelize
from largebatch.train.config import TrainConfig, save_config
from largebatch.train.deferred import Deferred, target_count
from largebatch.train.ema import WeightAverage
from largebatch.train.evaluate import EvalInterrupted, Evaluation
from largebatch.train.hf_import import init_from_pretrained
from largebatch.train.loss_scale import LossScale
from largebatch.train.metrics import MetricsLog, WandbSettings
from largebatch.train.optimizer import OPTIMIZERS, build_optimizer, device_step_counts
from largebatch.train.phases import PhaseSwitch, resolve_phases
from largebatch.train.profile import StepProfiler, profile_windows
from largebatch.train.progress import ConsoleLog, Progress, human_count
from largebatch.train.report import Reporting
from largebatch.train.rundir import TIMINGS_NAME, keep_tokenizer, lock_run_dir, note_stop
from largebatch.train.skip import DeviceSkip
from largebatch.train.stopping import (
    StepInterrupted,
    StopRequest,
    TimeLimit,
    control_group,
    exit_code,
    write_seconds,
)
from largebatch.typed_config import ConfigError, to_dict


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf and the run was configured to stop."""


@dataclass
class Progression:
    """Where the run is. Everything else is derived from these and the schedule."""

    step: int = 0
    tokens: int = 0  # tokens consumed by optimizer steps
    samples: int = 0  # global sample index of the next step's first sample
    next_eval: int = 0
    next_checkpoint: int = 0
    train_seconds: float = 0.0  # wall time spent in optimizer steps (not eval or checkpoints)
    skipped_steps: int = 0
    skipped_in_a_row: int = 0  # consecutive non-finite steps (run.max_skipped_steps)
    # run.dtype = 'fp16' (largebatch.train.loss_scale): the loss scale, the steps in a row without
    # overflow since it last changed, the overflowed (skipped) steps in all; None: not an fp16 run
    loss_scale: float | None = None
    loss_scale_good_steps: int = 0
    overflow_steps: int = 0
    phase: int = 0  # the current phase (largebatch.train.phases); ``samples`` counts within it
    phase_start: int = 0  # tokens at which the current phase began (its schedule's zero)
    model_flops: float = 0.0  # of the optimizer steps so far: each step's tokens x its phase's FLOPs per token
    # wall-clock seconds of the run's launches up to here, each from its trainer's setup on (data,
    # model, steps, evaluations, checkpoints); a launch's time after its last checkpoint is not kept
    wall_seconds: float = 0.0
    # the steps' seconds, each times its launch's peak FLOP/s x processes: the run's MFU denominator
    # when launches differ in processes or peak (None: a checkpoint from before it was kept)
    peak_flop_seconds: float | None = None
    save_seconds: float = 0.0  # the longest checkpoint save so far (a background write's own time included)
    eval_seconds: float = 0.0  # the longest evaluation so far (run.time_limit)
    # run.target_val_loss: where the first evaluation at or below it was (step, tokens, seconds), or None
    target: dict | None = None


def numerics() -> dict[str, Any]:
    """What sets the order of this process's floating-point sums besides the code: torch's thread
    count and version (kept in each checkpoint; a resume under others is exact in what it loads and
    no longer bit-identical to the uninterrupted run)."""
    return {"threads": torch.get_num_threads(), "torch": str(torch.__version__)}  # (a str: weights_only loads it)


def _numerics_text(n: dict[str, Any]) -> str:
    threads = n.get("threads")
    return f"{threads} torch thread{'s' if threads != 1 else ''} (torch {n.get('torch')})"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"run.device = {name!r}: CUDA is not available here; use 'cpu' or 'auto'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"run.device = {name!r}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s); use 'cuda' or 'cuda:N' with N < {torch.cuda.device_count()}")
    return device


def latest_any_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run, single-process (.pt) or distributed (.dcp), by step."""
    return latest_checkpoint(run_dir, kinds=(".pt", ".dcp"))


def _run_state(method):
    """A Trainer entry point, run in the process state the run sets and given back after:
    ``run.dtype`` alone decides the precision (torch's default dtype float32 whatever the caller's
    ``torch.set_default_dtype``, and a caller's ``torch.autocast`` off: the forward enters the run's
    own), and the warning filters the run adds (``quiet_view_warning``) are removed when it returns."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        dtype, depth = torch.get_default_dtype(), self.__dict__.get("_state_depth", 0)
        with contextlib.ExitStack() as outer:
            for device in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device):
                    outer.enter_context(torch.autocast(device, enabled=False))
            # the filter, at the outermost call only: catch_warnings clears Python's record of the
            # warnings already shown once, so entering it at every step would show them at every step
            if depth == 0 and getattr(self, "quiet_view_warning", False):
                outer.enter_context(warnings.catch_warnings())
                quiet_fsdp_view_warning()
            torch.set_default_dtype(torch.float32)
            self._state_depth = depth + 1
            try:
                return method(self, *args, **kwargs)
            finally:
                self._state_depth = depth
                torch.set_default_dtype(dtype)

    return wrapped


class Trainer(PhaseSwitch, Evaluation, Reporting):
    @_run_state
    def __init__(self, cfg: TrainConfig, run_dir: str | Path, resume: bool = False, log=None):
        self._launch_start, self._wall_before = time.perf_counter(), 0.0  # (the run's earlier launches)
        self._launch_monotonic = time.monotonic()  # run.time_limit counts from here
        # log: a callable taking one line; by default ConsoleLog (stdout, flushed; a closed pipe stops
        # the run as a signal does, after a checkpoint)
        self.cfg, self.run_dir = cfg, Path(run_dir).expanduser()
        self.log = ConsoleLog() if log in (None, print) else log
        run = cfg.run
        # -- 1. setup -------------------------------------------------------------------------
        self.par = init_distributed(cfg.parallel)  # a no-op in one process
        self.is_main = self.par.is_main
        if not self.is_main:
            self.log = lambda *_: None
        self.device = self.par.device if self.par.distributed else resolve_device(run.device)
        torch.manual_seed(run.seed)  # the same initial model on every rank
        random.seed(run.seed)
        np.random.seed(run.seed)
        # one run per directory; freed at death
        self.lock = lock_run_dir(self.run_dir, self.par, cfg.parallel.shared_fs_wait_s)
        if self.lock is not None and self.lock.warning:
            self.log(f"warning: {self.lock.warning}")
        self.phases = resolve_phases(cfg.phases, cfg.schedule, cfg.model.seq_len, run.total_tokens,
                                     run.micro_batch)
        self.phase = self.phases[0]
        self.data = build_data(cfg.data, seq_len=self.phase.seq_len, objective=model_spec(cfg.model.kind).objective,
                               log=self.log)
        source = f"data.mixture={cfg.data.mixture!r}" if cfg.data.mixture else f"data.corpus={cfg.data.corpus!r}"
        keep_tokenizer(self.run_dir, self.data.tokenizer, self.is_main, source)  # export/finetune read it
        self.prefetch = Prefetcher(self.data.train.get_batch, pin_memory=self.device.type == "cuda")
        self.writes = None  # run.async_checkpoint: the checkpoint write in the background
        if run.async_checkpoint:
            from largebatch.checkpoint.local import LocalWrite

            if self.par.distributed:
                from largebatch.checkpoint.distributed import DistributedWrite

                self.writes = DistributedWrite(self.par)
            else:
                self.writes = LocalWrite()
        vocab = model_vocab(cfg, self.data.vocab_size)
        if cfg.model.vocab_size != vocab:
            cfg = self.cfg = _with_vocab(cfg, vocab)
        separator = model_separator(cfg, self.data.tokenizer and document_separator(self.data.tokenizer),
                                    self.data.special_ids)
        if separator != cfg.model.separator_id:
            from largebatch.train.config import replace_section

            cfg = self.cfg = replace_section(cfg, "model", separator_id=separator)
        if separator is not None and (warning := separator_absent(self.data.train, separator)):
            self.log(f"warning: {warning}")
        # fixed order (torchtitan): [pipeline split ->] tensor/sequence parallel -> recompute ->
        # compile -> DDP/FSDP
        techniques = dict(recompute=_recompute_policy(run.recompute, cfg.model.n_layer), compile=run.compile)
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.dtype)  # autocast's dtype (half_precision)
        param_dtype = half  # FSDP2's all-gathered parameters (gradients are reduced in fp32)
        # FSDP2's view warning cannot apply to our blocks (their outputs are used out of place only);
        # silenced while the trainer's own methods run (_run_state), not for the caller's models after
        self.quiet_view_warning = self.par.dp_mode == "fsdp" and self.par.tp_size > 1  # (no forward here)
        if meta_init_applies(self.par, cfg.model.init_from):  # FSDP / TP / PP: no rank holds the whole model
            model, init_log = build_on_meta(lambda: build_model(cfg.model))
            self.n_params = model.num_params()
            if self.par.pp_size > 1:  # cut to this rank's stages on meta, then materialised
                self.pipeline = pipeline_parallelize(model, self.par, **techniques, init_log=init_log,
                                                     param_dtype=param_dtype)
                self.model = self.pipeline.model
            else:
                self.pipeline, self.model = None, parallelize(model, self.par, **techniques, param_dtype=param_dtype)
                materialize(unwrap(self.model), init_log, self.device)  # the one-process values, sharded
        else:
            model = build_model(cfg.model).to(self.device)
            if not resume:  # a fresh start from model.init_from's weights; a resume loads its checkpoint
                init_from_pretrained(model)
            self.n_params = model.num_params()
            self.pipeline = (pipeline_parallelize(model, self.par, **techniques, param_dtype=param_dtype)
                             if self.par.pp_size > 1 else None)
            self.model = (self.pipeline.model if self.pipeline else
                          parallelize(model, self.par, **techniques, param_dtype=param_dtype))
        if cfg.model.init_from and not resume:
            self.log(f"init_from: the model starts from {cfg.model.init_from}'s weights "
                     f"(model_type {cfg.model.hf_model_type})")
        self.raw_model = unwrap(self.model)  # checkpoints, the optimizer and generation use it
        self._params: list[torch.Tensor] | None = None  # _live_params, listed once
        seed_ranks(run.seed, self.par)  # dropout: a different stream per data-parallel replica and stage
        self.optimizer = shard_optimizer(build_optimizer(self.raw_model, cfg.optim, capturable=run.takes_steps_back),
                                         self.par)
        # run.ema_decay: the weights' moving average, beside the optimizer's parameters (train.ema)
        self.ema = (WeightAverage(self.optimizer, run.ema_decay, self.device, self.raw_model)
                    if run.ema_decay else None)
        # the batch granularity's replica count (see _load): a resume's checkpoints' (a one-process run
        # of batch 8 = micro_batch continues on 2 replicas, whose micro_batch x 2 would not divide 8)
        self.schedule_dp = (checkpoint_dp_size(self.run_dir) or self.par.dp_size) if resume else self.par.dp_size
        self.schedule = self._build_schedule()
        self.noise = self.phase.schedule.build_noise_scale()  # (the first phase's fields)
        self.phase_val_losses: list[float] = []  # each finished phase's last validation loss
        self.saved_step: int | None = None  # the step of the newest checkpoint written or loaded
        self.saved_path: Path | None = None
        self.stop_request: StopRequest | None = None  # while fit runs: evaluations poll it
        self.profiler: StepProfiler | None = None  # while fit runs: run.profile_steps
        self.val_accuracy: float | None = None  # of the last evaluation (see evaluate)
        self.val_by_corpus: dict[str, float] | None = None  # a mixture's: each corpus's loss, likewise
        self.val_ema: tuple[float, float | None] | None = None  # the weight average's (loss, accuracy), likewise
        self.last_eval: tuple[int, float] | None = None  # (step, validation loss) of this launch's last evaluation
        self.deferred = Deferred(self.device)  # the steps' device values until the loop reads them
        # noise-scale inputs: DDP (pipeline replicas too) -> one rank's gradient vs the all-reduced
        # one; one replica -> the first micro-batch vs the accumulated step (summed over pipeline
        # stages); FSDP over several replicas -> none
        self.local_grad_norm = (LocalGradNorm.install(self.model, self.par) if self.par.dp_size > 1
                                and self.par.dp_mode == "ddp" and not self.pipeline else None)
        # run.dtype alone sets the precision: an fp32 run also turns off an autocast its caller entered
        self.autocast = torch.autocast(self.device.type, dtype=half or torch.bfloat16, enabled=half is not None)
        self.eval_every = run.eval_every_tokens or max(1, run.total_tokens // 10)
        self.pos = Progression(next_eval=0, next_checkpoint=run.checkpoint_every_tokens or run.total_tokens)
        self._legacy_progress = False
        # -- 2. resume ------------------------------------------------------------------------
        resume_step = None
        if resume:
            ckpt = self._load_newest_intact()
            resume_step = self.pos.step
            self.log(f"resumed from {ckpt} at step {self.pos.step}, {human_count(self.pos.tokens)} tokens")
            if self.par.dp_size > 2 and self.pos.step > 0:  # 2 replicas sum in one order either way
                if settle_ddp_buckets(self.model, self._bucket_backward) and self.local_grad_norm is not None:
                    self.local_grad_norm.take()  # (its comm hook saw that backward: not a step's gradient)
        self.skip = (DeviceSkip(self.device, run.max_skipped_steps if run.on_nonfinite == "skip" else None,
                                self.pos.skipped_steps, self.pos.skipped_in_a_row) if run.takes_steps_back else None)
        self.loss_scale = None  # fp16: the dynamic loss scale, continued from the checkpoint's
        if run.dtype == "fp16":
            pos = self.pos
            given = getattr(self, "_saved_loss_scale", None)  # the start the checkpoint's run was given
            if pos.loss_scale is not None and given is not None and given != run.loss_scale:  # changed on resume
                self.log(f"note: run.loss_scale = {run.loss_scale:.10g} (the run started at {given:.10g}): the loss "
                         f"scale starts again there, from {pos.loss_scale:.10g}")
                pos.loss_scale, pos.loss_scale_good_steps = None, 0
            self.loss_scale = LossScale(self.device, run.loss_scale if pos.loss_scale is None else pos.loss_scale,
                                        run.loss_scale_growth_steps, pos.loss_scale_good_steps, pos.overflow_steps)
            pos.loss_scale = self.loss_scale.read()[0]
        else:  # (a run continued in another precision: its scale no longer applies)
            self.pos.loss_scale, self.pos.loss_scale_good_steps = None, 0
        self.metrics = None
        if self.is_main:
            save_config(cfg, self.run_dir / "config.toml")
            # resumed at the run's end: the final evaluation comes after the final checkpoint, and runs again
            at_end = resume_step is not None and (self._last_phase() and self.pos.tokens - self.pos.phase_start
                                                  >= self.phase.total_tokens or self._ended_at_target())
            wandb = WandbSettings(to_dict(cfg), run.wandb_project) if run.wandb else None
            self.metrics = MetricsLog(self.run_dir, tensorboard=run.tensorboard, resume_step=resume_step,
                                      evaluates_again=at_end, wandb=wandb)
            for note in self.metrics.notes:
                self.log(f"note: {note}")
        # run.time_limit: this launch's deadline, and what its steps, checkpoints and evaluations take
        self.time_limit = self._build_time_limit() if run.time_limit is not None else None
        self._held = 0.0  # the latest save's wait (a background write's own seconds come after it)
        self._time_note: str | None = None  # why run.time_limit stops the run (its log line)
        self.peak_flops = run.peak_flops or measure_peak_flops(self.device, half or torch.float32)
        self.peak_source = "declared" if run.peak_flops else f"measured {run.dtype} matmul"
        if self.pos.peak_flop_seconds is None:  # a new run (0 s), or a checkpoint without it: this launch's
            self.pos.peak_flop_seconds = self.pos.train_seconds * self.peak_flops * self.par.world_size
        self.flops_per_token = self.model_flops_per_token(self.phase.seq_len)
        if self._legacy_progress:  # a checkpoint from before model_flops was kept: its tokens at this phase's rate
            self.pos.model_flops = self.pos.tokens * self.flops_per_token

    # ------------------------------------------------------------------------------------------
    def wall_seconds(self) -> float:
        """Wall-clock seconds of the run so far: its earlier launches' (to their last checkpoint) and
        this one's, from its setup on."""
        return self._wall_before + time.perf_counter() - self._launch_start

    def extra_state(self) -> dict[str, Any]:
        """Everything but model and optimizer: schedule, estimator, position, RNG, config (and the
        weight average's decay and step count; its tensors are saved beside the model's)."""
        self.pos.wall_seconds = self.wall_seconds()
        ema = None if self.ema is None else {"decay": self.ema.decay, "steps": self.ema.step_count()}
        return {"version": 1, "ema": ema, "schedule": self.schedule.state_dict(),
                "noise_scale": self.noise.state_dict(), "progress": vars(self.pos).copy(),
                "phase_val_losses": list(self.phase_val_losses), "data_entry": self._data_entry(),
                "val_documents": list(self.data.stats.val_document_names),
                "rng": gather_rng(rng_state(self.device), self.par), "config": to_dict(self.cfg),
                "numerics": numerics()}

    def _data_entry(self) -> str | None:
        """What the run trains on, as a key a resume compares: a text corpus's data cache entry name
        (a hash of its text, both splits, and the tokenizer), a token-array corpus's fingerprint of
        its files ("tokens-...", see corpus.token_array_fingerprint)."""
        stats = self.data.stats
        return Path(stats.cache_path).name if stats.cache_path else stats.content_key

    def _load_newest_intact(self) -> Path:
        """Load the newest checkpoint that reads back whole, saying which damaged ones were passed."""
        ckpts = list_checkpoints(self.run_dir, kinds=(".pt", ".dcp"))
        if not ckpts:
            raise FileNotFoundError(f"--resume {self.run_dir}: no checkpoint in "
                                    f"{self.run_dir / 'checkpoints'}; start a new run instead")
        reasons = []
        for ckpt in reversed(ckpts):
            try:
                self._load(ckpt)  # a later, whole load overwrites whatever a failed one half-set
                return ckpt
            except (CheckpointError, FileNotFoundError) as exc:  # unreadable: try the one before
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                reasons.append(f"{ckpt.name}: {reason}")
                self.log(f"warning: checkpoint {ckpt} is damaged ({reason}); falling back to the "
                         f"one before it")
            except Exception as exc:  # noqa: BLE001 -- read whole but does not fit: never an older one
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if isinstance(exc, KeyError):  # (its text is the key alone)
                    reason = (f"it has no {exc.args[0]!r} entry, so it is not a checkpoint of this trainer (a "
                              f"file of another program, or state dicts saved by hand)")
                raise ValueError(f"cannot resume from {ckpt} (intact, so no older checkpoint is "
                                 f"used instead): {reason}") from exc
        raise CheckpointError(f"no intact checkpoint in {self.run_dir / 'checkpoints'} "
                              f"({'; '.join(reasons)}); start a new run instead")

    def _check_remaining_batches_split(self, saved_dp: int, progress: dict) -> None:
        """ValueError unless every remaining step's batch (the run's: multiples of micro_batch x
        ``saved_dp`` sequences, its last trimmed to the budget and rounded up to split,
        ``_last_step_granularity``) splits evenly over this run's
        data-parallel replicas. An adaptive Seesaw's batches follow the noise estimate, unknown ahead."""
        dp = self.par.dp_size
        fix = (f"resume with a data-parallel degree that divides {saved_dp}, or one that splits every "
               "remaining batch (the other processes as parallel.tp or parallel.pp)")
        for phase in self.phases[progress["phase"]:]:
            where = f"phase {phase.index}'s " if self.cfg.phases else "the "
            if phase.schedule.noise_scale_multiple is not None:
                raise ValueError(f"it was written with {saved_dp} data-parallel replica(s) and this run has "
                                 f"{dp}: {where}adaptive Seesaw batches follow the noise estimate, so they are "
                                 f"not known to split over {dp} replicas; {fix}")
            schedule = phase.schedule.build(total_tokens=phase.total_tokens, seq_len=phase.seq_len,
                                            micro_batch=phase.micro_batch, dp_size=saved_dp)
            tokens = progress["tokens"] - progress["phase_start"] if phase.index == progress["phase"] else 0
            while tokens < phase.total_tokens:
                batch = schedule.step_batch(tokens, phase.seq_len, math.lcm(saved_dp, dp))
                if batch % dp:
                    raise ValueError(
                        f"it was written with {saved_dp} data-parallel replica(s) and this run has {dp}: the "
                        f"run's batches are multiples of micro_batch x {saved_dp} = {phase.micro_batch * saved_dp} "
                        f"sequences, and {where}step at {tokens:,} tokens takes a batch of {batch} sequences, "
                        f"which {dp} replicas cannot split evenly; {fix}")
                tokens += batch * phase.seq_len

    def _load(self, path: Path) -> None:
        if path.suffix == ".dcp":  # from any number of ranks, onto this mesh
            from largebatch.checkpoint.distributed import load_distributed  # DCP: on use (start-up)

            average = {} if self.ema is None else {"ema": self.ema.state_dict()}
            extra = load_distributed(path, self.model, self.optimizer, self.par, tensors=average)
            saved_average = average.get("ema")  # (loaded in place)
        else:
            extra = load_checkpoint(path)  # CheckpointError when unreadable
            if self.pipeline is not None or any(is_dtensor(p) for p in self.raw_model.parameters()):
                from largebatch.checkpoint.distributed import load_full_state  # DCP: on use

                load_full_state(self.model, self.optimizer, extra["model"], extra["optimizer"])
            else:
                self.raw_model.load_state_dict(extra["model"])
                self.optimizer.load_state_dict(extra["optimizer"])
            saved_average = extra.get("ema_tensors")
        if self.cfg.run.takes_steps_back:  # (the loaded groups carry the flag of the run that saved them)
            device_step_counts(self.optimizer)
        self._load_average(path, saved_average, extra.get("ema"), extra["progress"]["step"])
        self._saved_loss_scale = extra["config"].get("run", {}).get("loss_scale")  # (the start it was given)
        saved_dp = extra["schedule"].get("config", {}).get("dp_size", self.par.dp_size)
        if saved_dp != self.par.dp_size:
            # another number of replicas: keep the run's batch granularity (micro_batch x old dp), so
            # every step's batch is the one the run would take; fewer replicas (dividing the old
            # count) always split it, more must split every remaining step's batch
            if saved_dp % self.par.dp_size:
                self._check_remaining_batches_split(saved_dp, extra["progress"])
            self.schedule_dp = saved_dp
        saved_entry, entry = extra.get("data_entry"), self._data_entry()
        if saved_entry and entry and saved_entry != entry:  # (another tokenizer is refused before this)
            arrays = entry.startswith("tokens-")
            what, key = ("token arrays", "fingerprint") if arrays else ("text", "data cache entry")
            self.log(f"warning: the corpus's {what} changed since {path.name} was written ({key} "
                     f"{saved_entry} -> {entry}): the run continues on the new {what} and no longer "
                     "follows the trajectory it was on")
        saved_val, val = extra.get("val_documents"), list(self.data.stats.val_document_names)
        if saved_val is not None and saved_val != val:  # (documents added or removed move the split)
            self.log(f"warning: the validation documents changed since {path.name} was written "
                     f"({_names(saved_val)} -> {_names(val)}): validation losses before and after this "
                     "resume are not comparable, and a document validated on before is now trained on "
                     "or gone" + ("" if self.cfg.data.mixture else
                                  "; list them in data.val_documents to keep the split as the corpus grows"))
        saved_numerics, now = extra.get("numerics"), numerics()
        if saved_numerics and saved_numerics != now:
            self.log(f"note: {path.name} was written with {_numerics_text(saved_numerics)}, and this launch has "
                     f"{_numerics_text(now)}: the run continues from exactly what was saved, but its sums "
                     "round in another order from here on, so its losses are not bit-identical to a run "
                     "left uninterrupted (start it with the saved thread count and torch for that)")
        self.pos = Progression(**extra["progress"])
        target = self.cfg.run.target_val_loss
        if self.pos.target is not None and self.pos.target.get("target_val_loss", target) != target:
            if target is not None:  # (evaluations before the resume are not read again)
                self.log(f"note: run.target_val_loss is {target} now ({self.pos.target.get('target_val_loss')} "
                         f"was reached at step {self.pos.target.get('step')}): the time to it is taken from the "
                         "evaluations from here on")
            self.pos.target = None
        self._wall_before = self.pos.wall_seconds
        # the checkpoint cadence of this launch (a restart field): the saved next point was the old
        # cadence's, so a --run.checkpoint_every_tokens added on a requeue waited for it (the run's end)
        every = self.cfg.run.checkpoint_every_tokens or self.cfg.run.total_tokens
        self.pos.next_checkpoint = (self.pos.tokens // every + 1) * every
        self.saved_step, self.saved_path = self.pos.step, path  # (not written again at the same step)
        self._legacy_progress = "model_flops" not in extra["progress"]
        self.phase_val_losses = list(extra.get("phase_val_losses", []))
        if self.pos.phase != self.phase.index or saved_dp != self.par.dp_size:
            self._set_phase(self.phases[self.pos.phase])
        self.schedule.load_state_dict(extra["schedule"])
        self.noise = self.phase.schedule.build_noise_scale()  # the saved phase's fields (its noise_scale_ema)
        saved_noise = extra["noise_scale"]
        if isinstance(saved_noise, dict) and saved_noise.get("ema_decay") not in (None, self.noise.ema_decay):
            # a checkpoint of a version that read the run's [schedule] in every phase: its own, to the end
            self.noise = type(self.noise)(saved_noise["ema_decay"])
        self.noise.load_state_dict(saved_noise)
        rngs = extra["rng"]
        if len(rngs) == self.par.world_size:
            set_rng_state(rngs[self.par.rank], self.device)
        else:  # another number of ranks: the data order is exact, dropout streams restart
            seed_ranks(self.cfg.run.seed + self.pos.step, self.par)
            self.log(f"note: checkpoint from {len(rngs)} ranks resumed on {self.par.world_size}: "
                     f"data position and state are exact, dropout streams are re-seeded")

    def _load_average(self, path: Path, tensors: dict[str, Any] | None, saved: dict[str, Any] | None,
                      step: int) -> None:
        """The weight average of checkpoint ``path`` (``tensors`` by name, and its decay and count),
        or, where the run keeps one and the checkpoint has none, a new one from the loaded weights."""
        if self.ema is None:
            if saved:
                self.log(f"note: {path.name} holds a weight average (run.ema_decay = {saved['decay']}), and "
                         "this launch has run.ema_decay off: the average is not kept from here on")
            return
        if saved and tensors is not None:
            self.ema.load(tensors, saved["steps"])
            if saved["decay"] != self.ema.decay:
                self.log(f"note: the weight average continues with run.ema_decay = {self.ema.decay} (it was "
                         f"{saved['decay']} up to {path.name})")
            return
        self.ema.restart()
        self.log(f"note: {path.name} holds no weight average: run.ema_decay = {self.ema.decay} averages "
                 f"from its weights (step {step}) on")

    def save(self) -> Path:
        """Checkpoint the current step (with run.async_checkpoint: started, written in the background;
        ``finish_saves`` waits for it)."""
        self.settle()  # never a checkpoint past a non-finite step; the estimator up to date
        keep = self.cfg.run.keep_checkpoints
        average = None if self.ema is None else {"ema": self.ema.state_dict()}
        if self.par.distributed:
            from largebatch.checkpoint.distributed import save_distributed  # DCP: on use (start-up)

            if self.writes is not None:
                path = self.writes.start(self.run_dir, self.pos.step, self.model, self.optimizer,
                                         self.extra_state(), keep_last=keep, tensors=average)
            else:
                path = save_distributed(self.run_dir, self.pos.step, self.model, self.optimizer,
                                        self.extra_state(), self.par, keep_last=keep, tensors=average)
        else:
            state = {**self.extra_state(), "model": self.raw_model.state_dict(),
                     "optimizer": self.optimizer.state_dict()}
            if average is not None:
                state["ema_tensors"] = average["ema"]
            if self.writes is not None:
                path = self.writes.start(self.run_dir, self.pos.step, state, keep_last=keep)
            else:
                path = save_checkpoint(self.run_dir, self.pos.step, state, keep_last=keep)
        self.saved_step, self.saved_path = self.pos.step, path
        return path

    def _end_write(self) -> BaseException | None:
        """A failing or ending run's wait for the checkpoint written in the background: in place (this
        rank's part of it; no collective), or its failure logged. Returns the exception of a stop signal
        that came meanwhile (the wait goes on through it)."""
        if self.writes is None:
            return None
        error, interrupted = self.writes.close()  # (idle after it: a save after fit writes in the background too)
        if error is not None:  # (a failure already on its way)
            self.log(f"warning: the checkpoint written in the background failed too: {error}")
        return interrupted

    def finish_saves(self) -> None:
        """Wait until the checkpoint written in the background (run.async_checkpoint) is in place; its
        failure raised here, on every rank. Nothing to wait for without it."""
        if self.writes is not None:
            self.writes.wait()

    def _bucket_backward(self) -> None:
        """A forward and backward of a micro-batch of zeros (the training shape: a compiled block sees
        no new shape), the random state kept (dropout's draws): what DDP needs to see once to lay out
        its buckets (parallelize.settle_ddp_buckets)."""
        ids = torch.zeros((self.phase.micro_batch, self.phase.seq_len), dtype=torch.long)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            _, loss, _ = self._forward({"input_ids": ids, "targets": ids})
            loss.backward()

    # ------------------------------------------------------------------------------------------
    def _forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """One forward of a host batch, for training and evaluation alike: (logits, summed loss,
        targets on the device). The logits are None under pipeline stages (a forward only, through
        every stage); under the vocabulary-parallel loss they are a DTensor split over the vocabulary."""
        inputs = batch["input_ids"].to(self.device, non_blocking=True)
        targets = batch["targets"] if "targets" in batch else batch["labels"]
        if self.pipeline:
            targets = targets.to(self.device)
            with self.autocast:
                return None, self.pipeline.eval_loss(inputs, targets), targets
        targets = targets.to(self.device, non_blocking=True)
        with self.autocast, self.par.loss_context():
            logits, loss_sum = self.model(inputs, targets, reduction="sum")
        return logits, loss_sum, targets

    @_run_state
    def train_step(self) -> dict[str, Any]:
        """One optimizer step at the current token position; returns its log record. The loss and
        gradient norm stay device tensors (deferred.read_record reads them when the loop logs), so
        a step that does not log never waits for the device, with on_nonfinite='skip' too (the
        update is taken back on the device, train.skip) -- except under an adaptive Seesaw
        schedule (the noise scale caps the next milestone), which reads one value per step."""
        cfg, pos, par = self.cfg, self.pos, self.par
        in_phase = pos.tokens - pos.phase_start  # the phase's schedule starts at its first token
        batch_size = self._step_batch(in_phase)  # the phase's last step: only what its budget needs
        self.last_step_start = (pos.phase, in_phase)  # (the summary's batch the schedule reached)
        lr = self.schedule.lr(in_phase)
        for group in self.optimizer.param_groups:  # a group's LR ratio to the schedule survives
            group["lr"] = lr * group.get("lr_mult", 1.0)
        mb = self.phase.micro_batch
        # global sample indices: the data order never depends on how batches are cut; each
        # data-parallel rank takes a contiguous share of the step
        indices = rank_samples(range(pos.samples, pos.samples + batch_size), par)
        micro_batches = self.prefetch.get([indices[i:i + mb] for i in range(0, len(indices), mb)])
        ends_at = in_phase + batch_size * self.phase.seq_len
        if ends_at < self.phase.total_tokens:  # the next step's batch, built while this one computes
            after = rank_samples(range(pos.samples + batch_size,
                                       pos.samples + batch_size + self._step_batch(ends_at)), par)
            self.prefetch.prefetch([after[i:i + mb] for i in range(0, len(after), mb)])
        n_local = sum(target_count(b) for b in micro_batches)
        n_targets = global_sum(n_local, par)  # (), on the device
        # DDP/FSDP average gradients over replicas: scale so the result is d(mean loss of the step)
        scale = n_targets.reciprocal() * par.dp_size  # (dp_size / n_targets, without its Python wrapper)
        # fp16: the loss (so every gradient) times the loss scale; unscaled before clipping (train.loss_scale)
        unscale = None if self.loss_scale is None else self.loss_scale.scale.reciprocal()
        if unscale is not None:
            scale = scale * self.loss_scale.scale.to(scale.dtype)

        def unscaled(squared: torch.Tensor) -> torch.Tensor:  # a squared norm read from the scaled gradients
            return squared if unscale is None else squared * unscale.to(squared.dtype).square()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        small_sq = None
        last = len(micro_batches) - 1
        # a stop signal is polled between micro-batches (every rank at the same one): a step of many
        # micro-batches can outlast a cluster's grace period. It drops the step: its gradients, and
        # the random draws of its forwards (dropout), so the checkpoint at the step before resumes exactly
        stop = self.stop_request if last > 0 and not self.pipeline else None
        stop = None if stop is None or stop.is_ending else stop
        draws = rng_state(self.device) if stop is not None else None
        if self.pipeline:  # the step's micro-batches are the pipeline's (a short last step padded)
            fed = padded_micro_batches(micro_batches, mb, par.pp_schedule, par.pp_size)
            with self.autocast:
                loss_sum = self.pipeline.step(*_stacked(fed, self.device), len(fed), scale)
            if self.pipeline.first_norm is not None and last > 0:  # summed over the stages
                small_sq = unscaled(self.pipeline.first_norm.take()) * _first_share(n_targets, micro_batches[0])
        for i, batch in enumerate([] if self.pipeline else micro_batches):
            if i and stop is not None and (signum := stop.poll()[0]) is not None:
                self.optimizer.zero_grad(set_to_none=True)
                set_rng_state(draws, self.device)
                self._reshard()
                raise StepInterrupted(signum)
            with gradient_sync(self.model, i == last):
                _, loss, _ = self._forward(batch)
                with par.loss_context():
                    (loss * scale.to(loss.dtype)).backward()
            loss_sum += loss.detach()
            if i == 0 and last > 0 and par.dp_size == 1:
                # the first micro-batch's own mean gradient = accumulated grad x N_step / N_mb
                first = global_grad_norm(self._live_params(), par).square()
                small_sq = unscaled(first) * _first_share(n_targets, batch)
        # listed AFTER backward: FSDP2 swaps its parameters between sharded and unsharded tensors
        # (the root stays unsharded after a no-grad evaluation), and only the sharded ones hold grads
        params = self._live_params()
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else math.inf
        # (), identical on every rank: non-finite on all when any rank's gradients or loss are
        grad_norm = clip_grad_norm_(params, max_norm, par, local_value=loss_sum, unscale=unscale)
        loss_value = global_sum(loss_sum, par) / n_targets
        record: dict[str, Any] = {"kind": "train", "phase": self.phase.index, "seq_len": self.phase.seq_len,
                                  "loss": loss_value, "lr": lr,
                                  "batch_size": batch_size, "micro_batches": len(micro_batches),
                                  "grad_norm": grad_norm}
        replica_sq = (self.local_grad_norm.take() if self.local_grad_norm is not None
                      else self.pipeline.local_squared if self.pipeline else None)
        if replica_sq is not None:  # DDP: this rank's batch vs all ranks' batch
            noise_inputs = noise_scale_inputs(unscaled(replica_sq), grad_norm.square(), len(indices), par, n_local,
                                              n_targets)
        elif small_sq is not None:
            noise_inputs = (small_sq, mb, grad_norm.square(), batch_size)
        else:
            noise_inputs = None
        finite = torch.isfinite(loss_value) & torch.isfinite(grad_norm)  # what run.on_nonfinite judges
        taken = finite  # whether the update stands
        if self.loss_scale is not None:  # fp16: gradients that overflowed at a finite loss are skipped, and
            # the scale halved; only an overflow at scale 1 is non-finite (train.loss_scale)
            loss_finite = torch.isfinite(loss_value)
            overflow = loss_finite & ~torch.isfinite(grad_norm)
            at_floor = self.loss_scale.update(overflow, hold=~loss_finite)
            finite = loss_finite & ~at_floor
            taken = finite & ~overflow
            record["overflow"] = overflow & ~at_floor
        if cfg.run.on_nonfinite == "stop":  # recorded on the device; the next read stops the run
            self.deferred.watch(finite, pos.step + 1, pos.tokens, loss_value, grad_norm)
        if self.skip is not None:  # decided on the device: the update is taken back unless taken
            self.skip.step(self.optimizer, taken, pos.step + 1, bad=~finite)
            if cfg.run.on_nonfinite == "skip":
                record["skipped"] = ~finite
        else:
            self.optimizer.step()
        if self.ema is not None:  # (after a skipped step's take-back: False leaves it as it was)
            self.ema.update(taken)
        self.optimizer.zero_grad(set_to_none=True)
        if noise_inputs is not None:
            self.deferred.add_noise_inputs(*noise_inputs, keep=taken)
            if self.schedule.uses_noise_scale:
                self.settle()  # synchronised already: reading the flag below costs no extra wait
                if self.noise.b_simple is not None and (self.skip is None or bool(taken)):
                    # adaptive Seesaw: caps only milestones after this token count (deterministic)
                    self.schedule.observe_noise_scale(in_phase, self.noise.b_simple)
        pos.step += 1
        pos.tokens += batch_size * self.phase.seq_len
        pos.model_flops += batch_size * self.phase.seq_len * self.flops_per_token
        pos.samples += batch_size
        return record

    def settle(self) -> None:
        """Read what the steps since the last read left on the device: stop on a non-finite step
        (run.on_nonfinite='stop'), feed the noise-scale estimator. Before every log, evaluation and
        checkpoint, so none of them sees a model past a non-finite step."""
        bad = self.deferred.settle(self.noise)
        if self.loss_scale is not None:
            pos = self.pos
            pos.loss_scale, pos.loss_scale_good_steps, pos.overflow_steps = self.loss_scale.read()
        if self.skip is not None:
            pos = self.pos
            pos.skipped_in_a_row, pos.skipped_steps, give_up = self.skip.settle(self.optimizer)
            if give_up is not None:
                step, in_a_row, total = give_up
                if (interrupted := self._end_write()) is not None:
                    raise interrupted
                last_ckpt = latest_any_checkpoint(self.run_dir)
                raise NonFiniteLoss(
                    f"{in_a_row} consecutive non-finite steps skipped, the last at step {step} "
                    f"({total} skipped in all){self._fp16_words()}. Last good checkpoint: {last_ckpt or 'none'}. "
                    f"Lower schedule.peak_lr, set optim.grad_clip, or raise run.max_skipped_steps{self._fp16_fix()}.")
        if bad is not None:
            step, tokens, loss, grad_norm = bad
            if (interrupted := self._end_write()) is not None:
                raise interrupted
            last_ckpt = latest_any_checkpoint(self.run_dir)
            raise NonFiniteLoss(
                f"loss is {loss} (gradient norm {grad_norm}) at step {step}, {tokens} tokens{self._fp16_words(loss)}. "
                f"Last good checkpoint: {last_ckpt or 'none'}. Lower schedule.peak_lr, set "
                f"optim.grad_clip, or run.on_nonfinite='skip'{self._fp16_fix()}.")

    def _fp16_words(self, loss: float | None = None) -> str:
        """An fp16 run's non-finite step, said so: a loss that is not finite (fp16 overflowing in the
        forward pass, which no loss scale mends), or gradients that overflowed at a scale of 1."""
        if self.loss_scale is None:
            return ""
        if loss is None:  # (skipped steps: either kind)
            return (" (run.dtype = 'fp16': a non-finite loss, which can be fp16 overflowing in the forward pass, "
                    "or gradients that overflowed at a loss scale of 1, the least it goes)")
        if math.isfinite(loss):
            return " (run.dtype = 'fp16': the gradients overflowed at a loss scale of 1, the least it goes)"
        return " (run.dtype = 'fp16': a loss that is not finite can be fp16 overflowing in the forward pass)"

    def _fp16_fix(self) -> str:
        return "; or train in run.dtype = 'bf16' (fp32's range) where the device has it" if self.loss_scale else ""

    def _live_params(self) -> list[torch.Tensor]:
        """The parameters as the model holds them now (the ones the gradients were written to).
        Listed once, except under FSDP2, which swaps them between sharded and unsharded tensors."""
        if self._params is not None:
            return self._params
        params = [p for p in self.raw_model.parameters() if p.requires_grad]
        if not any(hasattr(m, "set_requires_gradient_sync") for m in self.raw_model.modules()):  # FSDP2
            self._params = params
        return params

    # ------------------------------------------------------------------------------------------
    @_run_state
    def fit(self) -> dict[str, Any]:
        ended = (1, False)  # (exit code, stopped to be continued): how the W&B run ends
        try:
            result = self._fit()
            signum = result.get("signal")  # (run.max_steps: stopped early too, to be continued, exit 0)
            ended = (exit_code(signum) if signum else 0, bool(result.get("stopped_early")))
            return result
        finally:
            self.stop_request = None  # (its handlers are given back: an evaluation after fit polls nothing)
            if self.profiler is not None:  # a window the run failed inside: its recorded steps written
                self.profiler.close("the run failed")
            if isinstance(self.log, ConsoleLog):
                self.log.on_lost = None
            self._close(*ended)

    def _fit(self) -> dict[str, Any]:
        run, pos = self.cfg.run, self.pos
        self.log(self.describe())
        for warning in self.data.stats.warnings():
            self.log(f"warning: {warning}")
        progress = Progress(run.total_tokens, enabled={"auto": None, "on": True, "off": False}[run.progress])
        steps_here, val_loss, mark = 0, None, (pos.train_seconds, pos.tokens, pos.model_flops)  # the last record
        self._warned_mfu = False
        self.after_first_step = None  # (train seconds, tokens) once this launch's first step is done
        self.profiler = StepProfiler(profile_windows(run.profile_steps), self.run_dir, self.par.rank,
                                     self.device, run.profile_memory, self.log, pos.step + 1, self.is_main)
        signum, time_due = None, False  # stopping.SIGNALS, and the wall-clock checkpoint interval
        time_up = False  # run.time_limit: the time left holds no further step and checkpoint (every rank agreed)
        step_timeout = self.cfg.parallel.step_timeout_s if self.par.distributed else None
        self.model.train()
        with StopRequest(self.par, run.checkpoint_every_seconds) as stop:
            self.stop_request = stop  # (evaluations poll it)
            if isinstance(self.log, ConsoleLog):  # standard output closed by its reader: stop
                self.log.on_lost = lambda: stop.request(signal.SIGPIPE)
                if self.log.lost:  # (already, during setup)
                    self.log.on_lost()
            if self.time_limit is not None:  # a launch that starts past its limit takes no step
                signum, _ = stop.poll(self.time_limit.left() <= 0)
                time_up = stop.time_up
                if time_up:
                    raise ConfigError(f"run.time_limit: {self.time_limit.source} passed during the run's setup "
                                      f"(data, model: {time.monotonic() - self._launch_monotonic:.1f} s), before "
                                      "any step; give a longer limit (or requeue the job)")
            while True:
                # -- 3. top of the iteration: next phase, evaluate, checkpoint, stop ----------
                # A stop signal checkpoints first: a cluster's grace period (30 s by default) is no
                # time for an evaluation, so the one due (and a phase switch's) runs on resume; a
                # signal during an evaluation cuts it short the same way (``EvalInterrupted``).
                try:
                    phase_over = pos.tokens - pos.phase_start >= self.phase.total_tokens
                    held = signum is not None or time_up  # a stop: the phase switch and evaluation wait
                    if phase_over and (not held or self._last_phase()) and not self._next_phase():
                        break  # the last phase ended
                    if pos.tokens >= pos.next_eval and not held:
                        val_loss = self._log_eval()
                        pos.next_eval = (pos.tokens // self.eval_every + 1) * self.eval_every
                except EvalInterrupted as exc:
                    signum = exc.signum
                if self._ended_at_target() and not held:  # run.stop_at_target: the run ends here
                    break
                stopping = signum is not None or time_up or (run.max_steps and steps_here >= run.max_steps)
                if pos.tokens >= pos.next_checkpoint and pos.step > 0:
                    every = run.checkpoint_every_tokens or run.total_tokens
                    pos.next_checkpoint = (pos.tokens // every + 1) * every
                    time_due = True
                if stopping:  # (before the checkpoint: a window's trace holds its steps, not the save)
                    if time_up and signum is None:
                        self.log(self._time_note or
                                 f"run.time_limit: another rank found too little time left before "
                                 f"{self.time_limit.source}")
                    self.profiler.close("the run stopped")
                if (time_due or stopping) and pos.step > 0:
                    if self.saved_step != pos.step:  # (a resumed run stopped before its first step has it)
                        self._timed_save()
                        stop.checkpointed()
                    time_due = False
                if stopping:
                    self.finish_saves()  # (a background write: in place before the process exits)
                    self._note_write_seconds()
                    if signum is not None:  # before any rank exits: torchrun restarting them must see it
                        if self.is_main:
                            note_stop(self.run_dir, signum, pos.step)
                        if self.par.distributed:
                            torch.distributed.barrier(group=control_group(self.par))
                    reason = (signal.Signals(signum).name if signum else "run.time_limit" if time_up
                              else "run.max_steps")
                    kept = (f"checkpoint {self.saved_path}" if self.saved_path is not None
                            else "no checkpoint (no step was taken)")
                    self.log(f"stopped after {steps_here} steps ({reason}) at step {pos.step}; "
                             f"{kept}. Continue with: {self._resume_command()}")
                    progress.close()
                    return {"stopped_early": True, "step": pos.step, "tokens": pos.tokens,
                            "signal": signum, "time_limit": bool(time_up and signum is None)}
                # parallel.step_timeout_s from this launch's second step on, inside the step alone
                short = step_timeout is not None and steps_here >= 1
                if short:
                    set_collective_timeout(step_timeout, self.par)
                self.profiler.before(pos.step + 1)
                t0 = time.perf_counter()
                try:
                    record = self.train_step()
                except StepInterrupted as exc:  # dropped: the top of the loop checkpoints the step before
                    self.profiler.interrupted()
                    signum = exc.signum
                    continue
                finally:
                    if short:
                        set_collective_timeout(self.cfg.parallel.timeout_s, self.par)
                logs = pos.step % run.log_every_steps == 0
                if self.device.type == "cuda" and (logs or steps_here == 0 or pos.tokens >= min(
                        pos.next_eval, pos.next_checkpoint)):
                    torch.cuda.synchronize(self.device)  # the queued steps' time, before a read
                seconds = time.perf_counter() - t0
                pos.train_seconds += seconds
                pos.peak_flop_seconds += seconds * self.peak_flops * self.par.world_size
                steps_here += 1
                if steps_here == 1:  # the launch's warm-up (allocations, compilation) ends with it
                    self.after_first_step = (pos.train_seconds, pos.tokens)
                self.profiler.after(pos.step)  # (outside the step's time: a window's end writes its trace)
                time_up = self._time_is_up(seconds, record["batch_size"], time_due)
                signum, due = stop.poll(time_up)  # the same on every rank
                time_up = stop.time_up
                time_due |= due
                if logs:
                    mark = self._log_step(record, progress, mark)
            progress.close()
            # -- 4. the end: the final checkpoint first (a job killed during the final evaluation
            # loses no step: the same command then evaluates and writes the summary); a signal now
            # lets the evaluation and summary finish (the run is complete; a second signal still
            # exits at once) ---------------------------------------------------------------------
            stop.ending()
            self.profiler.close("the run ended")
            if self.saved_step != pos.step and pos.step > 0:  # (a target reached before any step: nothing to keep)
                self._timed_save()
            self.finish_saves()  # in place before the final evaluation: a kill during it loses no step
            if self._ended_at_target() and self.last_eval is not None and self.last_eval[0] == pos.step:
                val_loss = self.last_eval[1]  # (ended at that evaluation: not run twice)
            else:
                val_loss = self._log_eval()
            return self._summary(val_loss)

    def _ended_at_target(self) -> bool:
        """run.stop_at_target, and an evaluation has reached run.target_val_loss: the run ends."""
        return self.cfg.run.stop_at_target and self.pos.target is not None

    def _build_time_limit(self) -> TimeLimit:
        """run.time_limit's deadline, with what the run has timed before (the longest save, in its
        checkpoints and, for the save a stop wrote last, RUN_DIR/.timings.json; the longest evaluation);
        a run that has timed no save yet has its checkpoint's bytes written at the rate of a test write
        of 64 MiB on the checkpoints' disk, on rank 0 (its shard's bytes)."""
        saved = self.pos.save_seconds
        try:
            saved = max(saved, float(json.loads((self.run_dir / TIMINGS_NAME).read_text())["save_seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        estimated = 0.0
        if not saved and self.is_main:  # (rank 0 alone: a thousand ranks' test writes would load a shared
            # disk at the start; the ranks stop on any rank's call, so rank 0's estimate stops them all)
            local = sum((p.to_local() if is_dtensor(p) else p).numel() for p in self._live_params())
            per_parameter = 4 + OPTIMIZERS[self.cfg.optim.name].state_bytes + (4 if self.ema is not None else 0)
            estimated = local * per_parameter * write_seconds(self.run_dir / "checkpoints") / (64 * 2**20)
        return TimeLimit(self.cfg.run.time_limit, self._launch_monotonic, saved, self.pos.eval_seconds, estimated)

    def _timed_save(self) -> None:
        """``save``, its seconds kept for run.time_limit (the longest, in the checkpoints too)."""
        began = time.perf_counter()
        self.save()
        self._note_write_seconds(time.perf_counter() - began)

    def _note_write_seconds(self, held: float | None = None) -> None:
        """A save's seconds: ``held`` (the loop's wait), plus, in the background, the write's own once
        finished (the latest wait's and the latest finished write's); the longest is kept in the
        progress and (rank 0, for the next launch: a stop's checkpoint cannot hold its own time)
        RUN_DIR/.timings.json."""
        if held is not None:
            self._held = held
        seconds = self._held + ((self.writes.seconds or 0.0) if self.writes is not None else 0.0)
        if seconds > self.pos.save_seconds:
            self.pos.save_seconds = seconds
            if self.is_main and self.time_limit is not None:
                try:
                    atomic_write_text(self.run_dir / TIMINGS_NAME, json.dumps({"save_seconds": seconds}))
                except OSError:  # (an estimate: a full disk is reported by the checkpoints)
                    pass
        if self.time_limit is not None:
            self.time_limit.saved(seconds)

    def _time_is_up(self, seconds: float, batch_size: int, checkpoint_due: bool = False) -> bool:
        """After a step of ``seconds`` and ``batch_size`` sequences: whether run.time_limit leaves too
        little time for the next step and a checkpoint (and the evaluation or phase switch due before
        it); why is kept for the stop's log line. False without a limit, and at the run's end (the
        final checkpoint comes next)."""
        limit, pos = self.time_limit, self.pos
        if limit is None:
            return False
        limit.step_done(seconds, batch_size * self.phase.seq_len)
        if self.writes is not None:
            self._note_write_seconds()
        in_phase = pos.tokens - pos.phase_start
        phase_over = in_phase >= self.phase.total_tokens
        if phase_over and self._last_phase():
            return False
        if phase_over:  # a phase switch: an evaluation at each length, then the next phase's first step
            nxt = self.phases[pos.phase + 1]
            schedule = nxt.schedule.build(total_tokens=nxt.total_tokens, seq_len=nxt.seq_len,
                                          micro_batch=nxt.micro_batch, dp_size=self.schedule_dp)
            tokens = schedule.step_batch(0, nxt.seq_len, self._last_step_granularity()) * nxt.seq_len
            evaluations, due = 2, " and the phase switch's two evaluations"
        else:
            tokens = self._step_batch(in_phase) * self.phase.seq_len
            evaluations, due = (1, " and the evaluation due") if pos.tokens >= pos.next_eval else (0, "")
        left, needed = limit.left(), limit.needed(tokens, evaluations)
        if checkpoint_due or pos.tokens >= pos.next_checkpoint:  # a periodic save before the next step
            needed += limit.needed(0)  # (one more save, with the margin)
            due += " and the checkpoint due before it"
        if self.writes is not None and self.writes.busy:  # the next save waits for the write in flight first
            needed += limit.needed(0)
            due += " (after the background write in flight)"
        if left >= needed:
            return False
        when = f"{left:.1f} s left before" if left >= 0 else f"{-left:.1f} s past"
        self._time_note = (f"run.time_limit: {when} {limit.source}; the next step and a checkpoint{due} would "
                           f"take ~{needed:.1f} s (with a 25% margin)")
        return True

    def _step_batch(self, in_phase: int) -> int:
        """The schedule's batch at ``in_phase`` tokens, the phase's last step trimmed to its budget in
        multiples of the dp replicas (under pp too: the pipeline pads what its schedule needs)."""
        return self.schedule.step_batch(in_phase, self.phase.seq_len, self._last_step_granularity())

    def _last_step_granularity(self) -> int:
        """Sequences the budget's last step is rounded up to a multiple of: the run's replica count,
        and, resumed on more replicas than its checkpoints were written with, theirs too (each rank
        takes the same count): that step takes up to dp - 1 more sequences than the run would have,
        as a run started with that many replicas does; every other step is the run's own."""
        return math.lcm(self.schedule_dp, self.par.dp_size)

    def _close(self, code: int = 0, preempted: bool = False) -> None:
        """Close the logs and release the run directory (idempotent; also after a failure, with its
        exit ``code``; ``preempted``: stopped, to be continued)."""
        metrics, self.metrics = self.metrics, None
        self.prefetch.close()
        interrupted = self._end_write()  # the write in flight finishes, whatever signal comes meanwhile
        try:
            if metrics is not None:
                metrics.close(code, preempted)
        finally:
            if self.lock is not None:
                self.lock.release()
        if interrupted is not None and sys.exc_info()[1] is None:  # a stop signal came while the write ended
            raise interrupted

    evaluate = _run_state(Evaluation.evaluate)  # the mixins' entry points, in the run's state too
    generate = _run_state(Reporting.generate)

def _first_share(n_targets: torch.Tensor, first: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N_step / N_mb)^2: the accumulated gradient after the first micro-batch is its own mean
    gradient times N_mb / N_step (the loss is scaled by the step's target count)."""
    return ((n_targets / target_count(first)) ** 2).double()


def _stacked(micro_batches: list[dict[str, torch.Tensor]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batches as one (n x mb, T) batch of inputs and one of targets."""
    key = "targets" if "targets" in micro_batches[0] else "labels"
    return (torch.cat([b["input_ids"] for b in micro_batches]).to(device),
            torch.cat([b[key] for b in micro_batches]).to(device))


def _recompute_policy(policies: list[str], n_layer: int) -> str | list[str]:
    """['selective'] -> 'selective'; ['full', 'selective'] -> per-layer list (checked by config.check)."""
    return policies[0] if len(policies) == 1 else list(policies)


def model_vocab(cfg: TrainConfig, tokenizer_size: int) -> int:
    """Rows of the model's embedding: the tokenizer's size while ``model.vocab_size`` keeps its
    built-in default, else ``model.vocab_size`` (padding: ids past the tokenizer are never inputs
    nor targets) when it holds every id; ValueError naming the field when it cannot."""
    from largebatch.models.config import ModelConfig

    wanted = cfg.model.vocab_size
    if wanted == ModelConfig.vocab_size or wanted == tokenizer_size:
        return tokenizer_size
    if wanted < tokenizer_size:
        from largebatch.data.corpus import is_token_array_path

        if not cfg.data.mixture and cfg.data.tokenizer_file is None and is_token_array_path(cfg.data.corpus):
            raise ValueError(f"model.vocab_size={wanted} is smaller than the {tokenizer_size} ids data.vocab_size "
                             "gives the token array (it has no tokenizer): set data.vocab_size instead, above the "
                             "array's largest id, and leave model.vocab_size out (or set it >= data.vocab_size to "
                             "pad the embedding)")
        raise ValueError(f"model.vocab_size={wanted} is smaller than the tokenizer's {tokenizer_size} ids: "
                         f"leave model.vocab_size out (the trainer takes the tokenizer's size) or set it "
                         f">= {tokenizer_size} to pad the embedding")
    return wanted


def model_separator(cfg: TrainConfig, own: tuple[str, int] | None,
                    special: dict[str, int] | None = None) -> int | None:
    """``model.separator_id`` as the run uses it: None without model.document_mask; else the id
    that starts each document. ``own``: the run's tokenizer's separator (token, id), None without a
    tokenizer. A text corpus's streams put it before every document, so that is the id (another
    given is refused); token arrays take model.separator_id, else their data.tokenizer_file's
    separator; ValueError naming the field when neither is there. ``special``: the tokenizer's
    special tokens (name -> id), which masked-LM corruption never touches; a masked model's separator
    must be one of them, or corruption would hide separators from the mask and write the id where
    none was, and not [MASK], which corruption writes."""
    from largebatch.data.corpus import is_token_array_path
    from largebatch.data.tokenizer import DOCUMENT_SEPARATORS, masked_lm_ids

    if not cfg.model.document_mask:
        return None
    given = cfg.model.separator_id
    if not cfg.data.mixture and is_token_array_path(cfg.data.corpus):
        if given is not None:
            special = special or {}
            masked = model_spec(cfg.model.kind).objective == "masked"
            if masked and (given not in special.values() or given == masked_lm_ids(special).get("mask")):
                theirs = f" (its separator: {own[1]})" if own else ""
                raise ValueError(f"model.separator_id={given} with model.kind={cfg.model.kind!r}: masked-LM "
                                 "corruption writes [MASK] and replaces any token but the tokenizer's special "
                                 "ones, so this id would be masked away (merging documents) or written where "
                                 f"no document starts; give another special token of data.tokenizer_file{theirs}")
            return given
        if own is None:
            where = (f"data.tokenizer_file={cfg.data.tokenizer_file!r} has none of {', '.join(DOCUMENT_SEPARATORS)}"
                     if cfg.data.tokenizer_file else "token arrays without a tokenizer")
            raise ValueError(f"model.document_mask=true on data.corpus={cfg.data.corpus!r}, {where}: give "
                             "model.separator_id, the id their writer put between documents (GPT-2's "
                             "<|endoftext|>: 50256)" + ("" if cfg.data.tokenizer_file else
                                                         ", or data.tokenizer_file to take its separator"))
        return own[1]
    if given is not None and given != own[1]:
        raise ValueError(f"model.separator_id={given}: the corpus's token streams start every document with "
                         f"{own[0]!r}, id {own[1]} in the run's tokenizer; leave model.separator_id out (the "
                         "trainer takes that id)")
    return own[1]


SEPARATOR_PROBE_TOKENS = 2**20


def separator_absent(dataset, separator: int) -> str | None:
    """A warning when ``separator`` is nowhere in the first SEPARATOR_PROBE_TOKENS of the training
    stream (a wrong model.separator_id on token arrays: every sequence would be one document; a
    stream the trainer wrote starts each document with it); None when it is there, or for a dataset
    without one stream (a mixture)."""
    tokens = getattr(dataset, "tokens", None)
    if tokens is None or not isinstance(tokens, np.memmap | np.ndarray):
        return None
    head = np.asarray(tokens[:SEPARATOR_PROBE_TOKENS])
    if len(head) and not (head == separator).any():
        return (f"model.separator_id={separator} does not occur in the first {len(head):,} training tokens: "
                "document masking then sees one document per sequence; check the id the token arrays put "
                "between documents")
    return None


def _with_vocab(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    from largebatch.train.config import replace_section

    return replace_section(cfg, "model", vocab_size=vocab_size)


def _names(names: list[str], shown: int = 4) -> str:
    """A list of document names for a one-line message: the first ``shown``, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return "[" + ", ".join(names[:shown]) + more + "]"
