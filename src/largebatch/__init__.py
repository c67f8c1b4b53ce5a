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
