"""largebatch: fast transformer pretraining.

Three published systems in one toolkit (formulas in docs/papers.md):

* ``largebatch.optim`` -- LAMB, LANS, LARS layer-wise adaptive optimizers.
* ``largebatch.memory`` -- activation recomputation policies and the Korthikanti et al. 2022
  activation-memory model and planner.
* ``largebatch.schedules`` -- token-keyed LR and batch-size schedules, Seesaw, gradient noise scale.

``optim``, ``schedules`` and ``memory`` import nothing from ``train``: each drops into any PyTorch
training loop on its own.
"""

__version__ = "0.1.0"

# The oldest torch the whole package runs on (tensor parallel's all_gather_single, pipeline
# schedules' return_outputs, FSDP2 on CPU streams, ...): tested in CI on this version.
TORCH_MINIMUM = (2, 13)

# The description of a process group that waits longer than any collective on purpose (the other
# ranks waiting for rank 0's cold data build; a checkpoint written in the background across steps):
# parallel.step_timeout_s leaves it alone.
LONG_WAIT_GROUP = "largebatch-long-wait"


class TorchTooOld(ImportError):
    """The installed torch is older than TORCH_MINIMUM (``require_torch``)."""


def require_torch(what: str) -> None:
    """Raise TorchTooOld, naming ``what`` needs it, the version found and the fix, when the installed
    torch is older than TORCH_MINIMUM (torch is imported here, not at package import: ``largebatch
    memory`` runs without it)."""
    import re

    import torch

    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match and tuple(map(int, match.groups())) < TORCH_MINIMUM:
        need = ".".join(map(str, TORCH_MINIMUM))
        raise TorchTooOld(f"{what} needs torch >= {need}, and this is torch {torch.__version__}: install a newer "
                          f"torch (pip install 'torch>={need}', or your CUDA build from pytorch.org)")
