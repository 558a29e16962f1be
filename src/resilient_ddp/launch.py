"""A local launcher whose parent hosts the store, so the control plane outlives every rank.

Unlike :func:`torch.multiprocessing.spawn`, a rank that dies does not make the launcher kill
the others at once: the parent reports the death to the survivors through the store (with
the signal that killed it), gives them ``grace`` to raise and exit, and only then kills what
is left. It returns every rank's return value, or raises :class:`SpawnError` carrying how
each rank ended.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _control as ctl
from .errors import RankOutcome, SpawnError

__all__ = ["spawn"]

_DEFAULT_GRACE = timedelta(seconds=30)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: timedelta | None = None,
    grace: timedelta = _DEFAULT_GRACE,
    start_method: str = "spawn",
    env: Mapping[str, str] | None = None,
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
        timeout: Deadline for the whole job; processes still running then are killed.
        grace: After the first process fails, how long the others get to exit by
            themselves before they are killed.
        start_method: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"``.
        env: Extra environment variables for the processes.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        SpawnError: A process raised, exited non-zero, was killed or overran ``timeout``;
            ``outcomes`` holds each rank's exit code, return value and traceback.
    """
    outcomes = launch(fn, nprocs, args, timeout=timeout, grace=grace,
                      start_method=start_method, env=env)
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
        return f"  rank {o.rank}: killed by the launcher at the deadline"
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
    timeout: timedelta | None = None,
    grace: timedelta = _DEFAULT_GRACE,
    start_method: str = "spawn",
    env: Mapping[str, str] | None = None,
) -> list[RankOutcome]:
    """Like :func:`spawn`, but return every rank's :class:`RankOutcome` instead of raising."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control_root = ctl.root_prefix(store)
    ctx = mp.get_context(start_method)
    procs: list[Any] = []
    conns: list[Any] = []
    base_env = {
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "RESILIENT_DDP_STORE": f"127.0.0.1:{store.port}",
        # Make env:// connect to our store as a client, as it does under torchrun.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        **(env or {}),
    }
    for rank in range(nprocs):
        recv, send = ctx.Pipe(duplex=False)
        child_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
        p = ctx.Process(
            target=_child_main,
            args=(fn, rank, tuple(args), child_env, send),
            name=f"resilient_ddp-rank{rank}",
        )
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    results: dict[int, tuple[str, Any]] = {}
    start = time.monotonic()
    deadline = start + timeout.total_seconds() if timeout is not None else float("inf")
    kill_at = float("inf")
    reported: set[int] = set()
    events_seen = 0
    next_event_poll = 0.0
    try:
        while any(p.is_alive() for p in procs) or any(not c.closed for c in conns):
            ready = mpc.wait(
                [c for c in conns if not c.closed] + [p.sentinel for p in procs if p.is_alive()],
                timeout=0.05,
            )
            for c in conns:
                if c in ready and not c.closed:
                    _drain(c, conns.index(c), results)
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if p.exitcode is None or rank in reported:
                    continue
                reported.add(rank)
                if p.exitcode != 0 or results.get(rank, ("",))[0] == "error":
                    kill_at = min(kill_at, now + grace.total_seconds())
                    if p.exitcode != 0 and results.get(rank, ("",))[0] != "error":
                        _report_death(control_root, rank, p.exitcode)
            if now >= next_event_poll and kill_at == float("inf"):
                # A failure reported by the ranks themselves (a timeout naming a stopped
                # rank, say) also starts the grace period: such a rank may never exit.
                next_event_poll = now + 0.25
                events_seen, failed = _failure_reported(control_root, events_seen)
                if failed:
                    kill_at = now + grace.total_seconds()
            if now >= min(deadline, kill_at):
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for rank, c in enumerate(conns):
            if not c.closed:
                while c.poll(0):
                    _drain(c, rank, results)
                    if c.closed:
                        break
                if not c.closed:
                    c.close()
    outcomes = []
    for rank, p in enumerate(procs):
        kind, payload = results.get(rank, ("none", None))
        killed = p.exitcode == -signal.SIGKILL and now >= min(deadline, kill_at)
        exitcode = None if killed else p.exitcode
        if kind == "error":
            exc_type, exc_message, tb, exc = payload
            outcomes.append(RankOutcome(rank, exitcode, None, exc_type, exc_message, tb, exc))
        else:
            outcomes.append(RankOutcome(rank, exitcode, payload if kind == "value" else None))
    return outcomes


def _drain(conn: Any, rank: int, results: dict[int, tuple[str, Any]]) -> None:
    try:
        results[rank] = conn.recv()
    except (EOFError, OSError):
        conn.close()
    except Exception as e:  # noqa: BLE001 - an unpicklable result must not kill the launcher
        results[rank] = ("error", (type(e).__name__, f"result could not be received: {e}", "", None))


def _failure_reported(control_root: dist.Store, seen: int) -> tuple[int, bool]:
    """Whether a failure event appeared in the current generation's log since ``seen``."""
    try:
        control = ctl.ControlPlane(control_root, int(control_root.add("gen", 0)))
        n = control.event_count()
        if n == seen:
            return seen, False
        failed = any(
            ev["kind"] != ctl.EV_LEFT and not ev.get("secondary") for ev in control.read_events()
        )
        return n, failed
    except Exception:  # noqa: BLE001 - the store is ours; failing to read it is not fatal
        return seen, False


