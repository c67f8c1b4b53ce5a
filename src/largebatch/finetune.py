"""``largebatch finetune RUN_DIR``: did pretraining help? Fine-tune the run's encoder on a downstream
classification task, and the same model from random initialisation, and compare test accuracy.

    largebatch finetune runs/bert-lans-demo                       # folio-genre, 3 seeds
    largebatch finetune runs/bert-lans-demo --task bible-division --seeds 5 --epochs 4

The task (largebatch.data.tasks) labels passages of the bundled corpora and holds out whole
documents, so the test passages come from works the classifier never saw. Each seed fine-tunes two
arms that differ ONLY in the encoder's starting weights: "pretrained" (the run's newest intact
checkpoint) and "scratch" (the same architecture, freshly initialised). Both get the same head
initialisation, data order, dropout masks and hyperparameters: AdamW, linear warmup over the first
10% of steps then linear decay to 0, a mean-pooled linear head on the final hidden states.

The report (RUN_DIR/finetune/TASK.md and .json, also printed) gives each arm's test accuracy per
seed, its mean with a 95% t interval, and the paired gap pretrained - scratch with its interval:
pretraining "helped" only when that interval lies above 0. A gap that is the same at every seed
(sd 0) has no interval: "no difference established", however large. The majority-class rate is
the chance line. This stands in for the paper's SQuAD evaluation (Zheng et al. 2020 judge LANS pretraining by
downstream F1; docs/papers.md: LANS), which cannot be fetched here.

Options:
  --task NAME                 folio-genre (default) or bible-division
  --seeds N                   seeds per arm, 2-10 (default 3)
  --epochs N                  passes over the training passages (default 3)
  --lr LR                     peak AdamW learning rate (default 1e-4)
  --batch-size N              passages per step (default 32)
  --passage-len N             tokens per passage (default min(128, the model's seq_len, the longest
                              phase seq_len the run has trained at))
  --passages-per-document N   passages kept per document (default 32)
  --weight-decay WD           AdamW weight decay (default 0.01)
  --dropout P                 dropout before the head (default 0.1)
  --folds K                   K-fold cross-validation by document: every passage tested once
                              (default 1: the one held-out split)
  --probe-l2 L                l2 penalty of the linear probe on the frozen encoder (default 0.01)
  --tokenizer PATH            the run's tokenizer.json when it cannot be rebuilt from the run
  --checkpoint STEP           judge the run's checkpoint at optimizer step STEP (or its name or path)
                              instead of the newest; its report is TASK@step_NNNNNNNN.md beside TASK.md
  --ema                       judge the checkpoint's weight average (run.ema_decay) instead of its
                              weights; its report is TASK+ema.md (TASK@step_NNNNNNNN+ema.md)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from largebatch.arguments import OneLineParser, finite_float, run_command
from largebatch.data.tasks import TASKS, TaskData, TaskError, build_task, document_folds
from largebatch.stats import T_975, all_same, ci95


class FinetuneError(ValueError):
    """Bad input for finetune; the message names the option, the value and the fix."""


class SequenceClassifier(nn.Module):
    """A GPT or BERT encoder with a mean-pooled linear head: logits (B, classes) for ids (B, T)."""

    def __init__(self, encoder: nn.Module, n_classes: int, dropout: float):
        super().__init__()
        self.encoder = encoder
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(encoder.config.n_embd, n_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.encoder.hidden_states(ids).mean(dim=1)))


@dataclass
class Settings:
    task: str = "folio-genre"
    seeds: int = 3
    epochs: int = 3
    lr: float = 1e-4
    batch_size: int = 32
    passage_len: int | None = None
    passages_per_document: int = 32
    weight_decay: float = 0.01
    dropout: float = 0.1
    folds: int = 1
    probe_l2: float = 0.01


def check_settings(s: Settings, seq_len: int | None = None, trained_len: int | None = None) -> Settings:
    """One-line errors naming the option; with the model's ``seq_len``, also checks (or fills in)
    passage_len against it. ``trained_len``: the longest sequence the run trained its positions at
    (``trained_positions``), the default's bound when it is shorter than ``seq_len``."""
    def integer(name, low, high=None):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            bound = f"from {low} to {high}" if high else f">= {low}"
            raise FinetuneError(f"--{name.replace('_', '-')} {value!r}: must be an integer {bound}")

    integer("seeds", 2, max(T_975) + 1)
    integer("epochs", 1)
    integer("batch_size", 1)
    integer("passages_per_document", 1)
    integer("folds", 1)
    for name, ok, rule in (("lr", lambda v: v > 0, "> 0"), ("weight_decay", lambda v: v >= 0, ">= 0"),
                           ("probe_l2", lambda v: v > 0, "> 0"),
                           ("dropout", lambda v: 0 <= v < 1, "in [0, 1)")):
        if not ok(getattr(s, name)):
            raise FinetuneError(f"--{name.replace('_', '-')} {getattr(s, name)!r}: must be {rule}")
    if s.task not in TASKS:
        raise FinetuneError(f"--task {s.task!r}: unknown; choose one of {', '.join(TASKS)}")
    if s.passage_len is not None:
        integer("passage_len", 8)
    if seq_len is None:
        return s
    if s.passage_len is None:
        s.passage_len = min(128, seq_len, trained_len or seq_len)
    if s.passage_len > seq_len:
        raise FinetuneError(f"--passage-len {s.passage_len}: longer than the model's seq_len {seq_len} "
                            f"(its position table); use --passage-len {seq_len} or less")
    return s


