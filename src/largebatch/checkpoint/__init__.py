"""Checkpoints of a run, a component below the trainer (it imports neither ``train`` nor
``experiments``): what a trainer saves is its business; how it reaches the disk is this package's.

* :mod:`.files` -- the layout ``RUN_DIR/checkpoints/step_N.{pt,dcp}``, listing complete
  checkpoints, picking the newest, removing the temporaries of killed saves.
* :mod:`.local` -- one process: a ``.pt`` file written atomically (temporary, fsync, rename).
* :mod:`.distributed` -- torchrun: a torch.distributed.checkpoint (DCP) directory, resharded on
  load, so a run saved on one mesh resumes on another.
* :mod:`.rng` -- the random state of every rank, for bit-identical resume.

The distributed format is imported on use (``largebatch.checkpoint.distributed``): it pulls in
torch.distributed.checkpoint, which a one-process run never needs.
"""

from largebatch.checkpoint.files import (
    checkpoint_dir,
    checkpoint_dp_size,
    latest_checkpoint,
    list_checkpoints,
    remove_temporaries,
)
from largebatch.checkpoint.local import CheckpointError, load_checkpoint, save_checkpoint
from largebatch.checkpoint.rng import gather_rng, rng_state, set_rng_state

__all__ = [
    "CheckpointError",
    "checkpoint_dir",
    "gather_rng",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_dp_size",
    "load_checkpoint",
    "remove_temporaries",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
