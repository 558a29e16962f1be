"""Resilience events as structured records: a JSON-lines file per rank when configured
(``ResilienceConfig.event_log``, env ``RESILIENT_DDP_EVENT_LOG``), and the rank and
generation on every log record of the ``resilient_ddp`` logger.

Each line of the event file is one JSON object with at least ``t`` (wall time, seconds
since the epoch), ``kind``, ``job`` (the job id), ``rank``, ``host``, ``pid`` and
``generation``. Kinds and their other fields:

* ``failure``: this rank met a failure (once per failure, before it raises or recovers):
  ``error`` (the type), ``ranks`` (the culprits), ``op``, ``seq``, ``message`` (the first
  line).
* ``shrink``: the survivors formed a smaller generation: ``culprits``, ``world_size_before``,
  ``world_size``, ``step``, ``outcome`` (``redo``, ``skip`` or ``continue``: what happened
  to the step in flight), ``state_from``, ``recovery_s``.
* ``join``: replacements were admitted (on the members): ``joiners``, ``world_size_before``,
  ``world_size``, ``step``, ``admission_s``; ``joined`` on the joiner itself.
* ``straggler``: rank 0 found a rank slower than the group (``straggler``, ``compute_ms``,
  ``median_ms``).

The library's log lines that speak for a rank go through :data:`rank_log` (or a logger
:meth:`RankLog.of` a runtime in hand), which writes the ``rank N: `` in front of them; a
warning that is said once goes through :meth:`RankLog.warn_once`. The rank comes from the
identity provider that ``_runtime`` registers when it is imported (:func:`set_identity`):
this layer does not import it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from resilient_ddp.runtime._runtime import Runtime

log = logging.getLogger("resilient_ddp")

QUEUE_LINES = 1024  # lines waiting for the writer thread; beyond, events are dropped
WAIT_S = 0.1  # how long record() waits for its line to be written, while the file answers
FLUSH_S = 1.0  # how long the process waits at exit for the lines still queued
_IDLE_S = 0.5  # the writer thread ends after this long with nothing to write


def record(rt: Runtime, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event of ``kind`` to this rank's event file (if one is configured).

    The line is written by a background thread (:class:`_Writer`): this call waits at most
    ``WAIT_S`` (0.1 s) for it, and not at all while an earlier line is still being
    written, so a file system that stops answering (a hung network mount) never blocks a
    rank. Lines that find the queue full (``QUEUE_LINES``) are dropped and counted: a
    warning says so once, and an ``events_dropped`` line (``dropped``: how many so far)
    is written when the file answers again.

    Never raises: an event file that cannot be written is reported once in the log.

    Returns:
        The event as recorded.
    """
    event: dict[str, Any] = {
        "t": time.time(),
        "kind": kind,
        "job": getattr(rt.control_root, "job_id", None),
        "rank": rt.rank,
        "host": rt.identity.get("host"),
        "pid": os.getpid(),
        "generation": rt.generation,
        **fields,
    }
    template = rt.config.event_log
    if template:
        # The rank of the first event: a process keeps its file when elastic training
        # renumbers the ranks.
        writer.put(rt.event_file(template), (json.dumps(event, default=str) + "\n").encode())
    return event


def flush(timeout: float = FLUSH_S) -> bool:
    """Wait up to ``timeout`` seconds for the queued event lines to be written.

    Returns:
        True if none is left.
    """
    return writer.flush(timeout)


