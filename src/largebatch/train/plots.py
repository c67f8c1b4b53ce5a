"""A run's PNG plots, written at its end from metrics.jsonl: loss.png (loss vs tokens and vs steps)
and schedule.png (LR and batch size vs tokens). matplotlib (the [train] extra) is imported on use."""

from __future__ import annotations

from pathlib import Path

from largebatch.train.metrics import read_metrics


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
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "tokens", "tokens seen"), (axes[1], "step", "optimizer step")):
        ax.plot([r[key] for r in train], [r["loss"] for r in train], lw=1, label="train")
        if val:
            ax.plot([r[key] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
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
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "schedule.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "schedule.png")
    return out
