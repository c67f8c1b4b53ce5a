"""What a long run's ``metrics.jsonl`` costs at a restart and at the end-of-run plots.

Writes a synthetic history of N train records (the trainer's record layout: 449 bytes each, two
phases) with a validation record every 1,000 steps, then times, each in a fresh process so peak RSS
is its own:

* ``resume``: ``MetricsLog(resume_step=N - 1000)``, the cut a restart makes (read from the end);
* ``resume (every record)``: the peer it replaced, in the same run: parse every record, keep those
  up to the step and write them back (what a resume cost when it rewrote the history);
* ``plots``: ``plot_run`` (records read a line at a time, a long loss drawn as bin means).

    PYTHONPATH=src python benchmarks/metrics_history.py [--steps 1000000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RECORD = {"kind": "train", "phase": 0, "seq_len": 64, "step": 0, "tokens": 0, "loss": 6.0,
          "lr": 0.001, "batch_size": 8, "tokens_per_s": 8000.0, "mfu": 0.12, "mem_bytes": 1.5e9,
          "grad_norm": 0.8, "trust_min": 0.009, "trust_median": 0.02, "trust_max": 0.04,
          "pinned": 0, "noise_scale": 5.25, "noise_g2": 0.71, "noise_s": 3.72, "skipped_steps": 0,
          "micro_batches": 1, "window_steps": 1, "window_seconds": 0.06, "step_seconds": 0.06}

CASES = {
    "resume": "from largebatch.train.metrics import MetricsLog\n"
              "MetricsLog(D, tensorboard=False, resume_step=S).close()",
    "resume (every record)": "import json\nfrom largebatch.train.metrics import read_metrics\n"
                             "kept = [r for r in read_metrics(D) if r['step'] <= S]\n"
                             "(D / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in kept))",
    "plots": "from largebatch.train.plots import plot_run\nplot_run(D)",
}


def write_history(path: Path, steps: int) -> None:
    with open(path, "w") as file:
        for step in range(1, steps + 1):
            loss = 7.0 / (1 + step / 1000) ** 0.3
            file.write(json.dumps({**RECORD, "step": step, "tokens": 512 * step, "loss": loss,
                                   "phase": int(step > 0.6 * steps)}) + "\n")
            if step % 1000 == 0:
                file.write(json.dumps({"kind": "val", "step": step, "tokens": 512 * step,
                                       "val_loss": loss + 0.1}) + "\n")


def run_case(code: str, run_dir: Path, step: int) -> tuple[float, float]:
    """(seconds, peak RSS in GB) of ``code`` in a fresh process: the seconds exclude the imports, the peak
    RSS is the whole process's (interpreter and imports included)."""
    script = (f"import resource, time\nfrom pathlib import Path\nD, S = Path({str(run_dir)!r}), {step}\n"
              "import largebatch.train.plots, largebatch.train.metrics\n"
              f"t = time.perf_counter()\n{code}\n"
              "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    seconds, rss = out.split()
    return float(seconds), float(rss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        path = run_dir / "metrics.jsonl"
        write_history(path, args.steps)
        size = path.stat().st_size
        print(f"metrics.jsonl: {args.steps:,} steps, {size / 1e6:.0f} MB")
        results = {}
        for name, code in CASES.items():
            if path.stat().st_size != size:  # the cut before shortened it
                write_history(path, args.steps)
            results[name] = run_case(code, run_dir, args.steps - 1000)
            print(f"{name:24s} {results[name][0]:8.3f} s   peak RSS {results[name][1]:.2f} GB", flush=True)
        ratio = results["resume (every record)"][0] / max(results["resume"][0], 1e-9)
        print(f"resume: {ratio:,.0f}x faster than parsing and rewriting every record")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
