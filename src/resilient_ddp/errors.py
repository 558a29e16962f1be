"""Exceptions raised by resilient_ddp.

Every failure the library detects reaches every rank as a subclass of
:class:`ResilientDDPError`; the backend's own exception, when there is one, is kept as
``__cause__``. Each error is also the exception a plain-torch program would have caught at
that place (``torch.distributed``'s ``DistError`` family, all of them ``RuntimeError``; a timeout
is also a ``TimeoutError``), so an ``except`` written for torch keeps catching. The tree::

    ResilientDDPError
    ├── ConfigError (ValueError)          a setting is invalid
    ├── PreflightError (DistError)                 ranks disagree before training starts
    ├── RankFailureError (DistBackendError)        ranks crashed, raised, hung or left
    │   ├── CollectiveTimeoutError (TimeoutError)  late ranks, a stalled op
    │   └── ControlPlaneError (DistStoreError)     the c10d store is unreachable
    ├── CollectiveMismatchError (DistError)        ranks issued different collectives
    ├── RetryBudgetExhaustedError (DistError)      every allowed attempt failed
    └── SpawnError (ProcessRaisedException, ProcessExitedException)  an rd.spawn process failed

``DistError``, ``DistBackendError`` and ``DistStoreError`` are ``torch.distributed``'s (on a
torch built without them, stand-ins deriving from ``RuntimeError``); the two ``Process*``
classes are ``torch.multiprocessing``'s, which ``torch.multiprocessing.spawn`` raises.

Catch :class:`RankFailureError` to handle "a peer is gone or stuck", or
:class:`ResilientDDPError` for anything the library raises.
"""

from __future__ import annotations

import signal
import time
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, cast

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ControlPlaneError",
    "Culprit",
    "ItemFailureError",
    "PreflightError",
    "RankFailureError",
    "RankOutcome",
    "ResilientDDPError",
    "RetryBudgetExhaustedError",
    "SpawnError",
]


def _torch_error_types() -> tuple[type[RuntimeError], type[RuntimeError], type[RuntimeError]]:
    """``torch.distributed``'s ``DistError``, ``DistBackendError`` and ``DistStoreError``;
    on a torch built without them, stand-ins of the same shape deriving from ``RuntimeError``
    (nothing raises torch's there, and ``except RuntimeError`` still catches ours)."""
    try:
        import torch.distributed as dist

        return dist.DistError, dist.DistBackendError, dist.DistStoreError
    except (ImportError, AttributeError):

        class DistError(RuntimeError):
            """Stand-in for ``torch.distributed.DistError``."""

        class DistBackendError(DistError):
            """Stand-in for ``torch.distributed.DistBackendError``."""

        class DistStoreError(DistError):
            """Stand-in for ``torch.distributed.DistStoreError``."""

        return DistError, DistBackendError, DistStoreError


if TYPE_CHECKING:
    from torch.distributed import DistBackendError as _DistBackendError
    from torch.distributed import DistError as _DistError
    from torch.distributed import DistStoreError as _DistStoreError
else:
    _DistError, _DistBackendError, _DistStoreError = _torch_error_types()


class ResilientDDPError(Exception):
    """Base class of every error raised by resilient_ddp."""


class ConfigError(ResilientDDPError, ValueError):
    """Raised when a setting (argument, config field or environment variable) is invalid."""


def record_problem(
    record: Mapping[str, Any],
    fields: Mapping[str, tuple[type, ...]],
    required: tuple[str, ...] = (),
) -> str:
    """Why ``record`` (a JSON object read from the store) is not one the library writes
    ("" if it is one): a field of ``required`` is missing, or a field of ``fields`` (name
    -> the types it may have; ``float`` fields list ``int`` too, see :func:`field_types`)
    holds another type. An int is never taken for a bool, nor a bool for a number."""
    for name in required:
        if name not in record:
            return f"no {name!r}"
    for name, kinds in fields.items():
        if name not in record:
            continue
        value = record[name]
        if isinstance(value, bool) != (bool in kinds) and value is not None:
            return f"{name!r} is {type(value).__name__}"
        if not isinstance(value, kinds):
            return f"{name!r} is {type(value).__name__}"
    return ""


