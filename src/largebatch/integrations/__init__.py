"""Bridges to other libraries' training loops. Each submodule imports its library on import, so
``import largebatch`` (and ``largebatch.schedules``) never needs them:

* ``largebatch.integrations.hf``  ``TokenScheduleCallback``: token-keyed schedules in
  ``transformers.Trainer``.
"""
