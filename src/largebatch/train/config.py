"""The trainer's configuration: one TOML file, one table per component.

    [model]     largebatch.models.ModelConfig      -- architecture (GPT or BERT)
    [data]      largebatch.data.DataConfig         -- corpus, tokenizer, masking
    [schedule]  largebatch.schedules.ScheduleConfig -- LR and batch size against tokens (Seesaw, ...)
    [optim]     OptimConfig (below)                -- LAMB / LANS / LARS / AdamW
    [run]       RunConfig (below)                  -- budget, precision, recompute, logging, checkpoints
    [parallel]  largebatch.parallel.ParallelConfig -- data / tensor / sequence parallel (torchrun)

Every field can be overridden on the command line as ``--table.field=value``. The resolved config
is written to ``RUN_DIR/config.toml`` and is what ``--resume`` reads back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from largebatch.arguments import time_limit_value, token_count
from largebatch.checkpoint.files import atomic_write_text
from largebatch.data import DataConfig
from largebatch.data.dataset import BERTDataset
from largebatch.models import ModelConfig, model_spec
from largebatch.models.config import unread_rope_fields
from largebatch.models.flops import RecomputePolicy
from largebatch.optim.groups import ADAPT_DEFAULT, CATEGORIES
from largebatch.parallel.config import ParallelConfig, check_tp_divides
from largebatch.parallel.mesh import resolve_sizes
from largebatch.parallel.pipeline import check_micro_batches, stage_layers
from largebatch.schedules import ScheduleConfig
from largebatch.train.loss_scale import GROWTH_STEPS as LOSS_SCALE_GROWTH_STEPS
from largebatch.train.loss_scale import LARGEST as LOSS_SCALE_LARGEST
from largebatch.train.loss_scale import START as LOSS_SCALE_START
from largebatch.train.optimizer import OPTIMIZERS
from largebatch.train.phases import PhaseConfig, phases_total, resolve_phases, with_phase_total
from largebatch.train.profile import profile_windows
from largebatch.typed_config import (
    ConfigError,
    check_fields,
    check_off,
    dump_toml,
    from_dict,
    load_toml,
    set_dotted,
    to_dict,
)


@dataclass
class OptimConfig:
    name: str = field(default="lamb", metadata={"choices": OPTIMIZERS})
    """Optimizer, by name from largebatch.train.optimizer.OPTIMIZERS (the shipped ones below; add
    one with register_optimizer)."""
    weight_decay: float = 0.01
    """Decoupled weight decay, on weight matrices and embeddings; biases and norm weights get none
    (largebatch.optim.param_groups, which also decides which tensors get a trust ratio)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam-style moment decay rates (LAMB, LANS, AdamW)."""
    eps: float = 1e-6
    """Added to sqrt(v) (LAMB, LANS, AdamW) or to the LARS trust-ratio denominator."""
    momentum: float = 0.9
    """LARS momentum."""
    trust_coefficient: float = 0.001
    """LARS trust coefficient (the paper's eta)."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value before the optimizer step (None: no clipping;
    the gradient norm is logged either way). Explicit here because apex/timm LAMB do it silently."""
    fused: bool = False
    """Fused per-tensor kernels (torch.compile), like torch.optim.AdamW(fused=True)."""
    adapt: tuple[str, ...] | None = None
    """Parameter categories whose step is scaled by the trust ratio (weight, embedding, bias, norm;
    see largebatch.optim.param_groups); the rest take the plain step at the scheduled LR. None: the
    optimizer's default -- LAMB and LANS: weight and embedding (the LAMB authors' BERT recipe);
    LARS: all four, as in its Algorithm 1 (a bias or norm weight left out would take plain SGD at a
    LARS-sized LR, ~1-30; measured in docs/optim.md). Not used by AdamW."""
    no_decay_lr_mult: float = 1.0
    """LR multiplier of the parameter groups without weight decay (biases, norms): each group's LR
    is the scheduled LR times its ``lr_mult``, so the ratio survives every schedule and a resume."""
    unadapted_lr_mult: float = 1.0
    """LR multiplier of the groups outside ``adapt`` (no trust ratio): e.g. 0.01 under LARS, whose
    scheduled LR (~1-30) is sized for trust-ratio steps. Multiplies with no_decay_lr_mult."""
    log_trust_ratios: bool = True
    """Log min / median / max trust ratio on each logged step (kept on the device every step; read by
    the host only when a step logs)."""

    def __post_init__(self):
        check_fields(self, "optim")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay = {self.weight_decay}: must be >= 0")
        # the optimizers' own ranges, checked here so that --check reports them (the optimizer, built
        # after the tokenizer, would name param_groups[0] instead of the [optim] field)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas = {list(self.betas)}: each must lie in [0, 1), e.g. [0.9, 0.999]")
        if not (self.eps > 0 or (self.eps == 0 and self.name == "adamw")):
            raise ValueError(f"optim.eps = {self.eps}: must be > 0 (e.g. 1e-6)")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optim.momentum = {self.momentum}: must lie in [0, 1), e.g. 0.9")
        if not self.trust_coefficient > 0:
            raise ValueError(f"optim.trust_coefficient = {self.trust_coefficient}: must be > 0 (LARS's eta, "
                             "e.g. 0.001)")
        check_off("optim.grad_clip", self.grad_clip)
        for name in ("no_decay_lr_mult", "unadapted_lr_mult"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"optim.{name} = {value!r}: must be a finite number > 0 (1: the "
                                 f"scheduled LR)")
        spec = OPTIMIZERS.get(self.name)  # an unknown name is refused by from_dict, naming the choices
        adaptive = ", ".join(n for n, s in OPTIMIZERS.items() if s.adapt_default is not None)
        if spec is not None and spec.adapt_default is None and self.unadapted_lr_mult != 1:
            raise ValueError(f"optim.unadapted_lr_mult = {self.unadapted_lr_mult}: {spec.title} has no "
                             f"trust ratio; use optim.no_decay_lr_mult, or choose {adaptive}")
        if self.adapt is not None:
            unknown = [c for c in self.adapt if c not in CATEGORIES]
            if unknown or len(set(self.adapt)) != len(self.adapt):
                raise ValueError(f"optim.adapt = {list(self.adapt)}: expected distinct categories from "
                                 f"{', '.join(CATEGORIES)} (unknown: {', '.join(map(repr, unknown)) or 'none'})")
            if spec is not None and spec.adapt_default is None:
                raise ValueError(f"optim.adapt = {list(self.adapt)}: {spec.title} has no trust ratio; "
                                 f"remove optim.adapt or choose {adaptive}")

    def adapted_categories(self) -> tuple[str, ...]:
        """``adapt``, or the optimizer's default when it is None."""
        if self.adapt is not None:
            return tuple(self.adapt)
        default = OPTIMIZERS[self.name].adapt_default
        # an optimizer without a trust ratio ignores the groups' 'adapt'; they split as LAMB's do
        return ADAPT_DEFAULT if default is None else default