def field_types(record_type: Any) -> dict[str, tuple[type, ...]]:
    """The types each field of ``record_type`` (a TypedDict or a dataclass) may hold in a
    record read back (for :func:`record_problem`): a union's members, a generic's origin
    (``list`` for ``list[str]``), and ``int`` beside ``float`` (JSON writes ``2.0`` as
    ``2``)."""
    out: dict[str, tuple[type, ...]] = {}
    for name, hint in typing.get_type_hints(record_type).items():
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        kinds: list[type] = []
        for member in members:
            kind = typing.get_origin(member) or member
            kinds += [int, float] if kind is float else [kind]
        out[name] = tuple(kinds)
    return out


class CulpritRecord(TypedDict, total=False):
    """The JSON form of a :class:`Culprit` (:meth:`Culprit.record`), as failure events and
    diagnoses carry it on the store; a diagnosis adds what it judged the rank by.

    Attributes:
        rank, host, pid, what, op, seq, step, phase, section, exc_type, exc_message,
            traceback, stack, state_age: As :class:`Culprit`'s.
        blame: The diagnosis's :class:`~._diagnosis.Blame` name.
        alive: The rank's process is alive (answered, runs, or a fresh heartbeat).
        idle, moving, where, inside: Its progress signals: seconds since one moved, which
            moved, where its main thread is, whether in one of the library's own waits.
        busy_left: Seconds left in the budget of the section it is in.
    """

    rank: int
    host: str
    pid: int
    what: str
    op: str
    seq: int
    step: int
    phase: str
    section: str
    exc_type: str | None
    exc_message: str | None
    traceback: str | None
    stack: str | None
    state_age: float
    blame: str
    alive: bool
    idle: float
    moving: list[str]
    where: str
    inside: bool
    busy_left: float


#: The types of :class:`CulpritRecord`'s fields.
CULPRIT_FIELDS = field_types(CulpritRecord)


def culprit_problem(record: object) -> str:
    """Why ``record`` (read from the store) is not a culprit the library writes ("" if it
    is one): not an object, no ``rank``, or a field of another type
    (:func:`record_problem`)."""
    if not isinstance(record, dict):
        return "a culprit that is not an object"
    return record_problem(record, CULPRIT_FIELDS, ("rank",))


def decode_culprit(record: object) -> CulpritRecord | None:
    """``record`` (read from the store) as a :class:`CulpritRecord`, or None when it is
    not one the library writes (:func:`culprit_problem`)."""
    if culprit_problem(record):
        return None
    return cast("CulpritRecord", record)


