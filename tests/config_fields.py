"""TrainConfig's fields as the command line names them, for the tests that walk every one."""

from __future__ import annotations

import dataclasses
import typing

from largebatch.train.config import TrainConfig


def train_config_fields() -> list[tuple[str, typing.Any]]:
    """Every leaf field of TrainConfig as (``section.field``, its type); an array of tables
    ([[phases]]) by its first entry, ``phases.0.field``."""
    out = []
    for section in dataclasses.fields(TrainConfig):
        cls = typing.get_type_hints(TrainConfig)[section.name]
        prefix = section.name
        if typing.get_origin(cls) is list:  # an array of tables ([[phases]]): its first entry
            cls, prefix = typing.get_args(cls)[0], f"{section.name}.0"
        hints = typing.get_type_hints(cls)
        out += [(f"{prefix}.{f.name}", hints[f.name]) for f in dataclasses.fields(cls)]
    return out
