"""W = 2 across two emulated hosts (dev/netcluster.py): network namespaces on a bridge,
each link shaped with tc tbf, with both real launchers.

- torchrun multi-node (static rendezvous on host 0) and horovodrun -H h0:1,h1:1 --gloo over ssh
  (sshd inside each namespace) train the same job as a localhost W = 2 launch of the same config
  (torchrun --standalone / horovodrun -H localhost:2): every step's loss, every final parameter
  (dense, every embedding row, versions and sparse optimizer state, from the final checkpoint),
  the byte counters and the eval AUC are equal (BSP parity across the network);
- the traffic really crossed the emulated links (the hosts' veth counters carry at least the bytes
  the trainer counted);
- a Hydra sweep of two jobs runs under multi-node torchrun (each job its own process group);
- the cluster is torn down on normal exit, on an exception and on SIGTERM; cleanup_stale() removes
  what a SIGKILLed owner left behind.

Needs root and `ip netns` (CI has both); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_launch import ROOT, horovodrun, require_horovod, require_netns, tail, torchrun
from multihost_helpers import CFG, assert_crossed_links, assert_same_training
from dev import netcluster
from dev.netcluster import NetCluster

pytestmark = [pytest.mark.dist, pytest.mark.netns]
LAUNCH_TIMEOUT = 150


@pytest.fixture(scope="module")
def cluster():
    require_netns()
    with NetCluster(hosts=2, rate="1gbit", ssh=True) as c:
        yield c
    assert not [ns for ns in netcluster._namespaces() if ns.startswith(c.tag + "-")]


def _ns_of(tag: str) -> list[str]:
    return [ns for ns in netcluster._namespaces() if ns.startswith(tag + "-")]


# ------------------------------------------------------------------ the launchers
def test_torchrun_across_two_hosts_equals_localhost(cluster, tmp_path):
    local, net = str(tmp_path / "local"), str(tmp_path / "net")
    ref = torchrun(["-m", "trainer", "comm=torch", f"hydra.run.dir={local}", *CFG], timeout=LAUNCH_TIMEOUT)
    assert ref.returncode == 0, tail(ref)
    before = cluster.link_stats()
    res = cluster.torchrun(["-m", "trainer", "comm=torch", f"hydra.run.dir={net}", *CFG],
                           timeout=LAUNCH_TIMEOUT, env=cluster.env({"PYTHONPATH": ROOT}), cwd=ROOT)
    after = cluster.link_stats()
    for r in res:
        assert r.ok, r.tail()
    summary = assert_same_training(local, net)
    assert summary["backend"] == "TorchCollectives"
    assert_crossed_links(before, after, summary)


def test_torchrun_sweep_across_two_hosts(cluster, tmp_path):
    """A Hydra sweep of two jobs under multi-node torchrun: each job opens its own process group
    (the second one used to meet the first one's rendezvous keys in torchrun's store)."""
    sweep = tmp_path / "sweep"
    res = cluster.torchrun(["-m", "trainer", "-m", "comm=torch", *CFG[:2], "train.steps=4", "data.test_samples=256",
                            "train.progress=off", "checkpoint.enabled=false", "train.seed=0,1",
                            f"hydra.sweep.dir={sweep}"], timeout=LAUNCH_TIMEOUT, env=cluster.env({"PYTHONPATH": ROOT}),
                           cwd=ROOT)
    for r in res:
        assert r.ok, r.tail()
    with open(sweep / "summary.json") as f:
        index = json.load(f)
    assert (index["ok"], index["failed"]) == (2, 0), index
    summaries = [json.load(open(j["summary"])) for j in index["jobs"]]
    assert [s["world_size"] for s in summaries] == [2, 2] and [s["steps"] for s in summaries] == [4, 4]
    assert summaries[0]["final_loss"] != summaries[1]["final_loss"]  # two seeds, two models


def test_horovodrun_over_ssh_equals_localhost(cluster, tmp_path):
    require_horovod()
    local, net = str(tmp_path / "local"), str(tmp_path / "net")
    ref = horovodrun(["-m", "trainer", "comm=horovod", f"hydra.run.dir={local}", *CFG], timeout=LAUNCH_TIMEOUT)
    assert ref.returncode == 0, tail(ref)
    before = cluster.link_stats()
    res = cluster.horovodrun([sys.executable, "-m", "trainer", "comm=horovod", f"hydra.run.dir={net}", *CFG],
                             timeout=LAUNCH_TIMEOUT, env=cluster.env({"PYTHONPATH": ROOT}), cwd=ROOT)
    after = cluster.link_stats()
    assert res.ok, res.tail()
    assert "-H h0:1,h1:1" in " ".join(res.argv) and "--gloo" in res.argv
    summary = assert_same_training(local, net)
    assert summary["backend"] == "HorovodCollectives"
    assert_crossed_links(before, after, summary)


def test_commands_run_inside_their_host_and_links_are_shaped(cluster):
    for k in range(2):
        r = cluster.exec(k, ["ip", "-4", "-o", "addr", "show", "dev", netcluster.IFACE], timeout=20)
        assert r.ok and f"{netcluster.SUBNET}.{k + 1}/24" in r.stdout, r.tail()
    # ssh from host 0 reaches host 1 by name, with the cluster's key and no prompt
    r = cluster.exec(0, ["ssh", "h1", "cat /proc/net/dev"], timeout=30)
    assert r.ok and netcluster.IFACE in r.stdout, r.tail()
    q = cluster.exec(0, ["tc", "qdisc", "show", "dev", netcluster.IFACE], timeout=20)
    assert "tbf" in q.stdout and "rate 1Gbit" in q.stdout, q.stdout
    assert cluster.rate_bits == 10 ** 9


def test_a_command_past_its_timeout_is_stopped(cluster):
    t0 = time.monotonic()
    r = cluster.exec(1, [sys.executable, "-c", "import time; time.sleep(60)"], timeout=1.5)
    assert r.timed_out and not r.ok and time.monotonic() - t0 < 15
    assert netcluster._ns_pids(cluster.hosts[1].ns) == cluster._sshd_pids[1:2]  # only host 1's sshd is left


# ------------------------------------------------------------------ teardown
HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from dev.netcluster import NetCluster
with NetCluster(hosts=2, rate="200mbit") as c:
    print(c.tag, flush=True)
    {body}
"""