@dataclass(frozen=True)
class Culprit:
    """What is known about one rank that caused a failure.

    Attributes:
        rank: Global rank in the generation where it failed.
        host: Host name of the rank, or ``"?"`` when it never reported one.
        pid: Process id on ``host`` (0 when unknown).
        what: One-line description, e.g. ``"killed by SIGKILL"`` or ``"raised ValueError"``.
        op: Name of the last collective the rank entered (``""`` if none).
        seq: Sequence number of that collective (-1 if none).
        step: Training step the rank was at (-1 if unknown).
        phase: Phase within the step (``"forward"``, ``"backward"``, ``"data"``, ...).
        section: The user-named section (:func:`resilient_ddp.section`) it was in.
        exc_type: Qualified exception type name when the rank raised, else ``None``.
        exc_message: The exception's message when the rank raised, else ``None``.
        traceback: Summary of the exception's traceback (innermost frames last).
        stack: Where the rank's main thread was, for a rank that is alive but stuck.
        state_age: How old (seconds) the step/phase/op above were when the failure was
            detected: they come from the rank's last heartbeat.
    """

    rank: int
    host: str = "?"
    pid: int = 0
    what: str = "failed"
    op: str = ""
    seq: int = -1
    step: int = -1
    phase: str = ""
    section: str = ""
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    stack: str | None = None
    state_age: float | None = None

    @staticmethod
    def record(
        rank: int,
        what: str,
        *,
        info: Mapping[str, Any] | None = None,
        state: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> CulpritRecord:
        """The JSON form of a culprit (what events and diagnoses carry on the store).

        Args:
            rank: The rank it names.
            what: What it did, one line.
            info: What the rank published at start-up (``host``, ``pid``), if known.
            state: Its last state (a heartbeat: ``op``, ``seq``, ``step``, ``phase``,
                ``section``; its wall-clock ``t`` in seconds gives ``state_age``, unless
                ``board`` says it was read from the rank's board), if known.
            **extra: More fields, set last (a diagnosis adds some that are not fields of
                :class:`Culprit`: they travel on the wire and :meth:`from_record` drops
                them).
        """
        info = info or {}
        state = state or {}
        c: CulpritRecord = {
            "rank": rank,
            "host": info.get("host", state.get("host", "?")),
            "pid": info.get("pid", state.get("pid", 0)),
            "what": what,
            "op": state.get("op", ""),
            "seq": state.get("seq", -1),
            "step": state.get("step", -1),
            "phase": state.get("phase", ""),
            "section": state.get("section", ""),
        }
        if "t" in state and not state.get("board"):
            # A state read from a board (a rank that stopped or is gone on this host) is
            # what it was doing when it stopped: it has no age to show.
            c["state_age"] = round(max(0.0, time.time() - float(state["t"])), 3)
        return cast("CulpritRecord", {**c, **extra})

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Culprit:
        """The culprit a JSON form (:meth:`record`) describes; keys that are not fields
        are ignored. Its types are the reader's to check (see ``_control.event_problem``)."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in record.items() if k in names})

    @classmethod
    def of(
        cls,
        rank: int,
        what: str,
        *,
        info: Mapping[str, Any] | None = None,
        state: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> Culprit:
        """``rank`` as a culprit that ``what`` describes, from what the caller has: its
        start-up ``info``, its last ``state`` and any other field (see :meth:`record`)."""
        return cls.from_record(cls.record(rank, what, info=info, state=state, **fields))

    def describe(self) -> str:
        """Return a multi-line, human-readable account of this culprit."""
        head = f"rank {self.rank} (host {self.host}, pid {self.pid}) {self.what}"
        doing = []
        if self.step >= 0:
            doing.append(f"step {self.step}")
        if self.phase:
            doing.append(f"phase {self.phase!r}")
        if self.section:
            doing.append(f"section {self.section!r}")
        if self.op:
            doing.append(f"last op {self.op}#{self.seq}")
        if doing:
            if self.state_age is not None and self.state_age >= _FRESH_S:
                doing.append(f"as of {self.state_age:.1f} s earlier")
            head += " [" + ", ".join(doing) + "]"
        lines = [head]
        if self.exc_type is not None:
            lines.append(f"    {self.exc_type}: {self.exc_message}")
        if self.traceback:
            lines.append(_indent(self.traceback, "    | "))
        if self.stack:
            lines.append("    main thread is at:")
            lines.append(_indent(self.stack, "    | "))
        return "\n".join(lines)


_FRESH_S = 0.05  # a state younger than this is shown without its age


def error_head(
    op: str,
    rank: int,
    *,
    seq: int | None = None,
    generation: int | None = None,
    host: str | None = None,
) -> str:
    """The first words of a failure's message: which op failed on which rank, as
    ``"all_reduce#3 on rank 0 (generation 1)"``; ``seq`` and the parenthesis are left out
    when not given (``host`` replaces the generation where the rank's host matters more:
    the control plane is lost)."""
    where = f"host {host}" if host is not None else f"generation {generation}"
    name = op if seq is None else f"{op}#{seq}"
    paren = "" if host is None and generation is None else f" ({where})"
    return f"{name} on rank {rank}{paren}"


#: The ending of a message that names no culprit: every rank arrived at the op.
NO_CULPRIT = "every rank arrived but the data plane did not complete the op (network?)"


def failure_message(head: str, culprits: Sequence[Culprit], *, named: str = "culprit") -> str:
    """A failure's whole message: ``head``, then the ranks named (``"; culprit rank(s): 1,
    2"``, ``named`` saying how they are named) and each culprit's account on the lines
    after it, or :data:`NO_CULPRIT` when there is none."""
    if not culprits:
        return f"{head}; {NO_CULPRIT}"
    ranks = ", ".join(str(c.rank) for c in culprits)
    return f"{head}; {named} rank(s): {ranks}\n" + "\n".join(c.describe() for c in culprits)


def forget_frames(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and of the errors it chains (``__cause__``,
    ``__context__``), in place; their messages and types stay.

    A traceback keeps every frame it passed through alive, each frame its locals, and
    each frame its callers (``f_back``). A failure the library recovers from was raised
    through frames that hold the failed generation's backend objects (a bucket's gloo
    work in ``_resilient_hook``, the pass's works in ``_rd_finish_backward``, the old
    reducer in ``_rd_sync_buckets``), and most of those frames also hold the error (``cause
    = e``), a reference cycle that only the garbage collector breaks. Until it runs, in
    whichever thread and at whatever point it happens to, the old generation's gloo
    context outlives the release of its group (:func:`membership.release_retired`): its
    device's thread, epoll descriptor, pipe, listening socket and connections stay open.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def format_rank_table(
    table: Mapping[int, Mapping[str, object]], columns: Sequence[str], missing: Sequence[int] = ()
) -> str:
    """An aligned text table for an error message: one row per rank of ``table`` with the
    given ``columns``, then a ``(no answer)`` row per rank of ``missing``; indented by 4."""
    header = ["rank", *columns]
    body = [[str(r)] + [str(table[r].get(c, "")) for c in columns] for r in sorted(table)]
    body += [[str(r), "(no answer)"] + [""] * (len(columns) - 1) for r in missing]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    return "\n".join(
        "    " + "  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *body]
    )


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


class RankFailureError(ResilientDDPError, _DistBackendError):
    """Raised on every rank when one or more ranks crashed, raised, hung or left the group.

    Also a ``torch.distributed.DistBackendError`` (so a ``DistError`` and a
    ``RuntimeError``): what torch raises from a collective whose peer died or timed out, so
    an ``except RuntimeError`` around a collective catches it as it caught torch's error.

    Attributes:
        culprits: What is known of each failed rank, root cause first.
        ranks: The failed ranks, in the order of ``culprits``.
        hosts: Their host names, aligned with ``ranks``.
        op: The collective this rank was in (or about to enter) when it learned of the failure.
        seq: That collective's sequence number (-1 if none).
        generation: Process-group generation in which the failure happened.
        exc_type: Exception type of the first culprit that raised, else ``None``.
        exc_message: Its message, else ``None``.
        traceback: Its traceback summary, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        culprits: Sequence[Culprit] = (),
        op: str = "",
        seq: int = -1,
        generation: int = 0,
    ) -> None:
        super().__init__(message)
        self.culprits: tuple[Culprit, ...] = tuple(culprits)
        self.op = op
        self.seq = seq
        self.generation = generation

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(c.rank for c in self.culprits)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(c.host for c in self.culprits)

    def _first_raised(self) -> Culprit | None:
        return next((c for c in self.culprits if c.exc_type is not None), None)

    @property
    def exc_type(self) -> str | None:
        c = self._first_raised()
        return c.exc_type if c else None

    @property
    def exc_message(self) -> str | None:
        c = self._first_raised()
        return c.exc_message if c else None

    @property
    def traceback(self) -> str | None:
        c = self._first_raised()
        return c.traceback if c else None

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep attributes when the error crosses a process boundary (rd.spawn, pickling).
        return (
            _rebuild_error,
            (type(self), str(self), self.culprits, self.op, self.seq, self.generation),
        )