@dataclass
class RunConfig:
    out_dir: str = "runs/{time}-{kind}"
    """Run directory; '{time}' and '{kind}' are filled in ('{{' and '}}' are literal braces) and a
    leading '~' is the home directory. Holds config.toml (which records a run.out_dir that has no
    {time} as the absolute path it named where the run started, and one with {time} as written),
    metrics.jsonl, tensorboard/, PNG plots, summary.json and checkpoints/."""
    total_tokens: int = field(default=600_000, metadata={"parse": token_count})
    """Training budget in tokens (sequences x sequence length). Schedules are keyed on it. Token
    counts here and in the fields below take 2e9, 300M, 1.5B or 600_000."""
    micro_batch: int = 8
    """Sequences per forward/backward. A step's batch (from the schedule) is accumulated from
    batch_size / (micro_batch x data-parallel ranks) micro-batches."""
    dtype: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata={"refused": {
        **dict.fromkeys(("float16", "half"), "write 'fp16' (autocast with dynamic loss scaling)"),
        **dict.fromkeys(("bfloat16",), "write 'bf16'"), **dict.fromkeys(("float32", "float"), "write 'fp32'")}})
    """Compute precision: fp32, bf16 autocast, or fp16 autocast with dynamic loss scaling (for GPUs
    without bf16, e.g. V100 and T4). The parameters, their gradients and the optimizer's math stay
    fp32 in all three (under FSDP2 the all-gathered parameters are in the run's dtype, and the
    gradients are reduced in fp32).
    fp16 multiplies the loss by a scale (run.loss_scale) before backward so that small gradients
    survive fp16's range, divides the gradients by it before clipping and the optimizer, skips a step
    whose gradients overflowed and halves the scale, and doubles it after
    run.loss_scale_growth_steps steps in a row without overflow (largebatch.train.loss_scale)."""
    loss_scale: float = LOSS_SCALE_START
    """fp16 only: the loss scale the run starts from (2**16, as torch.amp.GradScaler). Overflowing
    steps halve it, so a high start costs a few skipped steps at the start, not accuracy. From 1 to
    2**127; a power of two multiplies exactly. Changed on --resume (from the start the run was given),
    the scale starts again there."""
    loss_scale_growth_steps: int = LOSS_SCALE_GROWTH_STEPS
    """fp16 only: double the loss scale after this many consecutive steps without overflow."""
    compile: bool = False
    """torch.compile the model (about a minute of compilation before the first step)."""
    recompute: list[RecomputePolicy] = field(default_factory=lambda: ["none"])
    """Activation recomputation: one policy for every layer (["selective"]) or exactly one per layer
    (["full", "full", "selective", "selective"] for 4 layers); on the command line also
    comma-separated (--run.recompute=full,full,selective,selective). See largebatch.memory."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    seed: int = 1337
    """Seed for initialisation and dropout (the data order and BERT masks follow data.seed)."""
    eval_every_tokens: int | None = field(default=None, metadata={"parse": token_count})
    """Validation interval in tokens (None: ten evaluations over the run)."""
    eval_tokens: int = field(default=32_768, metadata={"parse": token_count})
    """Validation tokens per evaluation (a fixed slice of the validation split)."""
    eval_micro_batch: int | None = None
    """Sequences per evaluation forward (None: the phase's training micro-batch). An evaluation
    keeps no activations for a backward, so a larger one usually fits, and on small models it runs
    the same tokens 3-4x faster (benchmarks/eval_batch.py). The loss is the same mean over the same tokens; only the
    float32 summation within a forward changes (last digits)."""
    log_every_steps: int = 1
    """Write a metrics record every this many optimizer steps."""
    checkpoint_every_tokens: int | None = field(default=None, metadata={"parse": token_count})
    """Checkpoint interval in tokens (None: none by tokens; see checkpoint_every_seconds)."""
    checkpoint_every_seconds: float | None = 600.0
    """Also checkpoint when this many seconds of wall time passed since the last checkpoint
    (None: none by time). Under torchrun the ranks agree on it after every step. SIGTERM and SIGINT
    always checkpoint before the run exits (largebatch.train.stopping)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    async_checkpoint: bool = False
    """Write checkpoints in the background (torchtitan's async checkpointing): a save waits only for
    the state's copy to host memory, and the file is written while training goes on, one at a time.
    A checkpoint is in place once written, as without it; a hard kill during the write loses that
    one (the one before is intact); a stop by a signal and the run's end wait for it. Needs host
    memory for one more copy of the model and optimizer state (per process: its shards)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in this invocation and checkpoint (None: run to the end
    of the budget). For time-limited jobs: continue later with --resume, which runs to the end
    unless given --run.max_steps again."""
    target_val_loss: float | None = None
    """Time to a target: the first evaluation whose validation loss is at or below this value is
    recorded -- its step, tokens, optimizer-step seconds and wall-clock seconds (summed over the run's
    launches) -- in the log, its metrics record and summary.json's ``target`` (the measure MLPerf
    takes of a training recipe, and the LANS paper's "BERT in 54 minutes"). Evaluations set the
    resolution (run.eval_every_tokens). None: nothing recorded. With stop_at_target the run ends there."""
    stop_at_target: bool = False
    """End the run at the first evaluation that reaches run.target_val_loss, as at the end of its
    token budget: final checkpoint, summary.json (which says so) and plots; the same command on the
    directory then finds the run ended. Without it the run goes on to its budget."""
    time_limit: float | str | None = field(default=None, metadata={"parse": time_limit_value})
    """This launch's wall-clock limit: the run stops with a checkpoint (exit 0, as run.max_steps;
    the same command continues it) while the time left still holds its next step and a
    checkpoint, as measured in this launch (largebatch.train.stopping.TimeLimit). A duration from
    the trainer's start -- seconds (5400), '90m', '3h50m', '1d12h', or Slurm's '3:50:00' and
    '1-12:00:00' -- or "slurm": the end of the Slurm job it runs in (SLURM_JOB_END_TIME). None: no
    limit. It may change when a run continues."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss either stops the run (naming the step and the last good checkpoint) or
    skips that step's update."""
    max_skipped_steps: int | None = 10
    """With on_nonfinite='skip': stop the run (exit 1, naming the step, the count and the last good
    checkpoint) after this many consecutive skipped steps. None: never give up. In an fp16 run the
    steps skipped for overflow (run.dtype) neither count nor start the count again."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights, updated after every optimizer step with
    this decay d (e.g. 0.999: an average over the last ~1/(1-d) = 1,000 steps), bias-corrected so
    that it is the weighted mean of the weights after each step so far (weights d^age; no pull
    toward the initial weights). Every evaluation also reports the average's validation loss
    (val_loss_ema); checkpoints keep it, and ``largebatch export --ema`` / ``largebatch finetune
    --ema`` use it. Costs one more copy of the parameters (in their dtype, sharded as they are).
    None: off. It may change when a run continues (the average then starts from the resumed
    weights where the checkpoint has none). See largebatch.train.ema."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU (e.g. 989e12 for H100 bf16). None: measured here with a
    matmul in the run's dtype, and printed as such."""
    sample_tokens: int = 80
    """Tokens to generate from the GPT at the end of the run (0: none); the sample ends early at the
    document separator. `largebatch generate RUN_DIR --prompt P` (P: sample_prompt) draws it again."""
    sample_prompt: str = "KING HENRY:"
    """Prompt for the generated sample."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    wandb: bool = False
    """Log to Weights & Biases as well (rank 0; needs ``pip install wandb``, or the ``largebatch[wandb]``
    extra): each record of metrics.jsonl at its optimizer step, the config, and summary.json's numbers;
    a resume continues the same W&B run (its id is kept in RUN_DIR/wandb-run.json), and a stop by a
    signal marks it preempted. W&B's environment variables apply: ``WANDB_API_KEY`` (or ``wandb
    login``), ``WANDB_ENTITY``, ``WANDB_MODE=offline`` (the run is written to RUN_DIR/wandb, uploaded
    later with ``wandb sync``). See docs/training.md, "Weights & Biases"."""
    wandb_project: str | None = None
    """The W&B project of a new run (None: ``WANDB_PROJECT``, else "largebatch"); a resume continues
    its run in the project it was started in."""
    plots: bool = True
    """Write loss.png and schedule.png into RUN_DIR at the end of the run. They cost seconds of
    matplotlib, which dominates a tiny run; largebatch.train.plots.plot_run(RUN_DIR) draws them
    later from metrics.jsonl."""
    progress: Literal["auto", "on", "off"] = "auto"
    """Progress bar in tokens on stderr ('auto': only on a terminal)."""
    profile_steps: str | int | None = None
    """Record these optimizer steps with torch.profiler: "10-12" (steps 10 to 12, numbered as in
    metrics.jsonl), "10", or several ranges ("10-12,500-501"). Each rank writes the timeline to
    RUN_DIR/profile/steps_10-12/rank{R}.pt.trace.json.gz (Perfetto, chrome://tracing or
    TensorBoard open it) and its operators by own time to rank{R}.txt; rank 0 logs the top ones.
    Profiled steps run slower (their metrics records say "profiled": true). See
    largebatch.train.profile."""
    profile_memory: bool = False
    """With profile_steps: record the allocations too (memory columns in rank{R}.txt) and, on CUDA,
    the allocator's history as rank{R}.memory.pickle (PyTorch's memory viewer opens it)."""

    @property
    def half_precision(self) -> bool:
        """A 16-bit autocast (bf16 or fp16): 2-byte activations in the memory estimates."""
        return self.dtype in ("bf16", "fp16")

    @property
    def takes_steps_back(self) -> bool:
        """Whether a step's update may be taken back on the device (run.on_nonfinite = 'skip', an fp16
        overflow: largebatch.train.skip); LAMB, LANS and LARS then keep their step counts there."""
        return self.on_nonfinite == "skip" or self.dtype == "fp16"

    def __post_init__(self):
        check_fields(self, "run")
        for name in ("total_tokens", "micro_batch", "eval_tokens", "log_every_steps",
                     "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"run.{name} = {getattr(self, name)}: must be > 0")
        if self.total_tokens > 2**53:  # schedules are float functions of the token count
            raise ValueError(f"run.total_tokens = {self.total_tokens}: at most 2**53 (~9.0e15), the largest "
                             "count the schedules' float arithmetic keeps exact")
        for name in ("eval_every_tokens", "checkpoint_every_tokens", "checkpoint_every_seconds",
                     "max_steps", "max_skipped_steps", "peak_flops"):
            check_off(f"run.{name}", getattr(self, name))
        if isinstance(self.time_limit, str) and self.time_limit != "slurm":
            object.__setattr__(self, "time_limit", time_limit_value(self.time_limit))
        if self.time_limit is not None and self.time_limit != "slurm" and not (
                isinstance(self.time_limit, float) and math.isfinite(self.time_limit) and self.time_limit > 0):
            raise ValueError(f"run.time_limit = {self.time_limit!r}: must be a positive duration (5400, '90m', "
                             "'3h50m') or 'slurm', or none for no limit")
        if self.target_val_loss is not None and not (math.isfinite(self.target_val_loss) and self.target_val_loss > 0):
            raise ValueError(f"run.target_val_loss = {self.target_val_loss}: must be a positive finite loss in nats "
                             "per token (e.g. 3.5), or none to record no target")
        if self.stop_at_target and self.target_val_loss is None:
            raise ValueError("run.stop_at_target = true ends the run at run.target_val_loss, and it is unset: set "
                             "run.target_val_loss too (e.g. 3.5)")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"run.ema_decay = {self.ema_decay}: must lie strictly between 0 and 1 (e.g. "
                             "0.999, an average over ~1,000 steps), or none for no weight average")
        if self.eval_micro_batch is not None and self.eval_micro_batch <= 0:
            raise ValueError(f"run.eval_micro_batch = {self.eval_micro_batch}: must be > 0, or unset "
                             "(the training micro-batch)")
        if self.sample_tokens < 0:
            raise ValueError(f"run.sample_tokens = {self.sample_tokens}: must be >= 0 (0: no sample)")
        if self.sample_tokens and not self.sample_prompt:
            raise ValueError("run.sample_prompt = '': the end-of-run sample continues a prompt; give one "
                             "(e.g. 'KING HENRY:'), or set run.sample_tokens = 0 for no sample")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"run.seed = {self.seed}: must lie in [0, 2**32 - 1] (numpy's and torch's "
                             "generators take it)")
        if not (isinstance(self.loss_scale, float) and 1.0 <= self.loss_scale <= LOSS_SCALE_LARGEST):
            raise ValueError(f"run.loss_scale = {self.loss_scale!r}: must be a number from 1 to 2**127 (fp32's "
                             "largest power of two; fp16's starting loss scale, 65536 by default)")
        if self.loss_scale_growth_steps < 1:
            raise ValueError(f"run.loss_scale_growth_steps = {self.loss_scale_growth_steps}: must be >= 1 (steps "
                             "without overflow before fp16's loss scale doubles; 2000 by default)")
        defaults = {"loss_scale": LOSS_SCALE_START, "loss_scale_growth_steps": LOSS_SCALE_GROWTH_STEPS}
        unread = [f"run.{name} = {getattr(self, name)!r}" for name, default in defaults.items()
                  if getattr(self, name) != default]
        if self.dtype != "fp16" and unread:
            raise ValueError(f"{' and '.join(unread)}: read by fp16 runs only, and run.dtype = {self.dtype!r}: "
                             "set run.dtype = 'fp16', or set them back to their defaults ("
                             + ", ".join(f"run.{name} = {value:g}" for name, value in defaults.items()) + ")")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"run.device = {self.device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        _check_out_dir_template(self.out_dir)
        try:
            profile_windows(self.profile_steps)
        except ValueError as exc:
            raise ValueError(f"run.profile_steps = {self.profile_steps!r}: {exc}") from None
        if self.profile_memory and self.profile_steps is None:
            raise ValueError("run.profile_memory = true records allocations in profiled steps, and "
                             "run.profile_steps names none: set run.profile_steps too (e.g. '10-12')")
        if self.wandb_project is not None and (not self.wandb_project.strip() or len(self.wandb_project) > 128
                                               or any(c in self.wandb_project for c in "/\\#?%:")):
            raise ValueError(f"run.wandb_project = {self.wandb_project!r}: W&B takes 1 to 128 characters without "
                             "/ \\ # ? % or : (e.g. 'gpt-pretraining'); or leave it unset for WANDB_PROJECT or "
                             "'largebatch'")


OUT_DIR_FIELDS = ("time", "kind")  # what run.out_dir may hold in braces


def out_dir_fields(out_dir: str) -> set[str]:
    """The placeholders ``run.out_dir`` names ({{ and }} are literal braces, not placeholders)."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(out_dir) if name is not None}
    except ValueError:  # a single brace: refused by the config's check
        return set()


