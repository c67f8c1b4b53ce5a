"""What run.time_limit does not count: the seconds from a stopped run's `stopped after ...` line (its
checkpoint in place) to the process's exit (closing the logs, TensorBoard, W&B, the process group, the
interpreter), timed from outside the process. Runs gpt-demo, 2 layers x 64, under a 15 s limit, with
TensorBoard on and off (any other `largebatch train` arguments may be appended).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/time_limit_exit.py [--run.time_limit=15 ...]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time


def main() -> None:
    for tensorboard in ("true", "false"):
        with tempfile.TemporaryDirectory(prefix="time-limit-") as out:
            args = [sys.executable, "-m", "largebatch", "train", "gpt-demo", "--model.n_layer=2", "--model.n_embd=64",
                    "--run.time_limit=15", f"--run.tensorboard={tensorboard}", "--run.progress=off",
                    f"--run.out_dir={out}/run", *sys.argv[1:]]
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            stopped = None
            for line in proc.stdout:
                if line.startswith("stopped after"):
                    stopped = time.monotonic()
            proc.wait()
            after = "no stop" if stopped is None else f"{time.monotonic() - stopped:.2f} s"
            print(f"tensorboard={tensorboard}: exit {proc.returncode}; from the 'stopped' line to the exit: {after}")


if __name__ == "__main__":
    main()