def _rebuild_error(
    cls: type[RankFailureError],
    message: str,
    culprits: tuple[Culprit, ...],
    op: str,
    seq: int,
    generation: int,
) -> RankFailureError:
    return cls(message, culprits=culprits, op=op, seq=seq, generation=generation)


class ControlPlaneError(RankFailureError, _DistStoreError):
    """Raised when the c10d store that carries heartbeats and failure reports is unreachable.

    The store must outlive every rank; when its host dies (the launcher, torchrun's agent,
    or rank 0 when it hosts the store) the job cannot coordinate any more and this error is
    fatal. It is a :class:`RankFailureError`, so one ``except`` covers "the group is gone",
    and also a ``torch.distributed.DistStoreError``, what torch raises when its store fails.
    """


class CollectiveTimeoutError(RankFailureError, TimeoutError):
    """Raised when a collective did not complete within its timeout or budget.

    Also a ``TimeoutError`` (and, as a :class:`RankFailureError`, a ``DistBackendError``
    and a ``RuntimeError``: torch's gloo reports a timed-out wait as one).

    ``culprits`` lists the ranks that never arrived or stopped responding, with where their
    main thread was; it is empty when every rank arrived and the data plane itself stalled.
    """


class CollectiveMismatchError(ResilientDDPError, _DistError):
    """Raised on every rank when ranks issued different collectives (op, shape, dtype, seq).

    Also a ``torch.distributed.DistError`` (so a ``RuntimeError``), as torch's own
    collective checks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) raise a ``RuntimeError``.

    Attributes:
        table: Per-rank signature of the collective each rank issued.
        ranks: Ranks whose signature differs from the most common one.
        op: The collective this rank issued.
        seq: Its sequence number.
    """

    def __init__(
        self,
        message: str,
        *,
        table: Mapping[int, Mapping[str, str]] | None = None,
        ranks: Sequence[int] = (),
        op: str = "",
        seq: int = -1,
    ) -> None:
        super().__init__(message)
        self.table: dict[int, dict[str, str]] = {
            int(r): dict(sig) for r, sig in (table or {}).items()
        }
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.op = op
        self.seq = seq

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_mismatch,
            (str(self), self.table, self.ranks, self.op, self.seq),
        )