def run_dir_of(out_dir: str, kind: str, time: str = "") -> Path:
    """The directory ``run.out_dir`` names: its placeholders filled in, a leading ``~`` expanded (as
    data.corpus's and data.cache_dir's are; it made a directory named ``~`` in the working one)."""
    return Path(out_dir.format(time=time, kind=kind)).expanduser()


def out_dir_naming(run_dir: str | Path) -> str:
    """A run.out_dir naming ``run_dir`` alone: its absolute path (not abspath's, which takes
    "link/.." away by its text), braces written literally."""
    return str(Path(run_dir).absolute()).replace("{", "{{").replace("}", "}}")


def _check_out_dir_template(out_dir: str) -> None:
    """run.out_dir may name only {time} and {kind}; anything else in braces is refused up front."""
    fix = "use only {time} and {kind} in braces (write {{ and }} for literal braces)"
    if not out_dir.strip():
        raise ValueError("run.out_dir = '': give a directory, e.g. runs/{time}-{kind}")
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(out_dir)
                  if name is not None]
    except ValueError as exc:  # a single '{' or '}'
        raise ValueError(f"run.out_dir = {out_dir!r}: {exc}; {fix}") from None
    for name, spec, conv in fields:
        if name not in OUT_DIR_FIELDS or spec or conv:
            raise ValueError(f"run.out_dir = {out_dir!r}: unknown placeholder {{{name}}}; {fix}")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model (architecture and size)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus, tokenizer and masking."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning rate and batch size against tokens."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    run: RunConfig = field(default_factory=RunConfig)
    """Budget, precision, recomputation, logging and checkpoints."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data / tensor / sequence parallel sizes, used when launched with torchrun."""
    phases: list[PhaseConfig] = field(default_factory=list)
    """Training phases ([[phases]] tables, largebatch.train.phases): each with its own seq_len (<=
    model.seq_len), total_tokens, micro_batch, [schedule] overrides and optimizer_state. Empty: one
    phase at model.seq_len with [schedule] and run.total_tokens. With phases the run's budget is
    their sum."""


