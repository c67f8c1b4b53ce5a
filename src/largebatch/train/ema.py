"""``run.ema_decay``: an exponential moving average of the weights, kept beside the training.

Averaging the iterates of stochastic gradient descent (Polyak & Juditsky 1992, "Acceleration of
stochastic approximation by averaging") removes noise the last iterate carries, at the price of
lagging behind it while the loss still falls fast; an exponential average forgets the early,
far-off weights. Which wins depends on the run: docs/training.md, "Weight averaging", measures
both through a warmup-stable-decay schedule.

After optimizer step n (n counting the steps taken, a skipped one not counted) with weights w_n and
decay d, the average is the bias-corrected exponential average

    a_n = sum_{k=1..n} d^(n-k) w_k  /  sum_{k=1..n} d^(n-k)
        = sum_{k=1..n} d^(n-k) (1 - d) w_k / (1 - d^n),

kept by the recursion a_n = a_{n-1} + beta_n (w_n - a_{n-1}) with beta_n = (1 - d) / (1 - d^n)
(beta_1 = 1: a_1 = w_1). It is the correction Adam applies to its moment estimates (Kingma & Ba
2015, Algorithm 1), here with a running weight instead of a final division, so that the average
never leans toward the initial weights (``torch.optim.swa_utils.get_ema_multi_avg_fn`` starts from
w_1 and keeps weight d^(n-1) on it: 0.37 after 1,000 steps at d = 0.999; here it is 0.0006).

The average is one tensor per parameter of the optimizer, in the parameter's dtype and sharded as
it is (FSDP shards, tensor-parallel DTensors, this rank's pipeline stages), updated on the device
with one multi-tensor lerp and no host read: beta_n comes from a device step count, zero for a
step ``run.on_nonfinite = "skip"`` took back. An evaluation copies the average into the parameters,
evaluates, and copies the weights back (exactly: a copy, not arithmetic), so the training is the
same, to the bit, with the average or without it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["WeightAverage"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``, a view of its storage (no autograd: the average and its copies run
    without it; ``to_local`` costs ~12 us a tensor on the host, every step)."""
    return t._local_tensor if isinstance(t, DTensor) else t


class WeightAverage:
    """The bias-corrected exponential moving average of an optimizer's parameters (module docstring).

    Each parameter is named as in the model's state dict: by its group's ``names`` (the groups of
    largebatch.optim.param_groups carry them), else by ``model``'s ``named_parameters`` (an optimizer
    whose groups were built otherwise). The average starts as a copy of the parameters with a step
    count of 0: its first update replaces it with the weights after that step."""

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float, device: torch.device,
                 model: torch.nn.Module | None = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay = {decay}: must lie strictly between 0 and 1")
        self.decay = float(decay)
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        named = None
        for index, group in enumerate(optimizer.param_groups):
            names = group.get("names")
            if names is None or len(names) != len(group["params"]):
                if named is None:
                    named = {id(p): name for name, p in (model.named_parameters() if model is not None else ())}
                names = [named.get(id(p)) for p in group["params"]]
                if None in names:
                    raise ValueError(f"param_groups[{index}] holds a tensor that is no parameter of the model, and "
                                     "the weight average is saved and exported under the model's parameter "
                                     "names: give the optimizer the model's parameters")
            self.params.extend(group["params"])
            self.names.extend(names)
        with torch.no_grad():
            self.tensors = [p.detach().clone() for p in self.params]
        self.steps = torch.zeros((), dtype=torch.int64, device=device)  # updates taken (device: no read)

    @torch.no_grad()
    def update(self, finite: torch.Tensor | None = None) -> None:
        """Fold in the parameters as they are after an optimizer step; ``finite`` (a 0-d bool on the
        device, or None for True): False leaves the average and its count as they were."""
        if finite is None:
            finite = torch.ones((), dtype=torch.bool, device=self.steps.device)
        self.steps += finite
        n = self.steps.clamp(min=1).to(torch.float64)
        beta = torch.where(finite, (1.0 - self.decay) / (1.0 - torch.pow(self.decay, n)), 0.0)
        by_dtype = {dtype: beta.to(dtype) for dtype in {p.dtype for p in self.params}}  # (one cast a dtype)
        weights = [by_dtype[p.dtype] for p in self.params]
        torch._foreach_lerp_([_local(a) for a in self.tensors], [_local(p) for p in self.params], weights)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The average in the parameters for the duration (an evaluation); the weights copied back
        after, bit for bit, whatever happens inside. Costs a copy of the parameters meanwhile."""
        with torch.no_grad():
            live = [_local(p) for p in self.params]
            kept = [t.clone() for t in live]
            torch._foreach_copy_(live, [_local(a) for a in self.tensors])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, kept)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average by parameter name (DTensors where the parameters are): a checkpoint's ``ema``."""
        return dict(zip(self.names, self.tensors))

    def step_count(self) -> int:
        """The updates taken (a host read)."""
        return int(self.steps)

    @torch.no_grad()
    def load(self, tensors: dict[str, Any], steps: int) -> None:
        """Put a checkpoint's average (by name: full tensors, cut to this rank's shards where the
        parameters are DTensors, or DTensors already shaped as here) and its count in place."""
        from largebatch.checkpoint.distributed import _shard_like

        missing = [name for name in self.names if name not in tensors]
        if missing:
            raise ValueError(f"the checkpoint's weight average has no {missing[0]!r} "
                             f"({len(missing)} parameter(s) missing): it was written for another model")
        for name, mine in zip(self.names, self.tensors):
            value = tensors[name]
            if isinstance(mine, DTensor) and not isinstance(value, DTensor):
                value = _shard_like(value, mine)
            source = _local(value)
            if tuple(source.shape) != tuple(_local(mine).shape):
                raise ValueError(f"the checkpoint's weight average of {name!r} has shape {tuple(source.shape)} "
                                 f"where the model has {tuple(_local(mine).shape)}")
            _local(mine).copy_(source)
        self.steps.fill_(int(steps))

    @torch.no_grad()
    def restart(self) -> None:
        """Start again from the parameters as they are now (a resumed run whose checkpoint holds no
        average)."""
        torch._foreach_copy_([_local(a) for a in self.tensors], [_local(p) for p in self.params])
        self.steps.zero_()
