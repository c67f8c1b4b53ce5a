"""Argument checks of the optimizers: every hyperparameter of every group is read through here.

Numbers may be Python numbers, numpy scalars or 0-d tensors (what an LR scheduler or a config system
hands over); each is checked and turned into a Python float. Errors are ValueErrors that name the
group, the field, the value and the allowed range. The functional forms (``lamb``, ``lans``,
``lars``) check their arguments with the same rules (``arguments``, ``per_tensor``).
"""

from __future__ import annotations

import math
import numbers
from typing import Callable

from torch import Tensor


def as_number(name: str, value) -> float:
    """``value`` as a float, or ValueError naming ``name``."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r}: expected a real number (a Python, numpy or 0-d tensor scalar)")
    return float(value)


def learning_rate(name: str, value) -> float:
    lr = as_number(name, value)
    if not (lr >= 0.0 and math.isfinite(lr)):
        raise ValueError(f"{name}={value!r}: the learning rate must be a finite number >= 0")
    return lr


def unit_interval(name: str, value) -> float:
    x = as_number(name, value)
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{name}={value!r}: must lie in [0, 1)")
    return x


def positive(name: str, value) -> float:
    x = as_number(name, value)
    if not x > 0.0 or math.isinf(x):
        raise ValueError(f"{name}={value!r}: must be a finite number > 0 (e.g. 1e-6)")
    return x


def non_negative(name: str, value) -> float:
    x = as_number(name, value)
    if not (x >= 0.0 and math.isfinite(x)):
        raise ValueError(f"{name}={value!r}: must be a finite number >= 0")
    return x


def optional_positive(name: str, value) -> float | None:
    return None if value is None else positive(name, value)


def betas(name: str, value) -> tuple[float, float]:
    if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == 2:
        value = tuple(value.unbind())
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name}={value!r}: expected a pair (beta1, beta2), e.g. (0.9, 0.999)")
    return unit_interval(f"{name}[0]", value[0]), unit_interval(f"{name}[1]", value[1])


def optional_callable(name: str, value):
    if value is not None and not callable(value):
        raise ValueError(f"{name}={value!r}: expected None or a callable (squared_norms, params) -> squared_norms")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be True or False")
    return value


Check = Callable[[str, object], object]


def resolve(group: dict, spec: dict[str, Check], where: str) -> dict:
    """The group's hyperparameters named in ``spec``, checked and as Python values; ``where`` (e.g.
    "param_groups[1]: ") prefixes every message."""
    return {key: check(f"{where}{key}", group[key]) for key, check in spec.items()}


def arguments(where: str, spec: dict[str, Check], values: dict) -> dict:
    """A functional form's hyperparameters checked as the classes check a group's (``where``: e.g.
    "lamb: "); a tensor is passed on unread (reading a device tensor would synchronise, and a device
    LR is the caller's to check, as torch's functional forms leave it)."""
    return {key: value if isinstance(value, Tensor) else spec[key](f"{where}{key}", value)
            for key, value in values.items()}


def per_tensor(where: str, params, **lists) -> None:
    """ValueError unless ``params`` and every list in ``lists`` are lists with one entry per tensor."""
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"{where}params={type(params).__name__}: expected a list of tensors")
    for name, values in lists.items():
        if not isinstance(values, (list, tuple)):
            raise ValueError(f"{where}{name}={values!r}: expected a list with one entry per tensor "
                             f"({len(params)})")
        if len(values) != len(params):
            raise ValueError(f"{where}{name} has {len(values)} entries for {len(params)} params: "
                             "expected one per tensor")
