"""Control plane: the store keys through which ranks exchange heartbeats, failure reports
and the decisions of elastic training.

The control plane lives in the c10d store, apart from the data plane (the process group), so
it keeps working when the data plane is broken. Every key of a job sits under the job's
namespace (:func:`root_prefix`; ``rd/current`` names the last job that started on the
store): ``rd/<job>/<tag>/``, ``tag`` derived from the job's record key, which comes from the
operator's secret or, without one, is agreed by the ranks over the formed group
(:func:`group_secret`). Every value and log line is sealed (:func:`seal`): an HMAC of its
key name and JSON. Old sealed records written back (replays) are ignored: generations,
``members`` and heartbeat beats only grow, copies of event lines are dropped. Data the job
did not write is counted (:func:`rejected_records`) and ignored; counters it lands in
never break a connection (:func:`_safe_add`). This module is the only one that reads or
writes these keys: :class:`ControlPlane` for one generation's keys, :class:`JobStore` for
the job's.

Every key the library writes in a store is under one root, ``rd/`` (:data:`ROOT`), and is
spelled here; the other modules take their keys from these constants and functions:

* ``rd/<job>/`` or ``rd/<job>/<tag>/``: a job's namespace (:func:`job_prefix`; the tables
  below);
* ``rd/current``: the id of the last job that started on the store
  (:data:`CURRENT_JOB_KEY`);
* ``rd/job_id``: the id rank 0 drew, in torch's default store, new for each job
  (:data:`JOB_ID_KEY`);
* ``rd/attempt<N>/``: torchrun attempt ``N``'s namespace in its agent's store, which
  outlives the attempts (:func:`attempt_prefix`): that attempt's group and control plane
  live under it;
* ``rd/torchelastic/attempt<N>/attached``: the ranks of attempt ``N`` attached to a group
  the user created (a counter, :func:`attached_key`);
* ``rd/preflight/<N>/``: attempt ``N``'s start-up checks (:class:`PreflightKeys`).

One generation ``N`` (:class:`ControlPlane`), under ``rd/<job>/g<N>/``
(:func:`generation_prefix`):

=====================  =======================================================
``info/<r>``           rank's identity: host, pid, process start time, boot id, PID ns
``state/<r>``          heartbeat: beat counter, op and seq, step, phase, stack
``ev/n``               number of events posted (a counter)
``ev/log``             the events, one sealed JSON document per line (``append``)
``diag``               diagnosis request counter; every watchdog answers with its stack
``claim/<r>``          first reporter of rank ``r``'s failure wins (``add`` returns 1)
``mm/<k>/<r>``         signature of the ``k``-th mismatched collective, per rank
``dg/<s>/<k>/claim``   first rank to diagnose round ``k`` of op ``s`` (``add``)
``dg/<s>/<k>/v``       its verdict, which the other ranks wait for and take
``inf/<c>/done``       ranks done with inference call ``c`` (a counter)
``extra``              names of the ``dg/`` and ``inf/`` keys made, and ``ack/<k>`` for
                       each count of join requests acknowledged (``append``)
``pg/...``             torch's rendezvous keys of the generation's process group
                       (:func:`group_prefix`)
=====================  =======================================================

The job (:class:`JobStore`), under ``rd/<job>/``:

=========================  ===================================================
``gen``                    the current generation ``{"gen": N}`` (set by its rank 0)
``gen_seq``                generation numbers drawn so far (a counter)
``g<N>/retry/<seq>/<a>``   group-retry votes for op ``seq``, attempt ``a``; ``/abort``
``g<N>/retry/<seq>/<a>/gen``  the generation that retry forms (slots as below)
``rec/g<N>/r<k>/log``      shrink round ``k`` after generation ``N``: proposals
``rec/g<N>/r<k>/d``        its decision (first valid of 4 ``compare_set`` slots)
``rec/g<N>/r<k>/n``        proposals posted in that round (a counter)
``form/g<N>/<r>``          rank ``r`` arrived to form generation ``N``
``form/g<N>/n``            ranks arrived to form it (a counter)
``members``                the member ids of the last complete generation
``left/g<N>``              members of generation ``N`` that left normally (counter)
``ended``                  the job is over: finished, or failed (and why)
``join/n``                 join requests posted (a counter the watchdogs poll)
``join/uid``               member ids drawn by joiners (a counter)
``join/log``               join requests, one sealed JSON document per line
``join/adm/<uid>``         the admission decided for joiner ``uid``
``join/done/<uid>``        ``uid`` was admitted once (never pending again)
``join/gone/<uid>``        ``uid`` gave up
``join/tries/<uid>``       admissions ``uid`` failed to reach (a counter)
``grow/g<N>``              the admission decided in generation ``N`` (slots as above)
``grow/g<N>/n<k>/ack/<r>`` rank ``r`` saw ``k`` join requests in generation ``N``
``grow/g<N>/n<k>/ack/n``   acknowledgements of those ``k`` (a counter)
``adm/g<N>/ok/<r>``        rank ``r`` of admission generation ``N`` has the state
``adm/g<N>/ok/n``          ranks of it that have the state (a counter)
``adm/g<N>/result``        that admission's outcome (slots as above)
=========================  ===================================================

All reads used on the healthy path are of keys known to exist, so no call here waits on the
store except :meth:`ControlPlane.wait_keys` and :meth:`ControlPlane.read_verdict`, which are
bounded. Waits for every rank read one counter a poll, and the ranks' keys only once the
counter says they are all there: O(1) requests a rank a poll, not O(W). Every store error
surfaces as :class:`ControlPlaneError`.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import os
import secrets
import socket
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient_ddp.base import _clock
from resilient_ddp.control._events import plain_log
from resilient_ddp.errors import (
    ControlPlaneError,
    Culprit,
    ResilientDDPError,
    culprit_problem,
    field_types,
    record_problem,
)

__all__: list[str] = []

log = logging.getLogger("resilient_ddp")

# Event kinds. A "primary" event names a culprit; "left" is primary only for the ops after
# the leaver's last one.
EV_EXCEPTION = "exception"
EV_CRASH = "crash"
EV_UNRESPONSIVE = "unresponsive"
EV_TIMEOUT = "timeout"
EV_LEFT = "left"
EV_SECTION = "section"  # a rank overran the budget of a section it declared


# Fields that the code reading a record relies on, with the types it needs (a field may be
# absent unless required). A record that breaks them is not one the library wrote.
NUMBER = (int, float)
_EVENT_FIELDS: dict[str, tuple[type, ...]] = {"reporter": (int,), "final_seq": (int,)}
_TIMEOUT_FIELDS: dict[str, tuple[type, ...]] = {
    "seq": (int,),
    "waited": NUMBER,
    "culprits": (list,),
}
_FAILURE_FIELDS: dict[str, tuple[type, ...]] = {"rank": (int,), "culprit": (dict,)}


def event_problem(ev: Any) -> str:
    """Why ``ev``, read from the event log, is not an event the library posts ("" if it
    is one): :meth:`FailureEvent.decode` refuses it."""
    if not isinstance(ev, dict):
        return f"a {type(ev).__name__}, not an object"
    if not isinstance(ev.get("kind"), str):
        return "no 'kind'"
    problem = record_problem(ev, _EVENT_FIELDS, ("reporter",))
    if problem:
        return problem
    if ev["kind"] == EV_TIMEOUT:
        problem = record_problem(ev, _TIMEOUT_FIELDS, ("op", "seq", "waited"))
        culprits = ev.get("culprits", [])
    else:
        problem = record_problem(ev, _FAILURE_FIELDS, ("rank", "culprit"))
        culprits = [ev.get("culprit")]
    for c in culprits:
        if problem:
            break
        problem = culprit_problem(c)
    return problem


@dataclass(frozen=True)
class HeartbeatState:
    """A rank's heartbeat (``state/<r>``): what its watchdog publishes
    (:meth:`Runtime.snapshot`, in its JSON form :meth:`record`) and what
    :meth:`ControlPlane.read_states` decodes each record into, once (:func:`decode_state`:
    every field has its type; a record that breaks one is left out). A record may lack
    any field (another process may have written the key): a field it does not say keeps
    its default, None ("not said") or the value its readers take for a missing one.

    Attributes:
        rank, host, pid: Who publishes it (None: not said).
        beat: Heartbeats sent so far (-1 in a rank's last record: it left or failed).
        gen: The rank's generation.
        seq, op: Its last collective's sequence number and name (-1 and "" before its
            first).
        in_op: Whether it waits in that collective.
        step, phase, section: Where its training loop is.
        section_left: The seconds left in its section's budget (None: no budget, or not
            said). Always in :meth:`record`, as the watchdog publishes it.
        status: ``running``, ``left`` or ``failed``.
        compute_s: Median local compute time of its recent steps (seconds; 0.0: none).
        progress: ``(call, done)`` of a ``distributed_inference`` call (None: none, or not
            said). Always in :meth:`record`, as the watchdog publishes it.
        idle, moving, where, inside: Its progress signals: seconds since one moved, which
            moved, where its main thread is, whether in the library's own wait.
        raised: It raised a failure error.
        t: Its wall clock, for people reading it (peers never compare it with theirs).
        diag: Diagnosis requests it answered (None: its watchdog did not say).
        stack: Its main thread's stack (in an answer to a diagnosis request).
        board: Step, seq, op, phase and in_op were read from its shared-memory board
            (:func:`~._board.with_board`; never published).
    """

    rank: int | None = None
    host: str | None = None
    pid: int | None = None
    beat: int | None = None
    gen: int | None = None
    seq: int | None = None
    op: str | None = None
    in_op: bool = False
    step: int | None = None
    phase: str | None = None
    section: str | None = None
    section_left: float | None = None
    status: str | None = None
    compute_s: float = 0.0
    progress: tuple[int, ...] | None = None
    idle: float | None = None
    moving: tuple[str, ...] = ()
    where: str | None = None
    inside: bool = False
    raised: bool = False
    t: float | None = None
    diag: int | None = None
    stack: str | None = None
    board: bool | None = None

    def record(self) -> dict[str, object]:
        """Its JSON form, as :meth:`ControlPlane.publish_state` writes it: every field
        that is said (not None), and ``section_left`` and ``progress`` always (their null
        is a value); tuples as lists. :func:`decode_state` reads it back into an equal
        state."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in _NULLABLE_STATE_FIELDS:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


