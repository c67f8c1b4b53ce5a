"""The trainer: ``largebatch train`` and the pieces it is built from.

``largebatch.typed_config`` (TOML <-> dataclasses), ``config`` (the trainer's tables),
``checkpoint`` (crash-safe saves), ``metrics`` (MFU, memory, logs, plots), ``loop`` (the loop), and
the loop's parts: ``phases`` (phases and switching between them), ``evaluate`` (validation loss and
accuracy), ``report`` (the header, logged steps, the summary) and ``deferred`` (device reads).
Import ``Trainer`` from ``largebatch.train.loop``; this package imports nothing heavy on its own.
"""