def _rebuild_mismatch(
    message: str,
    table: dict[int, dict[str, str]],
    ranks: tuple[int, ...],
    op: str,
    seq: int,
) -> CollectiveMismatchError:
    return CollectiveMismatchError(message, table=table, ranks=ranks, op=op, seq=seq)


class PreflightError(ResilientDDPError, _DistError):
    """Raised when ranks disagree before work starts (environment, parameters, devices).

    Also a ``torch.distributed.DistError`` (so a ``RuntimeError``). Where torch fails at
    start-up it raises a ``DistNetworkError`` (the store cannot be reached, its port is in
    use), a ``DistStoreError`` (not every rank arrived) or, from ``DistributedDataParallel``'s
    constructor, a plain ``RuntimeError`` (parameters differ across ranks). This error
    reports all of those cases, so it is their common base: the ``except RuntimeError`` or
    ``except DistError`` that a user writes around ``init_process_group`` catches it, while
    a handler written for one of the narrower types (a port-in-use retry, say) is not handed
    a problem it was not written for.

    Attributes:
        problems: One line per problem found, each naming the rank(s) involved.
        table: Per-rank values that were compared.
    """

    def __init__(
        self,
        message: str,
        *,
        problems: Sequence[str] = (),
        table: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems)
        self.table: dict[int, dict[str, str]] = {int(r): dict(v) for r, v in (table or {}).items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_preflight, (str(self), self.problems, self.table))


def _rebuild_preflight(
    message: str, problems: tuple[str, ...], table: dict[int, dict[str, str]]
) -> PreflightError:
    return PreflightError(message, problems=problems, table=table)


class RetryBudgetExhaustedError(ResilientDDPError, _DistError):
    """Raised when every attempt allowed by the retry policy or the total budget failed.

    Also a ``torch.distributed.DistError`` (so a ``RuntimeError``), which torch raises for
    a collective that fails.

    Attributes:
        attempts: Number of attempts made.
        last_attempt: The last attempt's error, always a :class:`RankFailureError` (also
            ``__cause__``).
    """

    def __init__(self, message: str, *, attempts: int, last_attempt: BaseException) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last_attempt = last_attempt

    def reraise(self) -> None:
        """Raise the last attempt's exception."""
        raise self.last_attempt

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_exhausted, (str(self), self.attempts, self.last_attempt))


