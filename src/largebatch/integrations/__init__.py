"""Bridges to other libraries' training loops. Each submodule imports its library on import, so
``import largebatch`` (and ``largebatch.schedules``) never needs them:

* ``largebatch.integrations.hf``  ``TokenScheduleCallback``: token-keyed schedules in
  ``transformers.Trainer``.
* ``largebatch.integrations.hf_export``  a run as a transformers model (``largebatch export``).
"""


class ExportError(ValueError):
    """Bad input for an export; the message names the field or value and the fix."""
