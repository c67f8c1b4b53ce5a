"""LAMB, LANS and LARS with capturable=True and a 0-d device tensor LR, captured in a CUDA graph.

What only a GPU shows: a step that read anything on the host (a step count, a hyperparameter, an LR
with .item()) cannot be captured. Each optimizer steps a small model eagerly for 3 steps, then the
same step is captured once (torch.cuda.graph) and replayed for 5 steps, the LR changed in place
between replays as a scheduler would; the replayed parameters are compared with an eager twin run
from the same state. Prints one line per optimizer: captured or the error, and the largest
difference. On CPU the same logic (no host read in a step, the tensor LR used where it lives) is
tests/test_optim_capturable.py::test_a_tensor_lr_is_used_on_its_device_and_never_read.

    PYTHONPATH=src python benchmarks/capturable_graph.py      (a CUDA device; exits 0 without one)
"""

from __future__ import annotations

import copy
import sys

import torch

from largebatch.optim import LAMB, LANS, LARS


def check(cls, device: torch.device, **kwargs) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).to(device)
    twin = copy.deepcopy(model)
    lr = torch.tensor(kwargs.pop("lr"), device=device)
    lr_twin = lr.clone()
    opt = cls(model.parameters(), lr=lr, capturable=True, **kwargs)
    opt_twin = cls(twin.parameters(), lr=lr_twin, capturable=True, **kwargs)
    x = torch.randn(32, 256, device=device)
    for m in (model, twin):  # static gradients: the graph replays the optimizer step alone
        m(x).square().mean().backward()
    for _ in range(3):  # warm-up on a side stream, as torch's capture recipe asks
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            opt.step()
        torch.cuda.current_stream().wait_stream(stream)
        opt_twin.step()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            opt.step()
    except Exception as exc:  # noqa: BLE001 -- any capture failure is the finding
        return f"NOT captured: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    for k in range(5):
        if k == 2:  # a scheduler's in-place change, seen by the replay
            lr.mul_(0.5)
            lr_twin.mul_(0.5)
        graph.replay()
        opt_twin.step()
    torch.cuda.synchronize()
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))
    return f"captured; 5 replays vs eager: max |diff| {diff:.2e}"


def main() -> int:
    if not torch.cuda.is_available():
        print("capturable_graph: no CUDA device; nothing to check")
        return 0
    device = torch.device("cuda")
    for name, cls, kwargs in (("LAMB", LAMB, {"lr": 1e-3}), ("LANS", LANS, {"lr": 1e-3}),
                              ("LARS", LARS, {"lr": 0.5, "weight_decay": 1e-4})):
        print(f"{name:5s} capturable, tensor lr: {check(cls, device, **kwargs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