KIND_OBJECTIVE = {"gpt": "causal language model", "bert": "masked language model"}


def _refuse_unread_rope_fields(model: ModelConfig, given: set[str]) -> None:
    """A rope scaling factor the user set (``given``) where model.rope_scaling -- the user's, or with
    model.init_from the directory's -- does not read it: a --model.rope_factor=32 without rope_scaling
    trained unscaled, silently. Values equal to the defaults pass (a copy of a run's config.toml
    writes every field)."""
    unread = [name for name in unread_rope_fields(model) if f"model.{name}" in given]
    if unread:
        name = unread[0]
        readers = '"linear" or "llama3"' if name == "rope_factor" else '"llama3"'
        raise ConfigError(f"model.{name}={getattr(model, name)!r} with model.rope_scaling={model.rope_scaling!r}: "
                          f"it is read with rope_scaling {readers} only, so it would change nothing; set "
                          f"model.rope_scaling, or leave model.{name} out")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                resolve_init: bool = True, warn: Callable[[str], None] | None = None,
                run_dir: str | Path | None = None) -> TrainConfig:
    """Defaults <- TOML file <- dotted overrides, validated (ConfigError on any problem).

    With ``model.init_from`` the model's shape fields and data.tokenizer_file come from that
    directory (largebatch.train.hf_import); a field the user's file or the overrides set
    otherwise is refused. A shipped recipe's model fields are defaults, not requests: they give
    way, and a recipe whose model.kind gives way (a BERT recipe from a GPT directory) is named in a
    one-line note to ``warn`` (default: stderr). ``resolve_init=False`` (a ``--resume``, whose saved
    config is already resolved) skips it. ``run_dir``: the run it continues (``--resume``; else
    run.out_dir), whose checkpoints' replica count sets the batch granularity checked (``check``)."""
    tree: dict[str, Any] = load_toml(path) if path else {}
    given = set() if path is None or _is_shipped(path) else {
        f"{table}.{name}" for table, fields in tree.items() if isinstance(fields, dict) for name in fields}
    for key, value in (overrides or {}).items():
        if "." not in key:
            raise ConfigError(f"override '--{key}' must name a table and a field, e.g. --run.{key}")
        set_dotted(tree, key, value)
        given.add(key)
    cfg = from_dict(TrainConfig, tree)
    if cfg.phases and "run.total_tokens" in given:  # (check() can tell a given budget from the default
        check_phases_budget(cfg.run.total_tokens, cfg.phases)  # only when it differs from it)
    if cfg.model.init_from and resolve_init:
        from largebatch.train.hf_import import context_note, dropout_note, rope_note, window_note
        from largebatch.train.hf_import import resolve_init as resolve

        recipe_kind = tree.get("model", {}).get("kind")  # set by a shipped recipe (a user's must agree)
        cfg = resolve(cfg, given)
        for note in (dropout_note(cfg, given), context_note(cfg, given), rope_note(cfg, given),
                     window_note(cfg, given)):
            if note is not None:
                (warn or (lambda line: print(line, file=sys.stderr)))(note)
        if recipe_kind is not None and recipe_kind != cfg.model.kind:
            kind = cfg.model.kind
            (warn or (lambda line: print(line, file=sys.stderr)))(
                f"note: the recipe {Path(path).name} trains a {recipe_kind!r}, but model.init_from="
                f"{cfg.model.init_from!r} holds a {kind!r} (config.json): this run trains that {kind} "
                f"({KIND_OBJECTIVE.get(kind, 'its own objective')}) with the recipe's other settings")
    if resolve_init:  # (a resume's saved config is checked as it was saved; with init_from, the directory's scaling)
        _refuse_unread_rope_fields(cfg.model, given)
    return check(cfg, run_dir)


