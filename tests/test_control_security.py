"""The control plane is safe by default (issue 29, items 1-6), checked on in-process stores.

Every record of a job is sealed, with the operator's secret or with a key the ranks of the
formed group agreed on; the job's keys live under a name derived from that key; old sealed
records written back (replays) are ignored; data the job did not write in a counter or a
log is counted and ignored, never a lost store nor detection switched off; logs are parsed
in bounded pieces; preflight's records fail start-up with a typed message at most.
The multi-process proof with a hostile client is tests/test_hostile_default.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ddp.control import _control as ctl
from resilient_ddp.errors import ConfigError, PreflightError
from resilient_ddp.group import preflight

SECRET = "a-long-enough-operator-secret"


@pytest.fixture
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ctl.SECRET_ENV, ctl.SECRET_FILE_ENV, ctl.JOB_ENV, ctl.STORE_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def one_rank_group(no_secret: None) -> Iterator[dist.Store]:
    """A formed one-rank gloo group, as after ``init_process_group``; its store."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def _event(rank: int, t: float = 1.0) -> dict[str, object]:
    return {
        "kind": ctl.EV_CRASH,
        "rank": rank,
        "reporter": 0,
        "gen": 0,
        "t": t,
        "culprit": {"rank": rank},
    }


# -- 1. sealed by default --------------------------------------------------------------------
def test_without_a_secret_the_group_agrees_on_a_key_and_refuses_joins(
    one_rank_group: dist.Store,
) -> None:
    root = ctl.control_store(one_rank_group, timeout=timedelta(seconds=10))
    assert isinstance(root, ctl.JobRoot)
    assert root.mac_key is not None  # sealed although nobody gave a secret
    assert root.joinable is False
    # The job's keys live under a name derived from the key: not rd/<job>/g0/...
    assert root.prefix.startswith(f"{ctl.job_prefix(root.job_id)}/")
    assert len(root.prefix) > len(f"{ctl.job_prefix(root.job_id)}/") + 16
    cp = ctl.ControlPlane(root, 0)
    cp.init_counters()
    cp.publish_state(0, ctl.HeartbeatState(beat=1))
    base = one_rank_group
    assert not base.check([f"{ctl.job_prefix(root.job_id)}/g0/ev/n"])
    raw = base.get(f"{root.prefix}/g0/state/0").decode()
    assert ctl.unseal(None, "g0/state/0", raw) is None  # a MAC in front of the JSON
    # Another draw (another job) gets another key: the secret is never in the store.
    again = ctl.control_store(one_rank_group, timeout=timedelta(seconds=10))
    assert isinstance(again, ctl.JobRoot)
    assert again.mac_key != root.mac_key


def test_a_joiner_without_the_operators_secret_is_refused_at_once(no_secret: None) -> None:
    t0 = time.monotonic()
    with pytest.raises(PreflightError, match="joining needs the job's secret"):
        ctl.control_store(dist.HashStore(), joiner=True, timeout=timedelta(seconds=30))
    assert time.monotonic() - t0 < 1


