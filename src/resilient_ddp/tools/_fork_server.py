"""Imported in ``rd.spawn``'s fork server only (the last of
:data:`resilient_ddp.tools.launch.FORK_SERVER_PRELOAD`): when the server ends, because the
program that started it exited, it skips the interpreter's teardown.

With torch and ``torch._dynamo`` loaded, that teardown takes about a second of CPU, and
on a loaded machine the server outlived its caller by more than 6 s, an orphan still
running after the user's program ended. The server holds nothing to flush or close: its
ranks are its children and ended before their caller did.

The ranks forked from the server inherit the handler below; it does nothing in them (they
run their own exit, see ``launch._child_main``).
"""

from __future__ import annotations

import atexit
import os

_SERVER_PID = os.getpid()


def _end_now() -> None:
    """Registered last, so run first at exit: end the server without its teardown."""
    if os.getpid() == _SERVER_PID:
        os._exit(0)


atexit.register(_end_now)