def _is_shipped(path: str | Path) -> bool:
    return Path(path).resolve().parent == (Path(__file__).resolve().parent.parent / "configs")


def batch_replicas(cfg: TrainConfig, dp: int, run_dir: str | Path | None = None) -> int:
    """The replica count a run's batches are multiples of (x micro_batch): this launch's ``dp`` for a
    new run; for one that continues (``run_dir``, else run.out_dir, holding checkpoints) the count its
    checkpoints were written with, which the trainer keeps (a one-process run of batch 8 and
    micro_batch 8 continues on 2 replicas of 4 sequences each, though 8 x 2 does not divide 8)."""
    if run_dir is None:
        if "time" in out_dir_fields(cfg.run.out_dir):
            return dp
        try:
            run_dir = run_dir_of(cfg.run.out_dir, cfg.model.kind)
        except (KeyError, IndexError, ValueError):
            return dp
    from largebatch.checkpoint.files import checkpoint_dp_size

    return checkpoint_dp_size(run_dir) or dp


def check_phases_budget(total_tokens: int, phases: list) -> None:
    """ConfigError unless a run.total_tokens given beside [[phases]] is their sum (the run's budget)."""
    total = phases_total(phases)
    if total_tokens != total:
        raise ConfigError(f"run.total_tokens = {total_tokens} but the phases sum to {total}: with [[phases]] "
                          "the budget is their sum; remove run.total_tokens")


