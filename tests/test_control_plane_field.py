"""The control plane in the field: a hostile client on the job's store, a long-lived store
shared by jobs one after another, stores bound to loopback, containers' PID namespaces."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.control import _control as ctl
from resilient_ddp.testing import format_outcomes, run_ranks
from resilient_ddp.tools.launch import launch

from . import _elastic_workers as w
from . import _hostile_workers as h
from .test_elastic_mp import _check_job


def test_a_hostile_client_without_the_secret_changes_nothing(tmp_path: Path) -> None:
    """A process that reaches the job's store but lacks its secret forges failure events,
    writes garbage over heartbeats and logs, plants garbage in decision slots, asks to join
    and forges its admission and the job's end, for 4 s while 4 ranks train, then a rank is
    killed and its replacement joins (the recovery reads the attacker's inflated proposals
    and garbage decisions): no rank raises, nothing is admitted but the replacement, every
    process holds the same state at every step and the data is exactly-once."""
    faults = [{"uid": 2, "kind": "kill", "step": 60, "full": 4}]
    outcomes = run_ranks(
        h.train_beside_attacker,
        4,
        (str(tmp_path), faults, 30, 4.0),
        timeout=timedelta(seconds=100),
        # Rank 0 waits for the attacker after training (up to 4 + 30 s): a cold interpreter
        # that imports torch, so under load it may end well after the job. The default 5 s
        # given to what still runs after the job's end killed rank 0 while it waited.
        grace=timedelta(seconds=35),
        restarts=1,
    )
    report = format_outcomes(outcomes)
    attacker = json.loads((tmp_path / "attacker.json").read_text())
    assert attacker["writes"] > 20, attacker  # it was busy all along
    survivor = _check_job(outcomes, tmp_path, faults)
    assert survivor["attacker_exit"] == 0, report
    kinds = [e["kind"] for e in survivor["events"]]
    assert kinds.count("shrink") == 1, survivor["events"]
    joins = [e for e in survivor["events"] if e["kind"] == "join"]
    assert [e["joiners"] for e in joins] == [[4]], survivor["events"]  # never uid 4242
    shrink = next(e for e in survivor["events"] if e["kind"] == "shrink")
    assert [c["rank"] for c in shrink["culprits"]] == [2], shrink


def test_an_admission_whose_state_transfer_outlasts_the_form_timeout_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state source takes 3 s to send the state to a joiner (as a large state or a slow
    link would), longer than the 2 s form timeout: the members that take no part in the
    transfer wait while the source's heartbeat says it is sending, the joiner is admitted
    at the first try and no member is removed."""
    monkeypatch.setenv("RD_TEST_SLOW_SEND", "3")
    faults = [{"uid": 2, "kind": "kill", "step": 20, "full": 4}]
    outcomes = run_ranks(
        w.train,
        4,
        (str(tmp_path), faults, 30, {}, 0.01),
        timeout=timedelta(seconds=100),
        restarts=1,
    )
    survivor = _check_job(outcomes, tmp_path, faults)
    joins = [e for e in survivor["events"] if e["kind"] == "join"]
    assert len(joins) == 1, survivor["events"]  # the first try
    assert joins[0]["admission_s"] >= 3.0, joins  # longer than the 2 s form timeout
    assert [h[1] for h in survivor["world_size_history"]] == [4, 3, 4], survivor


