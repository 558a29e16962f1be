"""The table of derived timings: every wait and bound computed from a config's durations.

A :class:`~resilient_ddp.config.ResilienceConfig` holds the durations a user sets
(``heartbeat_interval``, ``heartbeat_timeout``, ``op_timeout``, ``store_timeout``,
``diagnosis_timeout``...). Everything the library waits for that is *computed* from them
is defined here, once, named for what it bounds, so that a change to one is seen by every
caller. ``tests/test_timings.py`` fails when such a formula is written anywhere else in the
package. Two config properties stay beside the fields they read, in :mod:`.config`:
``effective_op_budget`` and ``base_stuck_window``.

Every function is pure and cheap, returns seconds (a float), and never blocks. Most build
on a few heartbeat intervals: the watchdog publishes and reads every ``heartbeat_interval``
(default 0.5 s), so something another rank's watchdog posts is seen here within about two
intervals, and the added fraction of a second is for slow store round trips.

This module imports only :mod:`.config` (the ground layer).
"""

from __future__ import annotations

from resilient_ddp.config import ResilienceConfig

#: The longest a collective waits on the backend between two looks at the recorded
#: failures (seconds): a failure is noticed at most this late.
MAX_BACKEND_SLICE_S = 0.25

#: How many heartbeats a rank may publish ahead of schedule at step boundaries per
#: ``heartbeat_interval`` at most: each is a watchdog tick (store round trips), so fast
#: steps must not turn into a flood of them.
STEP_BEATS_PER_INTERVAL = 5


def _interval(cfg: ResilienceConfig) -> float:
    return cfg.heartbeat_interval.total_seconds()


def _two_ticks_and_a_second(cfg: ResilienceConfig) -> float:
    """``2 * heartbeat_interval + 1`` s: the longest a healthy watchdog takes to see, act
    on and post something (two ticks), with a second for slow store round trips."""
    return 2 * _interval(cfg) + 1.0


# -- the control-plane store ------------------------------------------------------------------
def store_stall_limit(cfg: ResilienceConfig) -> float:
    """How long the watchdog may go without completing a tick before the store is taken to
    have stopped answering (seconds): ``heartbeat_timeout + 2 * heartbeat_interval``, the
    longest a peer may stay silent plus the two ticks it takes to notice.

    The ``Runtime.stall_s`` of every runtime.
    """
    return cfg.heartbeat_timeout.total_seconds() + 2 * _interval(cfg)


def store_lost_limit(cfg: ResilienceConfig) -> float:
    """How long a store that stalls, but whose host accepts connections (it fell behind),
    is given before the control plane is declared lost (seconds):
    ``max(store_timeout, store_stall_limit)``. A store that is gone is declared lost after
    :func:`store_stall_limit` instead, so this is never shorter.

    The ``Runtime.store_timeout_s`` of every runtime.
    """
    return max(cfg.store_timeout.total_seconds(), store_stall_limit(cfg))


def store_answering_window(cfg: ResilienceConfig) -> float:
    """How recent the watchdog's last completed tick must be for the store to count as
    answering (seconds): ``2 * heartbeat_interval + 1``. Past it, a store call from the main
    thread (a diagnosis) could block on a store that stopped answering, which torch's
    TCPStore client does not bound."""
    return _two_ticks_and_a_second(cfg)


# -- the watchdog ------------------------------------------------------------------------------
def watchdog_stop_wait(cfg: ResilienceConfig) -> float:
    """How long stopping a watchdog waits for its thread to end (seconds):
    ``2 * heartbeat_interval + 1``, a tick in progress (its store calls) and the next one's
    wake-up, with a second for slow store round trips. Used when a generation is rebuilt,
    a process group is destroyed and a joiner's admission failed."""
    return _two_ticks_and_a_second(cfg)


def watchdog_verdict_wait(cfg: ResilienceConfig) -> float:
    """How long a rank that saw a backend error or a signal waits for its watchdog to name
    the dead peer before blaming anything else (seconds): ``2 * heartbeat_interval + 0.5``.
    The watchdog learns of a death within a tick; it is poked to tick at once, and two
    ticks and half a second cover a peer's report still on its way.

    Used by a raw ``torch.distributed`` error in user code (the uncaught-exception report),
    a collective's backend error (connection reset by a dying peer) and SIGTERM from the
    launcher (a peer's death made it stop the job).
    """
    return 2 * _interval(cfg) + 0.5


