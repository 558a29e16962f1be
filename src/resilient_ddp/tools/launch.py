"""A local launcher whose parent hosts the store, so the control plane outlives every rank.

Unlike :func:`torch.multiprocessing.spawn`, a rank that dies does not make the launcher kill
the others at once: the parent reports the death to the survivors through the store (with
the signal that killed it), gives them ``grace`` to raise and exit, and only then kills what
is left. It returns every rank's return value, or raises :class:`SpawnError` carrying how
each rank ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from resilient_ddp.config import Duration, duration_seconds
from resilient_ddp.control import _board
from resilient_ddp.control import _control as ctl
from resilient_ddp.errors import Culprit, RankOutcome, SpawnError
from resilient_ddp.group.process_group import lighten_exit
from resilient_ddp.runtime import _exit_guard, _runtime

# Sent by the launcher to a rank it is about to kill: faulthandler prints every thread's
# stack on the rank's stderr. A real-time signal, so that no handler of the user's is in
# the way (the library's own verdict signal is SIGRTMIN+6).
STACK_SIGNAL = signal.SIGRTMIN + 7
_STACK_DUMP_S = 0.5  # time given to the dumps before SIGKILL
_EVICT_GRACE_S = 1.0  # an evicted process may end by itself this long before it is killed

__all__ = ["spawn"]

_DEFAULT_GRACE = timedelta(seconds=30)

#: What the fork server imports once before it forks the ranks (``start_method=
#: "forkserver"``, the default): each rank then starts in tens of milliseconds instead of
#: importing torch itself (a second of CPU, two with ``torch._dynamo``, which DDP loads).
#: Importing them creates no CUDA context and starts no Python thread (torch's import
#: starts one native helper thread, as in any process that imports torch; a fork copies
#: the forking thread only, as a DataLoader's forked workers do).
#: The last, ``tools._fork_server``, makes the server end without the interpreter's
#: teardown once its caller has exited.
FORK_SERVER_PRELOAD = (
    "torch",
    "torch._dynamo",
    "resilient_ddp",
    "resilient_ddp.tools._fork_server",
)


def _preload_fork_server() -> None:
    """Have the fork server import :data:`FORK_SERVER_PRELOAD`, unless this process
    already chose what it preloads (``multiprocessing.set_forkserver_preload``) or its
    fork server already runs (then it stays as it is). The user's main module is not
    preloaded: no code of theirs runs in the server, and each rank imports it as under
    ``"spawn"``."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return
    if list(getattr(server, "_preload_modules", ())) != ["__main__"]:  # not the default
        return
    mp.set_forkserver_preload(list(FORK_SERVER_PRELOAD))


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: Duration = None,
    grace: Duration = _DEFAULT_GRACE,
    start_method: str = "forkserver",
    env: Mapping[str, str] | None = None,
    restarts: int = 0,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` local processes and wait for them.

    Each process gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``, ...) pointing at a store hosted by this parent, so
    ``resilient_ddp.init_process_group()`` and plain
    ``torch.distributed.init_process_group("gloo")`` both work inside ``fn``.

    Blocks until every process ended, at most ``timeout`` (no limit by default).

    Args:
        fn: A picklable function (module level), called as ``fn(rank, *args)``.
        nprocs: Number of processes (ranks).
        args: Extra positional arguments for ``fn``.
        timeout: Deadline for the whole job (a timedelta or seconds; no limit by
            default); processes still running then are killed.
        grace: After the first process fails, how long the others get to exit by
            themselves before they are killed (a timedelta or seconds; default 30 s).
        start_method: ``"forkserver"`` (default: each process is forked from a server
            that imported torch and the library once, see :data:`FORK_SERVER_PRELOAD`;
            like ``"spawn"``, no state of this process is inherited), ``"spawn"`` (a
            new interpreter per process) or ``"fork"``.
        env: Extra environment variables for the processes.
        restarts: For elastic training (``on_failure="shrink"``): how many replacement
            processes may be started in all. A process that dies, raises or is removed from
            the group is replaced by a new one started as a joiner
            (``RESILIENT_DDP_JOINER=1``, same ``fn(rank, ...)`` slot), and the others are not
            stopped. ``0`` (default): no replacement; a failure ends the job as above,
            except under ``on_failure="shrink"``, where the survivors go on.

    Returns:
        The return values of ``fn``, indexed by rank (slot).

    Raises:
        SpawnError: A process raised, exited non-zero, was killed or overran ``timeout``;
            ``outcomes`` holds each rank's exit code, return value and traceback.
    """
    outcomes = launch(
        fn,
        nprocs,
        args,
        timeout=timeout,
        grace=grace,
        start_method=start_method,
        env=env,
        restarts=restarts,
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        lines = [_describe_outcome(o) for o in failed]
        raise SpawnError(
            f"{len(failed)} of {nprocs} process(es) failed:\n" + "\n".join(lines),
            outcomes=outcomes,
        )
    return [o.value for o in outcomes]


def _describe_outcome(o: RankOutcome) -> str:
    if o.exc_type is not None:
        return f"  rank {o.rank}: raised {o.exc_type}: {o.exc_message}"
    if o.exitcode is None:
        return f"  rank {o.rank}: still running at the deadline or after the grace period; killed"
    if o.exitcode < 0:
        return f"  rank {o.rank}: killed by {_signal_name(-o.exitcode)}"
    return f"  rank {o.rank}: exited with code {o.exitcode}"


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: Duration = None,
    grace: Duration = _DEFAULT_GRACE,
    start_method: str = "forkserver",
    env: Mapping[str, str] | None = None,
    restarts: int = 0,
) -> list[RankOutcome]:
    """Like :func:`spawn`, but return every rank's :class:`RankOutcome` instead of raising.

    Raises:
        ConfigError: ``timeout`` or ``grace`` is not a positive duration.
    """
    limit = None if timeout is None else duration_seconds("timeout", timeout)
    grace_s = duration_seconds("grace", grace, _DEFAULT_GRACE)
    lighten_exit()
    job = _Job(fn, nprocs, tuple(args), start_method, env or {}, restarts)
    try:
        job.supervise(limit, grace_s)
    finally:
        job.reap()
    return job.outcomes()


class _Job:
    """The processes of one :func:`launch`, the store they share, and what they sent back."""

    def __init__(
        self,
        fn: Callable[..., Any],
        nprocs: int,
        args: tuple[Any, ...],
        start_method: str,
        env: Mapping[str, str],
        restarts: int = 0,
    ) -> None:
        # Loopback only: whoever reaches the store's port controls the job.
        self.store = ctl.serve_store("127.0.0.1")
        self.job_id, secret = ctl.new_job_id(), secrets.token_hex(32)
        self.control_root = ctl.root_prefix(self.store, self.job_id, secret)
        self.jobs = ctl.JobStore(self.control_root)
        self.fn, self.args, self.nprocs = fn, args, nprocs
        if start_method == "forkserver":
            _preload_fork_server()
        self.ctx: Any = mp.get_context(start_method)
        self.base_env = {
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "RESILIENT_DDP_STORE": f"127.0.0.1:{self.store.port}",
            ctl.JOB_ENV: self.job_id,
            # Joiners prove with it that they belong to the job (never stored in clear).
            ctl.SECRET_ENV: secret,
            # Make env:// connect to our store as a client, as it does under torchrun.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            **env,
        }
        self.restarts_left = restarts
        self.elastic = restarts > 0
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.uids: list[int] = []  # member id of each slot's current process
        self.pids: list[int] = []  # every process started, for their boards (see reap)
        self.previous: dict[int, list[RankOutcome]] = {}
        for rank in range(nprocs):
            self.procs.append(None)
            self.conns.append(None)
            self.uids.append(rank)
            self._start(rank, joiner=False)
        self.results: dict[int, tuple[str, Any]] = {}
        self.killed: set[int] = set()
        self.ever_member: set[int] = set(range(nprocs))
        self.evicted_at: dict[int, float] = {}  # member id -> when its removal was seen

    def _start(self, rank: int, *, joiner: bool) -> None:
        recv, send = self.ctx.Pipe(duplex=False)
        # This process's environment as it is now, whatever the start method: a child of
        # the fork server would otherwise see the server's, as of when it started.
        child_env = {
            **os.environ,
            **self.base_env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
        }
        if joiner:
            child_env["RESILIENT_DDP_JOINER"] = "1"
            child_env["RESILIENT_DDP_UID"] = str(self.uids[rank])
        p = self.ctx.Process(
            target=_child_main,
            args=(self.fn, rank, self.args, child_env, send),
            name=f"resilient_ddp-rank{rank}",
        )
        p.start()
        send.close()
        if p.pid is not None:
            self.pids.append(p.pid)
        self.procs[rank] = p
        self.conns[rank] = recv

    def supervise(self, timeout: float | None, grace: float) -> None:  # noqa: PLR0912
        """Collect results until every process ended, the deadline, or the grace period
        after the first failure; report deaths to the survivors through the store."""
        now = time.monotonic()
        deadline = now + timeout if timeout is not None else float("inf")
        kill_at = float("inf")
        exited: set[int] = set()
        events_seen, next_event_poll = 0, 0.0
        while any(p.is_alive() for p in self.procs) or self._open_conns():
            ready = mpc.wait(
                self._open_conns() + [p.sentinel for p in self.procs if p.is_alive()],
                timeout=0.05,
            )
            for rank, c in enumerate(self.conns):
                if c in ready and not c.closed:
                    _drain(c, rank, self.results)
            now = time.monotonic()
            if self.elastic:
                self._remove_evicted()
            for rank, p in enumerate(self.procs):
                if p.exitcode is None or rank in exited:
                    continue
                result = self.results.get(rank, ("", None))
                raised = result[0] == "error"
                failed = p.exitcode != 0 or raised
                if raised and str(result[1][0]).startswith("resilient_ddp."):
                    # Our error: the group itself cannot go on (too few ranks); replacing
                    # the process would only wait for a group that is gone.
                    self.restarts_left = 0
                if failed and self.restarts_left > 0:
                    self._replace(rank)
                    continue
                if failed and not self.elastic:
                    self.elastic = _store_has(self.jobs.is_elastic)
                exited.add(rank)
                if failed and not self.elastic:
                    kill_at = min(kill_at, now + grace)
                if p.exitcode != 0 and not raised and not self.elastic:
                    _report_death(self.jobs, rank, p.exitcode)
            if now >= next_event_poll and kill_at == float("inf") and not self.elastic:
                # A failure reported by the ranks themselves (a timeout naming a stopped
                # rank, say) also starts the grace period: such a rank may never exit.
                next_event_poll = now + 0.25
                # Elastic training (on_failure="shrink"), even without replacements: the
                # survivors go on, so they are not stopped after a failure.
                self.elastic = _store_has(self.jobs.is_elastic)
                events_seen, failed_seen = _failure_reported(self.jobs, events_seen)
                if failed_seen and not self.elastic:
                    kill_at = now + grace
            if self.elastic and kill_at == float("inf") and now >= next_event_poll:
                next_event_poll = now + 0.25
                if _store_has(lambda: self.jobs.ended() is not None):
                    # The group failed (too few ranks, a minority) or finished: what is left
                    # (a stopped rank, a joiner) gets the grace period.
                    kill_at = now + grace
            if now >= min(deadline, kill_at):
                return

    def _replace(self, rank: int) -> None:
        """Record how slot ``rank``'s process ended and start a joiner in its place."""
        p, conn = self.procs[rank], self.conns[rank]
        while not conn.closed and conn.poll(0):
            _drain(conn, rank, self.results)
        if not conn.closed:
            conn.close()
        exitcode = None if rank in self.killed else p.exitcode
        self.killed.discard(rank)
        self.previous.setdefault(rank, []).append(
            _outcome(rank, exitcode, self.results.pop(rank, ("none", None)))
        )
        self.restarts_left -= 1
        self.uids[rank] = self.nprocs + sum(len(v) for v in self.previous.values()) - 1
        self._start(rank, joiner=True)

    def _remove_evicted(self) -> None:
        """Kill a process the group removed (stopped or hung while the others went on):
        a stopped one at once, another once it has had ``_EVICT_GRACE_S`` to end by
        itself (a process that died, by SIGKILL say, can still look alive while the kernel
        tears it down, after the survivors have already seen it gone; it then reports its
        own exit code, not the launcher's kill: ``exitcode=None``)."""
        try:
            record = self.jobs.members()
            if record is None:
                return
            members = set(record["members"])
        except Exception:  # noqa: BLE001 - the store is ours; a failed read is retried
            return
        self.ever_member |= members
        now = time.monotonic()
        for rank, p in enumerate(self.procs):
            uid = self.uids[rank]
            if uid not in self.ever_member or uid in members or not p.is_alive():
                continue
            since = self.evicted_at.setdefault(uid, now)
            # A stopped process (SIGSTOP, a debugger) cannot end by itself: killed at once.
            stopped = p.pid is not None and ctl.process_state(p.pid) in ("T", "t")
            if stopped or now - since >= _EVICT_GRACE_S:
                self.killed.add(rank)
                p.kill()
                p.join(5)

    def _open_conns(self) -> list[Any]:
        return [c for c in self.conns if not c.closed]

    def reap(self) -> None:
        """Kill what still runs, wait for every process and read what is left in the pipes.

        A process still running is first asked for the stacks of its threads (on its
        stderr): where it hangs is the first thing to know.
        """
        alive = [(rank, p) for rank, p in enumerate(self.procs) if p.is_alive()]
        for rank, p in alive:
            sys.stderr.write(
                f"resilient_ddp.spawn: rank {rank} (pid {p.pid}) still runs at the deadline or "
                "after the grace period; its threads, then SIGKILL:\n"
            )
            sys.stderr.flush()
            with contextlib.suppress(OSError):
                os.kill(p.pid, STACK_SIGNAL)
        if alive:
            time.sleep(_STACK_DUMP_S)
        for rank, p in alive:
            if p.is_alive():
                self.killed.add(rank)
                p.kill()
        for p in self.procs:
            p.join(5)
        # The boards of processes that could not remove theirs (SIGKILL).
        _board.remove_boards(self.pids)
        for rank, c in enumerate(self.conns):
            while not c.closed and c.poll(0):
                _drain(c, rank, self.results)
            if not c.closed:
                c.close()

    def outcomes(self) -> list[RankOutcome]:
        out = []
        for rank, p in enumerate(self.procs):
            exitcode = None if rank in self.killed else p.exitcode
            o = _outcome(rank, exitcode, self.results.get(rank, ("none", None)))
            out.append(dataclasses.replace(o, previous=tuple(self.previous.get(rank, []))))
        return out


def _outcome(rank: int, exitcode: int | None, result: tuple[str, Any]) -> RankOutcome:
    kind, payload = result
    if kind == "error":
        exc_type, exc_message, tb, exc = payload
        return RankOutcome(rank, exitcode, None, exc_type, exc_message, tb, exc)
    return RankOutcome(rank, exitcode, payload if kind == "value" else None)


def _drain(conn: Any, rank: int, results: dict[int, tuple[str, Any]]) -> None:
    try:
        results[rank] = conn.recv()
    except (EOFError, OSError):
        conn.close()
    except Exception as e:  # noqa: BLE001 - an unpicklable result must not kill the launcher
        results[rank] = (
            "error",
            (type(e).__name__, f"result could not be received: {e}", "", None),
        )


def _failure_reported(jobs: ctl.JobStore, seen: int) -> tuple[int, bool]:
    """Whether a failure event appeared in the current generation's log since ``seen``.
    ``jobs`` is the launcher's own (generations only grow: an old ``gen`` written back is
    ignored)."""
    try:
        control = ctl.ControlPlane(jobs.root, jobs.generation())
        n = control.event_count()
        if n == seen:
            return seen, False
        failed = any(
            ev.kind != ctl.EV_LEFT and not ev.secondary for ev in control.read_events(whole=True)
        )
        return n, failed
    except Exception:  # noqa: BLE001 - the store is ours; failing to read it is not fatal
        return seen, False


def _store_has(ask: Callable[[], bool]) -> bool:
    """``ask()`` (a question to the job's store: is the job elastic, has it ended); an
    unreadable store counts as "not (yet)"."""
    try:
        return ask()
    except Exception:  # noqa: BLE001 - the store is ours; a failed read is retried later
        return False


def _report_death(jobs: ctl.JobStore, rank: int, exitcode: int) -> None:
    """Tell the survivors, through the store, how rank ``rank`` died."""
    what = (
        f"was killed by {_signal_name(-exitcode)}"
        if exitcode < 0
        else f"exited with code {exitcode}"
    )
    try:
        gen = jobs.generation()
        control = ctl.ControlPlane(jobs.root, gen)
        if not control.has_state(rank) or not control.claim(rank):
            return
        state = control.read_states([rank]).get(rank)
        if state is not None and state.status == "left":
            return
        info = control.read_infos([rank]).get(rank)
        # What it was doing when it died, from its board: its last heartbeat may be a few
        # steps behind in a fast loop.
        judged = _board.with_board(state, info)
        control.post_event(
            {
                "kind": ctl.EV_CRASH,
                "rank": rank,
                "reporter": -1,
                "gen": gen,
                "t": time.time(),
                "culprit": Culprit.record(rank, what=what, info=info, state=judged.record()),
            }
        )
    except Exception:  # noqa: BLE001 - reporting is best effort; peers also detect deaths
        pass


def _child_main(
    fn: Callable[..., Any], rank: int, args: tuple[Any, ...], env: dict[str, str], conn: Any
) -> None:
    # The parent's environment at start, exactly (see _Job._start).
    os.environ.clear()
    os.environ.update(env)
    # What this launcher set, for preflight to tell a script that overrides it.
    from resilient_ddp.group.preflight import note_launcher

    note_launcher(env)
    faulthandler.enable()
    # The launcher asks a process it is about to kill for its threads' stacks (reap).
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    code = 0
    try:
        value = fn(rank, *args)
        message: tuple[str, Any] = ("value", value)
    except SystemExit as e:
        # sys.exit() is a departure, not a crash: as under torchrun, the code decides.
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            sys.stderr.write(f"{e.code}\n")  # as Python prints sys.exit("message")
        message = ("value", None) if code == 0 else ("exit", code)
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        code = 1
        from resilient_ddp.base import _traces
        from resilient_ddp.runtime import _runtime

        rt = _runtime.current()
        if rt is not None:
            rt.report_exception(e)
        tb = traceback.format_exc()
        try:
            pickle.dumps(e)
            exc: BaseException | None = e
        except Exception:  # noqa: BLE001
            exc = None
        message = ("error", (_traces.qualname(type(e)), str(e), tb, exc))
        sys.stderr.write(f"[rank {rank}] {tb}")
    try:
        conn.send(message)
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
        conn.send(("error", (type(e).__name__, f"could not send the result: {e}", "", None)))
        code = 1
    conn.close()
    _finish(code)


def _finish(code: int) -> None:
    """End this rank as a plain Python process ends, with exit code ``code``.

    First, as Python's shutdown does, thread pools are told to finish and the non-daemon
    threads are joined (a checkpoint that one of them writes must not be cut off); then
    the library detaches, unless ``fn`` did. After a failure (the exit guard is armed) the
    interpreter's teardown must not run: gloo objects destructed there can block on a
    stopped peer or abort the process on a dead one (SIGABRT or SIGSEGV at exit). The
    code is known here, so the atexit handlers run and ``os._exit(code)`` ends the process.
    Otherwise it ends as any ``multiprocessing`` process does: ``SystemExit(code)`` leaves
    the target.

    Raises:
        SystemExit: With ``code``, unless the process ended here.
    """
    from resilient_ddp.group.process_group import destroy_process_group

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter itself calls
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover - every CPython this supports has it
        _join_non_daemon_threads()
    try:
        if _runtime.current() is not None:
            destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    if _exit_guard.exit_guard_armed():
        _exit_guard.hard_exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def _join_non_daemon_threads() -> None:
    """Wait until no thread but this one and daemon threads is left."""
    me = threading.current_thread()
    while True:
        alive = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
        if not alive:
            return
        for t in alive:
            t.join()
