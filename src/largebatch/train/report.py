"""What a run tells its user: the start-up description, each logged step (read from the device,
with tokens/s, MFU and memory), the resume command, the end-of-run summary and a sample.

MFU (model FLOPs utilisation) is the model's FLOPs per token (largebatch.models.flops) times
tokens/s over the peak of all devices of the job (Korthikanti et al. 2022 §6; PaLM App. B).
"""

from __future__ import annotations

import json
import math
import shlex
import time
from typing import Any

import torch

from largebatch.checkpoint.files import atomic_write_text
from largebatch.data.dataset import BERTDataset
from largebatch.data.tokenizer import separator_id
from largebatch.memory.measure import memory_bytes
from largebatch.models.flops import flops_per_token, mfu_over_peak
from largebatch.models.registry import model_spec
from largebatch.train.deferred import read_record
from largebatch.train.metrics import strict_record
from largebatch.train.phases import describe as describe_phases
from largebatch.train.plots import plot_run
from largebatch.train.progress import format_record, human_count


class Reporting:
    """The Trainer's reports (a mixin of ``largebatch.train.loop.Trainer``): it reads the trainer's
    config, position, data, optimizer and parallel layout, and writes the log (console and
    metrics), ``summary.json`` and the plots of the run directory."""

    def log_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """The step's record read to the host (after ``settle``), with the noise scale and trust ratios."""
        self.settle()
        record = read_record(record)
        for flag in ("skipped", "overflow"):  # device flags (run.on_nonfinite='skip', fp16): logged where true
            if flag in record and record.pop(flag):
                record[flag] = True
        if self.loss_scale is not None:  # fp16: the scale the next step uses, the overflowed steps so far
            record["loss_scale"], record["overflow_steps"] = self.pos.loss_scale, self.pos.overflow_steps
        taken_back = record.get("skipped") or record.get("overflow")  # its trust ratios are of an undone update
        if self.cfg.optim.log_trust_ratios and hasattr(self.optimizer, "trust_ratio_summary") and not taken_back:
            # under pipeline parallel each rank steps its own stages: the summary covers them all
            summary = self.optimizer.trust_ratio_summary(self.par.pp_group if self.pipeline else None)
            if summary:
                record.update({f"trust_{k}": v for k, v in summary.items()})
        record["noise_scale"] = self.noise.b_simple
        return record

    def peak_memory(self) -> int:
        """``memory_bytes`` of the busiest process of the job: the maximum over every rank (one small
        all-reduce of a CPU integer; every rank calls it at the same point). Under pipeline parallel
        the stage with the output layer and its logits may peak above rank 0, which alone was read."""
        peak = memory_bytes(self.device)
        if self.par.distributed:
            import torch.distributed as dist

            from largebatch.train.stopping import control_group

            flag = torch.tensor([peak], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group(self.par))
            peak = int(flag)
        return peak

    def _log_step(self, record: dict[str, Any], progress,
                  mark: tuple[float, int, float]) -> tuple[float, int, float]:
        """Log a step's record with tokens/s and MFU over the optimizer steps' own time since
        ``mark`` (train seconds, tokens, model FLOPs) of the last record -- evaluations and
        checkpoints in between are not training throughput -- and memory; returns the new mark.
        MFU counts each step at its own phase's FLOPs per token (a window across a phase switch
        mixes two sequence lengths)."""
        pos = self.pos
        record = self.log_record(record)
        seconds = max(pos.train_seconds - mark[0], 1e-9)
        tps = (pos.tokens - mark[1]) / seconds
        mfu = (pos.model_flops - mark[2]) / seconds / (self.peak_flops * self.par.world_size)
        record.update(step=pos.step, tokens=pos.tokens, tokens_per_s=tps,
                      mfu=mfu, memory_bytes=self.peak_memory(), train_seconds=pos.train_seconds,
                      wall_time=time.time())
        profiler = getattr(self, "profiler", None)
        if profiler is not None and profiler.take_unreported():  # its steps ran slower: the profiler's cost
            record["profiled"] = True
        if record["mfu"] > 1 and not self._warned_mfu:
            self._warned_mfu = True
            self.log(f"warning: {mfu_over_peak(record['mfu'], self.peak_flops, self.peak_source)}")
        if self.metrics is not None:
            self.metrics.log(record)
        progress.update(pos.tokens, tps, f"loss {record['loss']:.3f}")
        if not progress.enabled:
            self.log(format_record(record))
        return pos.train_seconds, pos.tokens, pos.model_flops

    def _resume_command(self) -> str:
        """How to continue a stopped run (the same command again only where run.out_dir names one
        directory: a {time} in it names a new one at each launch)."""
        from largebatch.train.config import out_dir_fields

        command = f"largebatch train --resume {shlex.quote(str(self.run_dir))}"
        again = "time" not in out_dir_fields(self.cfg.run.out_dir)
        if self.par.distributed:
            return f"the same torchrun command, with `{command}`" + (" (or the same arguments again)" if again else "")
        return command + (" (or the same command again)" if again else "")

    def model_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token (no recomputation: MFU's numerator) at ``seq_len``; for a masked
        LM, its output layer on the share of positions the data chooses for prediction."""
        masked = model_spec(self.cfg.model.kind).objective == "masked"
        fraction = BERTDataset.predicted_fraction(seq_len, self.cfg.data.mlm_probability) if masked else 0.15
        return flops_per_token(self.cfg.model, seq_len=seq_len, mask_fraction=fraction)

    def describe(self) -> str:
        """The run's header: data, model, optimizer, device, parallel layout, budget, schedules."""
        cfg = self.cfg
        lines = [f"run dir      {self.run_dir}",
                 "data         " + self.data.stats.describe(cfg.run.total_tokens).replace("\n", "\n" + " " * 13),
                 f"model        {cfg.model.kind} {human_count(self.n_params)} parameters, "
                 f"{cfg.model.layout_words()}, recompute {','.join(cfg.run.recompute)}",
                 f"optimizer    {cfg.optim.name} (weight decay {cfg.optim.weight_decay}, "
                 f"grad clip {cfg.optim.grad_clip}; LR x lr_mult per group: "
                 f"{', '.join(str(g.get('lr_mult', 1.0)) for g in self.optimizer.param_groups)})"
                 + ("" if cfg.run.ema_decay is None else
                    f"; weight average decay {cfg.run.ema_decay} (~{1 / (1 - cfg.run.ema_decay):,.0f} steps), "
                    "evaluated beside the weights"),
                 f"device       {self.device}, {cfg.run.dtype}"
                 + ("" if self.loss_scale is None else f" (loss scale {self.pos.loss_scale:.10g}, doubled after "
                    f"{cfg.run.loss_scale_growth_steps} steps without overflow)")
                 + f", peak {self.peak_flops / 1e12:.3f} TFLOP/s "
                 f"({self.peak_source})",
                 f"parallel     {self.par.world_size} process(es): "
                 + (f"pp {self.par.pp_size} ({self.par.pp_schedule}, {self.par.pp_virtual_stages} stage(s) "
                    f"per rank) x " if self.par.pp_size > 1 else "")
                 + f"dp {self.par.dp_size} ({self.par.dp_mode}) x tp {self.par.tp_size}"
                 f"{' + sequence parallel' if self.par.sequence_parallel else ''}",
                 f"budget       {human_count(cfg.run.total_tokens)} tokens, micro-batch {cfg.run.micro_batch}"]
        if cfg.phases:
            lines += [f"phases       {line}" for line in describe_phases(self.phases)]
        lines += [p.schedule.describe(p.total_tokens, p.seq_len, p.micro_batch, self.schedule_dp)
                  for p in self.phases]
        if self.par.pp_size > 1:
            from largebatch.parallel.pipeline import padding_note
            from largebatch.train.config import step_micro_batches

            for p in self.phases:
                schedule = p.schedule.build(p.total_tokens, p.seq_len, p.micro_batch, self.schedule_dp)
                counts = step_micro_batches(schedule, self.par.dp_size, p.total_tokens, p.micro_batch)
                note = padding_note(self.par.pp_schedule, self.par.pp_size, counts)
                if note:
                    where = f"phase {p.index}: " if cfg.phases else ""
                    lines.append(f"pipeline     {where}{note}")
        if self.schedule_dp != self.par.dp_size:  # resumed on another replica count: the run's batches
            rounded = " (the budget's last step rounded up to split)" if self.schedule_dp % self.par.dp_size else ""
            lines.append(f"batches      the run's own, multiples of micro_batch x {self.schedule_dp} (the "
                         f"replicas its checkpoints were written with), split over {self.par.dp_size} "
                         f"replica{'s' if self.par.dp_size > 1 else ''}{rounded}")
        return "\n".join(line for line in lines if line)

    def _summary(self, val_loss: float) -> dict[str, Any]:
        """The end-of-run numbers (written to summary.json by rank 0, with the plots)."""
        pos = self.pos
        tps = pos.tokens / max(pos.train_seconds, 1e-9)
        # every step at its own phase's FLOPs per token (phases change the sequence length), over every
        # step's seconds at its own launch's peak and processes (a resume may change either)
        mfu = pos.model_flops / max(pos.peak_flop_seconds or 0.0, 1e-9)
        summary = {"final_val_loss": val_loss, "final_val_ppl": math.exp(min(val_loss, 50)),
                   "final_val_bpb": self.bits_per_byte(val_loss),
                   "unigram_val_loss": self.data.unigram_loss(), "steps": pos.step,
                   "tokens": pos.tokens, "train_seconds": pos.train_seconds, "tokens_per_s": tps,
                   "mfu": mfu, "world_size": self.par.world_size,
                   "peak_flops": self.peak_flops, "peak_flops_source": self.peak_source,
                   "memory_bytes": self.peak_memory(), "skipped_steps": pos.skipped_steps,
                   "noise_scale": self.noise.b_simple}
        if self.loss_scale is not None:  # fp16 (largebatch.train.loss_scale)
            summary.update(loss_scale=pos.loss_scale, overflow_steps=pos.overflow_steps)
        # a resume on another process count or another peak: the MFU is over each launch's own, so the
        # summary must not present it as a fraction of this launch's peak alone (a peak measured again
        # at each launch moves by ~1%: not counted)
        own = pos.train_seconds * self.peak_flops * self.par.world_size
        summary["peak_varied"] = bool(pos.peak_flop_seconds) and abs(pos.peak_flop_seconds - own) > 0.05 * own
        pos.wall_seconds = self.wall_seconds()
        summary.update(wall_seconds=pos.wall_seconds, tokens_per_s_wall=pos.tokens / max(pos.wall_seconds, 1e-9))
        first = getattr(self, "after_first_step", None)  # (train seconds, tokens) after this launch's first step
        if first is not None and pos.tokens > first[1] and pos.train_seconds > first[0]:
            summary["tokens_per_s_after_first_step"] = (pos.tokens - first[1]) / (pos.train_seconds - first[0])
        # the batch the (last phase's) schedule had reached at its last step's start (a milestone on
        # the budget's last tokens would name a batch no step took; a launch that took no step: at the
        # run's last token), and whether it is a Seesaw that grows without the noise-scale cap
        # (format_summary compares the two)
        phase, start = getattr(self, "last_step_start", (None, None))
        at = start if phase == pos.phase else max(pos.tokens - pos.phase_start - 1, 0)
        summary["final_batch_size"] = self.schedule.batch_size(at)
        summary["uncapped_seesaw"] = (self.phase.schedule.batch_policy == "seesaw"
                                      and self.phase.schedule.noise_scale_multiple is None)
        summary["final_val_accuracy"] = self.val_accuracy
        if self.cfg.run.target_val_loss is not None:  # run.target_val_loss: where it was reached, or None
            summary["target_val_loss"] = self.cfg.run.target_val_loss
            summary["target"] = None if pos.target is None else dict(pos.target)
            summary["stopped_at_target"] = bool(self.cfg.run.stop_at_target and pos.target is not None)
        if getattr(self, "ema", None) is not None:  # run.ema_decay: the average's, on the same tokens
            summary["final_val_loss_ema"], summary["final_val_accuracy_ema"] = self.val_ema
            summary["final_val_bpb_ema"] = self.bits_per_byte(self.val_ema[0])
        if self.val_by_corpus:  # data.mixture: each corpus's validation loss (the eval records' val_loss/<corpus>)
            summary["final_val_loss_by_corpus"] = dict(self.val_by_corpus)
            bits = {label: b for label, loss in self.val_by_corpus.items()
                    if (b := self.bits_per_byte(loss, label)) is not None}
            if bits:  # (where the tokenizer gives them: the eval records' val_bpb/<corpus>)
                summary["final_val_bpb_by_corpus"] = bits
        summary["unigram_val_accuracy"] = self.data.unigram_accuracy()
        evaluated = self.evaluated_targets()  # the baseline on the tokens the validation loss is on
        summary["unigram_eval_loss"] = self.data.unigram_loss(evaluated)
        summary["unigram_eval_accuracy"] = self.data.unigram_accuracy(evaluated)
        if self.cfg.phases:
            summary["phase_val_losses"] = [*self.phase_val_losses, val_loss]
        if model_spec(self.cfg.model.kind).objective == "causal" and self.cfg.run.sample_tokens:
            if self.par.sequence_parallel:  # growing prompts are not divisible by tp: no sample
                summary["sample"] = "(no sample: sequence parallel shards need length % tp == 0)"
            elif self.pipeline:
                summary["sample"] = "(no sample: generation under pipeline parallel is not supported)"
            elif self.data.tokenizer is None:
                summary["sample"] = ("(no sample: a token-array corpus without data.tokenizer_file has no "
                                     "tokenizer to encode the prompt and decode the text)")
            else:  # every rank generates: tensor-parallel and FSDP forwards are collective
                try:
                    summary["sample"] = self.generate(self.cfg.run.sample_prompt, self.cfg.run.sample_tokens)
                except Exception as exc:  # a convenience: one process never loses the finished run's summary to it
                    if self.par.distributed:  # (the other ranks may be in a collective of the sample)
                        raise
                    first = (str(exc).splitlines() or [""])[0]
                    summary["sample"] = f"(no sample: {type(exc).__name__}: {first})"
                    self.log(f"the end-of-run sample failed ({type(exc).__name__}: {first}); the run is complete")
        if not self.is_main:
            return summary
        try:
            if self.cfg.run.plots:
                plot_run(self.run_dir)
        except Exception as exc:  # plots are a convenience; never fail a finished run on them
            self.log(f"(plots skipped: {exc})")
        # never half of one; strict JSON, as metrics.jsonl (a non-finite number null, named in "nonfinite")
        atomic_write_text(self.run_dir / "summary.json", json.dumps(strict_record(summary), indent=2, allow_nan=False))
        if self.metrics is not None:
            self.metrics.summary(summary)
        return summary

    @torch.no_grad()
    def generate(self, prompt: str, n_tokens: int) -> str:
        self.raw_model.eval()
        # as the training text was encoded: no special tokens a tokenizer's post-processor would add
        ids = self.data.tokenizer.encode(prompt, add_special_tokens=False).ids
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        separator = separator_id(self.data.tokenizer, self.cfg.model.separator_id)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.cfg.run.seed)  # the same sample for the same weights (`largebatch generate`'s)
            # every rank runs all n_tokens forwards (collective under FSDP2 and tensor parallel); the
            # sample ends at the separator, as `largebatch generate`'s, whose draws before it are these
            out = self.raw_model.generate(idx, n_tokens, temperature=0.8, top_k=50)[0, len(ids):].tolist()
        self.raw_model.train()
        if separator is not None and separator in out:
            out = out[:out.index(separator) + 1]
        return self.data.tokenizer.decode(ids + out)
