"""``run.dtype = "fp16"``: dynamic loss scaling, decided on the device.

Mixed-precision training in fp16 (Micikevicius et al. 2018, "Mixed Precision Training", Sec. 3.2;
docs/papers.md, "Loss scaling"): fp16 keeps magnitudes from 2**-24 to 65504, and many activation
gradients of a language model lie below that range, where they flush to zero. Multiplying the loss
by a scale S before backward multiplies every gradient by S (backward is linear in the loss), which
lifts them into range; dividing the fp32 parameter gradients by S before clipping and the optimizer
step gives the true gradient back: the gradient norm, clipping and the optimizer see the true
gradient, and the noise scale's norms read during the step (a first micro-batch's, a replica's) are
divided by S^2.

The scale is chosen dynamically (the rule torch.amp.GradScaler and Megatron-LM use): start high
(run.loss_scale, 2**16); a step whose gradients overflowed (an inf or NaN in them while the loss
itself is finite) is skipped -- its update taken back on the device (largebatch.train.skip) -- and S
is halved; after run.loss_scale_growth_steps steps in a row without overflow S is doubled. With S a
power of two (the default, and so every halving and doubling of it) S and 1/S multiply exactly. S
never falls below 1: a step that overflows at S = 1 has gradients fp16 cannot hold at all, and
counts as a non-finite step, not as an overflow (run.on_nonfinite decides, as for a NaN loss). A
non-finite loss is never an overflow either (the loss is scaled after the forward pass, so a smaller
S cannot mend it): such a step leaves S and its count of good steps as they were.

Everything here is a device tensor updated without a host read; the trainer reads the scale and
the counts when it reads the rest of a step (before a log, an evaluation or a checkpoint), and
checkpoints keep them, so a resumed run continues with the scale and the count it stopped at.
"""

from __future__ import annotations

import torch

START = 65536.0  # run.loss_scale's default (2**16, torch.amp.GradScaler's)
GROWTH_STEPS = 2000  # run.loss_scale_growth_steps' default (GradScaler's)
LARGEST = 2.0**127  # run.loss_scale's largest: fp32's largest power of two


class LossScale:
    """The dynamic loss scale of an fp16 run: ``scale`` (a 0-d fp32 device tensor) multiplies the
    loss, ``update`` applies the rule after each step (module docstring)."""

    def __init__(self, device: torch.device, scale: float = START, growth_steps: int = GROWTH_STEPS,
                 good_steps: int = 0, overflow_steps: int = 0):
        if not 1.0 <= scale <= LARGEST:
            raise ValueError(f"loss scale {scale!r}: must lie in [1, 2**127]")
        self.growth_steps = int(growth_steps)
        self.scale = torch.tensor(float(scale), dtype=torch.float32, device=device)
        # (steps in a row without overflow since the scale last changed, overflowed steps in all)
        self.counts = torch.tensor([good_steps, overflow_steps], dtype=torch.int64, device=device)

    def update(self, overflow: torch.Tensor, hold: torch.Tensor) -> torch.Tensor:
        """After a step (0-d bools): ``overflow``, its gradients overflowed at ``scale`` (the loss
        finite); ``hold``, its loss is not finite (neither a good step nor an overflow: the scale and
        the count stay). On overflow the scale halves, unless it is 1 already: that step is
        non-finite, and not counted as an overflow. After ``growth_steps`` good steps in a row it
        doubles (while the double is finite). Returns a 0-d bool: it overflowed at scale 1."""
        at_floor = overflow & (self.scale <= 1.0)
        overflowed = overflow & ~at_floor
        good = torch.where(overflow, torch.zeros_like(self.counts[0]),
                           self.counts[0] + (~hold).long())
        doubled = self.scale * 2.0
        reached = good >= self.growth_steps  # (the count starts again, whether or not the double is finite)
        grow = reached & torch.isfinite(doubled)
        halved = torch.clamp(self.scale * 0.5, min=1.0)
        self.scale = torch.where(overflowed, halved, torch.where(grow, doubled, self.scale))
        good = torch.where(reached, torch.zeros_like(good), good)
        self.counts = torch.stack([good, self.counts[1] + overflowed.long()])
        return at_floor

    def read(self) -> tuple[float, int, int]:
        """One host read: (scale, good steps in a row, overflowed steps in all)."""
        scale, good, overflows = torch.cat([self.scale.double().view(1), self.counts.double()]).tolist()
        return scale, int(good), int(overflows)
