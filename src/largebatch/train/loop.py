"""The training loop: GPT or BERT pretraining keyed on tokens, with exact resume.

Read top to bottom, a run is:
  1. setup     -- device, seeds, data (tokenizer trained on the training split), model,
                  recomputation, optional compile, optimizer, joint LR/batch schedule
  2. resume    -- model, optimizer, schedule, noise-scale estimator, data position and every RNG
  3. the loop  -- at the top of each iteration: evaluate, checkpoint, maybe stop; then one
                  optimizer step accumulated over micro-batches, loss normalised by the step's
                  target tokens, so a step is the same whatever the micro-batch split
  4. the end   -- final evaluation and checkpoint, plots, a generated sample, the summary

Time is tokens: the schedule gives the LR and the batch size (in sequences) at the tokens seen so
far; the data order is keyed on the global sample index, so a batch-size change (Seesaw) only
changes how many samples form a step, and a resumed run continues bit-identically.
The gradient noise scale (McCandlish et al. 2018, App. A) is estimated from the first
micro-batch's gradient and the accumulated step's gradient.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from largebatch.data import build_data
from largebatch.memory import apply_recompute
from largebatch.models import build_model
from largebatch.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from largebatch.train.config import TrainConfig, save_config
from largebatch.train.metrics import (MetricsLog, Progress, human_bytes, human_count,
                                      measure_peak_flops, memory_bytes, plot_run)
from largebatch.train.optimizer import build_optimizer
from largebatch.typed_config import to_dict


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"run.device = {name!r}: CUDA is not available here; use 'cpu' or 'auto'")
    return device


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _grad_sq_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of all gradients, on device (no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.stack(torch._foreach_norm(grads)).double().square().sum()


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: str | Path, resume: bool = False, log=print):
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        run = cfg.run
        # -- 1. setup -------------------------------------------------------------------------
        self.device = resolve_device(run.device)
        torch.manual_seed(run.seed)
        random.seed(run.seed)
        np.random.seed(run.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data = build_data(cfg.data, seq_len=cfg.model.seq_len, kind=cfg.model.kind)
        if cfg.model.vocab_size != self.data.vocab_size:
            cfg = self.cfg = _with_vocab(cfg, self.data.vocab_size)
        self.model = build_model(cfg.model).to(self.device)
        self.raw_model = self.model  # the uncompiled module: checkpoints and generation use it
        apply_recompute(self.model, _recompute_policy(run.recompute, cfg.model.n_layer))
        if run.compile:
            self.model = torch.compile(self.model)
        self.optimizer = build_optimizer(self.raw_model, cfg.optim)
        self.schedule = cfg.schedule.build(total_tokens=run.total_tokens, seq_len=cfg.model.seq_len,
                                           micro_batch=run.micro_batch, dp_size=1)
        self.noise = cfg.schedule.build_noise_scale()
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if run.dtype == "bf16" else nullcontext())
        self.eval_every = run.eval_every_tokens or max(1, run.total_tokens // 10)
        self.pos = Progression(next_eval=0, next_checkpoint=run.checkpoint_every_tokens or run.total_tokens)
        # -- 2. resume ------------------------------------------------------------------------
        resume_step = None
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise FileNotFoundError(f"--resume {self.run_dir}: no checkpoint in "
                                        f"{self.run_dir / 'checkpoints'}; start a new run instead")
            self._load(load_checkpoint(ckpt))
            resume_step = self.pos.step
            self.log(f"resumed from {ckpt} at step {self.pos.step}, {human_count(self.pos.tokens)} tokens")
        save_config(cfg, self.run_dir / "config.toml")
        self.metrics = MetricsLog(self.run_dir, tensorboard=run.tensorboard, resume_step=resume_step)
        self.peak_flops = run.peak_flops or measure_peak_flops(
            self.device, torch.bfloat16 if run.dtype == "bf16" else torch.float32)
        self.peak_source = "declared" if run.peak_flops else f"measured {run.dtype} matmul"
        self.flops_per_token = self.raw_model.flops_per_token()

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
                "noise_scale": self.noise.state_dict(), "progress": vars(self.pos).copy(),
                "rng": _rng_state(self.device), "config": to_dict(self.cfg)}

    def _load(self, state: dict[str, Any]) -> None:
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.noise.load_state_dict(state["noise_scale"])
        self.pos = Progression(**state["progress"])
        _set_rng_state(state["rng"], self.device)

    def save(self) -> Path:
        return save_checkpoint(self.run_dir, self.pos.step, self.state_dict(),
                               keep_last=self.cfg.run.keep_checkpoints)

    # ------------------------------------------------------------------------------------------
    def _forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = batch["input_ids"].to(self.device, non_blocking=True)
        targets = batch["targets"] if "targets" in batch else batch["labels"]
        with self.autocast:
            _, loss_sum = self.model(inputs, targets.to(self.device, non_blocking=True), reduction="sum")
        return loss_sum

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats/token) over a fixed slice of the validation split."""
        self.model.eval()
        seq_len, mb = self.cfg.model.seq_len, self.cfg.run.micro_batch
        n = max(1, min(len(self.data.val), self.cfg.run.eval_tokens // seq_len))
        total, count = 0.0, 0
        for start in range(0, n, mb):
            batch = self.data.val.get_batch(range(start, min(n, start + mb)))
            total += float(self._forward_loss(batch))
            count += int(_target_count(batch))
        self.model.train()
        return total / max(1, count)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step at the current token position; returns its log record."""
        cfg, pos = self.cfg, self.pos
        batch_size = self.schedule.batch_size(pos.tokens)
        lr = self.schedule.lr(pos.tokens)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        mb = cfg.run.micro_batch
        # global sample indices: the data order never depends on how batches are cut
        indices = range(pos.samples, pos.samples + batch_size)
        micro_batches = [self.data.train.get_batch(indices[i:i + mb]) for i in range(0, batch_size, mb)]
        n_targets = sum(int(_target_count(b)) for b in micro_batches)
        params = [p for p in self.raw_model.parameters() if p.requires_grad]
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        small_sq = None
        for i, batch in enumerate(micro_batches):
            loss = self._forward_loss(batch)
            (loss / n_targets).backward()  # normalised by the whole step's target tokens
            loss_sum += loss.detach()
            if i == 0 and len(micro_batches) > 1:
                # the first micro-batch's own mean gradient = accumulated grad x N_step / N_mb
                scale = n_targets / int(_target_count(batch))
                small_sq = _grad_sq_norm(params) * scale**2
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        loss_value = float(loss_sum) / n_targets
        record: dict[str, Any] = {"kind": "train", "loss": loss_value, "lr": lr,
                                  "batch_size": batch_size, "micro_batches": len(micro_batches),
                                  "grad_norm": float(grad_norm)}
        if not (math.isfinite(loss_value) and math.isfinite(record["grad_norm"])):
            self.optimizer.zero_grad(set_to_none=True)
            if cfg.run.on_nonfinite == "stop":
                last = latest_checkpoint(self.run_dir)
                raise NonFiniteLoss(
                    f"loss is {loss_value} (gradient norm {record['grad_norm']}) at step {pos.step + 1}, "
                    f"{pos.tokens} tokens. Last good checkpoint: {last or 'none'}. Lower "
                    f"schedule.peak_lr, set optim.grad_clip, or run.on_nonfinite='skip'.")
            pos.skipped_steps += 1
            record["skipped"] = True
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if small_sq is not None:
                self.noise.update(float(small_sq), mb, float(grad_norm) ** 2, batch_size)
                if self.schedule.uses_noise_scale and self.noise.b_simple is not None:
                    # adaptive Seesaw: caps only milestones after this token count (deterministic)
                    self.schedule.observe_noise_scale(pos.tokens, self.noise.b_simple)
        if cfg.optim.log_trust_ratios and hasattr(self.optimizer, "trust_ratio_summary"):
            summary = self.optimizer.trust_ratio_summary()
            if summary:
                record.update({f"trust_{k}": v for k, v in summary.items()})
        record["noise_scale"] = self.noise.b_simple
        pos.step += 1
        pos.tokens += batch_size * cfg.model.seq_len
        pos.samples += batch_size
        return record

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, run, pos = self.cfg, self.cfg.run, self.pos
        self.log(self.describe())
        progress = Progress(run.total_tokens, enabled={"auto": None, "on": True, "off": False}[run.progress])
        steps_here, val_loss, t_log, tokens_log = 0, None, time.perf_counter(), pos.tokens
        self.model.train()
        while pos.tokens < run.total_tokens:
            # -- 3. top of the iteration: evaluate, checkpoint, stop ---------------------------
            if pos.tokens >= pos.next_eval:
                val_loss = self._log_eval()
                pos.next_eval = (pos.tokens // self.eval_every + 1) * self.eval_every
            if pos.tokens >= pos.next_checkpoint and pos.step > 0:
                every = run.checkpoint_every_tokens or run.total_tokens
                pos.next_checkpoint = (pos.tokens // every + 1) * every
                self.save()
            if run.max_steps and steps_here >= run.max_steps:
                path = self.save()
                self.log(f"stopped after {steps_here} steps (run.max_steps); checkpoint {path}. "
                         f"Continue with: largebatch train --resume {self.run_dir}")
                progress.close()
                self.metrics.close()
                return {"stopped_early": True, "step": pos.step, "tokens": pos.tokens}
            t0 = time.perf_counter()
            record = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            pos.train_seconds += time.perf_counter() - t0
            steps_here += 1
            if pos.step % run.log_every_steps == 0:
                now = time.perf_counter()
                tps = (pos.tokens - tokens_log) / max(now - t_log, 1e-9)
                t_log, tokens_log = now, pos.tokens
                record.update(step=pos.step, tokens=pos.tokens, tokens_per_s=tps,
                              mfu=self.flops_per_token * tps / self.peak_flops,
                              memory_bytes=memory_bytes(self.device))
                self.metrics.log(record)
                progress.update(pos.tokens, tps, f"loss {record['loss']:.3f}")
                if not progress.enabled:
                    self.log(_format_record(record))
        progress.close()
        # -- 4. the end -----------------------------------------------------------------------
        val_loss = self._log_eval()
        self.save()
        self.metrics.close()
        return self._summary(val_loss)

    def _log_eval(self) -> float:
        val_loss = self.evaluate()
        self.metrics.log({"kind": "val", "step": self.pos.step, "tokens": self.pos.tokens,
                          "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
        self.log(f"  eval  step {self.pos.step:>5}  tokens {human_count(self.pos.tokens):>7}  "
                 f"val loss {val_loss:.4f}  ppl {math.exp(min(val_loss, 50)):.1f}")
        return val_loss

    def describe(self) -> str:
        cfg, m = self.cfg, self.raw_model
        lines = [f"run dir      {self.run_dir}",
                 f"data         {self.data.stats}",
                 f"model        {cfg.model.kind} {human_count(m.num_params())} parameters, "
                 f"{cfg.model.n_layer} layers x {cfg.model.n_embd} hidden, seq {cfg.model.seq_len}, "
                 f"{cfg.model.attention} attention, recompute {cfg.run.recompute}",
                 f"optimizer    {cfg.optim.name} (weight decay {cfg.optim.weight_decay}, "
                 f"grad clip {cfg.optim.grad_clip})",
                 f"device       {self.device}, {cfg.run.dtype}, peak {self.peak_flops / 1e12:.3f} TFLOP/s "
                 f"({self.peak_source})",
                 f"budget       {human_count(cfg.run.total_tokens)} tokens, micro-batch {cfg.run.micro_batch}",
                 cfg.schedule.describe(cfg.run.total_tokens, cfg.model.seq_len, cfg.run.micro_batch, 1)]
        return "\n".join(line for line in lines if line)

    def _summary(self, val_loss: float) -> dict[str, Any]:
        pos = self.pos
        tps = pos.tokens / max(pos.train_seconds, 1e-9)
        summary = {"final_val_loss": val_loss, "final_val_ppl": math.exp(min(val_loss, 50)),
                   "unigram_val_loss": self.data.unigram_loss(), "steps": pos.step,
                   "tokens": pos.tokens, "train_seconds": pos.train_seconds, "tokens_per_s": tps,
                   "mfu": self.flops_per_token * tps / self.peak_flops,
                   "peak_flops": self.peak_flops, "peak_flops_source": self.peak_source,
                   "memory_bytes": memory_bytes(self.device), "skipped_steps": pos.skipped_steps,
                   "noise_scale": self.noise.b_simple}
        if self.cfg.model.kind == "gpt" and self.cfg.run.sample_tokens:
            summary["sample"] = self.generate(self.cfg.run.sample_prompt, self.cfg.run.sample_tokens)
        try:
            plot_run(self.run_dir)
        except Exception as exc:  # plots are a convenience; never fail a finished run on them
            self.log(f"(plots skipped: {exc})")
        import json

        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    @torch.no_grad()
    def generate(self, prompt: str, n_tokens: int) -> str:
        self.raw_model.eval()
        ids = self.data.tokenizer.encode(prompt).ids
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.cfg.run.seed)  # the same sample for the same weights
            out = self.raw_model.generate(idx, n_tokens, temperature=0.8, top_k=50)
        self.raw_model.train()
        return self.data.tokenizer.decode(out[0].tolist())


def _target_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "targets" in batch:
        return (batch["targets"] != -100).sum()
    return (batch["labels"] != -100).sum()


def _recompute_policy(spec: str, n_layer: int) -> str | list[str]:
    """'selective' -> 'selective'; 'full,selective' -> per-layer list (checked by config.check)."""
    parts = [p.strip() for p in spec.split(",")]
    return parts[0] if len(parts) == 1 else parts


def _with_vocab(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    from largebatch.train.config import replace_section

    return replace_section(cfg, "model", vocab_size=vocab_size)


def _format_record(r: dict[str, Any]) -> str:
    text = (f"step {r['step']:>5}  tokens {human_count(r['tokens']):>7}  loss {r['loss']:.4f}  "
            f"lr {r['lr']:.2e}  batch {r['batch_size']:>4}  tok/s {r['tokens_per_s']:,.0f}  "
            f"mfu {100 * r['mfu']:.1f}%  mem {human_bytes(r['memory_bytes'])}  "
            f"|g| {r['grad_norm']:.3f}")
    if "trust_median" in r:
        text += (f"  trust {r['trust_min']:.3g}/{r['trust_median']:.3g}/{r['trust_max']:.3g}"
                 f" pinned {r['trust_pinned']}")
    if r.get("noise_scale") is not None:
        text += f"  B_noise {r['noise_scale']:.0f}"
    return text