def test_an_outsider_writing_under_the_visible_names_changes_nothing(no_secret: None) -> None:
    """Garbage in ``g0/ev/n``, forged events and a 64 MiB junk log under ``rd/<job>/``
    (what a process without the key can name): the job reads none of it."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", SECRET)
    cp = ctl.ControlPlane(root, 0)
    cp.init_counters()
    cp.publish_state(2, ctl.HeartbeatState(beat=1))
    keyless = ctl.job_prefix("job")  # the namespace without the key
    base.set(f"{keyless}/g0/ev/n", "garbage")
    base.set(f"{keyless}/g0/ev/log", json.dumps(_event(1)) + "\n")
    base.append(f"{keyless}/g0/ev/log", "x" * (64 << 20))
    cp.post_event(_event(2))  # the real report of rank 2's death
    n, diag, states, _ = cp.poll([2])
    assert (n, diag, list(states)) == (1, 0, [2])
    assert [e.rank for e in cp.read_events()] == [2]


# -- secret file -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "content", "error"),
    [
        (0o600, SECRET + "\n", None),
        (0o400, SECRET, None),
        (0o640, SECRET, "mode 0640"),
        (0o604, SECRET, "mode 0604"),
        (0o620, SECRET, "mode 0620"),
        (0o600, "short", "at least 16"),
    ],
)
def test_the_secret_file_must_be_readable_by_the_jobs_user_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, content: str, error: str | None
) -> None:
    monkeypatch.delenv(ctl.SECRET_ENV, raising=False)
    path = tmp_path / "secret"
    path.write_text(content)
    path.chmod(mode)
    monkeypatch.setenv(ctl.SECRET_FILE_ENV, str(path))
    if error is None:
        assert ctl.operator_secret() == SECRET
        root = ctl.root_prefix(dist.HashStore(), "job")
        assert root.mac_key == ctl.root_prefix(dist.HashStore(), "job", SECRET).mac_key
        assert root.joinable
    else:
        with pytest.raises(ConfigError, match=error):
            ctl.operator_secret()


def test_the_secret_file_is_not_followed_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ctl.SECRET_ENV, raising=False)
    target = tmp_path / "secret"
    target.write_text(SECRET)
    target.chmod(0o600)
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv(ctl.SECRET_FILE_ENV, str(tmp_path / "link"))
    with pytest.raises(ConfigError, match="cannot be opened"):
        ctl.operator_secret()
    monkeypatch.setenv(ctl.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="cannot be opened"):
        ctl.operator_secret()


# -- 4. replays --------------------------------------------------------------------------------
def test_generations_only_grow_and_an_old_members_record_is_ignored() -> None:
    """The launcher's view (one JobStore): an old sealed ``gen`` or ``members`` record
    written back after a newer one is ignored, so the launcher never kills the joiner
    the newer record admitted."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", SECRET)
    ranks = ctl.JobStore(root)
    launcher = ctl.JobStore(root)
    ranks.set_generation(1)
    ranks.set_members(1, [0, 1, 3])
    assert launcher.generation() == 1
    assert launcher.members() == {"gen": 1, "members": [0, 1, 3]}
    old_gen, old_members = base.get(f"{root.prefix}/gen"), base.get(f"{root.prefix}/members")
    ranks.set_generation(2)
    ranks.set_members(2, [0, 1, 4])
    assert launcher.generation() == 2
    assert launcher.members() == {"gen": 2, "members": [0, 1, 4]}
    base.set(f"{root.prefix}/gen", old_gen)
    base.set(f"{root.prefix}/members", old_members)
    assert launcher.generation() == 2
    assert launcher.members() == {"gen": 2, "members": [0, 1, 4]}
    # Unsealed values (the former format, or garbage) do not move it either.
    base.set(f"{root.prefix}/gen", "7")
    base.set(f"{root.prefix}/members", json.dumps({"gen": 9, "members": [0]}))
    assert launcher.generation() == 2
    assert launcher.members() == {"gen": 2, "members": [0, 1, 4]}
    assert ctl.rejected_records().get("gen", 0) >= 1


def test_an_old_heartbeat_and_a_copied_event_line_are_ignored() -> None:
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", SECRET)
    rank1, reader = ctl.ControlPlane(root, 0), ctl.ControlPlane(root, 0)
    rank1.publish_state(1, ctl.HeartbeatState(beat=5, status="running"))
    old = base.get(f"{root.prefix}/g0/state/1")
    rank1.publish_state(1, ctl.HeartbeatState(beat=6, status="running"))
    assert reader.read_states([1])[1].beat == 6
    base.set(f"{root.prefix}/g0/state/1", old)
    assert reader.read_states([1]) == {}  # left out: its silence goes on being timed
    rank1.publish_state(1, ctl.HeartbeatState(beat=7, status="running"))
    assert reader.read_states([1])[1].beat == 7
    # A sealed event line appended again is a replay.
    rank1.post_event(_event(1))
    line = base.get(f"{root.prefix}/g0/ev/log").decode().strip()
    base.append(f"{root.prefix}/g0/ev/log", "\n" + line + "\n")
    base.add(f"{root.prefix}/g0/ev/n", 1)
    assert len(reader.read_events()) == 1
    # Generation 1's log does not take generation 0's records (the MAC covers the name).
    base.append(f"{root.prefix}/g1/ev/log", "\n" + line + "\n")
    assert ctl.ControlPlane(root, 1).read_events() == []


