"""Long elastic jobs do not grow: every rebuild of the process group (a shrink after a
failure, an admission of a joiner) releases the previous generation's group, its sockets,
threads and failed works (issue 15, defect 3).

Before the fix, each kill-and-rejoin cycle at 4 ranks cost every surviving rank 12 file
descriptors, 6 threads and 1.6-3.1 MiB of live memory (two generations per cycle), for
good: at 64 ranks the default limit of 1024 descriptors was reached after about 8 cycles.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from resilient_ddp.testing import format_outcomes, run_ranks

from . import _leak_workers as w

CYCLES = 20
# The launcher's hard deadline (then it dumps the stacks of what still runs and kills it),
# below pytest-timeout's 120 s; each rank dumps its own stacks and exits a little earlier.
# Measured: 18-21 s alone on 2 cores, 24-37 s beside another multi-process test run.
DEADLINE_S = 100
# Live memory (RSS after gc.collect() and malloc_trim(0)) may grow this much from the
# first cycle to the last: the job's history (a few KiB per cycle, kept on purpose and
# sent to joiners) and torch's own (about 4 KiB per DDP reducer built, measured with
# plain torch), with the allocator's fragmentation. Measured: 1-4.5 MiB over 20 cycles
# (60 cycles: 4-6 MiB); before the fix, 31-58 MiB.
LIVE_RSS_TOLERANCE_KIB = 8 * 1024


def _table(finals: list[dict[str, Any]]) -> str:
    lines = ["pid     uid  cycle  fds  threads  rss_MiB  live_MiB  store_keys"]
    for v in finals:
        for s in v["samples"]:
            lines.append(
                f"{v['pid']:<7} {v['uid']:<4} {s['cycle']:>5}  {s['fds']:>3}  {s['threads']:>7}"
                f"  {s['rss_kib'] / 1024:7.1f}  {s['live_kib'] / 1024:8.1f}  {s['keys']:>10}"
            )
    return "\n".join(lines)


def _stale_keys(samples: list[dict[str, Any]]) -> dict[str, int] | None:
    """The keys that appeared after the first sample and are still there three cycles (six
    generations) later, with the cycle whose sample first had each: what a growing store
    kept. None where the store cannot list its keys."""
    names = [s["key_names"] for s in samples]
    if any(n is None for n in names) or len(names) < 4:
        return None
    first = {k: s["cycle"] for s in reversed(samples) for k in s["key_names"]}
    stale = set(names[-1]) & set(names[-4]) - set(names[0])
    return {k: first[k] for k in sorted(stale, key=lambda k: (first[k], k))}


def test_fds_threads_and_memory_stay_flat_over_twenty_kill_and_rejoin_cycles() -> None:
    """20 cycles at 4 ranks (gloo, CPU): the process of rank 3 dies by SIGKILL (before its
    forward, or 2 ms into the step, mostly inside the gradient all-reduce: failed works
    hold bucket tensors), the 3 others shrink, and the launcher's replacement joins. Every
    process samples its descriptors, threads and RSS once per cycle: for the 3 that live
    through all of it, descriptors and threads never change from the first cycle's, and
    live memory stays within LIVE_RSS_TOLERANCE_KIB of it. The job's store holds one more
    key per cycle at most, and where the store lists its keys, the only keys that stay are
    the admitted joiners' records."""
    outcomes = run_ranks(
        w.cycles,
        w.WORLD,
        (CYCLES, DEADLINE_S - 8),
        timeout=timedelta(seconds=DEADLINE_S),
        restarts=CYCLES,
    )
    report = format_outcomes(outcomes)
    assert all(o.ok for o in outcomes), report
    victims = outcomes[w.VICTIM_RANK].previous
    assert len(victims) == CYCLES, report
    assert all(p.exitcode == -9 for p in victims), report
    finals = [o.value for o in outcomes]
    table = _table(finals)
    stale = _stale_keys(finals[0]["samples"])
    if stale is not None:
        table += "\nkeys that stayed:" + "".join(f"\n  cycle {c:>2}: {k}" for k, c in stale.items())
    print(table)
    survivors = finals[: w.VICTIM_RANK]
    for v in survivors:
        samples = v["samples"]
        assert [s["cycle"] for s in samples] == list(range(1, CYCLES + 1)), table
        first = samples[0]
        assert {s["fds"] for s in samples} == {first["fds"]}, f"descriptors grew\n{table}"
        assert {s["threads"] for s in samples} == {first["threads"]}, f"threads grew\n{table}"
        growth = max(s["live_kib"] for s in samples) - first["live_kib"]
        assert growth <= LIVE_RSS_TOLERANCE_KIB, f"live memory grew {growth} KiB\n{table}"
    # The job's store: every generation's keys are deleted once two newer ones exist (also
    # those of generations that failed to form or admit, and every rank's acknowledgements);
    # one key per admitted joiner stays (join/done/<uid>: it is never pending again).
    keys = [s["keys"] for s in finals[0]["samples"]]
    assert keys[-1] - keys[0] <= CYCLES - 1, f"store keys grew\n{table}"
    if stale is not None:
        assert all("/join/done/" in k for k in stale), f"store keys stayed\n{table}"
    # The last joiner (a fresh process) sampled the cycle that admitted it.
    assert [s["cycle"] for s in finals[w.VICTIM_RANK]["samples"]] == [CYCLES], table


def test_every_ranks_acknowledgements_are_forgotten_with_their_generation() -> None:
    """The rank that deletes a generation's keys (its rank 0, later) need not have
    acknowledged every count of join requests the others did: a watchdog of the next
    generation can acknowledge before rank 0 notes the counts of this one, or a rank can
    acknowledge while rank 0 already left the generation (seen in the leak test under
    load: ``grow/g5/n2/ack/{0,1,2,n}`` stayed). The first acknowledger of each count notes
    it in the generation's ``extra``, and every one of them is deleted."""
    import torch.distributed as dist

    from resilient_ddp import _control as ctl

    base = dist.HashStore()
    jobs = ctl.JobStore(ctl.root_prefix(base, "job", "secret"))
    before = base.num_keys()
    for rank in (1, 2):
        jobs.ack(5, 2, rank, 7)
    jobs.ack(5, 3, 0, 8)
    jobs.ack(5, 3, 1, 8)
    assert jobs.ack_count(5, 2) == 2
    jobs.forget_generation(5, 3, acked={3})  # rank 0 acknowledged 3 requests only
    assert base.num_keys() == before