#: Fields of :class:`HeartbeatState` whose null is a value on the wire, not "not said".
_NULLABLE_STATE_FIELDS = frozenset({"section_left", "progress"})

#: The types each field of a heartbeat record may hold (for :func:`state_problem`), from
#: :class:`HeartbeatState`'s: a tuple is a JSON list, and null only where it is a value.
_STATE_FIELDS = {
    name: tuple(
        list if kind is tuple else kind
        for kind in kinds
        if kind is not type(None) or name in _NULLABLE_STATE_FIELDS
    )
    for name, kinds in field_types(HeartbeatState).items()
}


def state_problem(record: Mapping[str, Any]) -> str:
    """Why ``record`` is not a heartbeat the library publishes ("" if it is one): a field
    of :class:`HeartbeatState` holds another type (:func:`~.errors.record_problem`)."""
    return record_problem(record, _STATE_FIELDS)


def decode_state(record: Mapping[str, Any], name: str) -> HeartbeatState | None:
    """``record``, read under ``name``, as a :class:`HeartbeatState` (its other fields
    dropped), or None when it is not a heartbeat the library publishes (counted and
    logged once per key family, see :func:`state_problem`)."""
    problem = state_problem(record)
    if problem:
        _note_rejected(name, problem)
        return None
    # Its fields' types are checked above; a JSON list is a tuple here (the state is frozen).
    said: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in _STATE_FIELDS
    }
    return HeartbeatState(**said)


@dataclass(frozen=True)
class FailureEvent:
    """One record of a generation's event log (``ev/log``): a rank's failure or
    departure, as read back. The log holds its JSON form (a dict, which
    :meth:`ControlPlane.post_events` writes); :meth:`ControlPlane.read_events` decodes
    each record once into this, and drops a malformed one.

    Attributes:
        kind: One of the ``EV_*`` kinds.
        reporter: The rank that posted it (-1: the launcher).
        rank: The rank it reports (every kind but ``EV_TIMEOUT``; -1 there).
        culprit: What is known of ``rank`` (every kind but ``EV_TIMEOUT``).
        culprits: The ranks a timeout named (``EV_TIMEOUT``).
        op: The op that timed out (``EV_TIMEOUT``).
        seq: Its sequence number (``EV_TIMEOUT``; -1 otherwise).
        waited: Seconds its reporter waited before it gave up (``EV_TIMEOUT``).
        cls: ``"timeout"`` (the op timed out) or ``"failure"`` (a transfer with a peer
            failed), for ``EV_TIMEOUT``.
        secondary: A consequence of another failure, not a cause (it names no one).
        final_seq: The last op of a rank that left (``EV_LEFT``; -1 otherwise).
        gen: The generation it was posted in (-1 if not said).
        t: When it was posted, the reporter's wall clock (seconds; 0.0 if not said).
    """

    kind: str
    reporter: int
    rank: int = -1
    culprit: Culprit | None = None
    culprits: tuple[Culprit, ...] = ()
    op: str = ""
    seq: int = -1
    waited: float = 0.0
    cls: str = "timeout"
    secondary: bool = False
    final_seq: int = -1
    gen: int = -1
    t: float = 0.0

    @classmethod
    def decode(cls, record: Any) -> FailureEvent:
        """The event a record of the log holds.

        Raises:
            ValueError: It is not an event the library posts (its message says why; see
                :func:`event_problem`).
        """
        problem = event_problem(record)
        if problem:
            raise ValueError(problem)
        gen, t = record.get("gen"), record.get("t")
        timeout = record["kind"] == EV_TIMEOUT
        return cls(
            kind=record["kind"],
            reporter=record["reporter"],
            rank=-1 if timeout else record["rank"],
            culprit=None if timeout else Culprit.from_record(record["culprit"]),
            culprits=tuple(Culprit.from_record(c) for c in record.get("culprits", []))
            if timeout
            else (),
            op=str(record.get("op", "")),
            seq=record["seq"] if timeout else -1,
            waited=float(record["waited"]) if timeout else 0.0,
            cls=str(record.get("cls", "timeout")),
            secondary=bool(record.get("secondary")),
            final_seq=record.get("final_seq", -1),
            gen=gen if isinstance(gen, int) and not isinstance(gen, bool) else -1,
            t=float(t) if isinstance(t, NUMBER) and not isinstance(t, bool) else 0.0,
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks it names: a timeout's culprits, else the rank it reports."""
        if self.kind == EV_TIMEOUT:
            return tuple(c.rank for c in self.culprits)
        return (self.rank,)


JOB_ENV = "RESILIENT_DDP_JOB_ID"
SECRET_ENV = "RESILIENT_DDP_SECRET"

# -- the keys outside a generation (see the module docstring) --------------------------------
#: The root of every key the library writes in a store.
ROOT = "rd"
#: The job that last started on a store: where a joiner that was not told its job looks.
CURRENT_JOB_KEY = f"{ROOT}/current"
#: The job id rank 0 draws and hands to the other ranks through torch's default store.
JOB_ID_KEY = f"{ROOT}/job_id"
#: The start-up checks' records, in torch's rendezvous store (see :class:`PreflightKeys`).
PREFLIGHT_PREFIX = f"{ROOT}/preflight"


def job_prefix(job_id: str, mac_key: bytes | None = None) -> str:
    """The prefix of job ``job_id``'s namespace: ``rd/<job_id>``, or ``rd/<job_id>/<tag>``
    with a record key (``tag`` derived from it: :func:`names_tag`)."""
    base = f"{ROOT}/{job_id}"
    return base if mac_key is None else f"{base}/{names_tag(mac_key)}"


def attempt_prefix(restart: int | str) -> str:
    """The prefix of torchrun attempt ``restart``'s namespace in its agent's store, which
    outlives the attempts (``TORCHELASTIC_RESTART_COUNT``): ``rd/attempt<N>``."""
    return f"{ROOT}/attempt{restart}"


def attached_key(restart: int | str) -> str:
    """The counter of the ranks of torchrun attempt ``restart`` that attached to a group the
    user created, in the default group's store."""
    return f"{ROOT}/torchelastic/attempt{restart}/attached"


def generation_prefix(generation: int) -> str:
    """The prefix of generation ``generation``'s keys in the job's namespace: ``g<N>``."""
    return f"g{generation}"


def group_prefix(generation: int) -> str:
    """The prefix, in the job's namespace, of torch's rendezvous keys for generation
    ``generation``'s process group: ``g<N>/pg``."""
    return f"{generation_prefix(generation)}/pg"


class PreflightKeys:
    """The start-up checks' keys of torchrun attempt ``restart`` (0 outside torchrun), in
    torch's rendezvous store, under ``rd/preflight/<restart>/``.

    Attributes:
        prefix: ``rd/preflight/<restart>``.
        arrived: The ranks that published their facts (a counter).
        done: The ranks that read the verdict (a counter).
    """

    def __init__(self, restart: int) -> None:
        self.prefix = f"{PREFLIGHT_PREFIX}/{restart}"
        self.arrived = f"{self.prefix}/n"
        self.done = f"{self.prefix}/done"

    def facts(self, rank: int) -> str:
        """Rank ``rank``'s facts (versions, devices, host)."""
        return f"{self.prefix}/{rank}"

    def verdict(self, slot: int = 0) -> str:
        """Verdict slot ``slot``: ``verdict``, then ``verdict/<slot>`` (with a secret, a slot
        that holds a record the job did not write is skipped for the next)."""
        name = f"{self.prefix}/verdict"
        return name if slot == 0 else f"{name}/{slot}"


_JOB_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
_MAX_JOB_ID = 128


def new_job_id() -> str:
    """A fresh job id: 128 random bits, hex."""
    return secrets.token_hex(16)


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a valid job id (1-128 of ``[A-Za-z0-9._-]``).

    Raises:
        ConfigError: It is not.
    """
    if not job_id or len(job_id) > _MAX_JOB_ID or not set(job_id) <= _JOB_ID_CHARS:
        from resilient_ddp.errors import ConfigError

        raise ConfigError(
            f"{JOB_ENV}={job_id!r} is not a valid job id: use 1 to {_MAX_JOB_ID} letters, "
            "digits, '.', '_' or '-'"
        )
    return job_id


class JobRoot(dist.PrefixStore):
    """Job ``job_id``'s namespace in a store, with the job's record key.

    Without a key the namespace is ``rd/<job_id>/``. With one it is
    ``rd/<job_id>/<tag>/``, ``tag`` being 128 bits derived from the key
    (:func:`names_tag`): a process that does not hold the key cannot name any key of the
    job (a TCPStore cannot list its keys), so it can neither read, overwrite, delete nor
    append to them; and a record it plants anywhere else is never read.

    Attributes:
        job_id: The job's id.
        mac_key: 32 bytes derived from the job's secret (see :func:`root_prefix`), or None
            when the job has none: then records are not authenticated.
        prefix: The namespace's prefix in the store (``rd/<job_id>`` or
            ``rd/<job_id>/<tag>``).
    """

    def __init__(self, job_id: str, store: dist.Store, mac_key: bytes | None) -> None:
        check_job_id(job_id)
        prefix = job_prefix(job_id, mac_key)
        super().__init__(prefix, store)
        self.job_id = job_id
        self.mac_key = mac_key
        self.prefix = prefix
        self.base = store
        # Whether a process outside the group can join: it needs the operator's secret;
        # a key the ranks agreed on among themselves (group_secret) is known to no joiner.
        self.joinable = mac_key is not None

    def clone(self) -> JobRoot:
        """The same namespace over a new connection (``Store.clone``) where the store has
        one, else over the same connection."""
        clone = getattr(self.base, "clone", None)
        root = JobRoot(self.job_id, clone() if clone is not None else self.base, self.mac_key)
        root.joinable = self.joinable
        return root


def names_tag(key: bytes) -> str:
    """The part of a keyed job namespace's name derived from the job's record key."""
    return hmac.new(key, b"resilient_ddp/names", "sha256").hexdigest()[:32]


SECRET_FILE_ENV = "RESILIENT_DDP_SECRET_FILE"
_MIN_SECRET = 16  # characters of a secret the operator gives


def operator_secret() -> str | None:
    """The job secret the operator gave: ``RESILIENT_DDP_SECRET``, else the content of
    the file named by ``RESILIENT_DDP_SECRET_FILE`` (surrounding white space dropped);
    None when neither is set. :func:`resilient_ddp.spawn` sets the first for its ranks.

    Reads the file each call (a few microseconds; called at start-up only).

    Raises:
        ConfigError: The file cannot be read, is not a regular file, is too short, does not
            belong to this user, or other users may read or write it (its mode must be
            ``0600`` or ``0400``).
    """
    secret = os.environ.get(SECRET_ENV)
    if secret:
        return secret
    path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    return read_secret_file(path)


def read_secret_file(path: str) -> str:
    """The secret stored in ``path``, checked as :func:`operator_secret` says.

    Raises:
        ConfigError: See :func:`operator_secret`.
    """
    from resilient_ddp.errors import ConfigError

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ConfigError(
            f"{SECRET_FILE_ENV}={path!r} cannot be opened ({type(e).__name__}: {e}); it must "
            "name a regular file, owned by the job's user, that only this user can read"
        ) from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat_mod.S_ISREG(st.st_mode):
            raise ConfigError(f"{SECRET_FILE_ENV}={path!r} is not a regular file")
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"{SECRET_FILE_ENV}={path!r} belongs to uid {st.st_uid}, not to the job's "
                f"user (uid {os.getuid()}): the job's secret must be readable by its user only"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{SECRET_FILE_ENV}={path!r} has mode {stat_mod.S_IMODE(st.st_mode):04o}: "
                f"other users may read or write the job's secret. Run: chmod 600 {path}"
            )
        raw = f.read(1 << 16)
    secret = raw.decode(errors="replace").strip()
    if len(secret) < _MIN_SECRET:
        raise ConfigError(
            f"{SECRET_FILE_ENV}={path!r} holds {len(secret)} character(s): a job secret needs "
            f"at least {_MIN_SECRET} (for example: python -c 'import secrets; "
            "print(secrets.token_hex(32))' > FILE; chmod 600 FILE)"
        )
    return secret


def root_prefix(store: dist.Store, job_id: str, secret: str | None = None) -> JobRoot:
    """Return job ``job_id``'s namespace inside ``store``: no key of one job is ever read
    by another job that shares the store.

    Args:
        store: The store.
        job_id: The job's id (see :func:`check_job_id`).
        secret: The job's secret; default the operator's (:func:`operator_secret`). With
            one, every record the library writes carries a MAC keyed by it, a record
            without a valid one (written by a process outside the job) is ignored, and the
            namespace's name is derived from it (see :class:`JobRoot`). The secret itself
            is never written anywhere.

    Raises:
        ConfigError: ``job_id`` is not valid, or the secret file is unusable.
    """
    secret = operator_secret() if secret is None else secret
    return JobRoot(job_id, store, record_key(secret, job_id) if secret else None)


def record_key(secret: str, job_id: str) -> bytes:
    """Job ``job_id``'s record key, derived from its secret."""
    return hmac.new(secret.encode(), b"resilient_ddp/" + job_id.encode(), "sha256").digest()


