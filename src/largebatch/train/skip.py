"""``run.on_nonfinite = "skip"`` decided on the device: a skipped step costs no host read.

Whether a step's loss and gradient norm are finite is a 0-d bool on the device. Reading it on the
host every step would stall the queue (train.deferred), so the optimizer always steps and the
update is then taken back on the device where the flag says so:

* before the step, a copy of every parameter (its local shard) and of every optimizer-state tensor
  on the device; after it, ``x <- where(finite, x_new, x_old)`` for each. A skipped step leaves them
  bit-identical (``torch.where`` selects, it does not compute), whatever the optimizer (LAMB, LANS,
  LARS, AdamW, fused or not). State the step created leaves zeros, the value it starts from.
  Cost: one extra copy of the parameters and the optimizer state while the step runs.
* step counts are optimizer state like the rest: under skip the trainer builds LAMB, LANS and LARS
  with ``capturable=True`` (their counts are device tensors and their bias corrections are computed
  on the device), so a skipped step leaves every count as it was and the next step's bias
  corrections use the right t: a run with skipped steps equals one that never took them, bit for
  bit (tests/test_train_skip.py). AdamW keeps device counts on a CPU run and when fused.
* counters the device cannot rewrite without a read -- AdamW(foreach)'s CPU step tensors on an
  accelerator, or the Python ints of a registered optimizer -- are corrected at the next host read:
  the device counts the skips since the last read and each such counter is lowered by that many
  (between a skip and that read they run ahead by the skips).
* the consecutive-skip count (``run.max_skipped_steps``) is kept on the device, with the step at
  which it first reached the limit; the run gives up at the next host read (a log, an evaluation, a
  checkpoint: at most ``run.log_every_steps`` steps late), naming that step, as a per-step read
  would. No checkpoint is written past it (checkpoints read first).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DeviceSkip:
    """Skip non-finite optimizer steps on the device; ``settle`` reads the counts once per log."""

    def __init__(self, device: torch.device, limit: int | None, skipped_steps: int = 0, skipped_in_a_row: int = 0):
        self.device, self.limit = device, limit
        # (consecutive skips, all skips, skips since the last read) and the give-up record
        # (step, consecutive, all) of the first step that reached the limit; step -1: none yet
        self.counts = torch.tensor([skipped_in_a_row, skipped_steps, 0], dtype=torch.int64, device=device)
        self.give_up = torch.full((3,), -1, dtype=torch.int64, device=device)

    def step(self, optimizer: torch.optim.Optimizer, finite: torch.Tensor, step: int,
             bad: torch.Tensor | None = None) -> None:
        """``optimizer.step()``, undone on the device unless ``finite`` (0-d bool); ``step``: its number.
        ``bad`` (0-d bool; default ``~finite``): whether the step counts as non-finite toward
        run.max_skipped_steps -- an fp16 step skipped for overflow (largebatch.train.loss_scale) is
        taken back without counting, and leaves the consecutive count as it was."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        before = {id(p): {key: _local(v).clone() for key, v in optimizer.state[p].items()
                          if isinstance(v, torch.Tensor) and v.device == finite.device}
                  for p in params if p in optimizer.state}
        values = [_local(p.detach()).clone() for p in params]
        optimizer.step()
        with torch.no_grad():
            for p, old in zip(params, values):
                x = _local(p.detach())
                x.copy_(torch.where(finite, x, old))
                saved = before.get(id(p), {})
                for key, v in optimizer.state[p].items():
                    if isinstance(v, torch.Tensor) and v.device == finite.device:
                        v = _local(v)
                        v.copy_(torch.where(finite, v, saved[key] if key in saved else torch.zeros_like(v)))
        counted = (~finite if bad is None else bad).long()
        in_a_row = (self.counts[0] + counted) * (~finite).long()  # a step taken starts it again
        self.counts = torch.stack([in_a_row, self.counts[1] + counted, self.counts[2] + (~finite).long()])
        if self.limit:
            this = torch.stack([in_a_row.new_full((), step), in_a_row, self.counts[1]])
            reached = (in_a_row >= self.limit) & (self.give_up[0] < 0) & (counted > 0)
            self.give_up = torch.where(reached, this, self.give_up)

    def settle(self, optimizer: torch.optim.Optimizer) -> tuple[int, int, tuple[int, int, int] | None]:
        """One host read: (consecutive skips, all skips, the give-up (step, consecutive, all) or
        None); lowers the host-side step counters by the skips since the last read."""
        in_a_row, total, since, *give_up = torch.cat([self.counts, self.give_up]).tolist()
        if since:
            for state in optimizer.state.values():
                count = state.get("step")
                if isinstance(count, int):
                    state["step"] = count - since
                elif isinstance(count, torch.Tensor) and count.device != self.counts.device:
                    count -= since
            self.counts = torch.tensor([in_a_row, total, 0], dtype=torch.int64, device=self.device)
        return in_a_row, total, (tuple(give_up) if give_up[0] >= 0 else None)