def host_mates_wait(cfg: ResilienceConfig) -> float:
    """How long a rank waits for the reports on the other ranks of a host that went silent,
    so that one error names the whole host (seconds): ``2 * heartbeat_interval``, the time
    another rank's watchdog takes to post them and this one's to read them."""
    return 2 * _interval(cfg)


def blind_spell_limit(cfg: ResilienceConfig) -> float:
    """How late a watchdog tick may come (the store kept the watchdog from looking) before
    the peers' silence during the gap stops being counted (seconds):
    ``heartbeat_timeout / 2``. Past it, every peer would otherwise be declared dead once the
    store answers again, since they could not publish either."""
    return cfg.heartbeat_timeout.total_seconds() / 2


def host_mate_silence(cfg: ResilienceConfig) -> float:
    """How long a rank on the host of a rank found dead must have been silent to be
    declared dead with it, in the same report (seconds):
    ``heartbeat_timeout - 2 * heartbeat_interval``. The ranks of a host that went away
    went silent together, give or take the two ticks between their last beats."""
    return cfg.heartbeat_timeout.total_seconds() - 2 * _interval(cfg)


def step_beat_gap(cfg: ResilienceConfig) -> float:
    """The shortest gap between two step heartbeats (a new training step published ahead
    of the regular beat, so that a rank dying early in a step is named in that step)
    (seconds): ``heartbeat_interval / STEP_BEATS_PER_INTERVAL``, which keeps a fast training
    loop from flooding the store."""
    return _interval(cfg) / STEP_BEATS_PER_INTERVAL


def tell_grace(cfg: ResilienceConfig) -> float:
    """How long the main thread, told of a verdict by a signal, has to raise it before the
    watchdog ends the process (seconds): ``2 + 2 * heartbeat_interval``. A main thread
    stuck in C code never sees the exception; two seconds and two ticks tell the two
    apart."""
    return 2.0 + 2 * _interval(cfg)


# -- the diagnosis of a timed-out collective --------------------------------------------------
def op_stuck_window(cfg: ResilienceConfig, learned_s: float) -> float:
    """How long a rank late to an op may make no progress before it is named stuck
    (seconds): ``min(learned_s, busy_timeout)``, the window learned for this kind of op
    (``base_stuck_window`` at first, longer where its waits were usually longer), and never
    longer than a busy rank is waited for.

    Args:
        cfg: The runtime's config.
        learned_s: The window learned for the op's name, seconds.
    """
    return min(learned_s, cfg.busy_timeout.total_seconds())


def diagnosis_window(cfg: ResilienceConfig) -> float:
    """How long a rank that diagnoses a timed-out collective waits for the late ranks to
    answer where they are (seconds): ``max(diagnosis_timeout, 2 * heartbeat_interval +
    0.25)``. Peers answer at their next heartbeat: never less than two of them."""
    return max(cfg.diagnosis_timeout.total_seconds(), 2 * _interval(cfg) + 0.25)


def shared_verdict_wait(cfg: ResilienceConfig) -> float:
    """How long a rank that did not get to diagnose waits for the diagnosing rank's shared
    verdict (seconds): :func:`diagnosis_window` plus ``2 * heartbeat_interval + 1``, the
    time that rank's diagnosis may take and its publishing after it."""
    return diagnosis_window(cfg) + _two_ticks_and_a_second(cfg)


def failure_check_slice(cfg: ResilienceConfig) -> float:
    """The longest one backend wait of a collective between two looks at the recorded
    failures (seconds): ``min(heartbeat_interval, MAX_BACKEND_SLICE_S)``. A failure is
    noticed at the end of the current slice: slices are kept short."""
    return min(_interval(cfg), MAX_BACKEND_SLICE_S)


