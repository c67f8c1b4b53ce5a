"""Large-batch layer-wise adaptive optimizers (docs/papers.md: optimizers): LAMB, LANS, LARS on one shared core.

    from largebatch.optim import LAMB, param_groups
    groups = param_groups(model, weight_decay=0.01)   # decay/adapt by module type and rank
    print(groups.report())
    optimizer = LAMB(groups, lr=2e-3)
    lars = LARS(param_groups(model, 0.0, adapt=CATEGORIES), lr=10.0)  # LARS adapts every tensor

``lamb``, ``lans`` and ``lars`` are the functional forms (as torch's ``adamw``). See docs/optim.md for
every switch, preset and measured number, and core.py for ``reduce_norms`` (sharded models).
"""

from .core import LayerwiseOptimizer, trust_ratio
from .groups import CATEGORIES, ParamGroups, param_groups
from .lamb import LAMB, PRESETS, lamb
from .lans import LANS, lans
from .lars import LARS, lars

__all__ = ["CATEGORIES", "LAMB", "LANS", "LARS", "LayerwiseOptimizer", "PRESETS", "ParamGroups", "lamb", "lans", "lars",
           "param_groups", "trust_ratio"]
