"""The exit guard: after a failure, end the process without the interpreter's teardown.

Gloo objects of a failed group, destructed at interpreter exit, block on a stopped peer or
throw on a dead one (SIGABRT), whatever the program did meanwhile. Once armed
(:func:`arm_exit_guard`, by the runtime when it records a failure or raises one), the
process ends with the exit code the interpreter chose, after the atexit handlers, and
without that teardown. Process-wide; needs nothing of the job.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn


def hard_exit(code: int) -> None:
    """Exit now with ``code``, after atexit handlers, without the interpreter's shutdown.

    For a process that knows its exit code (an ``rd.spawn`` rank, see ``launch._finish``)
    after a failure: gloo's worker threads would keep the interpreter from exiting until
    the process group's own timeout, or abort it. Non-daemon threads are not waited for:
    join them first.
    """
    try:
        atexit.unregister(_exit_guard)
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def lighten_finalization() -> None:
    """Let the interpreter's exit skip its last garbage collections. Never blocks.

    The garbage that exists now is collected (its finalizers run, its files are flushed);
    then every object that exists is frozen (``gc.freeze``), so that the collections of the
    interpreter's finalization, which walk every object of torch and torch._dynamo, pass
    over them: about 0.6 s of CPU less at the end of every rank (measured: those
    collections take 0.85 s of the 3.1 s that ``python -c "import torch, torch._dynamo,
    resilient_ddp"`` takes; the one collection here, 0.25 s). Objects are still destructed
    as their references drop while modules are torn down; only a cycle that becomes
    garbage after this call is not collected, which Python does not promise at exit
    either. Called at the end of the library's atexit handler, on a healthy exit only
    (after a failure the exit guard ends the process without any teardown).
    """
    import gc

    gc.collect()
    gc.freeze()


_guard_armed = False
# How long the exit guard waits for the copy of this process that finishes the
# interpreter's exit (about 0.1 s measured); past it, the copy is killed (see _exit_guard).
_FINISHER_WAIT_S = 30.0
# Exit code when the guard cannot learn the interpreter's own: never a false success.
_UNKNOWN_EXIT_CODE = 1


def _normalise_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints it and exits 1


def _exit_guard() -> None:
    """End a process that saw a failure with the exit code the interpreter chose, without
    the interpreter's teardown. Runs first among the atexit handlers (registered last).

    Python has joined the non-daemon threads by now. The code the interpreter will exit
    with (0, 1 after an uncaught exception, ``n`` for ``sys.exit(n)`` or
    ``raise SystemExit(n)``, SIGINT after Ctrl-C) is in its C stack only: no Python code
    can read it. Its teardown cannot run here: gloo objects of a failed group block on a
    stopped peer or abort the process, and a thread that returns from the backend while
    the interpreter finalizes aborts it (``terminate called without an active
    exception``: an op fails exactly when the peers exit). So the other handlers run
    first (every thread can still take the GIL), then the process forks: the copy has no
    other thread; it keeps every object alive and skips the C++ static destructors
    (:func:`_keep_everything`), so its finalization destructs nothing, and it exits with
    the interpreter's own code. This process then ends the same way, by ``os._exit``.
    Without ``fork`` (it failed) this process finishes the exit itself, kept the same
    way: the code is still the interpreter's, but a thread may still abort it.
    """
    atexit.unregister(_exit_guard)
    if threading.current_thread() is not threading.main_thread() or (
        sys._getframe().f_back is not None
    ):
        return  # run by atexit._run_exitfuncs() from Python code: not the process's end
    atexit._run_exitfuncs()
    import faulthandler
    import warnings

    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or absent stream must not stop it
            stream.flush()
    # Its watchdog thread is not copied: the copy's finalization would wait for it forever.
    faulthandler.cancel_dump_traceback_later()
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # else the copy's status is discarded
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, 3.12+
            pid = os.fork()
    except OSError:
        pid = 0
    if pid == 0:
        _keep_everything()
        return  # the interpreter's exit goes on, and ends with its own code
    _end_like(pid)


def _keep_everything() -> None:
    """Let the interpreter's finalization destruct nothing.

    Every module, and every object a module refers to, gets a reference that is never
    dropped (everything reachable stays alive); the garbage collector ignores every object
    that exists (``gc.freeze``); and ``exit()`` calls ``_exit`` with its status before the
    C and C++ exit handlers (static destructors of libraries whose threads were not copied).
    """
    import ctypes
    import gc

    kept: list[Any] = []
    for module in list(sys.modules.values()):
        kept.append(module)
        with contextlib.suppress(TypeError):
            kept.extend(vars(module).values())
    gc.freeze()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
    libc = ctypes.CDLL(None)
    on_exit = getattr(libc, "on_exit", None)  # glibc
    if on_exit is not None:
        # exit(status) calls it as _exit(status, NULL); _exit reads its one argument.
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)


def _end_like(pid: int) -> NoReturn:
    """Wait for the process ``pid`` (see :func:`_exit_guard`), then end as it ended: the
    same exit code, or killed by the same signal."""
    deadline = time.monotonic() + _FINISHER_WAIT_S
    status: int | None = None
    why = f"did not finish within {_FINISHER_WAIT_S:.0f} s"
    while status is None and time.monotonic() < deadline:
        try:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            else:
                time.sleep(0.005)
        except ChildProcessError:
            why = "ended, but its status was taken by someone else"
            break
        except BaseException:  # noqa: BLE001 - a signal handler raised; the end goes on
            continue
    if status is None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"resilient_ddp: the process finishing the interpreter's exit {why}; "
                f"exiting with code {_UNKNOWN_EXIT_CODE}\n"
            )
            sys.stderr.flush()
        os._exit(_UNKNOWN_EXIT_CODE)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(Exception):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def arm_exit_guard() -> None:
    """After a failure, end the process without the interpreter's teardown, with the exit
    code the interpreter chose (see :func:`_exit_guard`).

    Gloo objects of a failed group, destructed at interpreter exit, block on a stopped peer
    or throw on a dead one (SIGABRT), whatever the program did meanwhile.
    """
    global _guard_armed
    if _guard_armed:
        return
    _guard_armed = True
    atexit.register(_exit_guard)


def exit_guard_armed() -> bool:
    """Whether :func:`arm_exit_guard` was called in this process. Never blocks."""
    return _guard_armed
