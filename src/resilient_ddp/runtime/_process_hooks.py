"""The process's hooks while it has a runtime: the uncaught-exception hooks (the rank's
own failure goes to its peers and to torchrun's error file), SIGTERM (a launcher ends the
rank: it says what it was doing), and the signal the watchdog sends the main thread to
raise the peers' verdict on this rank (:meth:`Runtime.tell_main`).

Installed by ``process_group`` when a runtime starts (:func:`install_hooks`), removed when it
ends (:func:`uninstall_hooks`). Sits above the runtime: it reads the current one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, NoReturn

from resilient_ddp.base import _timings
from resilient_ddp.base._traces import qualname
from resilient_ddp.errors import ResilientDDPError
from resilient_ddp.runtime._exit_guard import _normalise_code, arm_exit_guard
from resilient_ddp.runtime._runtime import TELL_SIGNAL, Runtime, current, set_tell_ready

_hooks_installed = False
_prev_excepthook: Callable[..., Any] | None = None
_prev_thread_hook: Callable[..., Any] | None = None

# The main thread is in the excepthook: the process dies of an uncaught exception, which it
# is reporting (to the peers, to torchrun's error file, on stderr). A launcher's SIGTERM
# then must not raise another error into the hook (which would end it before the error
# file is written: seen as torchrun's bare "To enable traceback" for that rank).
_dying = False


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    global _dying
    _dying = True
    rt = current()
    if rt is not None:
        _report_dying(rt, exc, tb, to_peers=not issubclass(exc_type, KeyboardInterrupt))
    assert _prev_excepthook is not None
    _prev_excepthook(exc_type, exc, tb)
    if rt is not None and (rt.stuck or rt.failures):
        # Python joins the non-daemon threads, then the guard ends the process (code 1).
        arm_exit_guard()


def _report_dying(
    rt: Runtime, exc: BaseException, tb: TracebackType | None, *, to_peers: bool = True
) -> None:
    """The exception this rank dies of: to the peers, and to torchrun's error file (its
    root-cause summary shows what this rank saw)."""
    if to_peers:
        rt.report_exception(exc, tb)
    from resilient_ddp.control._torchelastic import record_error_file

    record_error_file(exc)


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    rt = current()
    if rt is not None and args.exc_value is not None:
        name = args.thread.name if args.thread is not None else "?"
        rt.note_thread_died(
            f"note: thread {name!r} died with {qualname(args.exc_type)}: {args.exc_value}"
        )
    assert _prev_thread_hook is not None
    _prev_thread_hook(args)


_prev_signal_handlers: dict[int, Any] = {}
_prev_exit: Callable[..., Any] | None = None


def _on_tell(signum: int, frame: FrameType | None) -> None:
    """Raise the peers' verdict on this rank in the main thread (see Runtime.tell_main)."""
    rt = current()
    if rt is not None:
        _raise_told(rt)


def _raise_told(rt: Runtime) -> None:
    """Raise the peers' verdict on this rank, once, if the watchdog has one for it."""
    error = rt.take_told_error()
    if error is not None:
        raise error


#: How soon a signal that came while the main thread held the runtime's lock is sent again.
REDELIVER_S = 0.05


def _owned(lock: Any) -> bool:
    """Whether this thread holds ``lock`` (an RLock; False for a lock that cannot tell)."""
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if is_owned is not None else False


