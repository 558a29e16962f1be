"""Imported at the start of every interpreter of ``nox -s tests`` and ``nox -s stress``
(through a ``.pth`` file that those sessions write into their virtualenv; nothing else
loads it): once ``import torch`` (or ``import lightning``) has finished, every object that
exists is moved out of the garbage collector's reach (``gc.freeze``).

Why: the suite starts some 400 fresh interpreters (ranks under torchrun, a framework's
launcher or ``mp.spawn``, the docs' samples), and each spends much of its CPU importing.
The collector's full passes during the imports that follow torch's (``torch._dynamo``,
which DDP loads; Lightning with torchmetrics and transformers) walk torch's 160,000
objects again and again: frozen, ``import torch, torch._dynamo`` takes about 2.3 CPU-s
instead of 3.4, ``import lightning.pytorch`` 3.2 instead of 4.4. Torch's modules live as
long as the process does, so nothing is kept that would have been freed; objects made
afterwards (the models, the library's state, a DDP wrapper) are collected as usual. Only
top-level imports made at start-up trigger it: ``torch._dynamo`` is imported by DDP's
constructor, while the wrapper being built exists, and is deliberately left out.
"""

from __future__ import annotations

import gc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_AFTER = {"torch", "lightning"}


class _FreezeAfterImport:
    """A meta path finder that finds nothing itself: for a module of ``_AFTER``, it asks
    the standard path finder and has its loader call ``gc.freeze()`` once the module's
    code has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _AFTER:
            return None
        _AFTER.discard(name)
        if not _AFTER:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = getattr(spec.loader, "exec_module", None) if spec is not None else None
        if run is None:
            return spec

        def run_then_freeze(module: ModuleType) -> None:
            run(module)
            gc.freeze()

        spec.loader.exec_module = run_then_freeze  # type: ignore[union-attr]
        return spec


_AFTER.difference_update(sys.modules)
if _AFTER:
    sys.meta_path.insert(0, _FreezeAfterImport())
