"""Start-up checks: the environment, the rendezvous store, and what every rank brings.

``init_process_group`` with the ``env://`` rendezvous (torchrun, ``rd.spawn``, or the
variables set by hand) runs these steps before torch creates the process group, within
``config.init_timeout``:

1. **Environment** (this rank alone, at once): ``MASTER_ADDR`` resolves, ``MASTER_PORT``,
   ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are integers in range, the backend exists
   in this build of torch.
2. **Store**: rank 0 hosts the TCPStore (unless torchrun's agent does) and every rank
   connects. Transient failures (connection refused while rank 0 is not up yet, a reset
   connection) are retried through tenacity until the budget runs out; permanent ones (the
   port is already in use on the master, the address does not resolve) are not.
3. **Exchange**: every rank publishes its facts (host, versions of Python, torch, CUDA and
   NCCL, device, free memory) through the store. Rank 0 waits for everyone's, reads them
   once and publishes its verdict; the other ranks wait for that verdict (one key a poll),
   so start-up reads O(W) bytes in all, not every rank every rank's facts. Ranks that
   never arrive are named, with the hosts of those that did. Versions that differ, two
   ranks on one GPU, a ``LOCAL_RANK`` without a GPU: every problem is listed in one
   :class:`PreflightError` with a per-rank table, raised on every rank that is up.

The store is created without waiting for all workers (torch's default makes rank 0 block
inside the TCPStore constructor, silently, until every rank connects).
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import json
import logging
import os
import platform
import socket
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import tenacity
import torch
import torch.distributed as dist

from resilient_ddp.base import _clock
from resilient_ddp.base._backend import nccl_version
from resilient_ddp.control._control import (
    PREFLIGHT_PREFIX,
    Backoff,
    PreflightKeys,
    operator_secret,
    seal,
    serve_store,
    unseal_dict,
)
from resilient_ddp.control._control import present as _present
from resilient_ddp.errors import PreflightError, format_rank_table

log = logging.getLogger("resilient_ddp")

__all__ = [
    "Environment",
    "check_environment",
    "compare",
    "format_table",
    "local_facts",
    "preflight",
]

_COMPARED = ("python", "torch", "cuda", "nccl")
_CHECKER = 0  # the rank that reads every rank's facts, once, and publishes the verdict
_POLL_S = 0.05  # rank 0, lingering until the others read its verdict


@dataclass(frozen=True)
class Environment:
    """The rendezvous variables of one rank, checked."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart: int  # torchrun's restart count: keeps each attempt's keys apart
    agent_store: bool  # torchrun's agent hosts the store; every rank is a client
    # Seals the preflight records when the operator gave a secret (see _record_key).
    key: bytes | None = dataclasses.field(default=None, repr=False, compare=False)


