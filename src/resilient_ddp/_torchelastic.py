"""torchrun (torchelastic) integration: the error file its root-cause summary reads, and the
plain-init restart trap.

Filled in by the torchrun integration work of issue 13; the call sites are
:func:`resilient_ddp._runtime._excepthook` and :func:`resilient_ddp.process_group.attach`.
"""

from __future__ import annotations

__all__: list[str] = []


def record_error_file(exc: BaseException) -> None:
    """Write ``exc`` to ``TORCHELASTIC_ERROR_FILE`` (if set and not written yet), so that
    torchrun's root-cause summary shows it. Never raises."""


def plain_init_restart_hint() -> str | None:
    """A warning for a job under torchrun with restarts whose default group was created by
    a plain ``torch.distributed.init_process_group`` (it fails to reconnect after a restart),
    or ``None``. Called only when the user, not resilient_ddp, created the default group."""
    return None
