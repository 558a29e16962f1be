"""A store wrapper that records every request: the tests that bound how many requests a
wait loop makes per poll use it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class CountingStore:
    """A store that records each request made through it: (method, first argument)."""

    def __init__(self, inner: dist.Store) -> None:
        self.inner = inner
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            with self._lock:
                self.calls.append((name, args[0] if args else None))
            return fn(*args)

        return call

    def count(self, name: str, where: Callable[[Any], bool] = lambda _: True) -> int:
        with self._lock:
            return sum(1 for n, arg in self.calls if n == name and where(arg))

    def wide_checks(self) -> int:
        """``check`` requests of more than one key."""
        return self.count("check", lambda keys: len(keys) > 1)
