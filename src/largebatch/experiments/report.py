"""Write an experiment's report directory: report.md (tables + the exact command), PNG plots and
the arms' run directories (raw metrics) under runs/.

Numbers in report tables are formatted here and nowhere else (``fmt_loss``: 4 decimals), so a
reader -- or the test -- can recompute each from the run's metrics.jsonl.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from matplotlib.figure import Figure

from largebatch.arguments import token_formatter
from largebatch.checkpoint.files import atomic_write_text
from largebatch.experiments.runner import ESCAPE_NATS, ArmResult  # noqa: E402


def fmt_loss(x: float | None) -> str:
    """A loss to 4 decimals; "n/a" when missing, "diverged" for a run that stopped on a non-finite loss."""
    if x is None:
        return "n/a"
    return "diverged" if math.isinf(x) else f"{x:.4f}"


def fmt_escape(result: ArmResult) -> str:
    """When a run left the unigram plateau (ArmResult.plateau_escape): "step 41 (21%)" -- the optimizer
    step and the share of its tokens seen by then -- or "never"."""
    escape = result.plateau_escape
    return "never" if escape is None else f"step {escape[0]:.0f} ({100 * escape[1]:.0f}%)"


ESCAPE_HEADER = f"off the plateau (val < unigram - {ESCAPE_NATS:g})"


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Report:
    """What an experiment found: a title, the command that reproduces it, markdown sections."""

    name: str
    title: str
    command: str
    sections: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time of the invocation that wrote the report."""
    kept: list[tuple[str, float]] = field(default_factory=list)
    """(arm, its own wall seconds) of every arm an earlier invocation trained and --resume kept."""
    arms: bool = True
    """Whether the experiment trains arms, each in runs/<arm>/ (recompute measures in-process)."""
    threads: int | None = None
    """Torch threads per arm (runner.arm_threads); None: this process's count (an in-process report)."""

    def _time_scope(self) -> str:
        if not self.kept:
            return "in all"
        return (f"in this invocation, which kept {len(self.kept)} arm(s) trained by an earlier one "
                f"(--resume); those took {sum(w for _, w in self.kept):.0f} s more, the sum of their "
                "own wall times (runs/<arm>/arm.json)")

    def add(self, text: str) -> None:
        self.sections.append(text.strip())

    def write(self, out_dir: str | Path) -> Path:
        out_dir = Path(out_dir)
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        import torch

        threads = torch.get_num_threads() if self.threads is None else self.threads
        device = (torch.cuda.get_device_name() if torch.cuda.is_available()
                  else f"{platform.machine()} CPU ({threads} torch thread(s) per arm)" if self.arms
                  else f"{platform.machine()} CPU ({threads} torch thread(s))")
        # the results change with the thread count (summation order): the command names the one it ran at
        command = self.command if self.command.startswith("OMP_NUM_THREADS=") else \
            f"OMP_NUM_THREADS={torch.get_num_threads()} {self.command}"
        header = [f"# {self.title}", "",
                  f"Reproduce: `{command}`", "",
                  f"Measured {stamp} on {device}, fp32, torch {torch.__version__}; "
                  f"{self.seconds:.0f} s {self._time_scope()}."
                  + (" Raw metrics: `runs/<arm>/metrics.jsonl`." if self.arms else ""), ""]
        body = "\n\n".join(self.sections)
        images = "\n".join(f"![{p}]({p})" for p in self.plots)
        path = out_dir / "report.md"
        # atomically: a kill or a full disk leaves the previous report or none, never half of one
        atomic_write_text(path, "\n".join(header) + "\n" + body + "\n\n## Plots\n\n" + images + "\n")
        return path


def finish_figure(fig, axes, path: Path, title: str | None = None, legend_axes=()) -> Path:
    """Grid on every axis, legends where asked, a title, save as PNG (a pyplot-free Figure: nothing to close)."""
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in legend_axes:
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:  # a full disk: the image writer's error names no file
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    return path


def plot_validation(results: list[ArmResult], path: Path, title: str) -> Path:
    """Validation loss against tokens (left) and against optimizer steps (right), one line per arm.
    Arms of the same group share a line style; colours follow the arm order within a group."""
    fig = Figure(figsize=(12, 4.5))
    ax_tokens, ax_steps = fig.subplots(1, 2, sharey=True)
    groups = list(dict.fromkeys(r.arm.group for r in results))
    styles = ["-", "--", ":", "-."]
    colours: dict[str, int] = {}
    for r in results:
        colour = f"C{colours.setdefault(r.arm.group, 0)}"
        colours[r.arm.group] += 1
        style = styles[groups.index(r.arm.group) % len(styles)]
        tokens = [v["tokens"] for v in r.val]
        steps = [v["step"] for v in r.val]
        losses = [v["val_loss"] for v in r.val]
        label = f"{r.arm.group}: {r.arm.legend}" if r.arm.group else r.arm.legend
        ax_tokens.plot(tokens, losses, style, color=colour, marker=".", label=label)
        ax_steps.plot(steps, losses, style, color=colour, marker=".", label=label)
    ax_tokens.set(xlabel="tokens", ylabel="validation loss (nats/token)", title="vs tokens")
    ax_tokens.xaxis.set_major_formatter(token_formatter())
    ax_steps.set(xlabel="optimizer steps", title="vs optimizer steps")
    _set_loss_limits(ax_tokens, results)
    return finish_figure(fig, (ax_tokens, ax_steps), path, title, legend_axes=(ax_steps,))


def _set_loss_limits(ax, results: list[ArmResult]) -> None:
    """Start the y axis just above the first evaluations so the interesting end is readable."""
    finals = [r.final_val_loss for r in results if math.isfinite(r.final_val_loss)]
    later = [v["val_loss"] for r in results for v in r.val[len(r.val) // 4:] if math.isfinite(v["val_loss"])]
    if later and finals:
        ax.set_ylim(min(finals) - 0.05, max(later) + 0.05)


def plot_schedules(results: list[ArmResult], path: Path, title: str) -> Path:
    """The realised learning rate and batch size against tokens, one line per arm."""
    fig = Figure(figsize=(12, 4))
    ax_lr, ax_batch = fig.subplots(1, 2)
    for i, r in enumerate(results):
        tokens = [t["tokens"] for t in r.train]
        label = f"{r.arm.group}: {r.arm.legend}" if r.arm.group else r.arm.legend
        ax_lr.plot(tokens, [t["lr"] for t in r.train], color=f"C{i % 10}", label=label)
        ax_batch.step(tokens, [t["batch_size"] for t in r.train], where="post", color=f"C{i % 10}",
                      label=label)
    ax_lr.set(xlabel="tokens", ylabel="learning rate", title="learning rate")
    ax_batch.set(xlabel="tokens", ylabel="batch size (sequences)", title="batch size", yscale="log")
    for ax in (ax_lr, ax_batch):
        ax.xaxis.set_major_formatter(token_formatter())
    return finish_figure(fig, (ax_lr, ax_batch), path, title, legend_axes=(ax_batch,))