def mac_key(store: dist.Store) -> bytes | None:
    """The record key of the job namespace ``store`` is (or is under), or None."""
    seen = 0
    while seen < 32:  # noqa: PLR2004 - a loop guard
        if isinstance(store, JobRoot):
            return store.mac_key
        if not isinstance(store, dist.PrefixStore):
            return None
        store = store.underlying_store
        seen += 1
    return None


STORE_ENV = "RESILIENT_DDP_STORE"


def control_store(
    explicit: dist.Store | None = None,
    *,
    joiner: bool = False,
    timeout: timedelta = timedelta(seconds=60),
) -> dist.Store:
    """The store that carries the control plane, inside this job's namespace ``rd/<job>/``.

    The store: under :func:`resilient_ddp.spawn` the launcher's (named in
    ``RESILIENT_DDP_STORE``), which outlives every rank; otherwise the store given to
    ``init_process_group`` or torch's default store (torchrun's agent store under torchrun).

    The job: ``RESILIENT_DDP_JOB_ID`` when set (:func:`resilient_ddp.spawn` sets it);
    otherwise rank 0 draws a fresh one and hands it to the others through torch's default
    store, which is new for every job (and every torchrun attempt), and records it in the
    control store for joiners. A joiner that was not given one takes the last job that
    started on the store. So no job ever reads another's keys on a long-lived store.

    The record key (every record sealed, the namespace's name derived from it; see
    :class:`JobRoot`): from the operator's secret (:func:`operator_secret`) when there is
    one; otherwise the ranks of torch's default group agree on one over the group
    (:func:`group_secret`, every rank must call this then), and the namespace is not
    ``joinable``: no process outside the group knows the key.

    Blocks at most ``timeout`` (the ranks other than 0 wait for rank 0's job id, and for
    its share of the key).

    Raises:
        ConfigError: ``RESILIENT_DDP_JOB_ID`` is not a valid id, or the secret file is
            unusable.
        PreflightError: No job id arrived in time (rank 0, or for a joiner any job, never
            started on this store); the ranks did not agree on a key in time; or a joiner
            has no secret.
    """
    addr = os.environ.get(STORE_ENV)
    if addr:
        host, _, port = addr.rpartition(":")
        root: dist.Store = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=60)
        )
    elif explicit is not None:
        root = explicit
    else:
        from resilient_ddp.control._torchelastic import attempt_namespace

        # A group the user created has no attempt namespace of its own: without one, a
        # restarted torchrun attempt would read the previous attempt's control plane.
        root = attempt_namespace(dist.distributed_c10d._get_default_store())
    secret = operator_secret()
    if joiner and secret is None:
        from resilient_ddp.errors import PreflightError

        raise PreflightError(
            "this process cannot join the running job: joining needs the job's secret, "
            f"set on every rank ({SECRET_ENV}, or {SECRET_FILE_ENV} naming a file only the "
            "job's user can read); resilient_ddp.spawn sets one itself",
            problems=["no job secret for a joiner"],
        )
    job = os.environ.get(JOB_ENV)
    if job:
        job = check_job_id(job)
    elif joiner:
        job = _wait_text(root, CURRENT_JOB_KEY, timeout, "no job has started on this store")
    else:
        job = _job_of_this_group(timeout)
    if not joiner and (not dist.is_initialized() or dist.get_rank() == 0):
        root.set(CURRENT_JOB_KEY, job)
    if secret is None and dist.is_initialized():
        # No secret given: the ranks of the formed group agree on one over the group
        # itself, never through the store (an outsider cannot take a rank of a formed
        # group without breaking it). Nobody outside the group can then join.
        jr = root_prefix(root, job, group_secret(timeout))
        jr.joinable = False
        return jr
    return root_prefix(root, job, secret)


_SECRET_BYTES = 32


