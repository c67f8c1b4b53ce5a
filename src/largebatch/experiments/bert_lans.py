"""LANS vs LAMB vs AdamW on the two-phase BERT recipe, judged by the loss and downstream
(Zheng et al. 2020; docs/papers.md: LANS).

The LANS paper pretrains BERT in two phases (most tokens at a short sequence length with a large
batch, then the full length with a smaller one, the LR re-warmed per phase) and judges the result by
SQuAD F1. Here every arm is the shipped recipe (configs/bert-lans-demo.toml at full size, the same
shape scaled down for quick and smoke), with equal tokens in each phase, and differs only in the
optimizer: LANS and LAMB at the recipe's peak LRs, AdamW at ADAMW_LR_SCALE times them (an Adam step
is not a fraction of the weight norm, so the same number would be a different step; not tuned).
Each arm runs at ``seeds`` pretraining seeds (init, data order and masking).

Judged by: the final masked-LM validation loss and accuracy (against the unigram baseline), the
loss at the end of each phase, and downstream accuracy on a bundled classification task, cross-
validated by document (every passage tested once, by a classifier that never saw its document;
largebatch.finetune): fine-tuned at the same fine-tuning seeds for every arm, and a linear probe of
the frozen encoder. The same architecture from random initialisation ("scratch", a random init per
fine-tuning seed) is the line pretraining has to beat. Quick and full judge on bible-division at
fine-tuning LR 1e-3: on the recipe, folio-genre is not learnable from either encoder, and at 1e-4
the pretrained encoder barely fits (docs/results.md).
Optimizers are compared paired by pretraining seed with a 95% t interval (largebatch/stats.py)
and a noise floor (experiments/floor.py): the first seed's three arms are pretrained again under
each harmless perturbation (another torch thread count, another data order and masking with the
same init, another init with the same data order; smoke size: data order only) and fine-tuned and
probed like the others; a comparison's floor is the largest move of its seed-1337 gap (loss,
fine-tuned or probe accuracy) under them. A difference is stated only when the interval excludes 0
and the mean exceeds the floor; each claim of the paper is then agrees / contradicts / not
resolvable at this scale. With one seed there is no interval and no floor is measured.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from largebatch.experiments import floor as noise_floor
from largebatch.experiments.report import ESCAPE_HEADER, Report, fmt_escape, fmt_loss, markdown_table, plot_validation
from largebatch.experiments.runner import (
    BASE_CONFIG,
    COMMON_OVERRIDES,
    Arm,
    ArmResult,
    Execution,
    arm_threads,
    check_seed_count,
    map_in_processes,
    run_arms,
)
from largebatch.stats import ci95

OPTIMIZERS = ("lans", "lamb", "adamw")
ADAMW_LR_SCALE = 0.1
SEEDS = (None, 7, 11, 23, 42)  # None: the config's defaults (run.seed 1337)
RECIPE = "bert-lans-demo"


@dataclass(frozen=True)
class Setting:
    overrides: dict[str, Any]
    """Changes to the recipe for this size (model, phases' tokens and batches)."""
    seeds: int
    finetune: dict[str, Any]
    """largebatch.finetune.Settings fields."""
    floor: tuple[str, ...] = noise_floor.PERTURBATIONS
    """Perturbations that measure the noise floor (experiments/floor.py); none with one seed."""


_FINETUNE_FULL = {"task": "bible-division", "seeds": 2, "epochs": 3, "lr": 1e-3, "folds": 5,
                  "passage_len": 64, "passages_per_document": 16}
SETTINGS = {
    "smoke": Setting({"model.n_layer": 1, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 32,
                      "data.vocab_size": 512, "data.corpus": "shakespeare", "run.eval_tokens": 2_048,
                      "run.micro_batch": 8, "run.eval_micro_batch": 64,
                      "phases.0.seq_len": 16, "phases.0.total_tokens": 4_096,
                      "phases.1.seq_len": 32, "phases.1.total_tokens": 2_048,
                      "phases.1.micro_batch": 4, "schedule.batch_size": 8,
                      "phases.1.schedule.batch_size": 4},
                     2, {"task": "folio-genre", "seeds": 2, "epochs": 1, "passages_per_document": 2,
                         "batch_size": 8, "folds": 2}, ("data",)),
    "quick": Setting({"model.n_layer": 2, "model.n_embd": 128, "model.n_head": 2, "model.seq_len": 128,
                      "data.vocab_size": 2048, "run.eval_tokens": 16_384,
                      "phases.0.total_tokens": 262_144, "phases.1.seq_len": 128,
                      "phases.1.total_tokens": 65_536},
                     2, {"task": "bible-division", "seeds": 2, "epochs": 2, "passages_per_document": 8,
                         "passage_len": 64, "lr": 1e-3, "folds": 5}),
    "full": Setting({}, 2, _FINETUNE_FULL),
}


def check_seeds(seeds: int) -> int:
    return check_seed_count(seeds, len(SEEDS))


def recipe_lrs() -> list[float]:
    """The recipe's peak LR per phase (a phase without its own keeps [schedule]'s)."""
    from largebatch.train.cli import shipped_configs
    from largebatch.train.config import load_config

    cfg = load_config(shipped_configs()[RECIPE])
    return [float(p.schedule.get("peak_lr", cfg.schedule.peak_lr)) for p in cfg.phases]


def arms(size: str, seeds: int) -> list[Arm]:
    lrs = recipe_lrs()
    out = []
    for seed in SEEDS[:check_seeds(seeds)]:
        for name in OPTIMIZERS:
            scale = ADAMW_LR_SCALE if name == "adamw" else 1.0
            overrides: dict[str, Any] = {"optim.name": name, "schedule.peak_lr": lrs[0] * scale}
            for i, lr in enumerate(lrs):
                overrides[f"phases.{i}.schedule.peak_lr"] = lr * scale
            arm_name, label = name, name
            if seed is not None:
                overrides.update({"run.seed": seed, "data.seed": seed})
                arm_name, label = f"{name}-seed{seed}", f"{name}, seed {seed}"
            out.append(Arm(arm_name, overrides, group=str(seed or 1337), label=label))
    return out


def base(size: str) -> dict[str, Any]:
    from largebatch.train.cli import shipped_configs

    common = {k: v for k, v in COMMON_OVERRIDES.items() if not k.startswith(("schedule.", "model.kind"))}
    common["data.corpus"] = "shakespeare+bible"
    return {BASE_CONFIG: str(shipped_configs()[RECIPE]), **common, **SETTINGS[size].overrides}


def finetune_arms(results: list[ArmResult], settings: dict[str, Any], log=print,
                  jobs: int = 1, keep_dir: Path | None = None) -> tuple[dict, dict]:
    """Downstream accuracy per arm: {arm name: [fine-tuned accuracy per fine-tuning seed]} and
    {arm name: linear-probe accuracy}, each pooled over the document folds; and the scratch line
    (same architecture, a random init per fine-tuning seed), with the pooled majority-class rate.

    Every (encoder, fine-tuning seed) is one task; ``jobs`` > 1 runs them in that many worker
    processes (largebatch.experiments.runner.map_in_processes), with the same numbers as one
    process at the same thread count: each task seeds its own fine-tuning and the probe draws no
    random numbers.

    With ``keep_dir``, each task's outcome is written there as it finishes and a later call (an
    experiment's ``--resume``) reuses it when the settings, fine-tuning seed, thread count and the
    encoder's and tokenizer's runs (their config.toml and summary.json) are unchanged; otherwise the
    task runs again."""
    import numpy as np

    from largebatch.finetune import pooled

    finite = [r for r in results if not r.diverged]
    if not finite:
        return {"finetuned": {}, "probe": {}}, {"scratch": [], "scratch_probe": [], "chance": None}
    first = str(finite[0].run_dir)
    s = _task(first, _key(settings))[0]

    def kept(name: str, seed: int) -> str | None:
        return None if keep_dir is None else str(Path(keep_dir) / f"{name}-seed{seed}.json")

    tasks = [(str(r.run_dir), first, settings, 1000 + k, k == 0, kept(r.arm.name, 1000 + k))
             for r in finite for k in range(s.seeds)]
    tasks += [(None, first, settings, 1000 + k, True, kept("scratch", 1000 + k)) for k in range(s.seeds)]
    if jobs > 1:
        outcomes = map_in_processes(_downstream, tasks, jobs, "downstream fine-tuning")
    else:
        outcomes = [_downstream(*task) for task in tasks]
    accuracy: dict[str, list[float]] = {r.arm.name: [] for r in finite}
    probe: dict[str, float] = {}
    names = [r.arm.name for r in finite for _ in range(s.seeds)] + [None] * s.seeds
    line: dict[str, Any] = {"scratch": [], "scratch_probe": [], "chance": None}
    for name, (acc, probed) in zip(names, outcomes):
        if name is None:
            line["scratch"].append(acc)
            line["scratch_probe"].append(probed)
            continue
        accuracy[name].append(acc)
        if probed is not None:
            probe[name] = probed
    for r in finite:
        log(f"  {r.arm.name}: fine-tuned {statistics.fmean(accuracy[r.arm.name]):.4f}, "
            f"probe {probe[r.arm.name]:.4f}")
    splits = _task(first, _key(settings))[1]
    line["chance"] = pooled(splits, lambda d: int((d.test_labels == np.bincount(d.train_labels).argmax()).sum()))
    return {"finetuned": accuracy, "probe": probe}, line


def _key(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


@functools.lru_cache(maxsize=2)
def _task(first_run: str, settings_key: str):
    """(checked settings, fold splits, model config): the task is built with the first arm's
    tokenizer (every arm trains the same one), once per process."""
    from largebatch.export import load_run
    from largebatch.finetune import Settings, build_task, check_settings, splits_of

    loaded = load_run(first_run, log=lambda _: None)
    s = check_settings(Settings(**json.loads(settings_key)), loaded.model.config.seq_len)
    task = build_task(s.task, loaded.tokenizer, s.passage_len, s.passages_per_document)
    return s, splits_of(task, s), loaded.model.config


def _identity(run_dir: str | None, first_run: str, settings: dict[str, Any], seed: int,
              with_probe: bool) -> str:
    """What a downstream outcome depends on, as text: the task, the thread count, and the bytes of
    the encoder's and the tokenizer's runs' config.toml and summary.json (rewritten whenever a run
    is trained again)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for run in (run_dir, first_run):
        for name in ("config.toml", "summary.json"):
            digest.update(b"-" if run is None else (Path(run) / name).read_bytes())
    return json.dumps({"settings": settings, "seed": seed, "with_probe": with_probe,
                       "threads": torch.get_num_threads(), "runs": digest.hexdigest()}, sort_keys=True)


def _downstream(run_dir: str | None, first_run: str, settings: dict[str, Any], seed: int,
                with_probe: bool, keep: str | None = None) -> tuple[float, float | None]:
    """One fine-tuning seed of one encoder -- the run's in ``run_dir``, or a fresh init (seeded
    with ``seed``) when None -- pooled over the folds; and its linear-probe accuracy if
    ``with_probe``. Each fold fine-tunes its own copy (finetune_arm trains in place). Runs in a
    worker process too. ``keep``: a JSON file holding the outcome, reused if its identity matches
    (finetune_arms), written atomically otherwise."""
    import os


    identity = _identity(run_dir, first_run, settings, seed, with_probe)
    if keep is not None and Path(keep).is_file():
        try:
            saved = json.loads(Path(keep).read_text())
        except ValueError:
            saved = {}
        if saved.get("identity") == identity:
            return saved["accuracy"], saved["probe"]
    outcome = _fine_tune(run_dir, first_run, settings, seed, with_probe)
    if keep is not None:
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{keep}.tmp")
        tmp.write_text(json.dumps({"identity": identity, "accuracy": outcome[0], "probe": outcome[1]}))
        os.replace(tmp, keep)
    return outcome


def _fine_tune(run_dir: str | None, first_run: str, settings: dict[str, Any], seed: int,
               with_probe: bool) -> tuple[float, float | None]:
    """_downstream's computation."""
    import torch

    from largebatch.export import load_run
    from largebatch.finetune import finetune_arm, pooled, probe_accuracy
    from largebatch.models import build_model

    s, splits, config = _task(first_run, _key(settings))
    model = None if run_dir is None else load_run(run_dir, log=lambda _: None).model

    def correct(d):
        torch.manual_seed(seed)
        encoder = build_model(config) if model is None else copy.deepcopy(model).train()
        return round(finetune_arm(encoder, d, s, seed)["test_accuracy"] * len(d.test_ids))

    accuracy = pooled(splits, correct)
    if not with_probe:
        return accuracy, None
    if model is None:
        torch.manual_seed(seed)
        model = build_model(config)
    return accuracy, probe_accuracy(model, splits, s.probe_l2)


def _mean(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f}" if values else "-"


def _interval(values: list[float]) -> str:
    """The 95% t interval of a mean accuracy, cut to [0, 1] (a few runs far apart reach past them)."""
    ci = ci95(values)
    return "" if ci is None else f" [{max(0.0, ci[0]):.4f}, {min(1.0, ci[1]):.4f}]"


PAIRS = (("lans", "lamb"), ("lans", "adamw"), ("lamb", "adamw"))
MEASURES = ("val loss", "fine-tuned accuracy", "probe accuracy")


def _gap(measure: str, a: str, b: str, downstream: dict):
    """diff(results) for floor.compare: ``a``'s value minus ``b``'s in one seed's (or one
    perturbation's) [lans, lamb, adamw] results; nan when an arm diverged (no downstream)."""
    ia, ib = OPTIMIZERS.index(a), OPTIMIZERS.index(b)

    def value(r: ArmResult) -> float:
        if measure == "val loss":
            return r.final_val_loss
        if r.diverged:
            return math.nan
        if measure == "fine-tuned accuracy":
            return statistics.fmean(downstream["finetuned"][r.arm.name])
        return downstream["probe"][r.arm.name]

    return lambda rs: value(rs[ia]) - value(rs[ib])


def comparisons(per_seed: list[list[ArmResult]], perturbed: dict[str, list[ArmResult]],
                downstream: dict) -> list[noise_floor.Comparison]:
    """Every pair x measure, paired by pretraining seed, with its noise floor. The verdict names the
    pair's first optimizer: "lans better" is a lower loss or a higher accuracy than the second's."""
    out = []
    for a, b in PAIRS:
        for measure in MEASURES:
            higher, lower = (f"{a} worse", f"{a} better") if measure == "val loss" else (f"{a} better",
                                                                                          f"{a} worse")
            out.append(noise_floor.compare(f"{a} - {b}: {measure}", _gap(measure, a, b, downstream),
                                           per_seed, perturbed, higher, lower))
    return out


def findings(found: list[noise_floor.Comparison], per_seed: list[list[ArmResult]]) -> str:
    """Each claim of the paper with the verdict of its comparison."""
    by = {c.gaps.name: c for c in found}
    stuck = noise_floor.never_left_plateau(per_seed)
    lamb, adamw = (noise_floor.both_on_plateau(per_seed, OPTIMIZERS.index("lans"), OPTIMIZERS.index(other))
                   for other in ("lamb", "adamw"))  # (seeds at which both pretraining runs stayed on it)
    lines = ["## What this shows\n",
             noise_floor.claim_line("LANS ends below LAMB in masked-LM loss at equal tokens (Zheng et al. 2020)",
                                    by["lans - lamb: val loss"], "lans better", "lans worse", on_plateau=lamb),
             noise_floor.claim_line("LANS's encoder fine-tunes better downstream than LAMB's",
                                    by["lans - lamb: fine-tuned accuracy"], "lans better", "lans worse", unit="",
                                    on_plateau=lamb),
             noise_floor.claim_line("LANS's encoder probes better downstream than LAMB's",
                                    by["lans - lamb: probe accuracy"], "lans better", "lans worse", unit="",
                                    on_plateau=lamb),
             noise_floor.claim_line(f"LANS ends below AdamW (AdamW at {ADAMW_LR_SCALE:g}x the LR, not tuned)",
                                    by["lans - adamw: val loss"], "lans better", "lans worse", on_plateau=adamw),
             f"- Pretraining runs that never leave the unigram plateau: {len(stuck)} of "
             f"{sum(len(rs) for rs in per_seed)}" + (f" ({', '.join(stuck)})." if stuck else "."),
             "- A difference is established only when its 95% interval excludes 0 and it exceeds the noise floor."]
    return "\n".join(lines)


def run(size: str, out_dir: Path, command: str, log=print, execution: Execution = Execution(),
        seeds: int | None = None) -> Report:
    setting = SETTINGS[size]
    n_seeds = check_seeds(seeds or setting.seeds)
    recipe = base(size)
    every = arms(size, n_seeds)
    results = run_arms(every, recipe, out_dir, log, execution)
    n = len(OPTIMIZERS)
    per_seed = [results[i * n:(i + 1) * n] for i in range(n_seeds)]
    threads = arm_threads(execution)
    kinds = setting.floor if n_seeds > 1 else ()
    perturbed = noise_floor.measure(every[:n], per_seed[0], kinds, threads, recipe, out_dir, log, execution)[1]
    extra = [r for rs in perturbed.values() for r in rs]
    downstream, line = finetune_arms(results + extra, setting.finetune, log, execution.jobs,
                                     keep_dir=out_dir / "downstream")
    found = comparisons(per_seed, perturbed, downstream)
    report = Report("bert-lans", "LANS vs LAMB vs AdamW on the two-phase BERT recipe, equal tokens", command,
                    threads=threads)
    first = results[0]
    report.add(f"""The {RECIPE} recipe (two phases, LANS's warmup-hold-decay schedule per phase) with
{', '.join(f'{k} = {v}' for k, v in setting.overrides.items()) or 'no changes'}; {first.tokens:,}
tokens per arm; LANS and LAMB at the recipe's peak LRs {recipe_lrs()}, AdamW at {ADAMW_LR_SCALE}x
them (not tuned). {n_seeds} pretraining seed(s) ({', '.join(noise_floor.seed_name(s) for s in SEEDS[:n_seeds])}:
init, data order and masking). {noise_floor.threads_sentence(threads, kinds)} Downstream:
{setting.finetune['task']}, {setting.finetune['folds']}-fold cross-validation by document, fine-tuned at
{setting.finetune['seeds']} seeds per arm (lr {setting.finetune.get('lr', 1e-4):g}), and a linear probe
(largebatch.finetune).""")
    rows = []
    for name in OPTIMIZERS:
        mine = [r for r in results if r.arm.overrides["optim.name"] == name]
        finite = [r for r in mine if not r.diverged]
        phases = [r.summary.get("phase_val_losses", []) for r in finite]
        per_phase = " / ".join(fmt_loss(statistics.fmean(p[i] for p in phases))
                               for i in range(min(map(len, phases), default=0)))
        acc = [a for r in finite for a in downstream["finetuned"].get(r.arm.name, [])]
        probes = [downstream["probe"][r.arm.name] for r in finite if r.arm.name in downstream["probe"]]
        rows.append([name, f"{len(finite)}/{len(mine)}",
                     _mean([r.final_val_loss for r in finite]),
                     _mean([r.summary.get("final_val_accuracy") for r in finite]),
                     per_phase or "-", _mean(acc) + _interval(acc), _mean(probes)])
    unigram_loss, unigram_acc = first.summary.get("unigram_val_loss"), first.summary.get("unigram_val_accuracy")
    chance = line["chance"]
    report.add("## Mean over pretraining seeds\n\n" + markdown_table(
        ["optimizer", "finished", "final val MLM loss", "final val MLM accuracy",
         "val loss at each phase's end", "fine-tuned accuracy [95% CI over fine-tuning runs]",
         "linear probe accuracy"], rows)
        + f"\n\nUnigram baseline: loss {fmt_loss(unigram_loss)}, accuracy "
        f"{'-' if unigram_acc is None else f'{unigram_acc:.4f}'}. Downstream from random init "
        f"(scratch): fine-tuned {_mean(line['scratch'])}{_interval(line['scratch'])}, probe "
        f"{_mean(line['scratch_probe'])}{_interval(line['scratch_probe'])}; majority class "
        f"{'-' if chance is None else f'{chance:.4f}'}.")
    report.add("## Paired by pretraining seed\n\nOne optimizer's value minus another's at the same "
               "pretraining seed (val loss: lower is better; accuracies: higher is better). The noise "
               "floor is the largest move of the seed-1337 gap when the three arms are pretrained again "
               f"with one harmless change ({', '.join(kinds) or 'not measured: one seed'}).\n\n"
               + markdown_table(["comparison"] + noise_floor.COMPARISON_HEADERS,
                                [[c.gaps.name] + c.row() for c in found]))
    if perturbed:
        report.add("## Noise floor\n\n" + noise_floor.floor_table(
            [c.floor for c in found], threads, "gap (seed 1337)", "comparison"))
    report.add(findings(found, per_seed))
    report.add("## Every run\n\n" + markdown_table(
        ["arm", "final val loss", "final val accuracy", "optimizer steps", ESCAPE_HEADER,
         "downstream accuracy per seed", "probe accuracy"],
        [[r.arm.name, fmt_loss(r.final_val_loss),
          "-" if r.diverged else f"{r.summary.get('final_val_accuracy', float('nan')):.4f}", r.steps, fmt_escape(r),
          ", ".join(f"{a:.4f}" for a in downstream["finetuned"].get(r.arm.name, [])),
          _mean([downstream["probe"][r.arm.name]] if r.arm.name in downstream["probe"] else [])]
         for r in results + extra]))
    report.plots.append(plot_validation(results, out_dir / "val_loss.png",
                                        "Two-phase BERT: validation MLM loss per optimizer").name)
    return report