def check_environment(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[Environment | None, list[str]]:
    """Validate the ``env://`` rendezvous variables of this rank.

    Args:
        environ: The variables (default: ``os.environ``).
        rank: Overrides ``RANK`` (as ``init_process_group(rank=...)`` does).
        world_size: Overrides ``WORLD_SIZE``.

    Returns:
        The checked environment (``None`` when a variable is unusable) and the problems
        found, each a sentence that names the variable, its value and the fix.
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []

    def integer(name: str, given: int | None, default: int | None, low: int, high: int) -> int:
        if given is not None:
            value: Any = given
        else:
            raw = env.get(name)
            if raw is None:
                if default is None:
                    problems.append(f"{name} is not set (torchrun and rd.spawn set it)")
                    return -1
                return default
            try:
                value = int(raw)
            except ValueError:
                problems.append(f"{name}={raw!r} is not an integer")
                return -1
        if not low <= value <= high:
            problems.append(f"{name}={value} should be in [{low}, {high}]")
            return -1
        return int(value)

    addr = env.get("MASTER_ADDR", "")
    if not addr:
        problems.append("MASTER_ADDR is not set: it must name rank 0's host")
    else:
        try:
            socket.getaddrinfo(addr, None)
        except OSError as e:
            problems.append(
                f"MASTER_ADDR={addr!r} does not resolve on host {socket.gethostname()} "
                f"({e.strerror or e}): use rank 0's host name or IP address"
            )
    port = integer("MASTER_PORT", None, None, 1, 65535)
    size = integer("WORLD_SIZE", world_size, None, 1, 1 << 20)
    # With an unusable WORLD_SIZE, RANK is only checked for being an integer >= 0.
    me = integer("RANK", rank, None, 0, size - 1 if size > 0 else 1 << 20)
    local_size = integer("LOCAL_WORLD_SIZE", None, 0, 0, 1 << 16)
    local = integer("LOCAL_RANK", None, 0, 0, max(local_size - 1, 0) if local_size else 1 << 16)
    restart = integer("TORCHELASTIC_RESTART_COUNT", None, 0, 0, 1 << 30)
    if environ is None:
        problems.extend(overridden_by_script())
    if problems:
        return None, problems
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
    return Environment(addr, port, me, size, local, local_size, restart, agent), []


# -- what the launcher set, against what the script set ---------------------------------------
# rd.spawn's store address, recorded by the process it starts before the user's function
# runs (see launch._child_main): under the fork server, /proc/self/environ holds the
# server's environment, not the one the launcher gave this process.
_spawned_with: dict[str, str] = {}


def note_launcher(environ: Mapping[str, str]) -> None:
    """Record the rendezvous variables that :func:`resilient_ddp.spawn` gave this process,
    before the user's code runs (see :func:`overridden_by_script`)."""
    _spawned_with.clear()
    _spawned_with.update(
        {k: environ[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in environ},
        launcher="rd.spawn",
    )


def _initial_environ() -> dict[str, str]:
    """The environment this process was started with (``/proc/self/environ``: writes to
    ``os.environ`` do not change it); empty where it cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def launcher_rendezvous() -> dict[str, str]:
    """The rendezvous variables the launcher of this process set, when it hosts the store
    every rank connects to (torchrun's agent, :func:`resilient_ddp.spawn`'s parent).

    Returns:
        ``{"launcher": name, "MASTER_ADDR": ..., "MASTER_PORT": ...}``, or ``{}`` when the
        process was not started by such a launcher (or its start environment is unreadable).
    """
    if _spawned_with:
        return dict(_spawned_with)
    initial = _initial_environ()
    agent = initial.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
    if not agent or "TORCHELASTIC_RUN_ID" not in initial:
        return {}  # not torchrun, or rank 0 hosts the store: the script's port is used
    launched: dict[str, str] = {
        k: initial[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in initial
    }
    return {"launcher": "torchrun", **launched}


def overridden_by_script(environ: Mapping[str, str] | None = None) -> list[str]:
    """The rendezvous variables this process's own code changed after its launcher set them.

    Under torchrun (its agent's store) or :func:`resilient_ddp.spawn`, every rank connects
    to the store the launcher hosts at ``MASTER_ADDR:MASTER_PORT``. A script that sets
    ``MASTER_PORT`` itself (as torch's DDP tutorial does) sends every rank to a port where
    no one listens: without this check, start-up waits out ``init_timeout`` and then blames
    rank 0. The same value set again is no problem, nor is a script that also turns the
    launcher's store off (``TORCHELASTIC_USE_AGENT_STORE=0``: rank 0 then hosts one at its
    ``MASTER_PORT``). A changed ``MASTER_ADDR`` alone is only logged: another name of the
    store's host (``localhost``) still reaches it.

    Args:
        environ: The current variables (default: ``os.environ``).

    Returns:
        One problem per changed port, each with the fix; ``[]`` when there is none.
    """
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() not in ("1", "true"):
        return []  # rank 0 hosts the store at the script's MASTER_PORT: consistent
    launched = launcher_rendezvous()
    if not launched:
        return []
    who = launched["launcher"]
    want_addr, want_port = launched.get("MASTER_ADDR", ""), launched.get("MASTER_PORT", "")
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if want_port and port != want_port:
        changed = f"MASTER_PORT={port}" if port else "MASTER_PORT unset"
        also = f" and MASTER_ADDR={addr}" if addr != want_addr and addr else ""
        line = "os.environ['MASTER_PORT'] = ..." if port else "the line that removes it"
        return [
            f"the script sets {changed}{also}, but {who}'s rendezvous store is at "
            f"{want_addr}:{want_port}, where every rank connects: remove {line} (and "
            f"any setting of MASTER_ADDR); {who} sets both"
        ]
    if want_addr and addr != want_addr:
        log.warning(
            "the script sets MASTER_ADDR=%s, but %s's rendezvous store is at %s:%s: if "
            "start-up cannot reach the store, remove the line that sets it (%s sets it)",
            addr,
            who,
            want_addr,
            want_port,
            who,
        )
    return []


def preflight(
    backend: str | None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    budget: timedelta,
    store_timeout: timedelta,
    environ: Mapping[str, str] | None = None,
    linger: timedelta = timedelta(seconds=15),
) -> tuple[dist.Store, Environment, dict[int, dict[str, str]]]:
    """Check the environment, open the store and compare every rank's facts.

    Blocks until every rank has published its facts and rank 0 has compared them, at
    most ``budget`` in all (plus ``linger`` on a failing store host). Rank 0 reads every
    rank's facts once; the others read its verdict.

    Args:
        backend: The backend that will be used (``None``: torch's default).
        rank: Overrides ``RANK``.
        world_size: Overrides ``WORLD_SIZE``.
        budget: Total time for connecting and for every rank to arrive.
        store_timeout: Timeout of the store's own operations afterwards.
        environ: The variables (default: ``os.environ``).
        linger: When this rank hosts the store and preflight fails, how long it keeps the
            store up for the ranks that arrived to read the verdict (they are told at once;
            this bounds the wait for a rank that does not answer).

    Returns:
        The store (torch's rendezvous store, to pass to ``init_process_group``), this rank's
        environment, and the facts this rank read: every rank's on rank 0 (which compared
        them), this rank's own on the others.

    Raises:
        PreflightError: A problem was found; every rank that is up raises it, with one line
            per problem and a per-rank table. The first rank whose budget runs out publishes
            its verdict, and every waiting rank raises it at once; so does a rank that
            finds every rank there but no verdict from rank 0 by its deadline (it compares
            the facts itself). A store that stops answering (its host exited) is reported
            as such, never as a bare backend error.
    """
    deadline = _clock.monotonic() + budget.total_seconds()
    env, problems = check_environment(environ, rank=rank, world_size=world_size)
    if env is None:
        raise PreflightError(
            f"The rendezvous environment of this process is not usable "
            f"(host {socket.gethostname()}):\n" + "\n".join(f"  - {p}" for p in problems),
            problems=problems,
        )
    env = dataclasses.replace(env, key=_record_key())
    store = _open_store(env, deadline, store_timeout)
    facts = local_facts(backend, env)
    hosting = env.rank == 0 and not env.agent_store
    try:
        table = _exchange(store, env, facts, deadline)
    except PreflightError as e:
        if hosting:
            # This process hosts the store: the ranks that arrived must read the verdict
            # before it exits, or they would see a lost store instead of the problem.
            _linger(store, env, e, linger)
        raise
    return store, env, table


# -- the store -------------------------------------------------------------------------------
class _TransientError(Exception):
    """A connection failure that may go away (rank 0 not up yet, a reset)."""


def _open_store(env: Environment, deadline: float, store_timeout: timedelta) -> dist.Store:
    host_store = env.rank == 0 and not env.agent_store
    attempts = 0

    def connect() -> dist.Store:
        nonlocal attempts
        attempts += 1
        left = max(0.5, deadline - _clock.monotonic())
        try:
            if host_store:
                # Listens on MASTER_ADDR's interface only, not on every one.
                return serve_store(
                    env.master_addr, env.master_port, timedelta(seconds=min(left, 30.0))
                )
            return dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=False,
                timeout=timedelta(seconds=min(left, 30.0)),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:  # DistNetworkError and DistStoreError included
            if host_store and "in use" in str(e).lower():
                raise PreflightError(
                    f"MASTER_PORT {env.master_port} is already in use on {env.master_addr} "
                    f"(host {socket.gethostname()}), so rank 0 cannot host the rendezvous "
                    "store: another job (or a previous run still exiting) holds it. HINT: "
                    "pick a free port (torchrun --master-port / MASTER_PORT), or use "
                    "torchrun's --rdzv-backend c10d with --rdzv-endpoint host:0.",
                    problems=[f"MASTER_PORT {env.master_port} already in use on rank 0's host"],
                ) from e
            raise _TransientError(str(e)) from e

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(_TransientError),
        stop=tenacity.stop_after_delay(max(0.0, deadline - _clock.monotonic())),
        wait=tenacity.wait_exponential(multiplier=0.1, max=2.0),
        reraise=True,
    )
    try:
        store: dist.Store = retrying(connect)
    except _TransientError as e:
        role = "host" if host_store else "reach"
        hint = (
            "is rank 0 running, is MASTER_ADDR rank 0's address as seen from this host, and "
            "is the port open in the firewall?"
        )
        launched = launcher_rendezvous()
        if env.agent_store and launched:
            who, addr = launched["launcher"], launched.get("MASTER_ADDR", "")
            hint = (
                f"the store is {who}'s, not rank 0's: is {who} still running, and is "
                "MASTER_ADDR its host's address as seen from this host?"
            )
            if addr and addr != env.master_addr:
                hint += (
                    f" {who} set MASTER_ADDR={addr} and the script changed it to "
                    f"{env.master_addr}: remove the line that sets it."
                )
        raise PreflightError(
            f"Rank {env.rank} (host {socket.gethostname()}) could not {role} the rendezvous "
            f"store at {env.master_addr}:{env.master_port} within the init budget "
            f"({attempts} attempt(s)): {str(e).rstrip('.')}. HINT: {hint}",
            problems=[
                f"store {env.master_addr}:{env.master_port} unreachable from rank {env.rank}"
            ],
        ) from e
    store.set_timeout(store_timeout)
    return store


# -- facts and their exchange ----------------------------------------------------------------
def local_facts(backend: str | None, env: Environment) -> dict[str, str]:
    """What this rank brings: host, versions, backend, device and free memory."""
    facts = {
        "host": socket.gethostname(),
        "pid": str(os.getpid()),
        "local_rank": str(env.local_rank),
        **_versions(),
        "backend": backend or "default",
        "backend_ok": _backend_available(backend),
        "host_free_gib": _host_free_gib(),
    }
    facts.update(_device(backend, env))
    return facts


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "nccl": nccl_version(),
    }


def _backend_available(backend: str | None) -> str:
    name = (backend or "").lower()
    if name == "gloo":
        return "yes" if dist.is_gloo_available() else "no"
    if name == "nccl":
        if not dist.is_nccl_available():
            return "no (this torch has no NCCL)"
        return "yes" if torch.cuda.is_available() else "no (no CUDA device visible)"
    return "yes"


def _host_free_gib() -> str:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return f"{int(line.split()[1]) / 2**20:.1f}"
    except OSError:
        pass
    return "?"


def _device(backend: str | None, env: Environment) -> dict[str, str]:
    """The GPU this rank will use (``LOCAL_RANK``'s), when it uses one."""
    uses_cuda = (backend or "").lower() == "nccl" or (backend is None and torch.cuda.is_available())
    if not uses_cuda:
        return {"device": "cpu", "gpu": "", "gpu_free_gib": ""}
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        return {
            "device": f"cuda:{env.local_rank} (only {count} visible)",
            "gpu": "",
            "gpu_free_gib": "",
        }
    props = torch.cuda.get_device_properties(env.local_rank)
    uuid = str(getattr(props, "uuid", "")) or f"{socket.gethostname()}:{env.local_rank}"
    try:
        free, _ = torch.cuda.mem_get_info(env.local_rank)
        free_gib = f"{free / 2**30:.1f}"
    except RuntimeError:
        free_gib = "?"
    return {"device": f"cuda:{env.local_rank}", "gpu": uuid, "gpu_free_gib": free_gib}


def _exchange(
    store: dist.Store, env: Environment, facts: dict[str, str], deadline: float
) -> dict[int, dict[str, str]]:
    """Publish this rank's facts and conclude with the job's one verdict.

    Rank :data:`_CHECKER` waits until every rank arrived, reads every rank's facts once,
    compares them and publishes the verdict; every other rank waits for that verdict (one
    key a poll). At ``deadline`` without a verdict, a rank looks for itself: it names the
    ranks that never arrived, or (all arrived: the checker is gone or late) compares the
    facts itself. The first verdict written wins (``compare_set``) and every rank follows
    it, so all ranks that are up raise the same problems.

    Blocks until a verdict is known, at most until ``deadline`` (a ``_clock.monotonic()``
    time) plus the few store requests of the search.

    Returns:
        The facts this rank read: every rank's on the rank that compared them, this rank's
        own elsewhere.

    Raises:
        PreflightError: The verdict names problems, or ranks did not arrive; or the store
            stopped answering.
    """
    own = _keys(env).facts(env.rank)
    _call(env, store.set, own, seal(env.key, own, facts))
    # Then counted: the checker polls the count, and reads the ranks' keys only when it
    # moved to every rank (the last rank's key is there before its count).
    _add(store, env, _keys(env).arrived, 1)
    table = {env.rank: facts}
    verdict, mine = _await_verdict(store, env, deadline, table)
    return _conclude(store, env, verdict, mine, table)


def _await_verdict(
    store: dist.Store, env: Environment, deadline: float, table: dict[int, dict[str, str]]
) -> tuple[dict[str, Any], bool]:
    """The verdict (see :func:`_exchange`) and whether this rank's proposal won; adds the
    facts this rank read to ``table``. Blocks until ``deadline`` at most."""
    names = _keys(env)
    keys = [names.facts(r) for r in range(env.world_size)]
    checker = env.rank == _CHECKER
    # ``check`` and ``add(counter, 0)`` never block (a timed ``wait`` would log a warning on
    # every expiry): one request a poll (two on the checker), whatever the number of ranks.
    poll, seen = Backoff(env.world_size, 1), -1
    while _clock.monotonic() < deadline:
        if checker:
            count = _add(store, env, names.arrived, 0)
            if count != seen:
                poll.reset()
                seen = count
                if count >= env.world_size and _call(env, store.check, keys):
                    read = _read_facts(store, env, keys, range(env.world_size))
                    table.update(read)
                    if len(read) == env.world_size:
                        return _propose(store, env, _judge(env, table))
                    seen = -1  # a record not sealed by the job: read again at the next poll
        found = _read_verdict(store, env)
        if found is not None:
            return found, False
        poll.sleep(deadline)
    return _give_up(store, env, table)


def _give_up(
    store: dist.Store, env: Environment, table: dict[int, dict[str, str]]
) -> tuple[dict[str, Any], bool]:
    """At this rank's deadline, with no verdict: find which ranks arrived (a halving search
    of their keys) and propose a verdict: the ranks that never arrived, or, when all did
    (the checker is gone or late), this rank's own comparison of their facts."""
    keys = [_keys(env).facts(r) for r in range(env.world_size)]
    present = _present(functools.partial(_call, env, store.check), keys)
    arrived = [r for r, there in enumerate(present) if there]
    table.update(_read_facts(store, env, keys, arrived))
    missing = [r for r in range(env.world_size) if r not in table]
    if not missing:
        log.warning(
            "resilient_ddp: rank %d: every rank arrived but rank %d published no preflight "
            "verdict within the init budget; rank %d compares the facts itself",
            env.rank,
            _CHECKER,
            env.rank,
        )
        return _propose(store, env, _judge(env, table))
    hosts = ", ".join(f"{r} ({table[r]['host']})" for r in sorted(table))
    problems = [
        f"rank(s) {_ranges(missing)} never arrived; WORLD_SIZE={env.world_size}, arrived: {hosts}"
    ]
    message = (
        f"Rank(s) {_ranges(missing)} did not arrive at the rendezvous within the init "
        f"budget (rank {env.rank} waited). Arrived: {hosts}. HINT: is WORLD_SIZE right "
        "(nnodes x nproc-per-node), and did every node start? A rank that crashed at "
        "import time never arrives either: see its log.\n" + format_table(table)
    )
    return _propose(store, env, {"rank": env.rank, "message": message, "problems": problems})


def _read_facts(
    store: dist.Store, env: Environment, keys: list[str], ranks: Iterable[int]
) -> dict[int, dict[str, str]]:
    """The facts of ``ranks`` (whose keys exist), in one request. With a secret, a record
    that is not sealed by the job is left out (that rank has not arrived, as far as this
    rank can tell); without one it fails start-up.

    Raises:
        PreflightError: Without a secret, a record that is not the job's (not JSON facts).
    """
    ranks = list(ranks)
    values = _call(env, store.multi_get, [keys[r] for r in ranks]) if ranks else []
    table = {}
    for r, v in zip(ranks, values, strict=True):
        facts = unseal_dict(env.key, keys[r], v)
        if facts is None or not all(isinstance(x, str) for x in facts.values()):
            if env.key is not None:
                continue
            raise _not_ours(env, keys[r], v)
        table[r] = facts
    return table


def _judge(env: Environment, table: dict[int, dict[str, str]]) -> dict[str, Any]:
    """This rank's verdict on every rank's facts: the problems, with the table when there
    are any (every rank's error shows it)."""
    problems = compare(table, env.world_size)
    verdict: dict[str, Any] = {"rank": env.rank, "problems": problems}
    if problems:
        verdict["table"] = table
    return verdict


def _propose(
    store: dist.Store, env: Environment, verdict: dict[str, Any]
) -> tuple[dict[str, Any], bool]:
    """Publish ``verdict`` unless one is there already: the first one written wins. One
    request. Returns the winner and whether it is ``verdict``."""
    body = _pack(verdict)
    for slot in _verdict_slots(env):
        packed = _seal_bytes(env.key, slot, body)
        winner = bytes(_call(env, store.compare_set, slot, "", packed))
        if winner == packed:
            return verdict, True
        if env.key is None:
            return _unpack(env, winner), False
        taken = _open_verdict(env, slot, winner)
        if taken is not None:
            return taken, False
    raise _not_ours(env, _verdict_slots(env)[-1], b"")


_SLOTS = 4  # with a secret, a verdict slot holding another process's record is skipped


def _keys(env: Environment) -> PreflightKeys:
    """This attempt's start-up keys (spelled by the control plane)."""
    return PreflightKeys(env.restart)


def _verdict_slots(env: Environment) -> list[str]:
    """The keys a verdict may be in: with a secret, the first of these that does not hold
    a record the job did not write; without one, the first."""
    names = _keys(env)
    return [names.verdict(i) for i in range(1 if env.key is None else _SLOTS)]


def _read_verdict(store: dist.Store, env: Environment) -> dict[str, Any] | None:
    """The verdict published, or None while there is none. One request a slot.

    Raises:
        PreflightError: A record that is not a verdict of the job (without a secret; with
            one, in every slot).
    """
    for slot in _verdict_slots(env):
        if not _call(env, store.check, [slot]):
            return None
        raw = bytes(_call(env, store.get, slot))
        if env.key is None:
            return _unpack(env, raw)
        verdict = _open_verdict(env, slot, raw)
        if verdict is not None:
            return verdict
    raise _not_ours(env, _verdict_slots(env)[-1], b"")


def _open_verdict(env: Environment, slot: str, raw: bytes) -> dict[str, Any] | None:
    """The verdict sealed in ``raw`` under ``slot``, or None if it is not the job's."""
    try:
        return _unpack(env, raw, slot)
    except PreflightError:
        log.warning(
            "resilient_ddp: rank %d ignored a preflight verdict under %r not sealed with the "
            "job's secret: another process writes to the rendezvous store",
            env.rank,
            slot,
        )
        return None


def _conclude(
    store: dist.Store,
    env: Environment,
    verdict: dict[str, Any],
    mine: bool,
    table: dict[int, dict[str, str]],
) -> dict[int, dict[str, str]]:
    """Count this rank as having read ``verdict``, clean up, and return ``table`` (the
    verdict is OK) or raise the verdict's :class:`PreflightError`."""
    ok = "message" not in verdict and not verdict.get("problems")
    _release(store, env, ok=ok)
    problems = [str(p) for p in verdict.get("problems", ())]
    if "message" in verdict:  # a rank gave up at its deadline
        if mine:
            raise PreflightError(str(verdict["message"]), problems=problems, table=table)
        raise PreflightError(
            f"{verdict['message']}\n(rank {verdict['rank']} gave up first and published "
            f"this; rank {env.rank} raises it too)",
            problems=problems,
        )
    if problems:
        checked = {int(r): dict(v) for r, v in verdict.get("table", {}).items()}
        raise PreflightError(
            f"Preflight found {len(problems)} problem(s) (rank {env.rank} reports):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\n"
            + format_table(checked),
            problems=problems,
            table=checked,
        )
    return table


def _release(store: dist.Store, env: Environment, *, ok: bool) -> None:
    """Count this rank in ``done``: it read the verdict. The last of all the ranks deletes
    their facts (nobody reads them again; before, a rank at its deadline may be reading
    them) and, after an OK verdict, the attempt's other keys: W + 3 requests, once. After
    a failed verdict those stay for the store's host to count its readers
    (:func:`_linger`), and the next attempt's checker deletes them
    (:func:`_forget_attempt`). Best effort: a store that fails here fails the next step."""
    names = _keys(env)
    try:
        done = int(store.add(names.done, 1))
        if done >= env.world_size:
            for r in range(env.world_size):
                store.delete_key(names.facts(r))
            if ok:
                for name in (names.arrived, names.done):
                    store.delete_key(name)
                for slot in _verdict_slots(env):
                    store.delete_key(slot)
        if env.rank == _CHECKER and env.restart > 0:
            _forget_attempt(store, env, env.restart - 1)
    except (RuntimeError, OSError) as e:  # DistNetworkError and DistStoreError included
        log.info("resilient_ddp: rank %d: could not clean up preflight keys: %s", env.rank, e)


def _forget_attempt(store: dist.Store, env: Environment, restart: int) -> None:
    """Delete the keys that attempt ``restart`` left (its preflight failed, or a rank never
    read its verdict): nothing reads them any more, since torchrun stops every process of
    an attempt before it starts the next. One request when it left none; the ranks' facts
    keys one by one only when some rank never read the verdict (then they are still
    there)."""
    names = PreflightKeys(restart)
    if not store.check([names.arrived]):
        return
    if int(store.add(names.done, 0)) < env.world_size:
        for r in range(env.world_size):
            store.delete_key(names.facts(r))
    for name in (names.verdict(), names.arrived, names.done):
        store.delete_key(name)
    for i in range(1, _SLOTS):
        store.delete_key(names.verdict(i))


def _pack(verdict: dict[str, Any]) -> bytes:
    """A verdict as stored: compressed JSON (a failed one holds every rank's facts, and
    every rank reads it: about 7 times smaller than the JSON)."""
    return zlib.compress(json.dumps(verdict, separators=(",", ":")).encode())


def _unpack(env: Environment, raw: bytes, name: str | None = None) -> dict[str, Any]:
    """The verdict stored as ``raw`` under ``name`` (default the first slot).

    Raises:
        PreflightError: It is not one (another process wrote the key).
    """
    name = _keys(env).verdict() if name is None else name
    body = _unseal_bytes(env.key, name, bytes(raw))
    verdict: Any = None
    if body is not None:
        try:
            verdict = json.loads(zlib.decompress(body))
        except (zlib.error, ValueError):
            verdict = None
    if (
        not isinstance(verdict, dict)
        or not isinstance(verdict.get("rank"), int)
        or not isinstance(verdict.get("problems"), list)
        or not isinstance(verdict.get("message", ""), str)
        or not _is_table(verdict.get("table", {}))
    ):
        raise _not_ours(env, name, raw)
    return verdict


def _is_table(table: Any) -> bool:
    """Whether ``table`` is a per-rank facts table as a verdict carries it."""
    if not isinstance(table, dict):
        return False
    for r, facts in table.items():
        if not str(r).lstrip("-").isdigit() or not isinstance(facts, dict):
            return False
    return True


def _record_key() -> bytes | None:
    """The key that seals the preflight records, from the operator's secret (None without
    one: the job's own key is agreed only once the group has formed)."""
    secret = operator_secret()
    if not secret:
        return None
    return hmac.new(secret.encode(), b"resilient_ddp/preflight", "sha256").digest()


_MAC_CHARS = 32


def _seal_bytes(key: bytes | None, name: str, body: bytes) -> bytes:
    """``body`` as stored under ``name``: with a key, its MAC (hex) and a space in front."""
    if key is None:
        return body
    mac = hmac.new(key, name.encode() + b"\0" + body, "sha256").hexdigest()[:_MAC_CHARS]
    return mac.encode() + b" " + body


def _unseal_bytes(key: bytes | None, name: str, raw: bytes) -> bytes | None:
    """The body of ``raw`` (see :func:`_seal_bytes`), or None without a valid MAC."""
    if key is None:
        return raw
    mac, _, body = raw.partition(b" ")
    good = hmac.new(key, name.encode() + b"\0" + body, "sha256").hexdigest()[:_MAC_CHARS]
    return body if hmac.compare_digest(mac, good.encode()) else None


def _not_ours(env: Environment, name: str, raw: Any) -> PreflightError:
    """The error for a record under ``name`` that this job did not write."""
    sealed = "sealed with the job's secret" if env.key is not None else "the job's format"
    return PreflightError(
        f"Rank {env.rank} read a start-up record under {name!r} in the rendezvous store at "
        f"{env.master_addr}:{env.master_port} that was not written by this job (not "
        f"{sealed}: {bytes(raw)[:80]!r}): another process writes under {PREFLIGHT_PREFIX}/ in this "
        "store. Start-up stops here; keep the store's port reachable to the job only, and "
        "give the ranks a secret (RESILIENT_DDP_SECRET or RESILIENT_DDP_SECRET_FILE) so "
        "that such records are told apart.",
        problems=[f"a record under {name} not written by this job"],
    )


def _add(store: dist.Store, env: Environment, key: str, n: int) -> int:
    """``store.add(key, n)``; data the job did not write under ``key`` (the server drops
    the connection of an ``add`` on a value that is not a number: it would read as a lost
    store) is reported as such. Two requests."""
    cur = _call(env, store.compare_set, key, "", "0")  # creates it at 0, never waits
    try:
        int(cur)
    except ValueError:
        raise _not_ours(env, key, cur) from None
    return int(_call(env, store.add, key, n)) if n else int(cur)


def _linger(store: dist.Store, env: Environment, error: PreflightError, budget: timedelta) -> None:
    """The store host failed preflight: keep serving until every rank that arrived has
    read the verdict (counted in ``done``), at most ``budget``."""
    names = _keys(env)
    try:
        if not store.check(_verdict_slots(env)[:1]):  # this rank never concluded
            payload = {"rank": env.rank, "message": str(error), "problems": list(error.problems)}
            _propose(store, env, payload)
            store.add(names.done, 1)
        end = _clock.monotonic() + budget.total_seconds()
        while _clock.monotonic() < end:
            if int(store.add(names.done, 0)) >= int(store.add(names.arrived, 0)):
                return
            _clock.sleep(_POLL_S)
    except (RuntimeError, OSError, PreflightError):  # our own server: nothing more to do
        return


def _call(env: Environment, fn: Any, *args: Any) -> Any:
    """Call a store method; a store that stops answering is a :class:`PreflightError`."""
    try:
        return fn(*args)
    except (RuntimeError, OSError) as e:  # DistNetworkError and DistStoreError included
        raise PreflightError(
            f"The rendezvous store at {env.master_addr}:{env.master_port} stopped answering "
            f"rank {env.rank} (host {socket.gethostname()}) during start-up "
            f"({type(e).__name__}: {e}). Its host (rank 0, or torchrun's agent) has probably "
            "exited: its log says why (a preflight problem, a crash).",
            problems=[f"store {env.master_addr}:{env.master_port} lost during start-up"],
        ) from e


def compare(table: Mapping[int, Mapping[str, str]], world_size: int) -> list[str]:
    """Every problem in the ranks' facts, one sentence each naming the ranks."""
    problems = []
    for key in _COMPARED:
        values: dict[str, list[int]] = {}
        for r in sorted(table):
            values.setdefault(table[r].get(key, ""), []).append(r)
        if len(values) > 1:
            parts = "; ".join(
                f"{v or '(none)'} on rank(s) {_ranges(rs)}" for v, rs in values.items()
            )
            problems.append(f"{key} versions differ: {parts}")
    for r in sorted(table):
        ok = table[r].get("backend_ok", "yes")
        if ok != "yes":
            problems.append(f"rank {r}: backend {table[r].get('backend')} not available: {ok}")
        if ok == "yes" and "visible" in table[r].get("device", ""):
            problems.append(
                f"rank {r} (host {table[r].get('host')}): LOCAL_RANK={table[r].get('local_rank')} "
                f"but {table[r]['device']}: fewer GPUs than processes on this host"
            )
    users: dict[str, list[int]] = {}
    for r in sorted(table):
        if table[r].get("gpu"):
            users.setdefault(table[r]["gpu"], []).append(r)
    for gpu, ranks in users.items():
        if len(ranks) > 1:
            problems.append(
                f"ranks {_ranges(ranks)} share one GPU ({gpu}): set LOCAL_RANK per process and "
                "call torch.cuda.set_device(local_rank)"
            )
    return problems


def format_table(table: Mapping[int, Mapping[str, str]]) -> str:
    """The facts as an aligned text table, one row per rank."""
    cols = ["host", "pid", "local_rank", "python", "torch", "cuda", "nccl", "backend"]
    return format_rank_table(table, [*cols, "device", "host_free_gib", "gpu_free_gib"])


def _ranges(ranks: list[int], shown: int = 16) -> str:
    more = ", ...]" if len(ranks) > shown else "]"
    return "[" + ", ".join(str(r) for r in ranks[:shown]) + more