def _failing_then_healthy(tmp_path: Path, store_addr: str, start: str) -> tuple[Any, Any]:
    # Both jobs use the long-lived store for their control plane and get no job id from the
    # launcher, as under the torchrun recipe: rank 0 draws it. Their ranks start as the
    # session's do (``start``: the fork server unless --rank-start spawn), as run_ranks
    # would start them: nine cold interpreters made most of this test's time.
    env = {"RESILIENT_DDP_STORE": store_addr, "RESILIENT_DDP_JOB_ID": ""}
    first = tmp_path / "first"
    first.mkdir()
    # min_world_size=4 of 4: a lost rank fails the job for good (its end is recorded).
    failing = launch(
        w.train,
        4,
        (str(first), [{"uid": 2, "kind": "kill", "step": 5}], 3, {"min_world_size": 4}, 0.01),
        timeout=timedelta(seconds=60),
        start_method=start,
        env=env,
    )
    second = tmp_path / "second"
    second.mkdir()
    faults = [{"uid": 1, "kind": "kill", "step": 20, "full": 4}]
    healthy = launch(
        w.train,
        4,
        (str(second), faults, 30, {}, 0.01),
        timeout=timedelta(seconds=100),
        start_method=start,
        env=env,
        restarts=1,
    )
    return failing, (healthy, second, faults)


@pytest.mark.slow
def test_a_second_job_on_a_long_lived_store_trains_normally(
    tmp_path: Path, rank_start: str
) -> None:
    """A job fails for good on a long-lived store (its failure events, its recovery
    decisions and its end stay there); a second job on the same store, with a rank killed
    and a replacement that finds the job through the store, trains as if the store were
    new: the first job's keys are never read."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    failing, (healthy, out_dir, faults) = _failing_then_healthy(
        tmp_path, f"127.0.0.1:{store.port}", rank_start
    )
    report = format_outcomes(failing)
    raised = {o.rank: o.exc_type for o in failing if o.exc_type}
    assert raised == dict.fromkeys((0, 1, 3), "resilient_ddp.RankFailureError"), report
    survivor = _check_job(healthy, out_dir, faults)
    assert [h[1] for h in survivor["world_size_history"]] == [4, 3, 4], survivor


def test_stores_the_library_hosts_listen_on_their_address_only() -> None:
    """torch's TCPStore listens on every interface even when given 127.0.0.1; the stores
    of rd.spawn and of rank 0 under env:// listen on the address they were given."""
    store = ctl.serve_store("127.0.0.1")
    port = store.port
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    listening = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    local = [f for f in listening if f.endswith(f":{port}")]
    assert local == [f"127.0.0.1:{port}"], listening
    del client, store


def test_records_are_authenticated_bound_to_their_key_and_size_capped() -> None:
    """Sealed records open only with the job's key and under the key name they were
    written to; garbage and forged lines are skipped; an oversized report is cut below
    the store's limit instead of being refused."""
    key = ctl.root_prefix(dist.HashStore(), "job1", "s3cret").mac_key
    other = ctl.root_prefix(dist.HashStore(), "job2", "s3cret").mac_key
    assert key is not None
    assert other is not None
    assert key != other
    rec = {"kind": "crash", "rank": 1}
    sealed = ctl.seal(key, "g0/ev/log", rec)
    assert "s3cret" not in sealed
    assert ctl.unseal(key, "g0/ev/log", sealed) == rec
    assert ctl.unseal(key, "g1/ev/log", sealed) is None  # replayed under another key
    assert ctl.unseal(other, "g0/ev/log", sealed) is None  # another job's key
    assert ctl.unseal(key, "g0/ev/log", json.dumps(rec)) is None  # no MAC
    assert ctl.unseal(None, "g0/ev/log", json.dumps(rec)) == rec  # a job without a secret
    log = (sealed + "\n" + json.dumps(rec) + "\n\x00junk\n" + sealed + "\n").encode()
    assert ctl.read_log(key, "g0/ev/log", log) == [rec, rec]
    assert ctl.read_log(None, "g0/ev/log", b'{"a": 1}\nnot json\n[1]\n') == [{"a": 1}]
    big = {"kind": "exception", "rank": 0, "traceback": "x" * (10 << 20)}
    cut = ctl.unseal(key, "g0/ev/log", ctl.seal(key, "g0/ev/log", big))
    assert cut["kind"] == "exception"
    assert cut["rank"] == 0
    assert len(json.dumps(cut)) <= ctl.MAX_RECORD_BYTES
    assert cut["traceback"].endswith("bytes cut]")