def _holder(body: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT, body=body)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    tag = proc.stdout.readline().strip()
    assert tag.startswith(netcluster.PREFIX), proc.stderr.read()
    assert len(_ns_of(tag)) == 3  # two hosts and the bridge
    return proc, tag


def test_teardown_on_exception_and_on_sigterm():
    require_netns()
    with pytest.raises(RuntimeError, match="boom"):
        with NetCluster(hosts=2) as c:
            assert len(_ns_of(c.tag)) == 3
            raise RuntimeError("boom")
    assert _ns_of(c.tag) == [] and not os.path.exists(c.tmpdir)
    assert not os.path.exists(os.path.join(netcluster.NETNS_ETC, c.hosts[0].ns))
    proc, tag = _holder("time.sleep(60)")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert _ns_of(tag) == []


def test_cleanup_stale_removes_what_a_killed_owner_left():
    require_netns()
    proc, tag = _holder("time.sleep(60)")
    with NetCluster(hosts=1) as live:  # a live cluster is never touched by cleanup
        proc.kill()  # SIGKILL: no teardown runs
        proc.wait(30)
        assert len(_ns_of(tag)) == 3
        removed = netcluster.cleanup_stale()
        assert sorted(removed) == sorted(f"{tag}-{n}" for n in ("h0", "h1", "br"))
        assert _ns_of(tag) == [] and len(_ns_of(live.tag)) == 2
