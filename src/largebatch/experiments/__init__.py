"""Reproduce the papers' claims at small scale: controlled comparisons on real text, with reports.

    largebatch experiment seesaw --quick        # Meterez et al. 2025 (Seesaw vs cosine)
    largebatch experiment optimizers --quick    # You et al. 2017 (LARS), 2019 (LAMB); Zheng et al. 2020 (LANS)
    largebatch experiment recompute --quick     # Korthikanti et al. 2022 (recomputation, memory model)
    largebatch experiment noise-scale --quick   # McCandlish et al. 2018 (gradient noise scale)

    from largebatch.experiments import run_experiment
    report_md = run_experiment("seesaw", size="quick", out_dir="runs/seesaw")

Each experiment trains its arms sequentially in-process through largebatch.train and writes
OUT/report.md (tables + the reproducing command), PNG plots and OUT/runs/<arm>/ (metrics.jsonl,
config.toml, summary.json). Formulas: docs/papers.md. Results: docs/results.md.
"""

from largebatch.experiments.cli import EXPERIMENTS, run_experiment

__all__ = ["EXPERIMENTS", "run_experiment"]