def test_a_peer_in_another_pid_namespace_is_never_judged_by_its_pid() -> None:
    """Containers with host networking share the hostname and the boot id but not the
    PID namespace: a peer's pid means nothing here, so it is not local."""
    rt = _runtime_with_peer(pidns="pid:[4026531836]")
    me = ctl.pid_namespace()
    assert me, "this test needs /proc/self/ns/pid"
    assert rt.is_local(1) is (me == "pid:[4026531836]")
    rt.infos[1]["pidns"] = me
    assert rt.is_local(1)
    rt.infos[1]["pid"] = 2**22 + 7  # no such process here: gone, since it is local
    assert rt.is_gone(1)
    rt.infos[1]["pidns"] = "pid:[1]"
    assert not rt.is_gone(1)  # another namespace: its pid is not ours to look up


def _runtime_with_peer(*, pidns: str) -> Any:
    from resilient_ddp.config import ResilienceConfig
    from resilient_ddp.runtime._runtime import Runtime

    rt = Runtime(
        rank=0,
        world_size=2,
        backend="gloo",
        control_root=ctl.root_prefix(dist.HashStore(), "unit"),
        config=ResilienceConfig(),
    )
    peer = dict(rt.identity, rank=1, pid=1, pidns=pidns)
    rt.infos = {0: dict(rt.identity), 1: peer}
    return rt


class _Evil:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (print, ("this ran on unpickling",))


def test_a_state_from_a_peer_is_unpickled_weights_only() -> None:
    """Elastic training loads a peer's state as torch.load(weights_only=True) would: a
    model's and an optimizer's state dicts (tensors, containers, numbers, dtypes, devices)
    come through; an object whose unpickling would call a function is refused."""
    import io
    import pickle

    import torch

    from resilient_ddp.ops._wire import dumps, loads
    from resilient_ddp.ops.checkpoint import _SkeletonPickler, _SkeletonUnpickler

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "meta": {"dtype": torch.float16, "device": torch.device("cpu"), "size": torch.Size([2])},
    }
    tensors: list[torch.Tensor] = []
    buf = io.BytesIO()
    _SkeletonPickler(buf, tensors).dump(state)
    back = _SkeletonUnpickler(io.BytesIO(buf.getvalue()), tensors, True).load()
    assert torch.equal(back["model"]["weight"], model.weight)
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert back["meta"] == state["meta"]
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print is not allowed"):
        _SkeletonUnpickler(io.BytesIO(pickle.dumps({"x": _Evil()})), [], True).load()
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        loads(dumps([_Evil()]), weights_only=True)
    assert loads(dumps([1, "a", (2.0,)]), weights_only=True) == [1, "a", (2.0,)]