def check(cfg: TrainConfig, run_dir: str | Path | None = None) -> TrainConfig:
    """Cross-table checks that need no data or model: fail in a second, not after setup. ``run_dir``:
    see ``load_config``."""
    from largebatch.models.config import hf_model_type_problem

    # (model.init_from's architecture sets the other fields: only the type's own fix can work)
    if (problem := hf_model_type_problem(cfg.model, fixed=bool(cfg.model.init_from))) is not None:
        raise ConfigError(problem)
    if cfg.phases:
        if cfg.run.total_tokens != RunConfig.total_tokens:
            check_phases_budget(cfg.run.total_tokens, cfg.phases)
        cfg = dataclasses.replace(cfg, run=with_phase_total(cfg.run, cfg.phases))
    par = cfg.parallel
    try:
        if par.tp > 1:  # what the tensor-parallel ranks split (the vocabulary: preflight, which knows it);
            # before the launch's size, so that a layout that can never run says so before "launch N"
            check_tp_divides(par.tp, "model.n_head", cfg.model.n_head)
            if cfg.model.n_kv_head is not None:  # grouped-query attention: k and v split by whole heads
                check_tp_divides(par.tp, "model.n_kv_head", cfg.model.n_kv_head)
            check_tp_divides(par.tp, "model.ffn_hidden (the MLP width)", cfg.model.ffn)
        pp, dp, _ = resolve_sizes(par, int(os.environ.get("WORLD_SIZE", "1")))
        granularity = batch_replicas(cfg, dp, run_dir)  # a continued run's own (its checkpoints')
        for phase in resolve_phases(cfg.phases, cfg.schedule, cfg.model.seq_len, cfg.run.total_tokens,
                                    cfg.run.micro_batch, init_from=cfg.model.init_from,
                                    rotary=cfg.model.position == "rope"):
            where = f"phases[{phase.index}]: " if cfg.phases else ""
            if phase.seq_len < BERTDataset.MIN_SEQ_LEN and model_spec(cfg.model.kind).objective == "masked":
                field = f"phases[{phase.index}].seq_len" if cfg.phases else "model.seq_len"
                raise ConfigError(f"{field} = {phase.seq_len}: too short for a masked-LM sample ([CLS] text "
                                  f"[SEP]); use >= {BERTDataset.MIN_SEQ_LEN}")
            if par.sequence_parallel:
                check_tp_divides(par.tp, f"phases[{phase.index}].seq_len" if cfg.phases else "model.seq_len",
                                 phase.seq_len)
            if cfg.phases and (problem := phase.schedule.unread_fields_problem(
                    cfg.phases[phase.index].schedule, f"phases[{phase.index}].schedule", "phase")) is not None:
                raise ValueError(problem)  # (a field the phase's own table sets; inherited ones may serve another)
            multiple = phase.schedule.noise_scale_multiple
            if multiple is not None and dp > 1 and par.dp_mode != "ddp":
                raise ValueError(
                    f"{where}schedule.noise_scale_multiple = {multiple}: the adaptive Seesaw cap needs the "
                    f"gradient noise scale, which is not measured with parallel.dp_mode = {par.dp_mode!r} over "
                    f"{dp} replicas (FSDP2 reduces the gradients inside its own collectives); use "
                    f"parallel.dp_mode = 'ddp' (tp = 1) or one replica, or leave noise_scale_multiple out")
            try:
                schedule = phase.schedule.build(total_tokens=phase.total_tokens, seq_len=phase.seq_len,
                                                micro_batch=phase.micro_batch, dp_size=granularity)
                first = schedule.step_batch(0, phase.seq_len, dp) if multiple is not None and dp == 1 else 0
                if first and first <= phase.micro_batch:
                    field = f"phases[{phase.index}].micro_batch" if cfg.phases else "run.micro_batch"
                    raise ValueError(
                        f"schedule.noise_scale_multiple = {multiple}: the adaptive Seesaw cap reads the "
                        f"gradient noise scale, which one replica measures from two or more micro-batches "
                        f"per step (the first one's gradient against the step's); the starting batch of "
                        f"{first} is one micro-batch ({field} = {phase.micro_batch}), so the first "
                        f"milestone would grow the batch with no estimate to cap it; use a {field} below "
                        f"{first} (e.g. {max(1, first // 2)}), or leave noise_scale_multiple out")
                first_tokens = schedule.batch_size(0) * phase.seq_len
                if phase.total_tokens < first_tokens:  # one cut-short step at the warmup's first LR (0)
                    field = f"phases[{phase.index}].total_tokens" if cfg.phases else "run.total_tokens"
                    raise ValueError(
                        f"{field} = {phase.total_tokens:,} is less than one optimizer step ({schedule.batch_size(0)} "
                        f"sequences x {phase.seq_len} tokens = {first_tokens:,}): the run would take a single "
                        f"cut-short step; give at least {first_tokens:,} tokens, or a smaller batch")
                if pp > 1:
                    check_pipeline(cfg, schedule, dp, phase.total_tokens, phase.micro_batch)
            except ValueError as exc:  # (a message that names the phase's field already is not prefixed)
                raise ValueError(f"{'' if str(exc).startswith('phases[') else where}{exc}") from exc
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not cfg.phases and (problem := cfg.schedule.unread_fields_problem()) is not None:  # (a phase may
        raise ConfigError(problem)  # change the policy and inherit the others' fields: not checked there)
    policies = cfg.run.recompute
    if len(policies) not in (1, cfg.model.n_layer):
        raise ConfigError(f"run.recompute = {list(policies)!r}: {len(policies)} per-layer "
                          f"policies for a model of {cfg.model.n_layer} layers; give one policy, "
                          f"or exactly {cfg.model.n_layer}")
    return cfg


