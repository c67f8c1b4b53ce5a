"""What run.ema_decay costs a step: the weight average's update (largebatch.train.ema.WeightAverage:
a device step count and one multi-tensor lerp, no host read) against torch's own exponential average
(``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn``, which has no bias correction
and reads nothing either), and against the optimizer step it follows (LAMB), on GPT-2 small's
parameters. Also the evaluation's swap: the average copied into the parameters and the weights back.

Interleaved rounds; each number is the median over the rounds of the mean over ``--repeat`` calls.

    PYTHONPATH=src python benchmarks/weight_average.py [--preset gpt2-small] [--rounds 5] [--repeat 5]
    PYTHONPATH=src python benchmarks/weight_average.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from largebatch.models import build_model, preset
from largebatch.optim import LAMB, param_groups
from largebatch.train.ema import WeightAverage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(preset(args.preset)).to(device)
    optimizer = LAMB(param_groups(model), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # the state exists from here
    ours = WeightAverage(optimizer, 0.999, device)
    theirs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=False)
    theirs.update_parameters(model)  # its first call copies; the average follows from the second
    finite = torch.ones((), dtype=torch.bool, device=device)

    def swap() -> None:
        with ours.applied():
            pass

    cases = {"LAMB step": optimizer.step, "average, ours": lambda: ours.update(finite),
             "average, torch AveragedModel": lambda: theirs.update_parameters(model),
             "evaluation swap (both ways)": swap}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            fn()  # warm
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(args.repeat):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) / args.repeat)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {n / 1e6:.1f}M parameters, {len(ours.params)} tensors, {device}, "
          f"{torch.get_num_threads()} thread(s), median of {args.rounds} rounds x {args.repeat} calls")
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(f"  {name:<30} {1e3 * value:8.2f} ms")
    peer = median["average, torch AveragedModel"]
    print(f"ratio: ours / torch's AveragedModel = {median['average, ours'] / peer:.2f}x; "
          f"ours / LAMB step = {median['average, ours'] / median['LAMB step']:.2f}x; "
          f"swap / LAMB step = {median['evaluation swap (both ways)'] / median['LAMB step']:.2f}x")


if __name__ == "__main__":
    main()