# -- 6. garbage in counters and logs -----------------------------------------------------------
def test_a_missing_or_deleted_heartbeat_is_left_out_never_waited_for() -> None:
    """A reader that lags behind a generation whose keys were deleted (an abandoned
    admission's, which the next generation's rank 0 cleans up) reads nothing there; it
    does not wait out the store's timeout (a joiner once waited 60 s in a diagnosis,
    missed three admissions and was given up on). The store's timeout is long, so that a
    read that waits for a key fails the test by raising."""
    base = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    root = ctl.root_prefix(base, "job", SECRET)
    writer, reader = ctl.ControlPlane(root, 3), ctl.ControlPlane(root, 3)
    writer.publish_state(0, ctl.HeartbeatState(beat=4, status="running"))
    writer.publish_info(0, {"host": "h", "pid": 7})
    assert list(reader.read_states([0, 1, 2])) == [0]
    assert reader.read_states([1, 2]) == {}
    assert list(reader.read_infos([0, 1])) == [0]
    base.delete_key(f"{root.prefix}/g3/state/0")
    assert reader.read_states([0, 1]) == {}


def test_garbage_in_the_event_counter_neither_hides_a_failure_nor_loses_the_store() -> None:
    """Garbage in ``g0/ev/n`` (and in a claim): the reporter of rank 2's death posts it
    (no 'store unreachable'), and the other watchdogs still read it, naming rank 2."""
    server = ctl.serve_store()
    try:
        root = ctl.root_prefix(
            dist.TCPStore("127.0.0.1", server.port, is_master=False), "job", SECRET
        )
        reporter, watcher = ctl.ControlPlane(root, 0), ctl.ControlPlane(root.clone(), 0)
        reporter.init_counters()
        assert watcher.poll([])[0] == 0
        root.set("g0/ev/n", "garbage")  # also what a buggy or stale client could do
        root.set("g0/claim/2", "garbage")
        seen = {watcher.poll([])[0] for _ in range(3)}
        assert len(seen) == 3  # a new count at every poll: the log is read every time
        assert watcher.read_events() == []
        assert reporter.claim(2)  # no ControlPlaneError: the store answers
        reporter.post_event(_event(2))
        assert watcher.poll([])[0] not in seen
        assert [e.rank for e in watcher.read_events()] == [2]
        assert ctl.rejected_records().get("ev/n", 0) >= 3
    finally:
        del server


