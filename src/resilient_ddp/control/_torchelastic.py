"""torchrun (torchelastic) integration: the error file its root-cause summary reads, and the
plain-init restart trap.

The call sites are :func:`resilient_ddp.runtime._process_hooks._excepthook` (every
uncaught exception once resilient_ddp is initialised) and
:func:`resilient_ddp.group.process_group.attach` (a default group
that the user, not resilient_ddp, created).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import traceback
from collections.abc import Mapping

import torch.distributed as dist

from resilient_ddp.control import _control as ctl
from resilient_ddp.control import _events

__all__ = [
    "attempt_namespace",
    "forget_default_group_addresses",
    "plain_init_restart_hint",
    "record_error_file",
]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

RESTART_HINT = (
    "this job runs under torchrun with restarts, and its process group was created by "
    "torch.distributed.init_process_group(): after a restart, the new ranks can read the "
    "previous attempt's keys in torchrun's store (it outlives the attempts) and fail to "
    "connect in init_process_group (gloo: 'connectFullMesh failed ... Connection refused', "
    "or a hang until the group's timeout). Call resilient_ddp.init_process_group() instead: "
    "it gives every attempt its own namespace in that store."
)


def record_error_file(exc: BaseException) -> None:
    """Write ``exc`` where torchrun's agent looks for this worker's error.

    torchrun gives each worker a ``TORCHELASTIC_ERROR_FILE``; when a worker exits non-zero
    without writing it, the job's closing summary shows only ``exitcode 1`` and "To enable
    traceback see ...". This writes the file in the format of torch's own
    :meth:`~torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception`:
    the exception's type and full message (for our errors: the culprit rank, its step,
    phase and op) and the whole formatted traceback, which is what the summary prints.

    Nothing is written when the variable is unset or empty (not under torchrun), when the
    file exists already (torch's ``@record`` or an earlier call wrote it: the first word
    stands), or for a ``KeyboardInterrupt``/``SystemExit`` (torch's ``@record`` skips those
    too). The summary's root cause is the failure with the smallest timestamp, in whole
    seconds, a tie going to the lowest rank (of those seen at the same poll); so an error
    that is only the consequence of another rank's failure (a
    :class:`~resilient_ddp.RankFailureError` naming other ranks) is stamped with the next
    whole second. The rank that failed first, in the same second, then stays the root cause
    rather than a survivor that merely reported it.

    Never raises: it runs while the process is dying, and the error is on stderr anyway.

    Args:
        exc: The uncaught exception.
    """
    try:
        path = os.environ.get(ERROR_FILE_ENV, "")
        if not path or os.path.exists(path) or not isinstance(exc, Exception):
            return
        now = time.time()
        stamp = math.ceil(now) if _is_consequence(exc) else int(now)
        data = {
            "message": {
                "message": f"{_type_name(type(exc))}: {exc}",
                "extraInfo": {
                    "py_callstack": "".join(
                        traceback.format_exception(type(exc), exc, exc.__traceback__)
                    ),
                    "timestamp": str(stamp),
                },
            }
        }
        _write_new(path, json.dumps(data))
    except Exception:  # noqa: BLE001  (never raise from a dying process's hook)
        pass


def _type_name(cls: type) -> str:
    # Our errors by their public name (``resilient_ddp.RankFailureError``), as every other
    # report of the library names them; others as the traceback would.
    mod = cls.__module__
    if mod.startswith("resilient_ddp."):
        mod = "resilient_ddp"
    return cls.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{cls.__qualname__}"


def _own_rank() -> int | None:
    who = _events.identity()  # the runtime's, once it exists
    if who is not None:
        return who[0]
    with contextlib.suppress(KeyError, ValueError):
        return int(os.environ["RANK"])
    return None


def _is_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` only reports another rank's failure (this rank is not a culprit)."""
    from resilient_ddp.errors import RankFailureError

    if not isinstance(exc, RankFailureError) or not exc.culprits:
        return False
    return _own_rank() not in exc.ranks