def group_secret(timeout: timedelta) -> str:
    """A secret drawn by rank 0 of torch's default group and sent to every rank over the
    group (one broadcast of 32 bytes), never through a store. Every rank must call it.

    Blocks until every rank of the group called it, at most ``timeout``.

    Raises:
        PreflightError: A rank did not take part in time, or the group failed.
    """
    import torch

    backend = str(dist.get_backend())
    device = torch.device("cpu")
    if backend == "nccl":  # the only backend with no CPU path in the default group
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.zeros(_SECRET_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        drawn = torch.frombuffer(bytearray(secrets.token_bytes(_SECRET_BYTES)), dtype=torch.uint8)
        buf.copy_(drawn)
    try:
        work = dist.broadcast(buf, src=0, async_op=True)
        if work is not None:
            work.wait(timeout)
    except ResilientDDPError:
        raise  # the peers' verdict on this rank (Runtime.tell_main), never a store failure
    except (RuntimeError, OSError) as e:
        from resilient_ddp.errors import PreflightError

        raise PreflightError(
            f"rank {dist.get_rank()}: the ranks could not agree on the job's record key over "
            f"the process group within {timeout} ({type(e).__name__}: {e}): every rank "
            "must call resilient_ddp.init_process_group() (or its first resilient_ddp "
            "collective) at start-up",
            problems=["record key not agreed"],
        ) from e
    return bytes(buf.cpu().tolist()).hex()


def _job_of_this_group(timeout: timedelta) -> str:
    """Rank 0 draws the job id and shares it through torch's default store (new for each
    job); the other ranks wait for it."""
    from resilient_ddp.control._torchelastic import attempt_namespace

    # Under torchrun's agent store (which outlives the attempts), the attempt's own
    # namespace: a restarted attempt's rank must never read the previous attempt's id.
    store = attempt_namespace(dist.distributed_c10d._get_default_store())
    if dist.get_rank() == 0:
        job = new_job_id()
        store.set(JOB_ID_KEY, job)
        return job
    return _wait_text(store, JOB_ID_KEY, timeout, "rank 0 did not publish the job id")


def _wait_text(store: dist.Store, key: str, timeout: timedelta, why: str) -> str:
    try:
        store.wait([key], timeout)
        return check_job_id(store.get(key).decode())
    except ResilientDDPError:
        raise  # the peers' verdict on this rank (Runtime.tell_main), never a store failure
    except (RuntimeError, OSError, UnicodeDecodeError) as e:
        from resilient_ddp.errors import PreflightError

        raise PreflightError(
            f"this process could not find its job on the store within {timeout}: {why} "
            f"({type(e).__name__}: {e})",
            problems=[why],
        ) from e


# A record larger than this is cut (its longest text fields first) before it is written:
# the store refuses values over 8 MiB, and that refusal would read as a lost store.
MAX_RECORD_BYTES = 256 << 10
_MAC_CHARS = 32


def seal(key: bytes | None, name: str, obj: Any) -> str:
    """The text stored for record ``obj`` under key ``name``: its JSON, size-capped, with
    the MAC of ``name`` and the JSON in front when ``key`` is given."""
    body = json.dumps(obj, separators=(",", ":"))
    if len(body) > MAX_RECORD_BYTES:
        body = json.dumps(_cap(obj, len(body) - MAX_RECORD_BYTES), separators=(",", ":"))
    if key is None:
        return body
    return _mac(key, name, body) + " " + body


def unseal(key: bytes | None, name: str, raw: bytes | str) -> Any:
    """The record stored under ``name``, or None if it is not one the job wrote: not JSON,
    or (with a key) without a valid MAC for ``name``."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        if key is not None:
            mac, _, text = text.partition(" ")
            if len(mac) != _MAC_CHARS or not hmac.compare_digest(mac, _mac(key, name, text)):
                _note_rejected(name, "no valid MAC")
                return None
        return json.loads(text)
    except (UnicodeDecodeError, ValueError):
        _note_rejected(name, "not JSON")
        return None


def unseal_dict(key: bytes | None, name: str, raw: bytes | str) -> dict[str, Any] | None:
    """:func:`unseal`, for records that must be JSON objects."""
    obj = unseal(key, name, raw)
    if obj is None or isinstance(obj, dict):
        return obj
    _note_rejected(name, "not an object")
    return None


def _mac(key: bytes, name: str, body: str) -> str:
    msg = name.encode() + b"\0" + body.encode()
    return hmac.new(key, msg, "sha256").hexdigest()[:_MAC_CHARS]


_rejected: dict[str, int] = {}


def rejected_records() -> dict[str, int]:
    """How many records this process ignored, by key family (the key's name without its
    generation and rank parts): records the job did not write (not its MAC, not JSON, not
    a number), and replays (older generations or beats, copies of log lines)."""
    return dict(_rejected)


def _note_rejected(name: str, why: str) -> None:
    """Count that a record read under ``name`` was ignored, and log it once per key
    family, with ``why``: the store holds data this job did not write (a stale client, a
    bug, or an attacker)."""
    family = "/".join(p for p in name.split("/") if not p.lstrip("gr").isdigit())
    _rejected[family] = _rejected.get(family, 0) + 1
    plain_log.warn_once(
        ("rejected record", family),
        "resilient_ddp: ignored a record under %r in the control-plane store (%s): the "
        "store holds data this job did not write (further ones are counted)",
        name,
        why,
    )


def _cap(obj: Any, excess: int) -> Any:
    """``obj`` with its longest strings shortened by about ``excess`` bytes in all."""
    if not isinstance(obj, dict):
        return {"truncated": True}
    out = dict(obj)
    for k in sorted(out, key=lambda k: -len(str(out[k]))):
        v = out[k]
        if excess <= 0:
            break
        text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        keep = max(0, len(text) - excess - 64)
        excess -= len(text) - keep
        out[k] = text[:keep] + f"...[{len(text) - keep} bytes cut]"
    return out


def serve_store(
    host: str = "127.0.0.1", port: int = 0, timeout: timedelta = timedelta(seconds=300)
) -> dist.TCPStore:
    """Host a TCPStore that listens on ``host``'s address only (loopback by default).

    torch's TCPStore server listens on every interface even when given ``127.0.0.1``
    (FINDINGS): here a socket bound to ``host`` is handed to it (``master_listen_fd``). When
    ``host`` is no address of this machine (a NAT, a name for another interface), the store
    listens on every interface, as torch's does, and a warning says so.

    Raises:
        OSError: ``port`` is in use (``EADDRINUSE``).
    """
    sock: socket.socket | None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        sock = None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(512)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise
            sock = None
    if sock is None:
        log.warning(
            "resilient_ddp: the store cannot be bound to %s alone on this host; it listens on "
            "every interface (anyone who reaches port %d can write to it)",
            host,
            port,
        )
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    bound_port = int(sock.getsockname()[1])
    fd = sock.detach()  # the store's server owns the socket from here on
    try:
        return dist.TCPStore(
            host,
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except (TypeError, RuntimeError, ValueError):  # pragma: no cover - older torch
        os.close(fd)
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


class ControlPlane:
    """Typed access to one generation's keys in the store.

    Not thread-safe across threads that block: give each thread its own instance (see
    :meth:`clone`), because a TCPStore client serialises calls on one connection.
    """

    def __init__(self, root: dist.Store, generation: int) -> None:
        self.root = root
        self.generation = generation
        self.store: dist.Store = dist.PrefixStore(generation_prefix(generation), root)
        self.key = mac_key(root)
        # Replays: the highest beat read of each rank (a heartbeat whose beat is lower is
        # an old record written back: ignored). Threads share it (the watchdog, the main
        # thread's diagnosis, inference's collector): see _parse.
        self._beats: dict[int, int] = {}
        self._beats_lock = threading.Lock()
        # The event log, read incrementally (see read_events).
        self._log = _LogReader(self.key, self._name("ev/log"))
        self._nudge = 0  # see poll

    def set_timeout(self, timeout: timedelta) -> None:
        """Bound every call of this control plane's connection (a call that gets no answer
        in time raises :class:`ControlPlaneError`)."""
        self._call(self.root.set_timeout, timeout)

    def clone(self) -> ControlPlane:
        """Return a control plane over a new connection to the same store."""
        clone = getattr(self.root, "clone", None)
        root = clone() if clone is not None else self.root
        return ControlPlane(root, self.generation)  # a JobRoot's clone keeps its key

    # -- identity and heartbeats -------------------------------------------------------------
    def publish_info(self, rank: int, info: dict[str, Any]) -> None:
        self._set(f"info/{rank}", info)

    def read_infos(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
        return self._multi_get_json([f"info/{r}" for r in ranks], ranks)

    def publish_state(self, rank: int, state: HeartbeatState) -> None:
        """Publish rank ``rank``'s heartbeat: its JSON form (:meth:`HeartbeatState.record`)."""
        self._set(f"state/{rank}", state.record())

    def read_states(self, ranks: Sequence[int]) -> dict[int, HeartbeatState]:
        """The heartbeat states of ``ranks``, decoded (:func:`decode_state`); a rank whose
        state is not a valid record (another process overwrote it) is left out."""
        return self._decoded(self._multi_get_json([f"state/{r}" for r in ranks], ranks))

    def _decoded(self, records: dict[int, dict[str, Any]]) -> dict[int, HeartbeatState]:
        """The heartbeats among ``records`` (rank -> record read), decoded; a record that
        is not one is left out (:func:`decode_state`)."""
        out = {}
        for r, rec in records.items():
            state = decode_state(rec, self._name(f"state/{r}"))
            if state is not None:
                out[r] = state
        return out

    def finish_inference(self, call: int) -> int:
        """Count this rank finished with inference call ``call``; how many have now."""
        n = int(self._call(self.store.add, f"inf/{call}/done", 1))
        if n == 1:
            self.note_keys([f"inf/{call}/done"])
        return n

    def inference_finished(self, call: int) -> int:
        """How many ranks finished with inference call ``call``."""
        return int(self._call(self.store.add, f"inf/{call}/done", 0))

    def has_state(self, rank: int) -> bool:
        return self._call(self.store.check, [f"state/{rank}"])  # type: ignore[no-any-return]

    def init_counters(self) -> None:
        """Create the counters every poll reads, so that no poll ever waits for a key."""
        self._add("ev/n", 0)
        self._add("diag", 0)

    def wait_attached(self, world: int, timeout: timedelta) -> list[int]:
        """Wait until every rank of ``range(world)`` published its identity and its first
        heartbeat, at most ``timeout``.

        Returns:
            The ranks that did not attach in time (empty when all did).

        Raises:
            ControlPlaneError: The store is unreachable.
        """
        keys = [f"state/{r}" for r in range(world)] + [f"info/{r}" for r in range(world)]
        try:
            self.wait_keys(keys, timeout)
        except ResilientDDPError:
            raise  # the peers' verdict on this rank (Runtime.tell_main), never a store failure
        except (RuntimeError, OSError):  # DistStoreError: the keys did not all appear
            return [r for r in range(world) if not self.has_state(r)]
        return []

    def wait_keys(self, keys: Iterable[str], timeout: timedelta) -> None:
        """Block until every key exists, at most ``timeout``.

        Raises:
            ControlPlaneError: The store is unreachable.
            TimeoutError: The keys did not all appear in time (the store's own error).
        """
        self.store.wait(list(keys), timeout)

    def poll(
        self, watched: Sequence[int], *, joins: bool = False
    ) -> tuple[int, int, dict[int, HeartbeatState], int]:
        """Read, in one round trip, the event count, the diagnosis counter, the states of
        the watched ranks and, with ``joins``, the job's join request counter (``join/n``,
        which elastic training creates; -1 without)."""
        g = generation_prefix(self.generation)
        keys = [f"{g}/ev/n", f"{g}/diag"] + [f"{g}/state/{r}" for r in watched]
        before = self._beats_before()
        raw = self._call(self.root.multi_get, keys + (["join/n"] if joins else []))
        parsed = self._parse(keys[2:], watched, raw[2 : 2 + len(watched)], before, prefixed=True)
        states = self._decoded(parsed)
        events = _number(raw[0], keys[0])
        if events is None or self._log.behind:
            # The counter holds data the job did not write, or the last read of the log
            # stopped at its cap: a count never seen before, so that the caller reads the
            # log (incrementally, bounded) at every poll until it is caught up.
            self._nudge -= 1
            events = self._nudge
        return events, _count(raw[1], keys[1]), states, _count(raw[-1], "join/n") if joins else -1

    # -- events ------------------------------------------------------------------------------
    def post_event(self, event: dict[str, Any]) -> None:
        """Append an event to the log, then bump the counter readers poll."""
        self.post_events([event])

    def post_events(self, events: Sequence[dict[str, Any]]) -> None:
        """Append events to the log in one append (a reader sees all of them or none),
        then bump the counter readers poll."""
        name = self._name("ev/log")
        # Starts on a line of its own: a line another process appended without its newline
        # must not swallow this one.
        lines = "\n" + "".join(seal(self.key, name, e) + "\n" for e in events)
        # Store.append exists on every store torch>=2.3 ships; the stubs omit it.
        self._call(getattr(self.store, "append"), "ev/log", lines)  # noqa: B009
        self._add("ev/n", len(events))

    def read_events(self, *, whole: bool = False) -> list[FailureEvent]:
        """The events posted so far, in order, each decoded once (the list grows; callers
        must not change it); a line that is not a valid record (another process appended
        it), a record that is not an event the library posts (:func:`event_problem`), or a
        copy of an earlier line (a replay), is skipped and counted
        (:func:`rejected_records`).

        Incremental: only the bytes appended since this instance's last read are parsed,
        at most :data:`MAX_LOG_PARSE` bytes a call unless ``whole`` (the rest at the next
        calls; :meth:`poll` says when one is due). Two round trips.
        """
        if not self._call(self.store.check, ["ev/log"]):
            return self._log.events
        raw = self._call(self.store.get, "ev/log")
        events = self._log.read(raw)
        while whole and self._log.behind:
            events = self._log.read(raw)
        return events

    def event_count(self) -> int:
        """The number of events posted (0 before the counter exists, or while it holds
        data the job did not write)."""
        # check and get, not add(key, 0): an add on a value that is not a number (written
        # by a process outside the job) makes the server drop the connection.
        if not self._call(self.store.check, ["ev/n"]):
            return 0
        return _count(self._call(self.store.get, "ev/n"), self._name("ev/n"))

    def claim(self, rank: int) -> bool:
        """Return True for the first caller that reports rank ``rank``'s failure."""
        return self._add(f"claim/{rank}", 1) == 1

    def request_diagnosis(self) -> int:
        return self._add("diag", 1)

    def _add(self, key: str, n: int) -> int:
        """``add(key, n)`` that survives data the job did not write under ``key``: the
        server drops the connection of an ``add`` on a value that is not a number, which
        would read as a lost store. Such a value is replaced by 0 (and counted, see
        :func:`rejected_records`) first. Two round trips (failure path only)."""
        return _safe_add(self._call, self.store, key, n, self._name(key))

    # -- shared diagnoses --------------------------------------------------------------------
    def claim_diagnosis(self, seq: int, k: int) -> bool:
        """Return True for the first rank to diagnose round ``k`` (1, 2, ...) of op ``seq``:
        it diagnoses and publishes its verdict (:meth:`publish_verdict`); the others read it
        (:meth:`read_verdict`). One round trip."""
        key = f"dg/{seq}/{k}/claim"
        first = self._add(key, 1) == 1
        if first:
            self.note_keys([key, f"dg/{seq}/{k}/v"])
        return first

    def publish_verdict(self, seq: int, k: int, verdict: dict[str, Any]) -> None:
        self._set(f"dg/{seq}/{k}/v", verdict)

    def read_verdict(self, seq: int, k: int, timeout: timedelta) -> dict[str, Any] | None:
        """Wait for the verdict of round ``k`` of op ``seq`` (a wait on the server: one
        round trip, whatever the number of ranks), at most ``timeout``; ``None`` when none
        came (its diagnoser died) or it is not a valid record.

        Raises:
            ControlPlaneError: The store is unreachable.
        """
        key = f"dg/{seq}/{k}/v"
        try:
            self.store.wait([key], timeout)
        except ResilientDDPError:
            raise  # the peers' verdict on this rank (Runtime.tell_main), never a store failure
        except (RuntimeError, OSError):  # DistStoreError: it did not appear in time
            if not self._call(self.store.check, [key]):
                return None
        return unseal_dict(self.key, self._name(key), self._call(self.store.get, key))

    def note_keys(self, keys: Sequence[str]) -> None:
        """Record keys of this generation that only some ops create (diagnosis rounds,
        inference counters), for :meth:`JobStore.forget_generation` to delete."""
        self._call(getattr(self.store, "append"), "extra", "".join(k + "\n" for k in keys))  # noqa: B009

    # -- mismatch tables ---------------------------------------------------------------------
    def publish_signature(self, k: int, rank: int, sig: dict[str, Any]) -> None:
        self._set(f"mm/{k}/{rank}", sig)

    def read_signatures(
        self, k: int, ranks: Sequence[int], timeout: timedelta
    ) -> dict[int, dict[str, Any]]:
        """Read every rank's signature of mismatch ``k``; ranks that never publish are
        missing from the result after ``timeout`` (the read leaves a missing key out)."""
        keys = [f"mm/{k}/{r}" for r in ranks]
        with contextlib.suppress(Exception):  # a missing rank is reported by its absence
            self.store.wait(keys, timeout)
        return self._multi_get_json(keys, ranks)

    # -- plumbing ----------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        """``key``'s name under the job root (what a record's MAC covers)."""
        return f"{generation_prefix(self.generation)}/{key}"

    def _set(self, key: str, value: dict[str, Any]) -> None:
        self._call(self.store.set, key, seal(self.key, self._name(key), value))

    def _multi_get_json(
        self, keys: Sequence[str], ranks: Sequence[int]
    ) -> dict[int, dict[str, Any]]:
        """The records at ``keys`` (one per rank of ``ranks``), unsealed; a key that does
        not exist is left out, never waited for (a store's ``multi_get`` waits for every
        key up to the store's timeout: a reader that lags behind a generation whose keys
        its successor deleted would wait that long). One round trip when every key is
        there (the usual case), one per key more when some are missing.

        Raises:
            ControlPlaneError: The store is unreachable.
        """
        if not keys:
            return {}
        if not self._call(self.store.check, list(keys)):
            there = [
                (k, r)
                for k, r in zip(keys, ranks, strict=True)
                if self._call(self.store.check, [k])
            ]
            if not there:
                return {}
            keys, ranks = [k for k, _ in there], [r for _, r in there]
        before = self._beats_before()
        raw = self._call(self.store.multi_get, list(keys))
        return self._parse(keys, ranks, raw, before)

    def _beats_before(self) -> dict[int, int]:
        """The highest beats read so far, taken before a read is sent (see :meth:`_parse`)."""
        with self._beats_lock:
            return dict(self._beats)

    def _parse(
        self,
        keys: Sequence[str],
        ranks: Sequence[int],
        raw: Sequence[bytes],
        before: Mapping[int, int],
        *,
        prefixed: bool = False,
    ) -> dict[int, dict[str, Any]]:
        """Unseal the states read; drop a heartbeat older than one read before this read
        was sent (``before``): the store answers in order, so only a record written back
        can be older. (Compared with the newest read by the time this one is parsed, a
        read of another thread that was sent later but parsed first made a live rank's
        heartbeat look replayed.)"""
        out = {}
        for key, r, v in zip(keys, ranks, raw, strict=True):
            name = key if prefixed else self._name(key)
            rec = unseal_dict(self.key, name, v)
            if rec is None:
                continue
            beat = rec.get("beat")
            # A rank's last state (left, failed) has beat -1: it is never older than one read.
            if "/state/" in name and isinstance(beat, int) and beat >= 0:
                if beat < before.get(r, beat):
                    _note_rejected(name, "an older heartbeat written back (a replay)")
                    continue
                with self._beats_lock:
                    self._beats[r] = max(beat, self._beats.get(r, beat))
            out[r] = rec
        return out

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ResilientDDPError:
            # The peers' verdict on this rank, raised by the signal handler of
            # Runtime.tell_main in the middle of the call: it is no store failure, and
            # wrapped it would read as a lost store and name nobody.
            raise
        except (RuntimeError, OSError) as e:
            # DistStoreError and DistNetworkError derive from RuntimeError.
            raise ControlPlaneError(
                f"The control-plane store is unreachable ({type(e).__name__}: {e}). The process "
                "hosting it (the launcher, torchrun's agent or rank 0) has probably died; "
                "no rank can coordinate any more."
            ) from e