def _deliver_again(signum: int) -> None:
    """Send ``signum`` to this process again in :data:`REDELIVER_S`, from a timer thread."""
    timer = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """A launcher ends the job (``mp.spawn`` and torchrun send SIGTERM to the others as
    soon as one rank fails): raise the failure this rank knows of, naming the culprit,
    instead of dying silently. Without a known failure, die by the signal as before."""
    rt = current()
    if _dying:
        return  # reporting the exception it dies of; the exit follows (see _dying)
    if rt is not None:
        if rt.lingering:
            return  # the store host serves the verdict to the last peers (bounded), then exits
        if isinstance(sys.exc_info()[1], ResilientDDPError):
            # The main thread is handling one of our errors already (an ``except`` block:
            # the user's, or mp.spawn's that reports it and exits): let it finish.
            return
        if _owned(rt.lock):
            # The main thread was interrupted inside the runtime's lock, which the watchdog
            # needs to record the verdict this handler would wait for: handle the signal
            # again in a moment, once the lock is released.
            _deliver_again(signum)
            return
        _raise_told(rt)
        # The watchdog learns of a death within a tick; let it tick now. (``rt.raised`` may
        # already be set: the watchdog builds the error it fails a pending op with.)
        grace = _timings.watchdog_verdict_wait(rt.config)
        if rt.status == "running" and rt.await_verdict(grace):
            name = signal.Signals(signum).name
            head = (
                f"rank {rt.rank} (host {rt.identity['host']}) was ended by {name} from its "
                f"launcher (in {rt.op or 'no collective'}"
                f"{f', step {rt.step}' if rt.step >= 0 else ''})"
            )
            raise rt.build_error(rt.op or "(no op)", max(rt.op_seq, 0), head=head)
        if rt.hosts_store and (rt.failures or rt.raised):
            return  # on its way out: it keeps the store up for the peers (linger), bounded
    signal.signal(signum, _prev_signal_handlers.get(signum, signal.SIG_DFL))
    os.kill(os.getpid(), signum)


def _exit_reporting(code: str | int | None = None) -> NoReturn:
    """``sys.exit`` while the library is attached: a non-zero exit from inside an
    ``except`` block (``torch.multiprocessing.spawn`` does this with the rank's exception,
    and so do many scripts) reports that exception to the peers, as an uncaught one is."""
    rt = current()
    exc = sys.exc_info()[1]
    if (
        rt is not None
        and exc is not None
        and _normalise_code(code) != 0
        and not isinstance(exc, (SystemExit, KeyboardInterrupt))
    ):
        _report_dying(rt, exc, exc.__traceback__)
    assert _prev_exit is not None
    _prev_exit(code)
    raise SystemExit(code)  # pragma: no cover - _prev_exit raised already


def _install_signal(signum: int, handler: Callable[[int, FrameType | None], None]) -> bool:
    """Install ``handler`` for ``signum`` unless the program has its own; True if done."""
    current = signal.getsignal(signum)
    if current not in (signal.SIG_DFL, None):
        return False
    _prev_signal_handlers[signum] = current
    signal.signal(signum, handler)
    return True


def install_hooks() -> None:
    """Hook uncaught exceptions, ``sys.exit`` and, in the main thread, SIGTERM and the
    verdict signal, so that every way this rank ends tells the peers, and every way the
    peers end tells this rank."""
    global _hooks_installed, _prev_excepthook, _prev_thread_hook, _prev_exit
    if _hooks_installed:
        return
    _prev_excepthook, sys.excepthook = sys.excepthook, _excepthook
    _prev_thread_hook, threading.excepthook = threading.excepthook, _thread_hook
    _prev_exit, sys.exit = sys.exit, _exit_reporting
    if threading.current_thread() is threading.main_thread():
        _install_signal(signal.SIGTERM, _on_sigterm)
        if TELL_SIGNAL is not None:
            set_tell_ready(_install_signal(TELL_SIGNAL, _on_tell))
    _hooks_installed = True


def uninstall_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        return
    if sys.excepthook is _excepthook and _prev_excepthook is not None:
        sys.excepthook = _prev_excepthook
    if threading.excepthook is _thread_hook and _prev_thread_hook is not None:
        threading.excepthook = _prev_thread_hook
    if sys.exit is _exit_reporting and _prev_exit is not None:
        sys.exit = _prev_exit
    if threading.current_thread() is threading.main_thread():
        for signum, handler in list(_prev_signal_handlers.items()):
            if signal.getsignal(signum) in (_on_sigterm, _on_tell):
                signal.signal(signum, handler)
            del _prev_signal_handlers[signum]
        set_tell_ready(False)
    _hooks_installed = False
