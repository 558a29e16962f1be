"""Process-group lifecycle: init (or attach to a group torch already made) and destroy."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient_ddp.base import _timings
from resilient_ddp.base._backend import abort_group, backend_name, default_pg_timeout
from resilient_ddp.config import ResilienceConfig, get_config, resolve
from resilient_ddp.control import _control as ctl
from resilient_ddp.control._events import rank_log
from resilient_ddp.errors import ConfigError
from resilient_ddp.group.membership import join_control_plane, release_retired
from resilient_ddp.group.preflight import preflight
from resilient_ddp.inference import _guest
from resilient_ddp.runtime import _exit_guard, _process_hooks, _runtime
from resilient_ddp.runtime._runtime import Runtime
from resilient_ddp.training.elastic import JOINER_ENV, join
from resilient_ddp.training.elastic import leave as elastic_leave
from resilient_ddp.training.elastic import setup as elastic_setup

__all__ = ["destroy_process_group", "init_process_group", "is_initialized"]

log = logging.getLogger("resilient_ddp")

STORE_ENV = ctl.STORE_ENV


def init_process_group(
    backend: str | None = None,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
    timeout: timedelta | None = None,
    config: ResilienceConfig | None = None,
    device_id: Any = None,
) -> None:
    """Initialise the default process group and start failure detection on this rank.

    Arguments mirror :func:`torch.distributed.init_process_group`; with none given it reads
    torchrun's (or :func:`resilient_ddp.spawn`'s) environment (``env://``). If torch's
    default group already exists (the user called ``torch.distributed.init_process_group``),
    this attaches to it and to its store instead of creating another.

    Every rank must call it. It blocks until every rank has attached, at most ``timeout``
    (default ``config.init_timeout``).

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (torch's default: gloo for CPU tensors,
            NCCL for CUDA tensors when available).
        init_method: URL of the rendezvous, as in torch (default ``env://``).
        rank: This process's rank (default: from the environment).
        world_size: Number of ranks (default: from the environment).
        store: A c10d store to rendezvous through instead of ``init_method``. It must outlive
            every rank (host it in the launching process, as :func:`spawn` does).
        timeout: As in torch: bounds the rendezvous (start-up, instead of
            ``config.init_timeout``) and is the backend's own timeout for every operation
            on the group, also the plain ``torch.distributed`` calls a framework makes.
            Default: torch's (30 minutes for gloo, 10 for NCCL), so that plain calls behave
            as without resilient_ddp; the library's own collectives are bounded by
            ``config.op_timeout`` whatever this is.
        config: Budgets and policies. The fields given in code win; the others come from
            ``RESILIENT_DDP_*`` environment variables, then the defaults (see
            :func:`resilient_ddp.config.resolve`). Default: the process-wide config.
        device_id: Passed to torch (binds NCCL communicators to a device).

    With the ``env://`` rendezvous (the default), start-up is checked first, within
    ``timeout`` or ``config.init_timeout`` (see :mod:`resilient_ddp.group.preflight`): the
    variables, the store (transient connection failures are retried), and every rank's
    versions, devices and free memory. Every problem found is reported at once, on every
    rank that is up.

    Raises:
        ConfigError: Already initialised through resilient_ddp, or a ``RESILIENT_DDP_*``
            variable is unknown or invalid.
        PreflightError: The environment is unusable, the store cannot be reached or hosted
            (port in use), ranks did not arrive, or ranks disagree (versions, devices); or
            some rank did not attach within ``config.init_timeout``. For a joiner
            (``RESILIENT_DDP_JOINER=1``, elastic training): not admitted in time, or the
            job failed before admitting it.
        SystemExit: A joiner whose job finished before admitting it exits with code 0
            (it has nothing left to do).
    """
    if _runtime.current() is not None:
        raise ConfigError("resilient_ddp is already initialised in this process.")
    cfg = resolve(config) if config is not None else get_config()
    if timeout is not None:
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ConfigError(f"The timeout ({timeout!r}) must be a positive timedelta.")
        # As in torch, ``timeout`` bounds the rendezvous.
        cfg = cfg.model_copy(update={"init_timeout": timeout})
    if os.environ.get(JOINER_ENV, "") not in ("", "0") and not dist.is_initialized():
        # A replacement for a failed rank: it joins the running job at a step boundary.
        joined = join(backend, cfg, cfg.init_timeout)
        if isinstance(joined, _guest.Guest):
            _guest.set_current(joined)  # helps with the running inference call, no group
            lighten_exit()
            return
        rt, _ = joined
        _became_current(rt)
        return
    if not dist.is_initialized():
        # The backend's timeout is torch's unless the caller gives one: plain calls (a
        # framework's barrier while rank 0 saves a checkpoint) must not fail sooner than
        # they would without us. Our ops have their own deadlines, and a process whose op
        # is stuck in the backend ends through the exit guard, not the backend's timeout.
        pg_timeout = timeout if timeout is not None else default_pg_timeout(backend)
        kwargs: dict[str, Any] = {"timeout": pg_timeout}
        if store is None and init_method in (None, "env://"):
            # Our own env:// rendezvous: checked, retried and bounded by init_timeout.
            store, env, _ = preflight(
                backend,
                rank=rank,
                world_size=world_size,
                budget=cfg.init_timeout,
                store_timeout=pg_timeout,
                linger=cfg.heartbeat_timeout,
            )
            rank, world_size = env.rank, env.world_size
            # torchrun's agent keeps one store across restarts: without a namespace per
            # attempt, gloo would read the previous attempt's addresses (connection refused)
            # and the watchdog its failure events.
            store = dist.PrefixStore(ctl.attempt_prefix(env.restart), store)
        if init_method is not None:
            kwargs["init_method"] = init_method
        if store is not None:
            kwargs["store"] = store
        if rank is not None:
            kwargs["rank"] = rank
        if world_size is not None:
            kwargs["world_size"] = world_size
        if device_id is not None:
            kwargs["device_id"] = device_id
        dist.init_process_group(backend, **kwargs)
        attach(cfg, store=store, owned=True).backend_timeout = pg_timeout
        return
    attach(cfg, store=store)


def is_initialized() -> bool:
    """Whether this process is attached to resilient_ddp's failure detection."""
    return _runtime.current() is not None


def attach(
    config: ResilienceConfig | None = None,
    *,
    store: dist.Store | None = None,
    owned: bool = False,
) -> Runtime:
    """Start failure detection on top of torch's existing default process group.

    Blocks until every rank attached (at most ``config.init_timeout``).

    Raises:
        ConfigError: torch's default process group does not exist.
        PreflightError: Some rank did not attach in time.
    """
    if not dist.is_initialized():
        raise ConfigError(
            "No process group: call resilient_ddp.init_process_group() (or "
            "torch.distributed.init_process_group()) on every rank first."
        )
    cfg = resolve(config) if config is not None else get_config()
    rt = Runtime.of_group(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=backend_name(),
        control_root=ctl.control_store(store, timeout=cfg.init_timeout),
        config=cfg,
    )
    if rt.rank == 0:
        _say_protection(rt)
    join_control_plane(rt)
    from resilient_ddp.control._torchelastic import plain_init_restart_hint

    hint = None if owned else plain_init_restart_hint()
    if hint is not None:
        rank_log.of(rt).warning("%s", hint)
    elastic_setup(rt)
    _became_current(rt)
    return rt


def _became_current(rt: Runtime) -> None:
    """``rt`` is this process's runtime from now on: its hooks are installed."""
    _runtime.set_current(rt)
    _process_hooks.install_hooks()
    lighten_exit()


def lighten_exit() -> None:
    """At this process's healthy exit, skip the interpreter's last garbage collections
    (:func:`~resilient_ddp.runtime._exit_guard.lighten_finalization`): for the processes
    the library runs in (a rank, a guest, a launcher). Never blocks."""
    global _light_exit
    _light_exit = True


def _say_protection(rt: Runtime) -> None:
    """One line at start-up (rank 0): how the job's control plane is protected, and
    whether processes outside the group can join it."""
    root = rt.control_root
    if ctl.mac_key(root) is None:  # a store given without a job namespace (tests)
        return
    if getattr(root, "joinable", True):
        log.info(
            "resilient_ddp: control plane sealed with the job's secret; replacements that "
            "hold it may join"
        )
        return
    elastic = rt.config.on_failure == "shrink"
    (log.warning if elastic else log.info)(
        "resilient_ddp: control plane sealed with a key the ranks agreed on at start-up; "
        "joining this job is refused%s. To allow replacements to join, give every rank "
        "the same secret: %s, or %s naming a file only the job's user can read",
        " (shrink still works)" if elastic else "",
        ctl.SECRET_ENV,
        ctl.SECRET_FILE_ENV,
    )


def _attach_on_first_use(config: ResilienceConfig | None) -> Runtime:
    if _guest.current() is not None:
        raise ConfigError(f"No process group here: {_guest.ONLY}.")
    return attach(config)


_runtime.set_attach(_attach_on_first_use)
ensure_runtime = _runtime.ensure_runtime  # the operations' way in, for the layers above


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Tell the peers this rank leaves, stop failure detection and destroy the group.

    If an exception is in flight (called from ``finally`` or ``except``), it is reported to
    the peers first, so that they name it rather than a bare departure. Returns within about
    one heartbeat interval, also after a failure with ops still stuck in the backend.

    Args:
        group: As in torch; ``None`` destroys the default group and detaches.
    """
    rt = _runtime.current()
    if group is None and _guest.current() is not None:
        _guest.set_current(None)  # a guest of an inference call: no group to destroy
        return
    if group is not None:
        dist.destroy_process_group(group)
        return
    if rt is not None:
        exc = sys.exc_info()[1]
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            rt.report_exception(exc)
        elif exc is None:
            elastic_leave(rt)  # joiners still waiting learn that the job finished
        _detach(rt)
        if rt.stuck:
            # A gloo group whose op is stuck behind a stopped peer blocks in its destructor
            # until the backend's timeout: abort it and keep it referenced for good.
            abort_group()
            _abandoned.append((dist.group.WORLD, rt.stuck))
    if dist.is_initialized():
        _retired.append(dist.group.WORLD)
        dist.destroy_process_group()


# Groups (and their stuck works) abandoned after a failure; never destructed, see above.
_abandoned: list[Any] = []
# Every default group destroyed here, kept for the life of the process. Otherwise a DDP
# model that outlives the group (plain DDP as well) drops the last reference when it
# goes: its reducer's C++ destructor runs ~ProcessGroupGloo with the GIL held, which joins
# the group's worker thread, and a worker freeing a late op's Python-visible tensor waits
# for the GIL: the process froze when the function holding the model returned (gdb: main
# thread in ~Reducer -> ~ProcessGroupGloo -> thread::join, pt_gloo_runloop in
# ~AsyncAllreduceWork -> decref_pyobject -> gil_scoped_acquire). Released at exit by
# _at_exit, while other threads can still take the GIL (during the interpreter's
# finalization a gloo thread waiting for it is ended, and the process aborts). Costs one
# group's sockets and threads per init/destroy cycle of a process.
_retired: list[Any] = []


def _detach(rt: Runtime) -> None:
    rt.report_left()
    if rt.watchdog is not None:
        rt.watchdog.stop(timeout=_timings.watchdog_stop_wait(rt.config))
    rt.linger()  # the store host keeps serving until the peers are done with it
    _runtime.set_current(None)
    _process_hooks.uninstall_hooks()


# Whether this process's healthy exit skips the interpreter's last garbage collections
# (see lighten_exit): a rank, a guest or a launcher of the library.
_light_exit = False


@atexit.register
def _at_exit() -> None:
    # The user never called destroy_process_group(): still tell the peers and stop the
    # watchdog before the interpreter tears down (a thread inside a store call at exit
    # aborts the process).
    rt = _runtime.current()
    if rt is not None:
        _detach(rt)
    _retired.clear()  # what the models left of them is gone by now (see _retired)
    if not _exit_guard.exit_guard_armed():
        # While other threads can still take the GIL (see _retired). With the exit guard
        # armed (after a failure) the process ends without destructing anything.
        release_retired(wait_s=2.0)
        _let_backend_threads_settle(_SETTLE_S)
        if _light_exit:
            _exit_guard.lighten_finalization()


# How long the exit waits at most for the backend's worker threads to go idle.
_SETTLE_S = 2.0
_BACKEND_WORKERS = ("pt_gloo_runloop",)
# Consecutive samples with no runnable worker that count as settled.
_QUIET_SAMPLES = 2


def _runnable_backend_threads() -> int | None:
    """How many of gloo's worker threads are running or waiting for a CPU (state R), from
    ``/proc/self/task``; ``None`` where there is no such file system."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    stats = [ctl.proc_stat(f"/proc/self/task/{tid}/stat") for tid in tids]
    # None: the thread ended meanwhile.
    return sum(1 for s in stats if s is not None and s[0] in _BACKEND_WORKERS and s[1][0] == "R")


def _let_backend_threads_settle(timeout_s: float) -> bool:
    """Wait, with the GIL released, until no gloo worker thread is runnable: at most
    ``timeout_s`` seconds. Returns whether they settled.

    A gloo worker drops its reference to an op just after completing it. If that is the
    last reference and a tensor of the op was seen by Python, the worker needs the GIL to
    free it. Should that happen after the interpreter began to finalize (the op's waiter went
    on at once, and the worker was preempted on a busy host), Python ends the worker thread
    inside the op's C++ destructor and the process aborts ("terminate called without an
    active exception", exit -6) after the job completed. Measured: 5 % of 3-rank runs on 2
    cores. Called at exit, while other threads can still take the GIL; a worker waiting for
    it takes it during the sleeps here.
    """
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < _QUIET_SAMPLES:
        time.sleep(0.002)
        n = _runnable_backend_threads()
        if n is None:
            return True
        quiet = quiet + 1 if n == 0 else 0
        if time.monotonic() > deadline:
            return False
    return True
