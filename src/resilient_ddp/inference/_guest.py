"""A replacement that helps with a running ``distributed_inference`` call (a guest).

A process started in the place of a failed rank (``rd.spawn(restarts=N)``, an elastic
launcher) asks to join the job (``elastic.join``). When the job is running an inference
call rather than training elastically, no member will ever admit it: the members pull their
work from the store and form no new group. It then becomes a *guest* of that call: its
``init_process_group()`` returns without a process group, and its ``distributed_inference``
or ``iter_inference`` pulls and delivers chunks as a rank does, under a worker number of its
own (``world_size + k``), so the work left by the failed rank is shared by one more process.
Nothing else needs a group on a guest: every other call of the library raises
:class:`~resilient_ddp.errors.ConfigError` saying so, and ``destroy_process_group()`` ends
the guest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from resilient_ddp.config import ResilienceConfig


@dataclass
class Guest:
    """What a guest knows of the call it helps with (from the job's ``inf/open`` record)."""

    root: dist.Store  # the job's store, sealed with the operator's secret
    uid: int  # this process's member id (its join request)
    generation: int  # the members' generation, whose keys the call uses
    call: int  # the inference call's number (its keys: inf/<call>/...)
    world_size: int  # the members' group size
    config: ResilienceConfig
    backend: str
    served: bool = False  # it has helped with its call (a later call runs without it)


_current: Guest | None = None

#: What a guest may call, in the error raised by the others.
ONLY = (
    "this process replaced a failed rank while the job ran distributed_inference, and "
    "helps with that call without joining the process group: on it, only "
    "distributed_inference / iter_inference (with the members' arguments) and "
    "destroy_process_group() are available"
)


def current() -> Guest | None:
    """This process's guest record, or None (it is not a guest)."""
    return _current


def set_current(guest: Guest | None) -> None:
    global _current
    _current = guest
