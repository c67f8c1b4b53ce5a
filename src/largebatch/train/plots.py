"""A run's PNG plots, written at its end from metrics.jsonl: loss.png (loss vs tokens and vs steps)
and schedule.png (LR and batch size vs tokens), with a dashed line where each [[phases]] phase
begins. matplotlib (the [train] extra) is imported on use."""

from __future__ import annotations

from pathlib import Path

from largebatch.train.metrics import read_metrics


def phase_boundaries(train: list[dict]) -> list[tuple[int, int, int, int]]:
    """(tokens, step, new phase, its seq_len) where a phase begins: the tokens and step at the end of
    the phase before, read from consecutive train records."""
    return [(a["tokens"], a["step"], b["phase"], b.get("seq_len")) for a, b in zip(train, train[1:])
            if a.get("phase", 0) != b.get("phase", 0)]


def _mark_phases(ax, boundaries: list[tuple[int, int, int, int]], by_step: bool = False) -> None:
    for tokens, step, phase, seq_len in boundaries:
        ax.axvline(step if by_step else tokens, color="grey", ls="--", lw=1)
        ax.annotate(f"phase {phase}" + (f" (seq {seq_len})" if seq_len else ""),
                    (step if by_step else tokens, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=8, color="grey")


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write loss.png (vs tokens and vs steps) and schedule.png (LR, batch vs tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    if not train:
        return []
    out = []
    boundaries = phase_boundaries(train)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "tokens", "tokens seen"), (axes[1], "step", "optimizer step")):
        ax.plot([r[key] for r in train], [r["loss"] for r in train], lw=1, label="train")
        if val:
            ax.plot([r[key] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
        _mark_phases(ax, boundaries, by_step=key == "step")
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "loss.png")

    fig, ax1 = plt.subplots(figsize=(7, 4))
    tokens = [r["tokens"] for r in train]
    ax1.plot(tokens, [r["lr"] for r in train], color="tab:blue")
    ax1.set_xlabel("tokens seen")
    ax1.set_ylabel("learning rate", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step(tokens, [r["batch_size"] for r in train], color="tab:orange", where="post")
    ax2.set_ylabel("batch size (sequences)", color="tab:orange")
    _mark_phases(ax1, boundaries)
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "schedule.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "schedule.png")
    return out
