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
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._runtime import Runtime

log = logging.getLogger("resilient_ddp")

_lock = threading.Lock()
_broken: set[str] = set()  # event files that could not be written (warned once each)


def record(rt: Runtime, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event of ``kind`` to this rank's event file (if one is configured).

    Never raises: an event file that cannot be written is reported once in the log.

    Returns:
        The event as written.
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
        if rt.event_path is None:
            # The rank of the first event: a process keeps its file when elastic training
            # renumbers the ranks.
            rt.event_path = template.replace("{rank}", str(rt.rank))
        path = rt.event_path
        line = (json.dumps(event, default=str) + "\n").encode()
        try:
            # One write of the whole line, appended: lines of several writers never mix.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            with _lock:
                first = path not in _broken
                _broken.add(path)
            if first:
                log.warning("cannot write resilience events to %s: %s", path, e)
    return event


class RankFilter(logging.Filter):
    """Put ``rank`` and ``generation`` on every record of the ``resilient_ddp`` logger (``-``
    without a process group), for a format such as ``"[rank %(rank)s] %(message)s"``."""

    def filter(self, record: logging.LogRecord) -> bool:
        from . import _runtime

        rt = _runtime.current()
        record.rank = rt.rank if rt is not None else "-"
        record.generation = rt.generation if rt is not None else "-"
        return True


def install_rank_filter() -> None:
    """Add :class:`RankFilter` to the ``resilient_ddp`` logger, once."""
    if not any(isinstance(f, RankFilter) for f in log.filters):
        log.addFilter(RankFilter())
