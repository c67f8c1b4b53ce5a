"""The trainer: ``largebatch train`` and the pieces it is built from.

``largebatch.typed_config`` (TOML <-> dataclasses), ``config`` (the trainer's tables),
``checkpoint`` (crash-safe saves), ``metrics`` (MFU, memory, logs, plots) and ``loop`` (the loop).
Import ``Trainer`` from ``largebatch.train.loop``; this package imports nothing heavy on its own.
"""