def _schedule(step: int, total: int) -> float:
    """Linear warmup over the first 10% of steps, then linear decay to 0 (BERT's fine-tuning schedule)."""
    warmup = max(1, round(0.1 * total))
    return (step + 1) / warmup if step < warmup else max(0.0, (total - step) / max(1, total - warmup))


def finetune_arm(encoder: nn.Module, data: TaskData, s: Settings, seed: int) -> dict:
    """Fine-tune ``encoder`` (modified in place) with a fresh head; returns test accuracy and losses."""
    torch.manual_seed(seed)  # the head's initialisation: the same in both arms of a seed
    model = SequenceClassifier(encoder, len(data.classes), s.dropout).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr)
    x, y = torch.from_numpy(data.train_ids), torch.from_numpy(data.train_labels)
    order = torch.Generator().manual_seed(seed)
    per_epoch = math.ceil(len(x) / s.batch_size)
    total, step, losses = per_epoch * s.epochs, 0, []
    torch.manual_seed(seed + 1)  # dropout masks
    for _ in range(s.epochs):
        perm = torch.randperm(len(x), generator=order)
        for start in range(0, len(x), s.batch_size):
            idx = perm[start:start + s.batch_size]
            for group in opt.param_groups:
                group["lr"] = s.lr * _schedule(step, total)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
    model.eval()
    correct = 0
    with torch.no_grad():
        test_x, test_y = torch.from_numpy(data.test_ids), torch.from_numpy(data.test_labels)
        for start in range(0, len(test_x), 64):
            logits = model(test_x[start:start + 64])
            correct += int((logits.argmax(-1) == test_y[start:start + 64]).sum())
    k = max(1, per_epoch)
    return {"test_accuracy": correct / len(data.test_ids), "first_epoch_loss": statistics.fmean(losses[:k]),
            "last_epoch_loss": statistics.fmean(losses[-k:])}


def pooled_features(encoder: nn.Module, ids) -> torch.Tensor:
    """Mean-pooled final hidden states (N, n_embd) in float64, the encoder frozen (eval, no grad)."""
    encoder.eval()
    with torch.no_grad():
        x = torch.as_tensor(ids)
        return torch.cat([encoder.hidden_states(x[i:i + 64]).mean(dim=1) for i in range(0, len(x), 64)]).double()