def test_a_64_mib_junk_log_is_parsed_in_bounded_pieces() -> None:
    """Junk appended past the per-record cap: each read parses at most MAX_LOG_PARSE new
    bytes, polls say when more is waiting, and a real event behind it is found."""
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", SECRET)
    cp = ctl.ControlPlane(root, 0)
    cp.init_counters()
    junk = ("junk " * 19 + "\n").encode() * ((64 << 20) // 96)
    base.append(f"{root.prefix}/g0/ev/log", junk)
    ctl.ControlPlane(root, 0).post_event(_event(2))
    reads, events = 0, []
    while True:
        n = cp.poll([])[0]
        events = cp.read_events()
        reads += 1
        if events and cp.poll([])[0] == n:
            break
        assert reads < 200
    assert [e.rank for e in events] == [2]
    # One piece a read, not the whole log: as many reads as pieces (a wall-clock bound per
    # read failed under load: 1.16 s on a machine at load 14).
    assert reads >= len(junk) // ctl.MAX_LOG_PARSE


# -- 5. preflight --------------------------------------------------------------------------------
def _env(rank: int = 1, key: bytes | None = None) -> preflight.Environment:
    return preflight.Environment("127.0.0.1", 1, rank, 2, rank, 2, 0, True, key=key)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_forged_preflight_records_fail_start_up_with_a_typed_message(
    monkeypatch: pytest.MonkeyPatch, secret: str | None
) -> None:
    monkeypatch.delenv(ctl.SECRET_FILE_ENV, raising=False)
    if secret is None:
        monkeypatch.delenv(ctl.SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(ctl.SECRET_ENV, secret)
    env = _env(key=preflight._record_key())
    store = dist.HashStore()
    # Garbage facts, a garbage counter, a garbage verdict: typed, never a JSONDecodeError
    # nor "the store stopped answering".
    keys = ctl.PreflightKeys(0)
    store.set(keys.facts(0), "{not json")
    if secret is None:
        with pytest.raises(PreflightError, match="not written by this job"):
            preflight._read_facts(store, env, [keys.facts(0)], [0])
    else:  # not arrived, as far as the checker can tell
        assert preflight._read_facts(store, env, [keys.facts(0)], [0]) == {}
    store.set(keys.arrived, "garbage")
    with pytest.raises(PreflightError, match="not written by this job"):
        preflight._add(store, env, keys.arrived, 1)
    with pytest.raises(PreflightError, match="not written by this job"):
        preflight._unpack(env, b"\x00garbage")
    forged = zlib.compress(json.dumps({"rank": 0, "problems": ["ATTACKER TEXT"]}).encode())
    if secret is None:
        # Without a secret a well-formed verdict cannot be told apart: it fails start-up.
        assert preflight._unpack(env, forged)["problems"] == ["ATTACKER TEXT"]
        return
    # With one, the attacker's text never reaches the error.
    with pytest.raises(PreflightError, match="not written by this job") as e:
        preflight._unpack(env, forged)
    assert "ATTACKER TEXT" not in str(e.value)
    # The job's own records, sealed, read back.
    mine = preflight._seal_bytes(env.key, keys.verdict(), forged)
    assert preflight._unpack(env, mine)["problems"] == ["ATTACKER TEXT"]
    store.set(keys.facts(1), ctl.seal(env.key, keys.facts(1), {"host": "h"}))
    assert preflight._read_facts(store, env, ["x", keys.facts(1)], [1]) == {1: {"host": "h"}}
    assert os.environ[ctl.SECRET_ENV] not in mine.decode(errors="replace")


@pytest.mark.parametrize(
    "verdict",
    [
        {"rank": 0, "problems": ["x"], "table": "ATTACKER TEXT"},
        {"rank": 0, "problems": ["x"], "table": {"a": 1}},
        {"rank": 0, "problems": ["x"], "message": 3},
        {"rank": "0", "problems": []},
        [1, 2],
    ],
)
def test_a_malformed_verdict_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, verdict: object
) -> None:
    monkeypatch.delenv(ctl.SECRET_ENV, raising=False)
    with pytest.raises(PreflightError, match="not written by this job"):
        preflight._unpack(_env(), zlib.compress(json.dumps(verdict).encode()))


def test_with_a_secret_a_planted_verdict_and_facts_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checker's verdict goes to the next slot; the planted facts count as not
    arrived until the rank's own record replaces them."""
    monkeypatch.setenv(ctl.SECRET_ENV, SECRET)
    store = dist.HashStore()
    planted = zlib.compress(json.dumps({"rank": 1, "problems": ["ATTACKER TEXT"]}).encode())
    names = ctl.PreflightKeys(0)
    store.set(names.verdict(), planted)
    store.set(names.facts(1), "{not json")
    checker, other = _env(0, preflight._record_key()), _env(1, preflight._record_key())
    keys = [names.facts(0), names.facts(1)]
    assert preflight._read_facts(store, checker, keys, [1]) == {}
    assert preflight._read_verdict(store, other) is None  # the planted one is skipped
    _, mine = preflight._propose(store, checker, {"rank": 0, "problems": []})
    assert mine
    assert store.check([names.verdict(1)])
    assert preflight._read_verdict(store, other) == {"rank": 0, "problems": []}


def test_garbage_in_the_jobs_counters_is_counted_never_a_lost_store() -> None:
    """Over a real TCPStore (whose server drops the connection of an add on a value that
    is not a number): join, arrival and retry counters holding garbage."""
    server = ctl.serve_store()
    try:
        root = ctl.root_prefix(
            dist.TCPStore("127.0.0.1", server.port, is_master=False), "job", SECRET
        )
        jobs = ctl.JobStore(root)
        for key in ("join/n", "form/g1/n", "g0/retry/3/0", "gen_seq"):
            root.set(key, "garbage")
        jobs.request_join({"uid": 5})
        assert jobs.join_count() == 1
        assert jobs.ready_count(1) == 0  # read without breaking the connection
        jobs.post_ready(1, 0)
        assert jobs.ready_count(1) == 1
        assert jobs.vote_retry(0, 3, 0) == 1
        assert jobs.next_generation() == 1
        assert ctl.rejected_records().get("join/n", 0) >= 1
    finally:
        del server


def test_a_ranks_last_state_is_never_taken_for_a_replay() -> None:
    """A rank that leaves or fails publishes its last state with beat -1."""
    root = ctl.root_prefix(dist.HashStore(), "job", SECRET)
    rank1, reader = ctl.ControlPlane(root, 0), ctl.ControlPlane(root, 0)
    rank1.publish_state(1, ctl.HeartbeatState(beat=9, status="running"))
    assert reader.read_states([1])[1].beat == 9
    rank1.publish_state(1, ctl.HeartbeatState(beat=-1, status="left"))
    assert reader.read_states([1])[1].status == "left"


def test_two_threads_reading_heartbeats_never_see_a_replay() -> None:
    """The watchdog, the main thread's diagnosis and inference's collector read states
    through one ControlPlane: a read sent before a newer one was parsed is not a replay
    (a live rank's heartbeat was reported replayed, with no attacker, after a kill)."""
    root = ctl.root_prefix(dist.HashStore(), "job", SECRET)
    rank1, reader = ctl.ControlPlane(root, 0), ctl.ControlPlane(root, 0)
    rank1.publish_state(1, ctl.HeartbeatState(beat=5, status="running"))
    slow_before = reader._beats_before()  # thread A sends its read...
    slow_raw = reader.store.multi_get(["state/1"])  # ...and gets beat 5
    rank1.publish_state(1, ctl.HeartbeatState(beat=6, status="running"))
    assert reader.read_states([1])[1].beat == 6  # thread B: sent later, parsed first
    rejected = dict(ctl.rejected_records())
    got = reader._parse(["state/1"], [1], slow_raw, slow_before)  # thread A parses now
    assert got[1]["beat"] == 5
    assert dict(ctl.rejected_records()) == rejected  # nothing counted as a replay
    assert reader.read_states([1])[1].beat == 6  # and the newest stands


# -- heartbeats, decoded once at the store boundary ------------------------------------------
_BEAT: dict[str, Any] = {
    "rank": 1,
    "beat": 7,
    "status": "running",
    "step": 3,
    "t": 1.5,
    "in_op": False,
}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        pytest.param({}, "", id="as-published"),
        pytest.param({"t": 2, "section_left": None, "progress": None}, "", id="int-for-float"),
        pytest.param({"beat": "many"}, "'beat' is str", id="beat-str"),
        pytest.param({"beat": True}, "'beat' is bool", id="bool-for-int"),
        pytest.param({"in_op": 1}, "'in_op' is int", id="int-for-bool"),
        pytest.param({"status": ["running"]}, "'status' is list", id="status-list"),
        pytest.param({"op": None}, "'op' is NoneType", id="op-none"),
        pytest.param({"idle": float("nan")}, "", id="nan-is-a-float"),
    ],
)
def test_a_heartbeat_is_read_only_with_its_fields_types(
    change: dict[str, Any], problem: str
) -> None:
    record = {**_BEAT, **change, "extra": {"not": "a heartbeat field"}}
    assert ctl.state_problem(record) == problem
    state = ctl.decode_state(record, "rd/job/g0/state/1")
    if problem:
        assert state is None
    else:
        # Its own fields, as sent; "extra" dropped (HeartbeatState has no such field).
        assert state == ctl.HeartbeatState(**{**_BEAT, **change})


def test_a_decoded_heartbeat_is_frozen_and_its_record_reads_back_equal() -> None:
    sent = {
        **_BEAT,
        "op": "all_reduce",
        "seq": 4,
        "section_left": None,
        "progress": [2, 5],
        "moving": ["cpu", "stack"],
        "stack": "f() at x.py:1",
    }
    state = ctl.decode_state(sent, "rd/job/g0/state/1")
    assert state is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.beat = 8  # type: ignore[misc]
    assert (state.beat, state.progress, state.moving) == (7, (2, 5), ("cpu", "stack"))
    # Not said: None, or what the readers take for a missing field.
    assert (state.host, state.diag, state.idle, state.compute_s, state.raised) == (
        None,
        None,
        None,
        0.0,
        False,
    )
    # Its JSON form: what was sent, with the defaults that are not None.
    assert state.record() == {**sent, "compute_s": 0.0, "inside": False, "raised": False}
    assert ctl.decode_state(state.record(), "rd/job/g0/state/1") == state
    empty = ctl.HeartbeatState()
    assert ctl.decode_state(empty.record(), "rd/job/g0/state/1") == empty
