"""Integrations with training frameworks; each submodule imports its framework.

* :mod:`resilient_ddp.integrations.lightning`: ``ResilientDDPStrategy`` for
  ``lightning.Trainer`` (``strategy="resilient_ddp"``).
* :mod:`resilient_ddp.integrations.fabric`: ``ResilientDDPStrategy`` for
  ``lightning.Fabric`` (``strategy="resilient_ddp"``).
* :mod:`resilient_ddp.integrations.transformers`: ``ResilientTrainerCallback`` for the
  Hugging Face ``Trainer``.
* Accelerate needs no module: ``model = rd.make_resilient(accelerator.prepare(model))``.

Importing :mod:`resilient_ddp` (or this package) imports no framework.
"""

from __future__ import annotations