def store_address(store: dist.Store) -> tuple[str, int] | None:
    """The host and port of the TCPStore under ``store``'s prefixes (job namespaces,
    generations), or None for a store that is no TCPStore (a FileStore, a HashStore)."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 32:  # noqa: PLR2004 - a loop guard
        store = store.underlying_store
        seen += 1
    if not isinstance(store, dist.TCPStore) or not store.port:
        return None
    return str(store.host), int(store.port)


# What a fresh TCP connection to the store's address says (see probe_store).
PROBE_ANSWERS, PROBE_REFUSED, PROBE_SILENT = "accepts connections", "refused", "silent"
# How long a probe may wait for the TCP handshake (seconds).
PROBE_TIMEOUT_S = 1.0


def probe_store(address: tuple[str, int], timeout: float = PROBE_TIMEOUT_S) -> tuple[str, str]:
    """Open and close a plain TCP connection to the store's ``address``.

    Tells a store that has fallen behind from one that is gone, which a store call cannot:
    torch's TCPStore client does not bound its calls by its timeout (torch 2.13: an
    ``add``, ``check`` or ``multi_get`` to a SIGSTOPped server blocked for 35 minutes,
    until it was resumed), and any request just queues. The host's kernel completes the
    handshake of a live listening socket even while the server process is stopped or busy.

    Blocks at most ``timeout`` seconds; never raises.

    Returns:
        ``(PROBE_ANSWERS, "")``: the host is up and the port listens (the store is slow,
        stopped or overloaded, not gone); ``(PROBE_REFUSED, why)``: nothing listens (the
        process hosting the store exited); ``(PROBE_SILENT, why)``: no answer in time or
        no route (the host is down or the network to it is cut).
    """
    try:
        with socket.create_connection(address, timeout=timeout):
            return PROBE_ANSWERS, ""
    except ConnectionRefusedError as e:
        return PROBE_REFUSED, f"{type(e).__name__}: {e}"
    except OSError as e:  # a timeout, no route, the name does not resolve
        return PROBE_SILENT, f"{type(e).__name__}: {e}"


class StoreProbe:
    """Probes the control-plane store's address (:func:`probe_store`) from a
    short-lived thread of its own, at most once per ``every`` seconds, while the
    watchdog's store calls do not complete; the main thread reads the latest result and
    never blocks on it."""

    def __init__(self, address: tuple[str, int], every: float) -> None:
        self.address = address
        self.every = every
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # (time.monotonic() when the probe started, verdict, why)
        self._result: tuple[float, str, str] | None = None

    def latest(self, since: float) -> tuple[str, str] | None:
        """The verdict of the newest probe started after ``since`` (None if none finished
        yet); starts a probe if none runs and the last one is older than ``every``."""
        with self._lock:
            res = self._result
            running = self._thread is not None and self._thread.is_alive()
            if not running and (res is None or time.monotonic() - res[0] >= self.every):
                self._thread = threading.Thread(
                    target=self._run, name="resilient_ddp-store-probe", daemon=True
                )
                self._thread.start()
        if res is None or res[0] < since:
            return None
        return res[1], res[2]

    def _run(self) -> None:
        started = time.monotonic()
        verdict, why = probe_store(self.address)
        with self._lock:
            self._result = (started, verdict, why)


def present(check: Callable[[list[str]], bool], keys: Sequence[str]) -> list[bool]:
    """Which of ``keys`` exist, ``check`` answering for a whole list at once (a store's
    ``check``). The list is halved where it says no: ``1 + 2 k log2(n / k)`` round trips or
    so for ``k`` absent keys out of ``n``, instead of ``n`` one by one (all there: one)."""
    out = [False] * len(keys)
    spans = [(0, len(keys))]
    while spans:
        lo, hi = spans.pop()
        if hi <= lo:
            continue
        if check(list(keys[lo:hi])):
            out[lo:hi] = [True] * (hi - lo)
        elif hi - lo > 1:
            mid = (lo + hi) // 2
            spans += [(mid, hi), (lo, mid)]
    return out


# Wait loops that every rank runs at once poll at these intervals (Backoff): the first
# after POLL_FIRST_S, growing by POLL_GROWTH a poll to POLL_MAX_S while nothing changes,
# and never shorter than keeps all the ranks' polls together under POLL_RATE requests a
# second (one store serves about 50k a second on one core; heartbeats need about 4 a rank).
POLL_FIRST_S = 0.005
POLL_MAX_S = 0.05
POLL_GROWTH = 1.5
POLL_RATE = 20_000.0


class Backoff:
    """The waits between the polls of one wait loop: :data:`POLL_FIRST_S` first, growing
    by :data:`POLL_GROWTH` a poll up to :data:`POLL_MAX_S`, back to the first after
    :meth:`reset` (something changed: the next change may come soon).

    ``ranks`` ranks poll together, each making ``requests`` store requests a poll: no wait
    is shorter than what keeps them under :data:`POLL_RATE` requests a second in all
    (at two requests a poll: from 50 ranks on, the first wait is longer than
    :data:`POLL_FIRST_S`, and from 500 on, every wait is that floor)."""

    def __init__(self, ranks: int, requests: int) -> None:
        floor = max(1, ranks) * max(1, requests) / POLL_RATE
        self.first = max(POLL_FIRST_S, floor)
        self.cap = max(POLL_MAX_S, floor)
        self.interval = self.first

    def reset(self) -> None:
        self.interval = self.first

    def next_wait(self, now: float, until: float | None = None) -> float:
        """The seconds to wait now (no later than ``until``, a monotonic time, give or
        take :data:`POLL_FIRST_S`); the next wait grows."""
        wait = self.interval
        if until is not None:
            wait = min(wait, max(until - now, POLL_FIRST_S))
        self.interval = min(self.cap, self.interval * POLL_GROWTH)
        return wait

    def sleep(self, until: float | None = None) -> None:
        """Wait the next wait (see :meth:`next_wait`; ``until`` is a :func:`_clock.monotonic`
        time) on the clock in use (:func:`_clock.use`). Blocks for that long."""
        _clock.sleep(self.next_wait(_clock.monotonic(), until))


# Key families a generation creates only for some ops (ControlPlane.note_keys).
_NOTED_FAMILIES = ("dg/", "inf/")

_SLOTS = 4  # a decision is taken in the first of these slots that holds no garbage


def _slot(key: str, i: int) -> str:
    return key if i == 0 else f"{key}/{i}"


class JobKeys:
    """The spelling of every job-level key of the module's second table, in one place:
    :class:`JobStore` writes and reads them, :meth:`JobStore.forget_generation` deletes
    them, and ``elastic`` names its rounds and decisions with them."""

    @staticmethod
    def retry(generation: int, seq: int, attempt: int) -> str:
        """Group-retry votes for op ``seq``'s ``attempt`` (``/abort``, ``/gen`` below)."""
        return f"{generation_prefix(generation)}/retry/{seq}/{attempt}"

    @staticmethod
    def shrink_round(generation: int, round_: int) -> str:
        """The prefix of shrink round ``round_`` after generation ``generation``."""
        return f"rec/{generation_prefix(generation)}/r{round_}"

    @staticmethod
    def round_decision(base: str) -> str:
        """The decision of the shrink round whose prefix is ``base``."""
        return f"{base}/d"

    @staticmethod
    def ready(generation: int, rank: int | str) -> str:
        """``rank`` arrived to form ``generation`` (``"n"``: the arrival counter)."""
        return f"form/{generation_prefix(generation)}/{rank}"

    @staticmethod
    def left(generation: int) -> str:
        return f"left/{generation_prefix(generation)}"

    @staticmethod
    def admission(generation: int) -> str:
        """The admission decided in ``generation``."""
        return f"grow/{generation_prefix(generation)}"

    @staticmethod
    def ack(generation: int, requests: int, rank: int | str) -> str:
        """``rank`` acknowledged ``requests`` join requests in ``generation`` (``"n"``:
        the counter): an acknowledgement counts for that generation and count only."""
        return f"{JobKeys.admission(generation)}/n{requests}/ack/{rank}"

    @staticmethod
    def has_state(generation: int, rank: int | str) -> str:
        """``rank`` of admission generation ``generation`` has the state (``"n"``: the
        counter)."""
        return f"adm/{generation_prefix(generation)}/ok/{rank}"

    @staticmethod
    def admission_result(generation: int) -> str:
        return f"adm/{generation_prefix(generation)}/result"

    @staticmethod
    def joiner(what: str, uid: int) -> str:
        """Joiner ``uid``'s ``what``: ``adm`` (its admission), ``done``, ``gone``,
        ``tries``."""
        return f"join/{what}/{uid}"

    @staticmethod
    def extra(generation: int) -> str:
        """Names of the keys only some ops made in ``generation``, one a line."""
        return f"{generation_prefix(generation)}/extra"