def _rebuild_exhausted(
    message: str, attempts: int, last_attempt: BaseException
) -> RetryBudgetExhaustedError:
    return RetryBudgetExhaustedError(message, attempts=attempts, last_attempt=last_attempt)


@dataclass(frozen=True)
class RankOutcome:
    """How one process launched by :func:`resilient_ddp.spawn` ended.

    Attributes:
        rank: The process's rank.
        exitcode: Its exit code; negative for a signal (``-9`` for SIGKILL), ``None`` if
            the launcher had to kill it: at the deadline, or (elastic training) when it was
            still alive 1 s after the group removed it (stopped or hung).
        value: What the function returned (``None`` if it did not return).
        exc_type: Qualified type name of the exception it raised, if any.
        exc_message: That exception's message.
        traceback: That exception's formatted traceback.
        exception: The exception object itself when it could be pickled back.
        previous: With ``spawn(restarts=N)``, how the earlier processes of this slot ended
            (each was replaced by a joiner), oldest first.
    """

    rank: int
    exitcode: int | None
    value: Any = None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    exception: BaseException | None = field(default=None, compare=False)
    previous: tuple[RankOutcome, ...] = field(default=(), compare=False)

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.exc_type is None


class SpawnError(ResilientDDPError, ProcessRaisedException, ProcessExitedException):
    """Raised by :func:`resilient_ddp.spawn` when a process raised, died or overran the deadline.

    Also both exceptions that ``torch.multiprocessing.spawn`` raises in these cases,
    ``ProcessRaisedException`` (a process raised) and ``ProcessExitedException`` (a process
    exited non-zero or was killed), with their attributes, taken from the first failed
    rank: code written around ``mp.spawn`` keeps catching when it calls ``rd.spawn``
    instead. Unlike torch's, it is not a ``RuntimeError``: neither of those is.

    Attributes:
        outcomes: How every process ended, indexed by rank.
        msg: The message (as torch's ``ProcessException``).
        error_index: The first failed rank (-1 when none is recorded).
        error_pid: 0: ``rd.spawn`` does not record process ids (see ``outcomes``).
        exit_code: That rank's exit code; ``-9`` (SIGKILL) when the launcher killed it.
        signal_name: The signal that ended it (``"SIGKILL"``), or ``None``.
    """

    def __init__(self, message: str, *, outcomes: Sequence[RankOutcome]) -> None:
        Exception.__init__(self, message)
        self.outcomes: tuple[RankOutcome, ...] = tuple(outcomes)
        first = next((o for o in self.outcomes if not o.ok), None)
        code = first.exitcode if first is not None else 0
        if code is None:  # the launcher killed it (RankOutcome.exitcode)
            code = -int(signal.SIGKILL)
        self.msg = message
        self.error_index = first.rank if first is not None else -1
        self.error_pid = 0
        self.exit_code = code
        self.signal_name = _signal_name(-code) if code < 0 else None

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(o.rank for o in self.outcomes if not o.ok)

    def __reduce__(self) -> tuple[Any, ...]:
        return (SpawnError._rebuild, (str(self), self.outcomes))

    @staticmethod
    def _rebuild(message: str, outcomes: tuple[RankOutcome, ...]) -> SpawnError:
        return SpawnError(message, outcomes=outcomes)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class ItemFailureError(ResilientDDPError, RuntimeError):
    """Raised on rank 0 by :func:`resilient_ddp.distributed_inference` when items could
    not be run: their ``fn`` raised on ``max_item_failures`` different ranks (poison items),
    or no rank that may still run them was left. Every other item's result is kept.

    Attributes:
        failures: One :class:`resilient_ddp.InferenceItemFailure` per poison item, by index:
            ``index``, ``exc_type``, ``message``, ``ranks``.
        results: The results, one per dataset item, ``None`` for the poison items.
    """

    def __init__(self, message: str, *, failures: Sequence[Any] = (), results: Any = None):
        super().__init__(message)
        self.failures: tuple[Any, ...] = tuple(failures)
        self.results = results

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_item_failure, (str(self), self.failures, self.results))


def _rebuild_item_failure(message: str, failures: Any, results: Any) -> ItemFailureError:
    return ItemFailureError(message, failures=failures, results=results)