def check_pipeline(cfg: TrainConfig, schedule, dp: int, total_tokens: int, micro_batch: int) -> None:
    """The pipeline layout against the model and the batch schedule (ValueError, one line)."""
    par = cfg.parallel
    if cfg.model.tie_embeddings:
        raise ValueError(f"model.tie_embeddings = true with parallel.pp = {par.pp}: the token embedding (first "
                         "stage) and the output layer (last stage) sit on different ranks; set "
                         "model.tie_embeddings = false")
    stage_layers(cfg.model.n_layer, par.pp, par.pp_virtual_stages, par.pp_split)
    check_micro_batches(par.pp_schedule, par.pp, step_micro_batches(schedule, dp, total_tokens, micro_batch))


def step_micro_batches(schedule, dp: int, total_tokens: int, micro_batch: int) -> set[int]:
    """The micro-batch counts of a replica's steps through the schedule (sampled at 64 points)."""
    step_tokens = total_tokens / 64  # the batch sizes the schedule goes through
    sizes = {schedule.batch_size(i * step_tokens) for i in range(64)}
    return {size // (micro_batch * dp) for size in sizes}


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Atomically: the ranks of a relaunched job read it while rank 0 rewrites it. A relative
    ``data.cache_dir`` is written as the directory it named from where the run started, so a resume
    launched from elsewhere finds the cache instead of tokenizing the corpus again into a new one;
    so is a ``run.out_dir`` without {time} (a resume from elsewhere took the run for one moved
    there). The data paths stay as written: a project moved as a whole (corpus and runs) continues
    from its new place, which absolute paths to the old one would refuse."""
    cfg = replace_section(cfg, "data", cache_dir=str(Path(cfg.data.cache_dir).expanduser().absolute()))
    if "time" not in out_dir_fields(cfg.run.out_dir):  # one directory: where it is from here ({{ kept literal)
        cfg = replace_section(cfg, "run", out_dir=out_dir_naming(run_dir_of(cfg.run.out_dir, cfg.model.kind)))
    atomic_write_text(path, dump_toml(to_dict(cfg)))


def replace_section(cfg: TrainConfig, section: str, **changes: Any) -> TrainConfig:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})