def _report_death(control_root: dist.Store, rank: int, exitcode: int) -> None:
    """Tell the survivors, through the store, how rank ``rank`` died."""
    what = (
        f"was killed by {_signal_name(-exitcode)}"
        if exitcode < 0
        else f"exited with code {exitcode}"
    )
    try:
        gen = int(control_root.add("gen", 0))
        control = ctl.ControlPlane(control_root, gen)
        if not control.has_state(rank) or not control.claim(rank):
            return
        state = control.read_states([rank])[rank]
        if state.get("status") == "left":
            return
        info = control.read_infos([rank])[rank] if control.store.check([f"info/{rank}"]) else None
        control.post_event({
            "kind": ctl.EV_CRASH,
            "rank": rank,
            "reporter": -1,
            "gen": gen,
            "t": time.time(),
            "culprit": ctl.culprit_from(rank, what=what, info=info, state=state),
        })
    except Exception:  # noqa: BLE001 - reporting is best effort; peers also detect deaths
        pass


def _child_main(
    fn: Callable[..., Any], rank: int, args: tuple[Any, ...], env: dict[str, str], conn: Any
) -> None:
    os.environ.update(env)
    faulthandler.enable()
    code = 0
    try:
        value = fn(rank, *args)
        message: tuple[str, Any] = ("value", value)
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        code = 1
        from . import _runtime

        rt = _runtime.current()
        if rt is not None:
            rt.report_exception(e)
        tb = traceback.format_exc()
        try:
            pickle.dumps(e)
            exc: BaseException | None = e
        except Exception:  # noqa: BLE001
            exc = None
        message = ("error", (_qualname(type(e)), str(e), tb, exc))
        sys.stderr.write(f"[rank {rank}] {tb}")
    try:
        conn.send(message)
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
        conn.send(("error", (type(e).__name__, f"could not send the result: {e}", "", None)))
        code = 1
    conn.close()
    _finish(code)


def _finish(code: int) -> None:
    from . import _runtime
    from .process_group import destroy_process_group

    rt = _runtime.current()
    stuck = rt is not None and bool(rt.stuck)
    try:
        if rt is not None:
            destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    if stuck or code != 0:
        # A failed op may still be pending in gloo's threads; interpreter shutdown would wait
        # for it (FINDINGS). Everything worth keeping has been sent.
        os._exit(code)
    sys.exit(code)


def _qualname(cls: type) -> str:
    mod = cls.__module__
    return cls.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{cls.__qualname__}"