def test_forgetting_a_generation_deletes_every_key_it_wrote() -> None:
    """The keys one generation writes (heartbeats, identities, events, claims, a mismatch
    table, a shrink round's proposals and decision, formation, an admission and its
    acknowledgements) are all deleted by forget_generation: a long job's store does not
    grow with every generation."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "secret")
    base.set("unrelated", "1")
    before = base.num_keys()
    cp = ctl.ControlPlane(root, 3)
    jobs = ctl.JobStore(root)
    cp.init_counters()
    for r in range(4):
        cp.publish_info(r, {"rank": r})
        cp.publish_state(r, ctl.HeartbeatState(beat=1))
        cp.publish_signature(1, r, {"op": "x"})
        jobs.post_ready(3, r)
        jobs.post_has_state(3, r)
        jobs.ack(3, 2, r, 7)
    cp.claim(1)
    cp.post_event({"kind": "crash", "rank": 1})
    cp.request_diagnosis()
    jobs.post_proposal("rec/g3/r0", {"rank": 0})
    jobs.decide("rec/g3/r0/d", {"gen": 4})
    jobs.decide("grow/g3", {"gen": 5})
    jobs.decide("adm/g3/result", {"ok": True})
    jobs.leave(3)
    assert base.num_keys() > before + 30
    deleted = jobs.forget_generation(3, 4, mismatches=1, acked=[2])
    assert base.num_keys() == before, base.num_keys()
    assert deleted > 30


def test_a_dead_store_during_elastic_work_is_a_typed_error_naming_the_work() -> None:
    """The elastic protocol's store calls go through _control, whose error says only that
    the store is unreachable; elastic work turns it into a ControlPlaneError that says what
    it was doing (never a bare DistNetworkError from forward())."""
    from resilient_ddp.errors import ControlPlaneError
    from resilient_ddp.training import elastic

    server = ctl.serve_store("127.0.0.1")
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    rt = _runtime_with_peer(pidns="")
    rt.control_root = ctl.root_prefix(client, "job")

    @elastic._typed_store_errors("testing")
    def work(rt: Any) -> int:
        return ctl.JobStore(rt.control_root).join_count()

    assert work(rt) == 0
    del server  # the store's host is gone
    with pytest.raises(ControlPlaneError, match="stopped answering during elastic testing"):
        work(rt)


_CONTAINER_RANK = """
import sys, torch, resilient_ddp as rd
rd.init_process_group("gloo")
model = rd.ResilientDDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(30):
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("done", rd.all_reduce(torch.ones(1)).item(), flush=True)
rd.destroy_process_group()
"""


# A PID namespace of its own, with its own /proc, as a container has.
_UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork"]


@pytest.mark.skipif(
    subprocess.run([*_UNSHARE, "--mount-proc", "true"], capture_output=True, check=False).returncode
    != 0,
    reason="needs unprivileged user and PID namespaces (unshare)",
)
def test_a_rank_in_another_pid_namespace_is_not_reported_dead(tmp_path: Path) -> None:
    """Three ranks on one host with one network, started as srun would (env://, rank 0
    hosts the store); rank 2 runs in a PID namespace of its own, as in a container with
    host networking. Its pid means nothing to the others: they must judge it by its
    heartbeats, and the job trains to the end (it used to be reported dead at the first
    heartbeat tick)."""
    import os
    import sys

    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "3",
        "RESILIENT_DDP_HEARTBEAT_INTERVAL": "0.1",
        "RESILIENT_DDP_HEARTBEAT_TIMEOUT": "3",
    }
    for key in ("RESILIENT_DDP_STORE", "RESILIENT_DDP_JOB_ID", "RESILIENT_DDP_SECRET"):
        env.pop(key, None)
    procs = []
    logs = []
    for rank in range(3):
        prefix = [*_UNSHARE, "--mount-proc"] if rank == 2 else []
        log = (tmp_path / f"rank{rank}.log").open("w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [*prefix, sys.executable, "-c", _CONTAINER_RANK],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    report = "\n".join(
        f"--- rank {r} (exit {p.returncode})\n" + (tmp_path / f"rank{r}.log").read_text()
        for r, p in enumerate(procs)
    )
    assert codes == [0, 0, 0], report
    for r in range(3):
        assert "done 3.0" in (tmp_path / f"rank{r}.log").read_text(), report


def test_the_admission_bound_is_the_largest_acknowledged_step_once_all_acknowledged() -> None:
    """The acknowledgements of a round of join requests carry each member's committed
    step count; the bound exists only once every member acknowledged, and is their max."""
    jobs = ctl.JobStore(ctl.root_prefix(dist.HashStore(), "job", "secret"))
    jobs.ack(2, 1, 0, 11)
    jobs.ack(2, 1, 2, 12)
    assert jobs.ack_bound(2, 1, 3) is None
    assert jobs.missing_acks(2, 1, 3) == [1]
    jobs.ack(2, 1, 1, 10)
    assert jobs.ack_bound(2, 1, 3) == 12
    assert jobs.missing_acks(2, 1, 3) == []
    assert jobs.ack_bound(2, 2, 3) is None  # another round: its own acknowledgements
    assert jobs.ack_bound(3, 1, 3) is None  # another generation
    jobs.root.set(ctl.JobKeys.ack(2, 1, 1), "garbage")  # not a sealed record: never believed
    assert jobs.ack_bound(2, 1, 3) is None


# Acknowledgements (generation, requests, rank) -> whether every rank of generation 3 (3
# ranks) acknowledged 2 requests: only acknowledgements of that generation and count count.
ACKS = [
    pytest.param([(3, 2, 0), (3, 2, 1), (3, 2, 2)], True, id="all-acked"),
    pytest.param([(3, 2, 0), (3, 2, 1)], False, id="one-missing"),
    pytest.param([(3, 2, 0), (3, 2, 1), (3, 1, 2)], False, id="stale-count-request-since"),
    pytest.param([(3, 2, 0), (3, 2, 1), (2, 2, 2)], False, id="stale-generation"),
    pytest.param([(3, 2, 0), (3, 2, 1), (3, 2, 3)], False, id="rank-outside-world"),
    pytest.param(
        [(3, 1, 0), (3, 1, 1), (3, 1, 2), (3, 2, 0), (3, 2, 1), (3, 2, 2)],
        True,
        id="older-round-left-behind",
    ),
]


@pytest.mark.parametrize(("acks", "complete"), ACKS)
def test_acks_complete_only_with_every_rank_of_the_generation_and_count(
    acks: list[tuple[int, int, int]], complete: bool
) -> None:
    jobs = ctl.JobStore(ctl.root_prefix(dist.HashStore(), "job", "secret"))
    for gen, requests, rank in acks:
        jobs.ack(gen, requests, rank, committed=10 + rank)
    assert (jobs.ack_bound(3, 2, 3) is not None) is complete
    assert (jobs.missing_acks(3, 2, 3) == []) is complete
    assert ctl.JobKeys.ack(3, 2, 1) == "grow/g3/n2/ack/1"


def test_a_member_that_acknowledged_keeps_looking_until_its_generation_ends() -> None:
    """An acknowledgement promises to look for the admission at every step boundary after
    it: nothing may switch that off within the generation. Rounds never go back, and a
    watchdog of a generation that ended posts nothing."""
    from types import SimpleNamespace

    from resilient_ddp.training import elastic

    jobs = ctl.JobStore(ctl.root_prefix(dist.HashStore(), "job", "secret"))
    rt: Any = SimpleNamespace(generation=3, rank=1)
    el = elastic.Elastic(uid=1, members=[0, 1], committed=9)
    el.join_seen = True
    elastic._stop_looking(rt, el)  # nothing acknowledged here: it may stop
    assert not el.join_seen
    elastic.acknowledge(rt, el, jobs, 3, 1, 2)
    assert el.join_seen
    assert el.acked == (3, 2)
    assert el.first_ack == (3, 9)
    jobs.ack(3, 2, 0, 8)
    assert jobs.ack_bound(3, 2, 2) == 9
    elastic._stop_looking(rt, el)
    assert el.join_seen  # acknowledged in this generation: keeps looking
    el.committed = 10
    elastic.acknowledge(rt, el, jobs, 3, 1, 1)  # an older round: nothing goes back
    assert el.acked == (3, 2)
    assert jobs.ack_bound(3, 2, 2) == 9
    elastic.acknowledge(rt, el, jobs, 2, 1, 5)  # the watchdog of an ended generation
    assert el.acked == (3, 2)
    assert jobs.missing_acks(2, 5, 2) == [0, 1]
    rt.generation = 4
    elastic._stop_looking(rt, el)
    assert not el.join_seen


def test_the_watchdog_acknowledges_only_while_a_request_is_pending() -> None:
    """``Elastic.acknowledge_pending`` is the watchdog's way into the elastic layer (it
    does not import it): a round is acknowledged only if a request in it is still to be
    admitted, and never changes ``joins_seen`` (the training thread's count)."""
    from types import SimpleNamespace

    from resilient_ddp.training import elastic

    jobs = ctl.JobStore(ctl.root_prefix(dist.HashStore(), "job", "secret"))
    jobs.init_joins()
    rt: Any = SimpleNamespace(generation=3, rank=1)
    el = elastic.Elastic(uid=1, members=[0, 1], committed=9)
    jobs.request_join({"uid": 1000001, "host": "h", "pid": 1})
    jobs.mark_admitted(1000001)  # admitted already: nothing is pending
    el.acknowledge_pending(rt, jobs, 3, 1, 1)
    assert (el.acked, el.join_seen) == ((-1, -1), False)
    assert jobs.missing_acks(3, 1, 2) == [0, 1]
    jobs.request_join({"uid": 1000002, "host": "h", "pid": 2})
    el.acknowledge_pending(rt, jobs, 3, 1, 2)
    assert (el.acked, el.join_seen, el.joins_seen) == ((3, 2), True, 0)
    assert jobs.missing_acks(3, 2, 2) == [0]


_FILE_STORE_RANK = """
import json, os, sys, time, torch, resilient_ddp as rd
from datetime import timedelta
rank, world, path, fault = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = rd.ResilienceConfig(
    heartbeat_interval=timedelta(seconds=0.2),
    heartbeat_timeout=timedelta(seconds=3),
    op_timeout=timedelta(seconds=2),
)
rd.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                      config=cfg)
model = rd.ResilientDDP(torch.nn.Linear(4, 1))
for _ in range(3):
    model(torch.ones(8, 4)).sum().backward()
if rank == world - 1 and fault == "kill":
    os.kill(os.getpid(), 9)
if rank == world - 1 and fault == "hang":
    time.sleep(30)
t0 = time.monotonic()
try:
    for _ in range(3):
        model(torch.ones(8, 4)).sum().backward()
    out = {"done": rd.all_reduce(torch.ones(1)).item()}
except rd.ResilientDDPError as e:
    out = {"type": type(e).__name__, "ranks": list(e.ranks), "s": time.monotonic() - t0,
           "stack": [c.stack for c in e.culprits]}
finally:
    rd.destroy_process_group()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("fault", ["none", "kill", "hang"])
def test_a_file_store_carries_the_control_plane(fault: str, tmp_path: Path) -> None:
    """``init_method="file://..."`` (a FileStore on a shared file system, as on SLURM sites
    without a TCP rendezvous): the control plane runs on that store. A killed rank is named
    within a second, a hung one with its stack within op_timeout + 2 s."""
    import json
    import sys

    world, path = 3, tmp_path / "store"
    script = tmp_path / "rank.py"  # a file: frames of "-c" code are left out of stacks
    script.write_text(_FILE_STORE_RANK)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(path), fault],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(
        f"--- rank {r} (exit {p.returncode})\n{o}"
        for r, (p, o) in enumerate(zip(procs, outs, strict=True))
    )
    results = {}
    for r, o in enumerate(outs):
        lines = [x for x in o.splitlines() if x.startswith("RESULT ")]
        if lines:
            results[r] = json.loads(lines[-1][len("RESULT ") :])
    survivors = range(world) if fault == "none" else range(world - 1)
    for r in survivors:
        assert procs[r].returncode == 0, report
        v = results[r]
        if fault == "none":
            assert v == {"done": float(world)}, report
        elif fault == "kill":
            assert (v["type"], v["ranks"]) == ("RankFailureError", [world - 1]), report
            assert v["s"] < 1.0, report
        else:
            assert (v["type"], v["ranks"]) == ("CollectiveTimeoutError", [world - 1]), report
            assert v["s"] < 2.0 + 2.0, report
            assert "time.sleep(30)" in v["stack"][0], report
    if fault == "kill":
        assert procs[world - 1].returncode == -9, report
