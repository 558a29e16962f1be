"""A real two-host run on one machine: two network namespaces joined by a veth pair, one
torchrun per "host" (its own UTS name, so the hosts have different names), 2 ranks each,
training with ResilientDDP over gloo. The link is then cut mid-training: every rank must
raise our error naming the ranks on the other host within the bound, and nothing may hang.

Needs root, ``ip`` (iproute2) and ``unshare``; skipped otherwise. Only addresses inside the
two namespaces are used.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._procs import kill_named, wait_for

pytestmark = pytest.mark.skipif(
    os.name != "posix"
    or os.geteuid() != 0
    or shutil.which("ip") is None
    or shutil.which("unshare") is None,
    reason="needs root, iproute2 (ip netns) and unshare",
)

HEARTBEAT_TIMEOUT_S = 3.0  # as set in two_host_main
BOUND_S = HEARTBEAT_TIMEOUT_S + 3.0  # from the cut to every rank's error
SUBNET = "10.231.{}.{}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_hosts() -> Iterator[dict[str, str]]:
    """Namespaces rdA and rdB (unique names), joined by veth; yields names and addresses."""
    tag = uuid.uuid4().hex[:6]
    net = int(tag, 16) % 200 + 20
    hosts = {
        "a_ns": f"rdA{tag}", "b_ns": f"rdB{tag}", "a_if": f"va{tag}", "b_if": f"vb{tag}",
        "a_ip": SUBNET.format(net, 1), "b_ip": SUBNET.format(net, 2),
    }  # fmt: skip
    try:
        _ip("netns", "add", hosts["a_ns"])
        _ip("netns", "add", hosts["b_ns"])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr!r}")
    etc = [Path("/etc/netns") / hosts[f"{side}_ns"] for side in ("a", "b")]
    try:
        # ``ip netns exec`` mounts /etc/netns/<name>/hosts over /etc/hosts: the host names
        # resolve to the namespaces' own addresses only.
        for d in etc:
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(
                f"127.0.0.1 localhost\n{hosts['a_ip']} node-a\n{hosts['b_ip']} node-b\n"
            )
        _ip("link", "add", hosts["a_if"], "type", "veth", "peer", "name", hosts["b_if"])
        for side in ("a", "b"):
            ns, ifname = hosts[f"{side}_ns"], hosts[f"{side}_if"]
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{hosts[f'{side}_ip']}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for side in ("a", "b"):
            subprocess.run(
                ["ip", "netns", "del", hosts[f"{side}_ns"]], capture_output=True, check=False
            )
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)


def _torchrun(hosts: dict[str, str], side: str, script: Path, out: Path) -> subprocess.Popen[str]:
    name = "node-a" if side == "a" else "node-b"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_DDP", "TORCHELASTIC"))
    }
    env["GLOO_SOCKET_IFNAME"] = hosts[f"{side}_if"]  # gloo on the veth, not on a host name
    cmd = [
        "ip", "netns", "exec", hosts[f"{side}_ns"], "unshare", "--uts", "sh", "-c",
        f'hostname {name} && exec "$0" "$@"',
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{hosts['a_ip']}:29400", "--rdzv-id", "netns-test",
        "--local-addr", hosts[f"{side}_ip"], "--monitor-interval", "0.2",
        str(script), str(out),
    ]  # fmt: skip
    with (out / f"torchrun-{side}.log").open("w") as log:  # the child keeps its own copy
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )


def test_cut_link_between_two_hosts_names_the_other_side(
    two_hosts: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    root = Path(__file__).resolve().parent.parent
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(root)!r})\n"
        "from tests._preflight_workers import two_host_main\ntwo_host_main()\n"
    )
    procs = [_torchrun(two_hosts, side, script, tmp_path) for side in ("a", "b")]
    try:

        def steps() -> list[int]:
            out = []
            for r in range(4):
                p = tmp_path / f"progress{r}"
                out.append(int(p.read_text() or 0) if p.exists() else 0)
            return out

        started = wait_for(lambda: min(steps()) >= 5, 60)
        assert started, (steps(), _logs(tmp_path))
        cut = time.time()
        _ip("-n", two_hosts["a_ns"], "link", "set", two_hosts["a_if"], "down")
        done = wait_for(lambda: all((tmp_path / f"result{r}.json").exists() for r in range(4)), 30)
        assert done, _logs(tmp_path)
        results = {r: json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(4)}
        # Nothing hangs: every rank's process ends by itself after its error (its agent,
        # torch's, may still be busy with the lost rendezvous; it is killed below).
        pids = [res["pid"] for res in results.values()]
        assert wait_for(lambda: all(_ended(pid) for pid in pids), 15), (pids, _logs(tmp_path))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        kill_named(tmp_path)  # torchrun's workers run in sessions of their own
    other = {0: [2, 3], 1: [2, 3], 2: [0, 1], 3: [0, 1]}
    for r, res in results.items():
        assert res["host"] == ("node-a" if r < 2 else "node-b")
        assert res["type"] in ("RankFailureError", "ControlPlaneError", "CollectiveTimeoutError"), (
            res
        )
        assert sorted(res["ranks"]) == other[r], (r, res["message"])
        assert res["raised_at"] - cut < BOUND_S, (r, res["raised_at"] - cut, res["message"])
        assert set(res["hosts"]) == {"node-b" if r < 2 else "node-a"}, res


def _ended(pid: int) -> bool:
    """The process is gone, or a zombie waiting for its parent to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


def _logs(out: Path) -> str:
    return "\n----\n".join(p.read_text()[-3000:] for p in sorted(out.glob("torchrun-*.log")))