def _write_new(path: str, text: str) -> None:
    """Create ``path`` holding ``text`` unless it exists, never leaving it half written.

    The agent parses the file after the worker exited and dies on invalid JSON ("Failed to
    parse reply file"), and a worker that is dying may be SIGKILLed at any moment: so the
    text goes to a temporary file first and is linked in under the final name in one step
    (a link, unlike a rename, fails rather than replaces when the name exists).
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:
        # No hard links on this file system: create exclusively and write in place.
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _restarts_possible(env: Mapping[str, str]) -> bool:
    if not env.get("TORCHELASTIC_RUN_ID"):
        return False
    try:
        return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


def _gloo_keys_forgettable(env: Mapping[str, str]) -> bool:
    # Lazy init (TORCH_GLOO_LAZY_INIT) connects pairs at first use, reading the keys then:
    # they must stay. A backend other than gloo keeps other keys (NCCL's unique ids).
    lazy = env.get("TORCH_GLOO_LAZY_INIT", "").strip().lower() not in ("", "0", "false")
    return not lazy and dist.get_backend() == "gloo"


def forget_default_group_addresses() -> int:
    """Delete the default group's gloo rendezvous keys from its store; return how many.

    gloo publishes each rank's listening address in the store and every rank reads the
    others' to connect its full mesh. Under torchrun that store is the agent's, which
    outlives the attempts: a restarted rank would read the dead ranks' addresses, since
    ``store.get`` answers at once with a stale key, and fail to connect ("Connection
    refused" in ``connectFullMesh``, or a hang until the group's timeout). Deleting the keys
    makes the next attempt's ranks wait for the fresh ones instead.

    Call only once every rank's ``init_process_group`` has returned: until then some rank
    may still be reading them.

    Returns:
        The number of keys deleted: 0 when the key layout (torch's, not a public one) is not
        the one this was written against.
    """
    # The default store is torch's PrefixStore("<group name>/", ...) of the default group;
    # gloo keeps each rank's address under "<device type>/" then "<gloo device index>/"
    # (torch 2.13: default_pg/0//cpu//0/<rank> in the agent's store).
    store = dist.distributed_c10d._get_default_store()
    group = dist.distributed_c10d._get_default_group()
    device_types = {d.type for d in getattr(group, "_device_types", ())} or {"cpu"}
    world = dist.get_world_size()
    deleted = 0
    for device in sorted(device_types):
        # One key per rank and gloo device (several with GLOO_SOCKET_IFNAME=a,b): go on
        # while the index still had keys.
        index = 0
        while True:
            found = sum(bool(store.delete_key(f"{device}//{index}/{r}")) for r in range(world))
            if not found:
                break
            deleted += found
            index += 1
    return deleted


def _last_to_attach(env: Mapping[str, str]) -> bool:
    """Count this rank in; True for the rank that completes the count (every rank of this
    attempt has attached, so every rank's ``init_process_group`` has returned).

    A counter of our own, keyed by the attempt: the library's attach keys do not prove it
    on a user-created group, whose control plane may hold the previous attempt's keys.
    """
    store = dist.distributed_c10d._get_default_store()
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    n = int(store.add(ctl.attached_key(attempt), 1))
    return n % dist.get_world_size() == 0


def attempt_namespace(store: dist.Store) -> dist.Store:
    """``store`` as seen by this torchrun attempt: under the agent's store, which outlives the
    attempts, a ``PrefixStore`` of the attempt's own (``rd/attempt<N>/``,
    :func:`~resilient_ddp.control._control.attempt_prefix`); else ``store``.

    For the control plane over a group the user created: without it a restarted attempt
    would read the previous attempt's states and failure events (and blame its culprit).
    ``resilient_ddp.init_process_group`` puts its whole group under the same prefix.

    Args:
        store: The default group's store.
    """
    global _attempt_namespaced
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    _attempt_namespaced = True
    return dist.PrefixStore(ctl.attempt_prefix(restart), store)


# Whether this process's control plane went through attempt_namespace: only then does a
# restarted attempt that connects (thanks to forget_default_group_addresses) also start
# with a clean control plane.
_attempt_namespaced = False


def plain_init_restart_hint() -> str | None:
    """Defuse, or warn of, the restart trap of a group the user created under torchrun.

    torchrun's agent store outlives the attempts, and a default group created by a plain
    ``torch.distributed.init_process_group`` keeps its keys there under the same names in
    every attempt; ``resilient_ddp.init_process_group`` gives each attempt a namespace of
    its own. Called once per rank when the user, not resilient_ddp, created the group, after
    the rank attached to the control plane. With gloo (not lazily initialised), the last
    rank of the attempt to get here deletes the group's rendezvous keys (see
    :func:`forget_default_group_addresses`), so that a restarted attempt connects; this
    only when the control plane is namespaced by attempt too (:func:`attempt_namespace`),
    or the restarted attempt would connect and then read the previous attempt's failures.

    Returns:
        ``None`` when there is nothing to warn of: not under torchrun with
        ``--max-restarts`` above 0, the store is not the agent's (each attempt gets a
        fresh one), or the keys were taken care of. Otherwise a warning (backend other
        than gloo, lazy init, a control plane not namespaced by attempt, an unknown key
        layout, or the store refused) that tells the user to call
        ``resilient_ddp.init_process_group()`` instead.
    """
    env = os.environ
    if not _restarts_possible(env) or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        if not _attempt_namespaced or not _gloo_keys_forgettable(env):
            return RESTART_HINT
        if not _last_to_attach(env):
            return None  # the last rank to attach takes care of it, or warns
        return None if forget_default_group_addresses() > 0 else RESTART_HINT
    except Exception:  # noqa: BLE001  (a store refusal must not fail the attach)
        return RESTART_HINT