def linear_probe(train_x: torch.Tensor, train_y, test_x: torch.Tensor, l2: float) -> tuple[torch.Tensor, dict]:
    """Multinomial logistic regression on frozen features: standardised by the training features'
    mean and sd, then W, b minimising mean cross-entropy + l2 * ||W||^2 (a strictly convex problem,
    solved to its unique optimum by L-BFGS in float64). Returns the test predictions and the fit."""
    mean, sd = train_x.mean(0), train_x.std(0) + 1e-6
    z, zt = (train_x - mean) / sd, (test_x - mean) / sd
    y = torch.as_tensor(train_y)
    n_classes = int(y.max()) + 1
    w = torch.zeros(z.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=20, line_search_fn="strong_wolfe")

    def objective():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(z @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(objective)
    with torch.no_grad():
        return (zt @ w + b).argmax(-1), {"w": w.detach(), "b": b.detach(), "z": z, "y": y}


def splits_of(data: TaskData, s: Settings) -> list[TaskData]:
    """The one held-out split, or with s.folds > 1 the document folds (every passage tested once)."""
    return [data] if s.folds == 1 else document_folds(data, s.folds)


def pooled(splits: list[TaskData], per_split) -> float:
    """Accuracy over the test passages of all splits: per_split(split) -> correct count."""
    return sum(per_split(d) for d in splits) / sum(len(d.test_ids) for d in splits)


def probe_accuracy(encoder: nn.Module, splits: list[TaskData], l2: float) -> float:
    """Pooled test accuracy of a linear probe on the frozen encoder's features, split by split."""
    def correct(d: TaskData) -> int:
        predictions, _ = linear_probe(pooled_features(encoder, d.train_ids), d.train_labels,
                                      pooled_features(encoder, d.test_ids), l2)
        return int((predictions == torch.as_tensor(d.test_labels)).sum())

    return pooled(splits, correct)


def _verdict(gaps: list[float]) -> tuple[tuple[float, float] | None, str]:
    """The paired gaps' 95% t interval and the verdict: "pretraining helped" (hurt) only when the
    interval lies above (below) 0. Gaps that are all the same value (sd 0: deterministic runs, or a
    coarse accuracy that moved by the same count at every seed) give no interval (None): the t
    interval would have zero width, and any gap but 0 would be called a difference."""
    if all_same(gaps):
        return None, (f"no difference established (the gap is {statistics.fmean(gaps):+.4f} at all "
                      f"{len(gaps)} seeds: sd 0, no interval)")
    ci = ci95(gaps)
    return ci, ("pretraining helped" if ci[0] > 0 else "pretraining hurt" if ci[1] < 0
                else "no difference established")


def _accuracy_ci(accuracies: list[float]) -> tuple[float, float] | None:
    """An arm's 95% t interval of its mean accuracy, clipped to [0, 1] where an accuracy lies (the t
    interval of a few seeds can reach past it); None with one seed, or when every seed gave the same
    accuracy (sd 0: a zero-width interval, as for the gap)."""
    if len(accuracies) < 2 or all_same(accuracies):
        return None
    low, high = ci95(accuracies)
    return max(0.0, low), min(1.0, high)


def compare(pretrained: nn.Module, data: TaskData, s: Settings, log=print) -> dict:
    """Both arms at every seed, fine-tuned and probed; the per-seed results, the intervals and the
    verdicts. With s.folds > 1 every arm runs on each document fold and its accuracy is pooled."""
    from largebatch.models import build_model

    splits = splits_of(data, s)
    seeds = [1000 + i for i in range(s.seeds)]
    arms: dict[str, list[dict]] = {"pretrained": [], "scratch": []}
    for seed in seeds:
        for arm in arms:
            start, runs = time.perf_counter(), []
            for split in splits:
                torch.manual_seed(seed)
                encoder = copy.deepcopy(pretrained) if arm == "pretrained" else build_model(pretrained.config)
                runs.append(finetune_arm(encoder, split, s, seed))
            result = {"test_accuracy": sum(r["test_accuracy"] * len(d.test_ids) for r, d in zip(runs, splits))
                      / sum(len(d.test_ids) for d in splits),
                      "first_epoch_loss": statistics.fmean(r["first_epoch_loss"] for r in runs),
                      "last_epoch_loss": statistics.fmean(r["last_epoch_loss"] for r in runs),
                      "seconds": round(time.perf_counter() - start, 1)}
            arms[arm].append(result)
            loss = (f"{result['first_epoch_loss']:.3f} -> {result['last_epoch_loss']:.3f}" if s.epochs > 1
                    else f"{result['first_epoch_loss']:.3f} over its one epoch")
            log(f"  seed {seed} {arm:<10} test accuracy {result['test_accuracy']:.4f} "
                f"(train loss {loss}, {result['seconds']:.0f} s)")
    acc = {arm: [r["test_accuracy"] for r in rs] for arm, rs in arms.items()}
    gaps = [p - q for p, q in zip(acc["pretrained"], acc["scratch"])]
    gap_ci, verdict = _verdict(gaps)
    probe_pretrained = probe_accuracy(pretrained, splits, s.probe_l2)
    probe_scratch = []
    for seed in seeds:
        torch.manual_seed(seed)
        probe_scratch.append(probe_accuracy(build_model(pretrained.config), splits, s.probe_l2))
    probe_gaps = [probe_pretrained - q for q in probe_scratch]
    probe_ci, probe_verdict = _verdict(probe_gaps)
    log(f"  linear probe: pretrained {probe_pretrained:.4f}, scratch {statistics.fmean(probe_scratch):.4f}")
    majority = pooled(splits, lambda d: int((d.test_labels == np.bincount(d.train_labels).argmax()).sum()))
    return {"seeds": seeds, "arms": arms, "folds": s.folds, "test_passages": sum(len(d.test_ids) for d in splits),
            "summary": {arm: {"mean": statistics.fmean(a), "ci95": _accuracy_ci(a)} for arm, a in acc.items()},
            "gap": {"per_seed": gaps, "mean": statistics.fmean(gaps), "ci95": gap_ci},
            "verdict": verdict, "majority_rate": majority,
            "probe": {"pretrained": probe_pretrained, "scratch": probe_scratch,
                      "gap": {"per_seed": probe_gaps, "mean": statistics.fmean(probe_gaps), "ci95": probe_ci},
                      "verdict": probe_verdict}}


def report_markdown(result: dict, data: TaskData, s: Settings, run: str, checkpoint: str, command: str) -> str:
    def ci(pair):
        return ("n/a (one seed)" if s.seeds < 2 else "n/a (sd 0)") if pair is None else \
            f"[{pair[0]:.4f}, {pair[1]:.4f}]"

    def gap_ci(pair):
        return "n/a (sd 0)" if pair is None else f"[{pair[0]:+.4f}, {pair[1]:+.4f}]"

    held_out = ", ".join(d.split("/", 1)[1] for d in data.test_documents)

    rows = [f"| {arm} | " + " | ".join(f"{r['test_accuracy']:.4f}" for r in result["arms"][arm])
            + f" | {result['summary'][arm]['mean']:.4f} | {ci(result['summary'][arm]['ci95'])} |"
            for arm in ("pretrained", "scratch")]
    gap = result["gap"]
    if s.folds == 1:
        task = (f"{len(data.train_ids)} training passages from {len(data.train_documents)} documents, "
                f"{len(data.test_ids)} test passages from {len(data.test_documents)} held-out documents "
                f"({held_out}); {s.passage_len} tokens each. Majority-class rate on test")
    else:
        task = (f"{s.folds}-fold cross-validation by document over {len(data.train_ids) + len(data.test_ids)} "
                f"passages of {len(data.train_documents) + len(data.test_documents)} documents (every passage "
                f"tested once, by a classifier that never saw its document); {s.passage_len} tokens each. "
                "Majority-class rate, pooled over the folds")
    lines = [
        f"# Fine-tuning {run} on {data.name}", "",
        f"Command: `{command}` (torch {torch.__version__}, {torch.get_num_threads()} threads). "
        f"Checkpoint: {checkpoint}.", "",
        f"Task: {TASKS[data.name].description}; {task}: {result['majority_rate']:.4f}.", "",
    ]
    lines += [
        f"Fine-tuning: {s.epochs} epoch{'s' if s.epochs != 1 else ''}, AdamW lr {s.lr:g} (10% warmup, "
        f"linear decay), batch {s.batch_size}, "
        f"weight decay {s.weight_decay:g}, head dropout {s.dropout:g}.", "",
        "| arm | " + " | ".join(f"seed {x}" for x in result["seeds"]) + " | mean | 95% CI |",
        "|---|" + "---|" * (len(result["seeds"]) + 2), *rows, "",
        f"Paired gap pretrained - scratch: {gap['mean']:+.4f}, 95% CI {gap_ci(gap['ci95'])} over "
        f"{len(result['seeds'])} seeds: **{result['verdict']}**.", ""]
    probe = result["probe"]
    lines += [
        f"Linear probe (encoder frozen, mean-pooled final hidden states standardised, multinomial logistic "
        f"regression with l2 {s.probe_l2:g}): pretrained {probe['pretrained']:.4f}, scratch "
        + ", ".join(f"{a:.4f}" for a in probe["scratch"])
        + f" (one random init per seed); gap {probe['gap']['mean']:+.4f}, 95% CI "
        f"{gap_ci(probe['gap']['ci95'])}: **{probe['verdict']}**.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="largebatch finetune", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--task", default=Settings.task)
    for name, kind in (("seeds", int), ("epochs", int), ("lr", finite_float), ("batch-size", int),
                       ("passage-len", int), ("passages-per-document", int), ("weight-decay", finite_float),
                       ("dropout", finite_float), ("folds", int), ("probe-l2", finite_float)):
        p.add_argument(f"--{name}", type=kind, default=getattr(Settings, name.replace("-", "_")))
    p.add_argument("--tokenizer")
    p.add_argument("--checkpoint")
    p.add_argument("--ema", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body(args: argparse.Namespace) -> int:
        settings = Settings(**{k: v for k, v in vars(args).items()
                               if k not in ("run_dir", "tokenizer", "checkpoint", "ema")})
        return run(args.run_dir, settings, args.tokenizer, shlex.join(["largebatch", "finetune", *argv]),
                   checkpoint=args.checkpoint, ema=args.ema)

    return run_command(build_parser(), argv, body, (FinetuneError, TaskError))


def _check_report_paths(out: Path, stem: str) -> None:
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise FinetuneError(f"{str(out)!r} exists and is not a directory: the report is written into "
                            "RUN_DIR/finetune/; move or delete that file and run again")
    for report in (out / f"{stem}.md", out / f"{stem}.json"):
        if report.is_dir():
            raise FinetuneError(f"{str(report)!r} is a directory: the report is written to that path; "
                                "move or delete it and run again")


def run(run_dir: str, settings: Settings, tokenizer_file: str | None = None, command: str = "",
        checkpoint: str | None = None, ema: bool = False) -> int:
    """Fine-tune the run's newest checkpoint (or the one ``checkpoint`` names, reported as
    ``TASK@step_NNNNNNNN``; with ``ema``, its weight average, reported as ``...+ema``) against
    scratch; writes the report to RUN_DIR/finetune/."""
    from largebatch.export import ExportError, check_run_dir_given, load_run, partial_note

    try:
        check_run_dir_given(run_dir)
    except ExportError as exc:
        raise FinetuneError(str(exc)) from None
    check_settings(settings)  # everything that does not need the model, before the (slow) load
    run_dir = os.path.expanduser(run_dir)
    out = Path(run_dir) / "finetune"  # where the report goes: checked now, not when the results are in
    _check_report_paths(out, settings.task)
    try:
        loaded = load_run(run_dir, tokenizer_file, checkpoint=checkpoint, ema=ema)
    except ExportError as exc:
        raise FinetuneError(str(exc)) from None
    stem = settings.task if checkpoint is None else f"{settings.task}@{loaded.checkpoint.name.split('.')[0]}"
    stem += "+ema" if ema else ""
    _check_report_paths(out, stem)
    if loaded.tokenizer is None:
        raise FinetuneError(f"RUN_DIR {run_dir!r}: its tokenizer cannot be recovered: pass --tokenizer PATH")
    from largebatch.export import trained_positions

    trained = trained_positions(loaded)
    s = check_settings(settings, loaded.model.config.seq_len, trained)
    data = build_task(s.task, loaded.tokenizer, s.passage_len, s.passages_per_document)
    if int(max(data.train_ids.max(), data.test_ids.max())) >= loaded.model.config.vocab_size:
        raise FinetuneError(f"the tokenizer's ids exceed the model's vocab_size {loaded.model.config.vocab_size}: "
                            "pass --tokenizer PATH to the tokenizer.json the run trained with")
    try:
        splits_of(data, s)
    except TaskError as exc:  # the folds against this task's documents, named as the option
        raise FinetuneError(f"--folds {s.folds}: {str(exc).split(': ', 1)[-1]}; --folds 1 uses the one "
                            "held-out split") from None
    passages = (f"{len(data.train_ids)} train / {len(data.test_ids)} test passages" if s.folds == 1 else
                f"{len(data.train_ids) + len(data.test_ids)} passages in {s.folds} folds of whole documents")
    print(f"fine-tuning {loaded.checkpoint} (step {loaded.step}{', its weight average' if ema else ''}) on "
          f"{s.task}: {passages} of {s.passage_len} "
          f"tokens, {s.seeds} seeds x 2 arms")
    partial = partial_note(loaded, "judges")  # judged before the end of the run's token budget
    if partial:
        print(f"note: {partial}")
    if trained is not None and s.passage_len > trained:
        print(f"note: --passage-len {s.passage_len} is longer than the {trained} tokens the run's phases "
              f"trained so far: positions past {trained} are untrained in the pretrained arm")
    result = compare(loaded.model.train(), data, s)
    out.mkdir(exist_ok=True)
    where = loaded.checkpoint.name + (" (its weight average, run.ema_decay)" if ema else "") \
        + (f" ({partial})" if partial else "")
    text = report_markdown(result, data, s, Path(run_dir).name, where, command)
    payload = {"settings": asdict(s), "checkpoint": str(loaded.checkpoint), "step": loaded.step, "ema": ema,
               "trained_tokens": loaded.tokens, "partial": partial,
               "classes": data.classes, "train_documents": data.train_documents,
               "test_documents": data.test_documents, **result}
    for path, content in ((out / f"{stem}.md", text), (out / f"{stem}.json", json.dumps(payload, indent=1))):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(content)
        tmp.replace(path)
    print("\n" + text)
    print(f"report: {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