def stuck_recheck_delay(cfg: ResilienceConfig, window_s: float, idle_s: float) -> float:
    """How long after a diagnosis that found a late rank alive, but idle for ``idle_s``
    seconds, it is diagnosed again (seconds): ``max(heartbeat_interval, window_s - idle_s +
    heartbeat_interval)``, when its idleness could first reach the stuck window
    ``window_s``, a heartbeat later (its next answer), and never sooner than a heartbeat.

    Args:
        cfg: The collective's config.
        window_s: The op's stuck window, seconds.
        idle_s: How long the late rank had made no progress when diagnosed, seconds.
    """
    interval = _interval(cfg)
    return max(interval, window_s - idle_s + interval)


def data_plane_recheck(cfg: ResilienceConfig) -> float:
    """How often a collective that every rank has arrived at, but that has not completed,
    looks again at whether its data plane moves (seconds): ``heartbeat_interval``. A data
    plane that moved nothing for the op's stuck window is stalled."""
    return _interval(cfg)


# -- distributed inference -------------------------------------------------------------------
def inference_thread_join_wait(cfg: ResilienceConfig) -> float:
    """How long the end of a ``distributed_inference`` call waits for each of its helper
    threads (the progress beat, the result collector) to end (seconds):
    :func:`store_lost_limit` plus one: a thread in a store call when told to stop returns
    within the store's own bound."""
    return store_lost_limit(cfg) + 1.0


def inference_finish_poll(cfg: ResilienceConfig) -> float:
    """How often a rank that finished its share of a ``distributed_inference`` call looks
    whether the others have (seconds): ``min(0.1, heartbeat_interval)``; a peer's count
    comes with its heartbeat, and a finish is seen within a tenth of a second."""
    return min(0.1, _interval(cfg))


# -- elastic recovery (on_failure="shrink") ---------------------------------------------------
def shrink_recovery_budget(cfg: ResilienceConfig) -> float:
    """How long one recovery (a shrink) may take before the survivors give up (seconds):
    ``3 * op_timeout + heartbeat_timeout``: the proposals, the state transfer and the new
    group's first op each within an ``op_timeout``, after a silent rank is declared dead
    (``heartbeat_timeout``)."""
    return 3 * cfg.op_timeout.total_seconds() + cfg.heartbeat_timeout.total_seconds()


def late_proposer_grace(cfg: ResilienceConfig) -> float:
    """How long the shrink decider waits for a rank that a timeout named, but that is not
    known dead, to propose (seconds): ``min(op_timeout, 2 * heartbeat_interval + 0.5)``.
    It may only have been slower to give up (it timed out too, and is on its way)."""
    return min(cfg.op_timeout.total_seconds(), 2 * _interval(cfg) + 0.5)


def shrink_decider_wait(cfg: ResilienceConfig) -> float:
    """How long a non-deciding survivor waits for the decider's shrink decision before it
    decides itself (seconds): :func:`late_proposer_grace` plus ``2 * heartbeat_interval +
    1``, the longest a healthy decider may take (as a diagnosis is waited for)."""
    return late_proposer_grace(cfg) + _two_ticks_and_a_second(cfg)


def rendezvous_form_timeout(cfg: ResilienceConfig) -> float:
    """How long a member waits for the others at a step of forming a new generation
    (seconds): their arrival at its rendezvous, their confirmation that they hold an
    admission's state, the acknowledgement of join requests.
    ``max(2, min(heartbeat_timeout, op_timeout))``: a rank that is not there by then is
    dead or stuck (its watchdog would have named it within ``heartbeat_timeout``), and
    never less than two seconds."""
    return max(2.0, min(cfg.heartbeat_timeout.total_seconds(), cfg.op_timeout.total_seconds()))


# -- tools -------------------------------------------------------------------------------------
def doctor_run_limit(init_timeout_s: float, op_timeout_s: float) -> float:
    """How long ``resilient-ddp doctor --nproc`` lets its ranks run before killing them
    (seconds): ``init_timeout + 4 * op_timeout + 120``: the rendezvous, four ``op_timeout``
    for its collectives, and two minutes for the measurements and the processes' start and
    exit.

    Args:
        init_timeout_s: The doctor's ``--init-timeout``, seconds.
        op_timeout_s: The doctor's ``--op-timeout``, seconds.
    """
    return init_timeout_s + 4 * op_timeout_s + 120
