"""A run's PNG plots, written at its end from metrics.jsonl: loss.png (loss vs tokens and vs steps)
and schedule.png (LR and batch size vs tokens), with a dashed line where each [[phases]] phase
begins. matplotlib (the [train] extra) is imported on use."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path

import numpy as np

from largebatch.arguments import token_formatter
from largebatch.train.metrics import iter_metrics


def phase_boundaries(train: Iterable[dict]) -> list[tuple[int, int, int, int]]:
    """(tokens, step, new phase, its seq_len) where a phase begins: the tokens and step at the end of
    the phase before, read from consecutive train records."""
    return [(a["tokens"], a["step"], b["phase"], b.get("seq_len")) for a, b in pairwise(train)
            if a.get("phase", 0) != b.get("phase", 0)]


def _mark_phases(ax, boundaries: list[tuple[int, int, int, int]], by_step: bool = False) -> None:
    for tokens, step, phase, seq_len in boundaries:
        ax.axvline(step if by_step else tokens, color="grey", ls="--", lw=1)
        ax.annotate(f"phase {phase}" + (f" (seq {seq_len})" if seq_len else ""),
                    (step if by_step else tokens, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=8, color="grey")


MAX_POINTS = 2000
"""The most points a line is drawn with (about twice the pixels across a panel): a longer run's train
loss is drawn as the mean of equal bins of consecutive steps, with a band from the bin's least to its
greatest loss, and its LR and batch at the last step of each bin."""

TRAIN_FIELDS = ("step", "tokens", "loss", "lr", "batch_size", "phase", "seq_len")


def _columns(run_dir: Path) -> tuple[dict[str, list], dict[str, list]]:
    """The fields the plots draw, per train and validation record, read a record at a time."""
    train: dict[str, list] = {key: [] for key in TRAIN_FIELDS}
    val: dict[str, list] = {"step": [], "tokens": [], "val_loss": [], "val_loss_ema": []}
    for record in iter_metrics(run_dir):
        kind = record.get("kind")
        columns = train if kind == "train" else val if kind == "val" else None
        if columns is not None:
            for key, column in columns.items():
                column.append(record.get(key, 0 if key == "phase" else None))
    return train, val


def _float(values: list) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _binned(x: list, y: list, limit: int = MAX_POINTS) -> tuple[np.ndarray, ...]:
    """(x, mean y, least y, greatest y) over equal bins of consecutive points, at most ``limit`` of
    them (each x the bin's mean); the points themselves (and no band: None) when there are fewer."""
    xs, ys = _float(x), _float(y)
    if len(xs) <= limit:
        return xs, ys, None, None
    size = -(-len(xs) // limit)
    pad = np.full((-len(xs)) % size, np.nan)
    xs, ys = (np.concatenate([v, pad]).reshape(-1, size) for v in (xs, ys))
    with warnings.catch_warnings():  # a bin of non-finite losses only (skipped steps) is a gap
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(xs, 1), np.nanmean(ys, 1), np.nanmin(ys, 1), np.nanmax(ys, 1)


def _sampled(x: list, y: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    """At most ``limit`` of the points, evenly spaced, the last one always among them."""
    if len(x) <= limit:
        return x, y
    size = -(-len(x) // limit)
    index = list(range(size - 1, len(x), size))
    if index[-1] != len(x) - 1:
        index.append(len(x) - 1)
    return [x[i] for i in index], [y[i] for i in index]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write loss.png (vs tokens and vs steps) and schedule.png (LR, batch vs tokens)."""
    from matplotlib.figure import Figure  # not pyplot: the caller's backend and figures are left alone

    run_dir = Path(run_dir)
    train, val = _columns(run_dir)
    if not train["step"]:
        return []
    out = []
    boundaries = phase_boundaries(dict(zip(TRAIN_FIELDS, values)) for values in zip(*train.values()))
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for ax, key, label in ((axes[0], "tokens", "tokens seen"), (axes[1], "step", "optimizer step")):
        x, mean, least, greatest = _binned(train[key], train["loss"])
        if least is None:
            ax.plot(x, mean, lw=1, label="train")
        else:
            size = -(-len(train[key]) // MAX_POINTS)
            ax.fill_between(x, least, greatest, alpha=0.25, lw=0, color="tab:blue")
            ax.plot(x, mean, lw=1, color="tab:blue", label=f"train (mean of {size} steps; band: least to greatest)")
        if val["step"]:
            x, mean, _, _ = _binned(val[key], val["val_loss"])
            ax.plot(x, mean, "o-" if len(x) <= 100 else "-", color="tab:orange", label="validation")
            if any(v is not None for v in val["val_loss_ema"]):  # run.ema_decay: the weight average's
                x, mean, _, _ = _binned(val[key], val["val_loss_ema"])
                ax.plot(x, mean, "s--" if len(x) <= 100 else "--", color="tab:green", ms=3,
                        label="validation, weight average")
        _mark_phases(ax, boundaries, by_step=key == "step")
        ax.set_xlabel(label)
        if key == "tokens":
            ax.xaxis.set_major_formatter(token_formatter())
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    out.append(run_dir / "loss.png")

    fig = Figure(figsize=(7, 4))
    ax1 = fig.subplots()
    ax1.plot(*_sampled(train["tokens"], train["lr"]), color="tab:blue")
    ax1.set_xlabel("tokens seen")
    ax1.xaxis.set_major_formatter(token_formatter())
    ax1.set_ylabel("learning rate", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step(*_sampled(train["tokens"], train["batch_size"]), color="tab:orange", where="post")
    ax2.set_ylabel("batch size (sequences)", color="tab:orange")
    _mark_phases(ax1, boundaries)
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "schedule.png", dpi=110)
    out.append(run_dir / "schedule.png")
    return out