def _append(path: str, line: bytes) -> None:
    """Write one line to ``path``, appended in one write: lines of several writers never
    mix. Blocks while the file system does not answer."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        plain_log.warn_once(
            ("event file", path), "cannot write resilience events to %s: %s", path, e
        )


class _Writer:
    """Writes event lines from a daemon thread, in order, off the caller's thread.

    The thread starts with the first line and ends after ``_IDLE_S`` without work; a
    forked child starts its own. At most ``QUEUE_LINES`` lines wait; more are dropped.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queued = 0  # lines accepted so far
        self._done = 0  # lines handed to the file system and returned
        self._busy_since: float | None = None  # monotonic start of the write in progress
        self._dropped = 0
        self._reported = 0  # drops already written to the file as ``events_dropped``
        self._thread: threading.Thread | None = None
        self._at_exit = False

    def put(self, path: str, line: bytes) -> None:
        """Queue ``line`` for ``path``; wait up to ``WAIT_S`` for it while the file answers."""
        with self._cv:
            if len(self._queue) >= QUEUE_LINES:
                self._dropped += 1
                plain_log.warn_once(
                    "events dropped",
                    "the event log %s is not keeping up (is its file system answering?): "
                    "events are dropped, and counted in an 'events_dropped' line when it "
                    "answers again; training goes on",
                    path,
                )
                return
            self._queue.append((path, line))
            self._queued += 1
            ticket = self._queued
            if self._thread is None or not self._thread.is_alive():
                self._start()
            self._cv.notify_all()
            if self._stalled():
                return  # an earlier line is still being written: do not wait behind it
            self._cv.wait_for(lambda: self._done >= ticket, WAIT_S)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every queued line; True if none is left."""
        with self._cv:
            return self._cv.wait_for(lambda: self._done >= self._queued, timeout)

    @property
    def dropped(self) -> int:
        """Lines dropped so far because the queue was full."""
        return self._dropped

    def _stalled(self) -> bool:
        since = self._busy_since
        return since is not None and time.monotonic() - since > WAIT_S

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="resilient_ddp-events", daemon=True)
        self._thread.start()
        if not self._at_exit:
            self._at_exit = True
            atexit.register(self.flush, FLUSH_S)

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._cv.wait_for(lambda: bool(self._queue), _IDLE_S):
                    self._thread = None
                    return
                path, line = self._queue.popleft()
                self._busy_since = time.monotonic()
                dropped = self._dropped
            _append(path, line)
            if dropped > self._reported:
                self._reported = dropped
                note = {"t": time.time(), "kind": "events_dropped", "dropped": dropped}
                _append(path, (json.dumps(note) + "\n").encode())
            with self._cv:
                self._busy_since = None
                self._done += 1
                self._cv.notify_all()

    def _after_fork(self) -> None:
        # The child has no writer thread and a copy of a lock that may have been held.
        self.__init__()  # type: ignore[misc]


writer = _Writer()
os.register_at_fork(after_in_child=writer._after_fork)


# -- the rank's identity and its logger ----------------------------------------------------
#: This process's ``(rank, generation)``, or None while it has no runtime: registered by
#: ``_runtime`` when it is imported (a layer above this one, which must not import it).
_identity: Callable[[], tuple[int, int] | None] | None = None


def set_identity(provider: Callable[[], tuple[int, int] | None]) -> None:
    """Register ``provider``: it returns this process's ``(rank, generation)``, or None
    while the process has no runtime. Called by ``_runtime`` when it is imported; it must
    not block (it is called for every log record)."""
    global _identity
    _identity = provider


def identity() -> tuple[int, int] | None:
    """This process's ``(rank, generation)`` from the registered provider; None while it
    has no runtime (or before ``_runtime`` was imported)."""
    provider = _identity
    return None if provider is None else provider()


def _current_rank() -> int | None:
    ident = identity()
    return None if ident is None else ident[0]


def _no_rank() -> int | None:
    return None


class HasRank(Protocol):
    """Whatever knows a rank (a runtime, a world-size change)."""

    @property
    def rank(self) -> int: ...


class RankLog(logging.LoggerAdapter[logging.Logger]):
    """The ``resilient_ddp`` logger, writing ``rank N: `` in front of each message.

    ``N`` is read when a record is logged, from ``rank`` (no prefix when it gives None),
    so a rank renumbered by elastic training logs under its new number. Arguments are
    formatted by the logger as usual (``%``-style, only when the record is emitted).

    Args:
        logger: The logger written to.
        rank: Returns the rank to name, or None for no prefix.
    """

    def __init__(self, logger: logging.Logger, rank: Callable[[], int | None]) -> None:
        super().__init__(logger, None)
        self._rank = rank
        self._once: set[Hashable] = set()
        self._once_lock = threading.Lock()

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        rank = self._rank()
        return (msg if rank is None else f"rank {rank}: {msg}"), kwargs

    def of(self, owner: HasRank) -> RankLog:
        """A logger that names ``owner.rank`` (read at each record) instead: for a runtime
        that need not be the process's current one (a watchdog's before its runtime is
        current, an inference guest's). Its :meth:`warn_once` remembers keys for as long
        as it lives (a watchdog's: once per generation)."""
        return RankLog(self.logger, lambda: owner.rank)

    def warn_once(self, key: Hashable, msg: str, *args: object) -> bool:
        """Log warning ``msg % args`` the first time this logger sees ``key``; later calls
        with the same key do nothing. Thread-safe; never blocks beyond the logging itself.

        Returns:
            True if this call logged it.
        """
        with self._once_lock:
            if key in self._once:
                return False
            self._once.add(key)
        self.warning(msg, *args, stacklevel=2)
        return True

    def forget(self) -> None:
        """Forget the keys :meth:`warn_once` has seen (a forked child warns for itself)."""
        self._once_lock = threading.Lock()  # a copy of a lock that may have been held
        self._once = set()


#: Lines that speak for this process's rank: ``rank N: ...`` (no prefix without a runtime).
rank_log = RankLog(log, _current_rank)
#: Lines that speak for no rank (the process, a file): no prefix; for :meth:`RankLog.warn_once`.
plain_log = RankLog(log, _no_rank)


def _forget_in_child() -> None:
    rank_log.forget()
    plain_log.forget()


os.register_at_fork(after_in_child=_forget_in_child)


class RankFilter(logging.Filter):
    """Put ``rank`` and ``generation`` on every record of the ``resilient_ddp`` logger (``-``
    without a process group), for a format such as ``"[rank %(rank)s] %(message)s"``."""

    def filter(self, record: logging.LogRecord) -> bool:
        ident = identity()
        record.rank = ident[0] if ident is not None else "-"
        record.generation = ident[1] if ident is not None else "-"
        return True


def install_rank_filter() -> None:
    """Add :class:`RankFilter` to the ``resilient_ddp`` logger, once."""
    if not any(isinstance(f, RankFilter) for f in log.filters):
        log.addFilter(RankFilter())