class JobStore:
    """Typed access to the job's keys (see the module's table), over one connection.

    Every method raises :class:`ControlPlaneError` when the store does not answer.
    """

    def __init__(self, root: dist.Store) -> None:
        self.root = root
        self.key = mac_key(root)
        # Replays: generations only grow. The highest generation read under ``gen``, and
        # the ``members`` record of the highest generation read: an older record written
        # back is ignored (the launcher kills the processes a record leaves out).
        self._gen_seen = 0
        self._members: dict[str, Any] | None = None

    # -- plumbing ----------------------------------------------------------------------------
    def _c(self, fn: Any, *args: Any) -> Any:
        return ControlPlane._call(fn, *args)

    def _has(self, *keys: str) -> bool:
        return bool(self._c(self.root.check, list(keys)))

    def _put(self, key: str, value: Any) -> None:
        self._c(self.root.set, key, seal(self.key, key, value))

    def _get(self, key: str) -> Any:
        if not self._has(key):
            return None
        return unseal(self.key, key, self._c(self.root.get, key))

    def _flag(self, key: str) -> None:
        self._c(self.root.set, key, "1")

    def _counter(self, key: str) -> int:
        """A counter's value, 0 while it does not exist (reading never creates it)."""
        if not self._has(key):
            return 0
        return _count(self._c(self.root.get, key))

    def _bump(self, key: str) -> None:
        """Count one more record under the arrival counter ``key`` (see :meth:`_tally`)."""
        self._add(key, 1)

    def _add(self, key: str, n: int) -> int:
        """``add(key, n)``, safe from data the job did not write (see :func:`_safe_add`)."""
        return _safe_add(self._c, self.root, key, n, key)

    def _tally(self, key: str) -> int:
        """An arrival counter's value in one round trip, whether or not it exists yet.

        Each rank bumps one after writing its own record (:meth:`_bump`), so a waiter reads
        this one key a poll instead of every rank's, and reads theirs only once it moved.
        ``add(key, 0)`` creates the key at 0 (never waits on the store), which is why it is
        only used on keys written by ``add`` alone: ``add`` on a key holding anything but a
        number breaks the connection.
        """
        return _count(self._c(self.root.compare_set, key, "", "0"), key)

    def _present(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` exist (:func:`present`)."""
        return present(lambda ks: self._has(*ks), keys)

    def _append(self, key: str, value: dict[str, Any]) -> None:
        self._c(getattr(self.root, "append"), key, "\n" + seal(self.key, key, value) + "\n")  # noqa: B009

    def _log(self, key: str) -> list[dict[str, Any]]:
        if not self._has(key):
            return []
        return read_log(self.key, key, self._c(self.root.get, key))

    def decision(self, key: str) -> dict[str, Any] | None:
        """The decision taken under ``key``, or None if none was taken yet."""
        for i in range(_SLOTS):
            k = _slot(key, i)
            if not self._has(k):
                return None
            rec = unseal_dict(self.key, k, self._c(self.root.get, k))
            if rec is not None:
                return rec
        return None

    def decide(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        """Propose ``value`` as the decision under ``key``; return the decision taken (the
        first proposal made, whoever made it), in the first slot that holds no garbage.

        Raises:
            ControlPlaneError: Every slot holds garbage another process wrote.
        """
        for i in range(_SLOTS):
            k = _slot(key, i)
            got = self._c(self.root.compare_set, k, "", seal(self.key, k, value))
            rec = unseal_dict(self.key, k, got)
            if rec is not None:
                return rec
        raise ControlPlaneError(
            f"the control-plane store holds data this job did not write in every slot of "
            f"the decision {key!r}: a process outside the job writes to its store"
        )

    # -- generations -------------------------------------------------------------------------
    def generation(self) -> int:
        """The current generation (0 before any rebuild). A record that is not the job's,
        or names a generation lower than one this instance read before (a replay), is
        ignored: the highest read so far stands."""
        rec = self._get("gen")
        gen = rec.get("gen") if isinstance(rec, dict) else None
        if not isinstance(gen, int) or isinstance(gen, bool):
            return self._gen_seen
        if gen < self._gen_seen:
            _note_rejected("gen", "an older generation written back (a replay)")
            return self._gen_seen
        self._gen_seen = gen
        return gen

    def set_generation(self, generation: int) -> None:
        """Record the current generation (rank 0 of it does; the launcher reads it)."""
        self._put("gen", {"gen": generation})

    def vote_retry(self, generation: int, seq: int, attempt: int) -> int:
        """Vote, as one rank of ``generation``, to redo op ``seq`` (``attempt``); return
        the votes so far."""
        return self._add(JobKeys.retry(generation, seq, attempt), 1)

    def retry_votes(self, generation: int, seq: int, attempt: int) -> int:
        return self._counter(JobKeys.retry(generation, seq, attempt))

    def call_off_retry(self, generation: int, seq: int, attempt: int) -> None:
        """A rank gave up: nobody retries op ``seq`` (``attempt``)."""
        self._flag(JobKeys.retry(generation, seq, attempt) + "/abort")

    def retry_called_off(self, generation: int, seq: int, attempt: int) -> bool:
        return self._has(JobKeys.retry(generation, seq, attempt) + "/abort")

    def retry_generation(self, generation: int, seq: int, attempt: int) -> int:
        """The generation the retry of op ``seq`` forms: the first voter's draw."""
        key = JobKeys.retry(generation, seq, attempt) + "/gen"
        taken = self.decide(key, {"gen": self.next_generation()})
        return int(taken["gen"])

    def next_generation(self) -> int:
        """A generation number no group has used, above every one used so far."""
        return self._add("gen_seq", 1)

    def members(self) -> dict[str, Any] | None:
        """The last complete generation's record ``{"gen": N, "members": [ids]}``, or None
        before there is one. A record of a generation lower than one this instance read
        before (a replay) is ignored: the newest read stands."""
        rec = self._get("members")
        if not isinstance(rec, dict):
            return self._members
        gen = rec.get("gen")
        if not isinstance(gen, int) or not isinstance(rec.get("members"), list):
            return self._members
        last = self._members
        if last is not None and gen < int(last["gen"]):
            _note_rejected("members", "an older generation written back (a replay)")
            return last
        self._members = rec
        return self._members

    def set_members(self, generation: int, members: list[int]) -> None:
        self._put("members", {"gen": generation, "members": members})

    def leave(self, generation: int) -> int:
        """Count one more member of ``generation`` that left normally; return the count."""
        return self._add(JobKeys.left(generation), 1)

    def ended(self) -> dict[str, Any] | None:
        return self.decision("ended")

    def end(self, step: int, failed: str | None) -> None:
        self.decide("ended", {"step": step, "failed": failed})

    def open_inference(self, record: dict[str, Any]) -> None:
        """Say that inference call ``record["call"]`` of generation ``record["gen"]`` runs
        (rank 0, when it starts; ``record["closed"]`` once it ended): a replacement started
        meanwhile helps with it instead of waiting for an admission (see ``_guest``)."""
        self._put("inf/open", record)

    def inference(self) -> dict[str, Any] | None:
        """The last :meth:`open_inference` record, or None (no call ran, or not one the job
        wrote)."""
        rec = self._get("inf/open")
        return rec if isinstance(rec, dict) else None

    def is_elastic(self) -> bool:
        """Whether the job trains elastically (``on_failure="shrink"`` creates ``join/n``)."""
        return self._has("join/n")

    # -- shrink ------------------------------------------------------------------------------
    def post_proposal(self, base: str, proposal: dict[str, Any]) -> None:
        """Append a proposal to round ``base``'s log, then count it (``<base>/n``)."""
        self._append(f"{base}/log", proposal)
        self._bump(f"{base}/n")

    def proposal_count(self, base: str) -> int:
        """Proposals counted in round ``base`` (one round trip). A poster that died between
        its log line and its count leaves the counter behind the log: read the log when
        this moved, and before deciding."""
        return self._tally(f"{base}/n")

    def proposals(self, base: str) -> list[dict[str, Any]]:
        return self._log(f"{base}/log")

    def post_ready(self, generation: int, rank: int) -> None:
        """``rank`` arrived to form ``generation``: its flag, then the count of arrivals."""
        self._flag(JobKeys.ready(generation, rank))
        self._bump(JobKeys.ready(generation, "n"))

    def ready_count(self, generation: int) -> int:
        """Arrivals counted to form ``generation`` (members and joiners; one round trip)."""
        return self._tally(JobKeys.ready(generation, "n"))

    def ready(self, generation: int, ranks: Iterable[int]) -> bool:
        return self._has(*[JobKeys.ready(generation, r) for r in ranks])

    # -- grow --------------------------------------------------------------------------------
    def init_joins(self) -> None:
        self._add("join/n", 0)

    def join_count(self) -> int:
        return self._counter("join/n")

    def new_joiner_uid(self) -> int:
        return self._add("join/uid", 1)

    def request_join(self, request: dict[str, Any]) -> None:
        self._append("join/log", request)
        self._add("join/n", 1)

    def join_requests(self) -> list[dict[str, Any]]:
        return self._log("join/log")

    def ack(self, generation: int, requests: int, rank: int, committed: int) -> None:
        """``rank`` saw ``requests`` join requests in ``generation`` when it had
        ``committed`` steps, and looks for the admission at every step boundary after."""
        self._put(JobKeys.ack(generation, requests, rank), {"committed": committed})
        if self._add(JobKeys.ack(generation, requests, "n"), 1) == 1:
            # The first rank to acknowledge this count notes it in the generation's
            # ``extra`` (one line), for :meth:`forget_generation` to delete these keys: no
            # single rank knows every count the others acknowledged in the generation.
            append = getattr(self.root, "append")  # noqa: B009
            self._c(append, JobKeys.extra(generation), f"ack/{requests}\n")

    def ack_count(self, generation: int, requests: int) -> int:
        """Acknowledgements counted of ``requests`` requests in ``generation`` (one round
        trip; :meth:`ack_bound` reads them)."""
        return self._tally(JobKeys.ack(generation, requests, "n"))

    def ack_bound(self, generation: int, requests: int, world: int) -> int | None:
        """The largest committed step count in the acknowledgements of ``requests``
        requests by every rank of ``generation``; None until every rank acknowledged (or
        while one acknowledgement is not a valid record). Two round trips at most."""
        keys = [JobKeys.ack(generation, requests, r) for r in range(world)]
        if not self._has(*keys):
            return None
        raw = self._c(self.root.multi_get, keys)
        counts = []
        for k, v in zip(keys, raw, strict=True):
            rec = unseal(self.key, k, v)
            if not isinstance(rec, dict) or not isinstance(rec.get("committed"), int):
                return None
            counts.append(int(rec["committed"]))
        return max(counts)

    def missing_acks(self, generation: int, requests: int, world: int) -> list[int]:
        """The ranks of ``generation`` that did not acknowledge ``requests`` requests."""
        keys = [JobKeys.ack(generation, requests, r) for r in range(world)]
        return [r for r, there in enumerate(self._present(keys)) if not there]

    def admission_for(self, uid: int) -> dict[str, Any] | None:
        rec = self._get(JobKeys.joiner("adm", uid))
        return rec if isinstance(rec, dict) else None

    def set_admission_for(self, uid: int, admission: dict[str, Any]) -> None:
        self._put(JobKeys.joiner("adm", uid), admission)

    def mark_admitted(self, uid: int) -> None:
        """``uid`` was admitted: it is never pending again, and its admission record and
        failed-try counter are no longer read (deleted: one key per joiner stays)."""
        self._flag(JobKeys.joiner("done", uid))
        self._c(self.root.delete_key, JobKeys.joiner("adm", uid))
        self._c(self.root.delete_key, JobKeys.joiner("tries", uid))

    def admitted(self, uid: int) -> bool:
        return self._has(JobKeys.joiner("done", uid))

    def mark_gone(self, uid: int) -> None:
        self._flag(JobKeys.joiner("gone", uid))

    def gone(self, uid: int) -> bool:
        return self._has(JobKeys.joiner("gone", uid))

    def join_tries(self, uid: int) -> int:
        return self._counter(JobKeys.joiner("tries", uid))

    def add_join_try(self, uid: int) -> None:
        self._add(JobKeys.joiner("tries", uid), 1)

    def post_has_state(self, generation: int, rank: int) -> None:
        self._put(JobKeys.has_state(generation, rank), {"ok": True})
        self._bump(JobKeys.has_state(generation, "n"))

    def has_state_count(self, generation: int) -> int:
        """Confirmations counted in admission generation ``generation`` (one round trip)."""
        return self._tally(JobKeys.has_state(generation, "n"))

    def all_have_state(self, generation: int, world: int) -> bool:
        """Whether every rank of admission generation ``generation`` confirmed it has the
        state (at most two round trips)."""
        keys = [JobKeys.has_state(generation, r) for r in range(world)]
        if not self._has(*keys):
            return False
        raw = self._c(self.root.multi_get, keys)
        return all(unseal(self.key, k, v) == {"ok": True} for k, v in zip(keys, raw, strict=True))

    def missing_state(
        self, generation: int, world: int, among: Iterable[int] | None = None
    ) -> list[int]:
        """The ranks of admission generation ``generation`` (of ``among``, default all
        ``world``) that did not confirm yet: a few round trips when few are missing."""
        ranks = list(range(world)) if among is None else list(among)
        keys = [JobKeys.has_state(generation, r) for r in ranks]
        there = [k for k, t in zip(keys, self._present(keys), strict=True) if t]
        raw = self._c(self.root.multi_get, there) if there else []
        ok = {k for k, v in zip(there, raw, strict=True) if unseal(self.key, k, v) == {"ok": True}}
        return [r for r, k in zip(ranks, keys, strict=True) if k not in ok]

    # -- cleaning up -------------------------------------------------------------------------
    def forget_generation(
        self,
        generation: int,
        world: int,
        *,
        rounds: int = 8,
        mismatches: int = 0,
        acked: Iterable[int] = (),
    ) -> int:
        """Delete generation ``generation``'s keys (``world`` ranks): its heartbeats,
        identities, events, claims and mismatch tables, and the job's keys of its shrink
        rounds (the first ``rounds``), formation, admission and acknowledgements (of the
        request counts in ``acked`` and of those any rank noted in ``g<N>/extra``: see
        :meth:`ack`) with their arrival counters, and the rendezvous keys
        torch 2.13's gloo writes for the generation's group (``g<N>/pg/0//cpu//0/<r>``;
        other torch versions may write others, which stay).

        Returns:
            How many keys were deleted.
        """
        g = generation_prefix(generation)
        names: list[str] = []
        if self._has(JobKeys.extra(generation)):
            # Keys only some ops created (ControlPlane.note_keys, claim_decision) and the
            # request counts acknowledged (ack), one name a line. Unsealed: only names of
            # those families are believed.
            raw = self._c(self.root.get, JobKeys.extra(generation))
            names = bytes(raw).decode(errors="replace").split("\n")
        noted = {int(k[4:]) for k in names if k.startswith("ack/") and k[4:].isdigit()}
        acked = sorted(set(acked) | noted)
        keys = [f"{g}/ev/n", f"{g}/ev/log", f"{g}/diag", JobKeys.left(generation)]
        for r in range(world):
            keys += [f"{g}/info/{r}", f"{g}/state/{r}", f"{g}/claim/{r}"]
            # torch 2.13's gloo rendezvous of the generation's default group, per rank
            keys += [f"{g}/pg/0//cpu//0/{r}", f"{g}/pg/0//cuda//0/{r}"]
            keys += [JobKeys.ready(generation, r), JobKeys.has_state(generation, r)]
            keys += [f"{g}/mm/{k}/{r}" for k in range(1, mismatches + 1)]
            keys += [JobKeys.ack(generation, n, r) for n in acked]
        bases = [JobKeys.shrink_round(generation, k) for k in range(rounds)]
        decisions = [JobKeys.admission(generation), JobKeys.admission_result(generation)]
        decisions += [JobKeys.round_decision(b) for b in bases]
        keys += [_slot(d, i) for d in decisions for i in range(_SLOTS)]
        keys += [f"{b}/{name}" for b in bases for name in ("log", "n")]
        # The arrival counters (JobStore._tally)
        keys += [JobKeys.ready(generation, "n"), JobKeys.has_state(generation, "n")]
        keys += [JobKeys.ack(generation, n, "n") for n in acked]
        if names:
            keys += [f"{g}/{k}" for k in names if k.startswith(_NOTED_FAMILIES)]
            keys.append(JobKeys.extra(generation))
        deleted = 0
        for key in keys:
            deleted += bool(self._c(self.root.delete_key, key))
        return deleted

    # -- one decider -------------------------------------------------------------------------
    def claim_decision(self, generation: int, name: str, rank: int) -> int | None:
        """Claim the decision ``name`` of generation ``generation`` for ``rank``, unless a
        rank claimed it first: one ``compare_set`` on ``g<N>/dg/<name>/claim``, whatever
        the number of ranks. The winner records the key's name in ``g<N>/extra``, so that
        :meth:`forget_generation` deletes it with the generation's other ``dg/`` keys.

        Does not block beyond the round trips (two for the winner, one for the others).

        Returns:
            The rank whose claim stands: ``rank`` when this call made it, another when that
            rank came first; ``None`` when the key holds something that is not a valid
            claim (written by a process outside the job): then no rank is the decider.

        Raises:
            ControlPlaneError: The store is unreachable.
        """
        key = f"{generation_prefix(generation)}/dg/{name}/claim"
        mine = seal(self.key, key, {"rank": rank})
        rec = unseal_dict(self.key, key, self._c(self.root.compare_set, key, "", mine))
        who = rec.get("rank") if rec is not None else None
        if not isinstance(who, int) or isinstance(who, bool):
            return None
        if who == rank:
            extra = JobKeys.extra(generation)
            self._c(getattr(self.root, "append"), extra, f"dg/{name}/claim\n")  # noqa: B009
        return who


def read_log(
    key: bytes | None, name: str, raw: bytes, seen: set[str] | None = None
) -> list[dict[str, Any]]:
    """The valid records of a JSON-lines log stored under ``name``, in order. With
    ``seen`` (which this updates) and a key, a line equal to an earlier one is a replay
    and skipped: every event the job writes is distinct (its MAC covers a body with its
    own time and reporter)."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        text = raw.decode(errors="replace")
    out = []
    for line in text.splitlines():
        if not line:
            continue
        if key is not None and seen is not None:
            if line in seen:
                _note_rejected(name, "a copy of an earlier record (a replay)")
                continue
            seen.add(line)
        rec = unseal_dict(key, name, line)
        if rec is not None:
            out.append(rec)
    return out


def _safe_add(call: Callable[..., Any], store: dist.Store, key: str, n: int, name: str) -> int:
    """``store.add(key, n)`` through ``call`` (which types store errors), safe from data the
    job did not write under ``key``: the server drops the connection of an ``add`` on a
    value that is not a number, which would read as a lost store. Such a value is counted
    (:func:`rejected_records`) and replaced by 0 first. With ``n == 0`` one request
    (``compare_set``, which also creates the counter), else two."""
    cur = call(store.compare_set, key, "", "0")  # creates it at 0 if missing
    value = _number(cur, name)
    if value is None:
        call(store.compare_set, key, cur, "0")
        value = 0
    return int(call(store.add, key, n)) if n else value


def _number(raw: bytes, name: str = "counter") -> int | None:
    """A counter's value (``add``), or None (counted, see :func:`rejected_records`) for
    data that is not a number: another process wrote it."""
    try:
        return int(raw)
    except ValueError:
        _note_rejected(name, "not a number")
        return None


def _count(raw: bytes, name: str = "counter") -> int:
    """A counter's value; data that is not a number reads as 0 (see :func:`_number`)."""
    n = _number(raw, name)
    return 0 if n is None else n


# Parsed at most per read of a log (see _LogReader), and the longest line of a log that
# can be a record of the job (seal caps records at MAX_RECORD_BYTES, give or take).
MAX_LOG_PARSE = 1 << 20
MAX_LINE = 2 * MAX_RECORD_BYTES


class _LogReader:
    """The event log (JSON lines of sealed records), read incrementally: each
    :meth:`read` looks at the complete lines appended since the last one; a line longer
    than any record the job writes (:data:`MAX_LINE`) is skipped unparsed (counted); at
    most :data:`MAX_LOG_PARSE` bytes of lines are parsed a call (``behind`` says more is
    waiting); copies of earlier lines (replays) are dropped. Each record is decoded once
    (:meth:`FailureEvent.decode`); a malformed one is dropped (counted)."""

    def __init__(self, key: bytes | None, name: str) -> None:
        self.key, self.name = key, name
        self.events: list[FailureEvent] = []
        self.offset = 0  # bytes consumed (complete lines)
        self.mark = b""  # the last bytes consumed: tells a log that was replaced
        self.seen: set[str] = set()
        self.behind = False

    def read(self, raw: bytes) -> list[FailureEvent]:
        raw = bytes(raw)
        if len(raw) < self.offset or raw[self.offset - len(self.mark) : self.offset] != self.mark:
            # Not the log read before (deleted and written again): from the start.
            self.events, self.offset, self.mark, self.seen = [], 0, b"", set()
        pos, parsed, lines = self.offset, 0, []
        while parsed < MAX_LOG_PARSE:
            nl = raw.find(b"\n", pos)
            if nl < 0:
                break
            if nl - pos > MAX_LINE:
                _note_rejected(self.name, "a line longer than any record of the job")
            elif nl > pos:
                lines.append(raw[pos:nl])
                parsed += nl - pos
            pos = nl + 1
        for rec in read_log(self.key, self.name, b"\n".join(lines), self.seen) if lines else []:
            try:
                self.events.append(FailureEvent.decode(rec))
            except ValueError as e:
                _note_rejected(self.name, f"not an event the library posts: {e}")
        if pos > self.offset:
            self.offset = pos
            self.mark = raw[max(0, pos - 64) : pos]
        self.behind = raw.find(b"\n", self.offset) >= 0
        return self.events


# -- identity helpers -------------------------------------------------------------------------
def host_name() -> str:
    return socket.gethostname()


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def proc_stat(path: str) -> tuple[str, list[str]] | None:
    """A Linux ``stat`` file (``/proc/<pid>/stat``, ``/proc/self/task/<tid>/stat``): the
    name in it and the fields after the name (the state first), or None if it is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    # The name may hold spaces and parentheses: it ends at the last ")".
    return stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), or None if it is gone."""
    stat = proc_stat(f"/proc/{pid}/stat")
    return None if stat is None else int(stat[1][19])


def process_state(pid: int) -> str | None:
    """One-letter Linux process state (R, S, D, T, Z, ...), or None if it is gone."""
    stat = proc_stat(f"/proc/{pid}/stat")
    return None if stat is None else stat[1][0]


def same_process_alive(pid: int, start_time: int | None) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` still runs (not a zombie)."""
    if start_time is None:
        return True  # cannot tell; never report what we cannot see
    state = process_state(pid)
    if state is None or state in "ZX":
        return False
    return process_start_time(pid) == start_time


def store_port(store: dist.Store) -> int | None:
    """The TCP port of the TCPStore under ``store``'s prefixes, or None for another store."""
    address = store_address(store)
    return address[1] if address is not None else None


_INODE = 9  # column of the socket's inode in /proc/net/tcp


def serves_port(port: int) -> bool:
    """Whether this process holds a socket listening on TCP ``port`` (Linux; False when it
    cannot tell). It tells which process hosts a TCPStore: rank 0 under ``env://`` or
    ``mp.spawn``, not under torchrun or :func:`resilient_ddp.spawn`."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; then the inode.
            fields = row.split()
            if len(fields) <= _INODE or fields[3] != "0A":
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[_INODE])
    if not inodes:
        return False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def my_identity(rank: int) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "rank": rank,
        "host": host_name(),
        "pid": pid,
        "start": process_start_time(pid),
        "boot": boot_id(),
        "pidns": pid_namespace(),
    }


def pid_namespace() -> str:
    """This process's PID namespace (``/proc/self/ns/pid``'s target), or "" if unknown.

    Two processes on one host (same hostname and boot id) can see each other's pids only
    when they share this: containers with host networking usually do not."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
