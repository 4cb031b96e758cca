"""An emulated multi-host cluster on one Linux machine: N hosts as network namespaces on a bridge.

Why: on localhost, bytes are nearly free, so the trainer's byte savings (cache, placement,
pipelining, wire precision) never show up as time. Network namespaces give each worker its own
network stack, and `tc tbf` on both ends of each host's link caps what it can send and receive, so
a W-worker run on one machine pays for its traffic like a small cluster does.

Layout (everything lives in namespaces this module creates; outside them it only adds, and
removes again, the namespace names and their /etc/netns/<name>/ files):

    <tag>-br   the switch: bridge br0 with one port p<k> per host
    <tag>-h<k> host k: veth0 = 10.213.0.<k+1>/24 (its peer is p<k> on the bridge), lo up

`<tag>` is `htnet<pid>-<seq>` (pid of the owning process), so `cleanup_stale()` can tell leftovers
of dead runs from live clusters.

Each host link is shaped to `rate` in both directions: tbf on the host's veth0 (host -> switch) and
on its bridge port (switch -> host), like a switch port of that speed. Where the kernel has netem,
`delay_ms` adds that delay on both ends too (a host-to-host packet crosses two shaped egresses, so
its one-way delay is 2 x delay_ms); netem is detected, and a requested delay without it is reported
and left out.

Names: each host gets /etc/netns/<tag>-h<k>/hosts, which `ip netns exec` mounts over /etc/hosts for
everything started in that host: h0, h1, ... name the hosts, and the machine's hostname resolves to
the host's own address. Gloo code that finds its address from the hostname (Horovod 0.28 builds its
process-set contexts that way, ignoring HOROVOD_GLOO_IFACE) would otherwise get 127.0.0.1 and send
its peers to their own loopback.

Launchers across the hosts:
- `exec(k, argv)`: any command inside host k (`ip netns exec`);
- `torchrun(args)`: one `torchrun --nnodes N --node_rank k` per host, static rendezvous on host 0;
- `horovodrun(command)`: `horovodrun -H <h0>:1,<h1>:1 --gloo` started on host 0, reaching the
  others over ssh. With `ssh=True` an sshd (openssh-server, installed with apt-get when missing)
  runs inside every host on port 22 with a host key and an authorized client key generated in the
  cluster's private temp dir; the ssh client is wrapped (a `ssh` script first on PATH) so it uses
  that key, never asks about host keys and never writes the user's known_hosts. horovodrun's gloo
  launcher exports the launching environment (PYTHONPATH, ...) to every remote command, and the
  commands use absolute paths, so every host runs the same Python.
Gloo is also pinned to the hosts' veth0 by name (GLOO_SOCKET_IFNAME, HOROVOD_GLOO_IFACE and
horovodrun's --network-interfaces, which also skips horovodrun's interface probe over ssh).

Everything is bounded: every command has a timeout; a launch that overruns, or whose peer failed,
is stopped (process group, then whatever is left inside the host namespaces); the context manager
tears everything down on exit, on exceptions and on SIGTERM / SIGINT / SIGHUP.

Command line (`python -m dev.netcluster`, from the repository root): up / run / torchrun /
horovodrun / shape / status / down / cleanup-stale; `up` starts a holder process that keeps the
cluster until `down` or --ttl.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from trainer.base.core import procs  # /proc/PID/stat, parsed once (a leaf: the standard library only)
from dev.launch import ROOT, horovodrun_path, launch_command

PREFIX = "htnet"
SUBNET = "10.213.0"  # host k is SUBNET.<k+1>/24; the subnet exists only inside our namespaces
IFACE = "veth0"  # every host's interface has this name, so one GLOO_SOCKET_IFNAME fits all hosts
BRIDGE = "br0"
MAX_HOSTS = 200
CMD_TIMEOUT_S = 30.0  # any single ip / tc / ssh-keygen call
SSH_PORT = 22
NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/<file> over /etc/<file>
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-([A-Za-z0-9]+)-(br|h\d+)$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)?$", re.I)
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
_LAUNCHER_PREFIXES = ("HOROVOD_", "OMPI_", "PMI_", "TORCHELASTIC_")
_SEQ = iter(range(1 << 30))
_SEQ_LOCK = threading.Lock()


class NetClusterError(RuntimeError):
    """The emulated cluster cannot be built or used; the message says what is missing."""


# ------------------------------------------------------------------ small helpers
def _run(argv: Sequence[str], timeout: float = CMD_TIMEOUT_S, check: bool = True,
         env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise NetClusterError(f"`{shlex.join(argv)}` did not finish within {timeout:g}s") from exc
    except FileNotFoundError as exc:
        raise NetClusterError(f"`{argv[0]}` is not installed") from exc
    if check and proc.returncode != 0:
        raise NetClusterError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def parse_rate(rate: Any) -> int | None:
    """Link rate in bits/s; None (no shaping) for None, '', 'none', 'off', 'localhost', 0.

    Accepts tc's units (bit, kbit, mbit, gbit, tbit: decimal SI, and bps, kbps, ... in bytes/s)."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        if rate < 0:
            raise NetClusterError(f"link rate {rate!r} must be >= 0")
        return int(rate) or None
    text = str(rate).strip().lower()
    if text in ("", "none", "off", "localhost", "0"):
        return None
    m = _RATE_RE.match(text)
    if not m:
        raise NetClusterError(f"link rate {rate!r} is not a rate like 1gbit, 200mbit, 500kbit")
    bits = int(float(m.group(1)) * _RATE_UNITS[(m.group(2) or "bit").lower()])
    if bits < 8_000:
        raise NetClusterError(f"link rate {rate!r} is below 8 kbit/s")
    return bits


def _proc_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): with the pid, it names one process."""
    st = procs.stat(pid)
    return None if st is None else st.start


def _alive(pid: int, start: str | None = None) -> bool:
    now = _proc_start(pid)
    return now is not None and (start is None or now == start)


def _namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def _kill_pids(pids: Iterable[int], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is still there after grace_s. Only ever called with processes
    living inside namespaces this module created (which only its launches populate)."""
    pids = [p for p in set(pids) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p) and not _zombie(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    st = procs.stat(pid)
    return st is None or st.state == "Z"


def _remove_namespace(ns: str, keep: Iterable[int] = ()) -> None:
    """Kill every process inside ns, then delete it (its veth ends go with it) and its
    /etc/netns/<ns> files."""
    _kill_pids(p for p in _ns_pids(ns) if p not in set(keep))
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def availability() -> tuple[bool, str]:
    """(True, '') when this process can build a cluster: Linux, root, `ip netns` working."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return False, "`ip` (iproute2) is not installed"
    ns = f"{PREFIX}{os.getpid()}-probe{_next_seq()}-h0"
    try:
        add = _run(["ip", "netns", "add", ns], check=False)
    except NetClusterError as exc:
        return False, f"`ip netns` is unavailable: {exc}"
    if add.returncode != 0:
        return False, f"`ip netns add` is unavailable here: {add.stderr.strip()}"
    _run(["ip", "netns", "del", ns], check=False)
    return True, ""


def _next_seq() -> int:
    with _SEQ_LOCK:
        return next(_SEQ)


def ensure_sshd(install: bool = True) -> str:
    """The sshd binary, installing Debian's openssh-server with apt-get when it is missing."""
    for path in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if path and os.access(path, os.X_OK):
            return path
    if not install:
        raise NetClusterError("sshd is not installed: install openssh-server (apt-get install openssh-server)")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise NetClusterError("sshd is not installed and cannot be installed here (needs root and apt-get): "
                              "install openssh-server")
    print("netcluster: sshd is missing: installing openssh-server with apt-get", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install_cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "openssh-server"]
    proc = _run(install_cmd, timeout=600, check=False, env=env)
    if proc.returncode != 0:  # stale package lists: refresh once and retry
        _run(["apt-get", "update", "-q"], timeout=300, check=False, env=env)
        proc = _run(install_cmd, timeout=600, check=False, env=env)
    path = shutil.which("sshd") or "/usr/sbin/sshd"
    if proc.returncode != 0 or not os.access(path, os.X_OK):
        raise NetClusterError(f"installing openssh-server failed (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return path


def cleanup_stale(prefix: str = PREFIX, verbose: bool = False) -> list[str]:
    """Remove namespaces and temp dirs of clusters whose owner process is gone; returns the
    namespaces removed. A cluster counts as live while its owner (the pid in its tag, with the
    start time recorded in its state file when there is one) runs; live clusters are never touched."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    by_tag: dict[str, set[str]] = {}
    etc = os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []
    for ns in _namespaces() + etc:
        m = _NAME_RE.match(ns)
        if m and ns.startswith(prefix):
            by_tag.setdefault(f"{PREFIX}{m.group(1)}-{m.group(2)}", set()).add(ns)
    tmp_by_tag: dict[str, list[str]] = {}
    for d in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*-*-*")):
        m = re.match(rf"^({PREFIX}\d+-[A-Za-z0-9]+)-", os.path.basename(d))
        if m and os.path.isdir(d):
            tmp_by_tag.setdefault(m.group(1), []).append(d)
    removed = []
    for tag in sorted(set(by_tag) | set(tmp_by_tag)):
        pid = int(re.match(rf"^{PREFIX}(\d+)-", tag).group(1))
        start = None
        for d in tmp_by_tag.get(tag, []):
            try:
                with open(os.path.join(d, "state.json")) as f:
                    start = json.load(f).get("owner_start")
            except (OSError, ValueError):
                pass
        if _alive(pid, start):
            continue
        for ns in sorted(by_tag.get(tag, ()), key=lambda n: (n.endswith("-br"), n)):  # hosts, then the bridge
            _remove_namespace(ns)
            removed.append(ns)
        for d in tmp_by_tag.get(tag, []):
            shutil.rmtree(d, ignore_errors=True)
        if verbose:
            print(f"netcluster: removed stale cluster {tag} ({len(by_tag.get(tag, []))} namespaces)",
                  file=sys.stderr)
    return removed


# ------------------------------------------------------------------ results
@dataclass
class Result:
    """One finished (or stopped) command."""
    host: int | None
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def tail(self, n: int = 3000) -> str:
        where = "root namespace" if self.host is None else f"host {self.host}"
        return (f"[{where}] rc={self.returncode}{' (timed out)' if self.timed_out else ''} "
                f"{shlex.join(self.argv)}\nstdout:\n{self.stdout[-n:]}\nstderr:\n{self.stderr[-n:]}")


@dataclass
class Host:
    index: int
    ns: str
    addr: str


def _bounded(jobs: list[tuple[int | None, list[str]]], timeout: float, env: dict | None,
             cwd: str | None, capture: bool, grace_s: float,
             after: Any = None) -> list[Result]:
    """Start every job at once; wait until all end or `timeout`. Once one fails, the others get
    `grace_s` more (a peer of a dead worker would otherwise wait for its own timeouts). Whatever is
    still running at the deadline is stopped (its process group: SIGTERM, then SIGKILL)."""
    procs, files = [], []
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix=f"{PREFIX}-out-") as tmp:
            for i, (_, argv) in enumerate(jobs):
                out = open(os.path.join(tmp, f"{i}.out"), "w+") if capture else None
                err = open(os.path.join(tmp, f"{i}.err"), "w+") if capture else None
                files.append((out, err))
                procs.append(subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=cwd,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            deadline = t0 + timeout
            timed_out = [False] * len(procs)
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if any(p.returncode not in (None, 0) for p in procs):
                    deadline = min(deadline, now + grace_s)
                if now >= deadline:
                    for i, p in enumerate(procs):
                        if p.poll() is None:
                            timed_out[i] = True
                    break
                time.sleep(0.05)
            walls = time.monotonic() - t0
            _stop(procs)
            if after is not None:
                after()
            results = []
            for i, ((host, argv), p, (out, err)) in enumerate(zip(jobs, procs, files)):
                text = []
                for f in (out, err):
                    if f is None:
                        text.append("")
                    else:
                        f.flush()
                        f.seek(0)
                        text.append(f.read())
                        f.close()
                results.append(Result(host, list(argv), p.returncode if p.returncode is not None else -9,
                                      text[0], text[1], timed_out[i], round(walls, 3)))
            return results
    finally:
        _stop(procs)
        for out, err in files:
            for f in (out, err):
                if f is not None and not f.closed:
                    f.close()


def run_local(argvs: list[Sequence[str]], timeout: float, env: dict | None = None, cwd: str | None = None,
              capture: bool = True, grace_s: float = 20.0) -> list[Result]:
    """The same bounded launch in the root namespace (e.g. the localhost baseline of a benchmark)."""
    return _bounded([(None, list(a)) for a in argvs], timeout, env, cwd, capture, grace_s)


def _descendants(pid: int) -> set[int]:
    """Every process below pid (by parent pid, read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = procs.stat(int(entry))
            if st is not None:
                children.setdefault(st.ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop what is still running of procs, with everything below them (launchers such as torchrun
    put their workers in sessions of their own, so the process group alone would miss them)."""
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    tree: set[int] = set()
    for p in running:
        tree |= _descendants(p.pid)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for p in running:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while time.monotonic() < deadline and any(_alive(t) and not _zombie(t) for t in tree):
            time.sleep(0.05)
        running = [p for p in running if p.poll() is None]
        tree = {t for t in tree if _alive(t) and not _zombie(t)}
        if not running and not tree:
            return


def launcher_env(base: dict | None = None) -> dict:
    """A copy of the environment without the variables a launcher sets for its workers (a launch
    from inside a torchrun / horovodrun job must not inherit its parent's rank)."""
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES):
            del env[k]
    return env


# ------------------------------------------------------------------ the cluster
class NetCluster:
    """N emulated hosts (network namespaces) on a bridge, links shaped to `rate` both ways.

        with NetCluster(hosts=2, rate="1gbit", ssh=True) as c:
            c.torchrun(["-m", "trainer", "comm=torch", ...], timeout=300)
            c.horovodrun([sys.executable, "-m", "trainer", "comm=horovod", ...], timeout=300)

    rate: None (unshaped), bits/s, or a tc rate ('200mbit'); delay_ms: per link end (netem, where
    the kernel has it); ssh: start sshd in every host (needed by horovodrun); names: another name
    for each host, beside h0, h1, ... (e.g. the docs' host1, host2, so their commands run as printed).
    """

    def __init__(self, hosts: int = 2, rate: Any = None, delay_ms: float = 0.0, ssh: bool = False,
                 install_sshd: bool = True, verbose: bool = False, names: Sequence[str] = (),
                 held: bool = False) -> None:
        if not 1 <= int(hosts) <= MAX_HOSTS:
            raise NetClusterError(f"hosts={hosts}: must be 1..{MAX_HOSTS}")
        if names and len(names) != int(hosts):
            raise NetClusterError(f"names={list(names)}: one per host ({hosts})")
        self.names = tuple(names)
        self.held = held  # made by the command line's `up` (its holder): what run / torchrun / down act on
        if delay_ms < 0:
            raise NetClusterError(f"delay_ms={delay_ms}: must be >= 0")
        self.n = int(hosts)
        self.rate_bits = parse_rate(rate)
        self.delay_ms = float(delay_ms)
        self.ssh = bool(ssh)
        self.install_sshd = install_sshd
        self.verbose = verbose
        self.tag = ""
        self.hosts: list[Host] = []
        self.bridge_ns = ""
        self.tmpdir = ""
        self.netem: bool | None = None  # detected at up()
        self.delay_applied = False
        self.owner = True
        self._sshd: list[subprocess.Popen] = []
        self._sshd_pids: list[int] = []
        self._up = False
        self._ready = False
        self._owner = (os.getpid(), _proc_start(os.getpid()))
        self._old_handlers: dict[int, Any] = {}

    # ---- lifecycle
    def __enter__(self) -> "NetCluster":
        self._install_signal_handlers()
        try:
            self.up()
        except BaseException:
            try:
                self.down()
            finally:
                self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.down()
        finally:
            self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; its own handlers decide there

        def on_signal(signum: int, frame: Any) -> None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def up(self) -> "NetCluster":
        """Build the namespaces, the bridge, the links, the shaping (and sshd)."""
        if self._up:
            return self
        ok, why = availability()
        if not ok:
            raise NetClusterError(why)
        if shutil.which("tc") is None:
            raise NetClusterError("`tc` (iproute2) is not installed: links cannot be shaped")
        cleanup_stale()
        self.tag = f"{PREFIX}{os.getpid()}-{_next_seq()}"
        self.tmpdir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = [Host(k, f"{self.tag}-h{k}", f"{SUBNET}.{k + 1}") for k in range(self.n)]
        self._up = True  # from here on, down() has something to remove
        self._write_state(ready=False)
        br = self.bridge_ns
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0"])
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        machine = socket.gethostname()
        names = "".join(f"{x.addr} h{x.index}{' ' + self.names[x.index] if self.names else ''}\n"
                        for x in self.hosts)
        for h in self.hosts:
            port = f"p{h.index}"
            _run(["ip", "netns", "add", h.ns])
            # Inside host k, the machine's hostname resolves to host k's own address and h0, h1, ...
            # to the hosts: code that finds its address from the hostname (Gloo without an
            # interface name, e.g. Horovod 0.28's process-set contexts) then uses veth0, not lo.
            # The host's own name comes first on its line, so the reverse lookup of its address
            # (socket.getfqdn(): what torchrun's elastic agent tells the other nodes to reach it
            # at) gives a name every host resolves, not the machine's.
            etc = os.path.join(NETNS_ETC, h.ns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                own = f"{self.names[h.index]} h{h.index}" if self.names else f"h{h.index}"
                f.write(f"# netcluster {self.tag}, host {h.index}\n127.0.0.1 localhost\n"
                        f"{h.addr} {own} {machine}\n{names}")
            # both ends are created directly inside their namespaces: nothing appears in the root one
            _run(["ip", "link", "add", IFACE, "netns", h.ns, "type", "veth", "peer", "name", port,
                  "netns", br])
            _run(["ip", "-n", h.ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", IFACE])
            _run(["ip", "-n", h.ns, "link", "set", IFACE, "up"])
            _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE])
            _run(["ip", "-n", br, "link", "set", port, "up"])
        self.netem = self._detect_netem()
        self.shape(self.rate_bits, self.delay_ms)
        if self.ssh:
            self._start_sshd()
        self._write_state(ready=True)
        if self.verbose:
            print(f"netcluster: {self.describe()}", file=sys.stderr)
        return self

    def down(self) -> None:
        """Stop every process inside the hosts, delete the namespaces and the temp dir."""
        if not self._up or not self.owner:
            return
        blocked = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        old_mask = None
        if threading.current_thread() is threading.main_thread():
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # finish the teardown first
        try:
            _stop(self._sshd)
            for h in self.hosts:
                _remove_namespace(h.ns)
            _remove_namespace(self.bridge_ns)
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self._up = False
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def describe(self) -> str:
        rate = "unshaped" if self.rate_bits is None else f"{self.rate_bits / 1e6:g} Mbit/s"
        delay = f", delay {self.delay_ms:g} ms per link end" if self.delay_applied else ""
        hosts = ", ".join(f"h{h.index}={h.addr}" for h in self.hosts)
        return f"{self.tag}: {self.n} hosts ({hosts}) on {self.bridge_ns}, {rate}{delay}"

    # ---- shaping
    def _detect_netem(self) -> bool:
        probe = _run(["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", "lo", "root", "netem",
                      "delay", "1ms"], check=False)
        if probe.returncode == 0:
            _run(["tc", "-n", self.bridge_ns, "qdisc", "del", "dev", "lo", "root"], check=False)
        return probe.returncode == 0

    def _link_ends(self) -> list[tuple[str, str]]:
        return [(h.ns, IFACE) for h in self.hosts] + [(self.bridge_ns, f"p{h.index}") for h in self.hosts]

    def shape(self, rate: Any = None, delay_ms: float = 0.0) -> None:
        """Re-shape every host link: `rate` (None = unshaped) and `delay_ms` (netem), both ways."""
        bits = parse_rate(rate)
        if delay_ms < 0:
            raise NetClusterError(f"delay_ms={delay_ms}: must be >= 0")
        if self.netem is None:
            self.netem = self._detect_netem()
        use_delay = delay_ms > 0 and self.netem
        if delay_ms > 0 and not self.netem:
            print(f"netcluster: netem is not available in this kernel: links get the rate only, "
                  f"without the {delay_ms:g} ms delay", file=sys.stderr)
        for ns, dev in self._link_ends():
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            parent = ["root"]
            if use_delay:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                      "delay", f"{delay_ms:g}ms", "limit", "100000"])
                parent = ["parent", "1:1", "handle", "10:"]
            if bits:
                # burst: at least two 64 KiB GSO packets (veth hands tbf whole TSO segments),
                # 2 ms of traffic at high rates; queue: 50 ms at the rate
                burst = max(128 * 1024, int(bits / 8 * 0.002))
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{bits}bit",
                      "burst", str(burst), "latency", "50ms"])
        self.rate_bits, self.delay_ms, self.delay_applied = bits, float(delay_ms), bool(use_delay)
        if self.tmpdir and os.path.isdir(self.tmpdir):
            self._write_state()

    def link_stats(self) -> list[dict[str, int]]:
        """Bytes and packets each host's veth0 sent and received so far (kernel counters)."""
        out = []
        for h in self.hosts:
            proc = _run(["ip", "-n", h.ns, "-s", "-j", "link", "show", "dev", IFACE])
            st = json.loads(proc.stdout)[0]["stats64"]
            out.append({"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"],
                        "tx_packets": st["tx"]["packets"], "rx_packets": st["rx"]["packets"]})
        return out

    # ---- ssh
    def _start_sshd(self) -> None:
        sshd = ensure_sshd(self.install_sshd)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        d = self.tmpdir
        host_key, client_key = os.path.join(d, "ssh_host_ed25519_key"), os.path.join(d, "id_ed25519")
        for key in (host_key, client_key):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.tag, "-f", key])
            os.chmod(key, 0o600)
        shutil.copyfile(client_key + ".pub", os.path.join(d, "authorized_keys"))
        with open(os.path.join(d, "ssh_config"), "w") as f:
            f.write("Host *\n"
                    f"  IdentityFile {client_key}\n  IdentitiesOnly yes\n"
                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                    "  GlobalKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
                    "  ConnectTimeout 10\n  ServerAliveInterval 5\n  ServerAliveCountMax 6\n")
        bindir = os.path.join(d, "bin")
        os.makedirs(bindir)
        ssh = shutil.which("ssh") or "/usr/bin/ssh"
        wrapper = os.path.join(bindir, "ssh")
        with open(wrapper, "w") as f:
            f.write(f"#!/bin/sh\n# netcluster {self.tag}: the cluster's key and options\n"
                    f"exec {shlex.quote(ssh)} -F {shlex.quote(os.path.join(d, 'ssh_config'))} \"$@\"\n")
        os.chmod(wrapper, 0o755)
        for h in self.hosts:
            cfg = os.path.join(d, f"sshd_config_h{h.index}")
            with open(cfg, "w") as f:
                f.write(f"Port {SSH_PORT}\nListenAddress {h.addr}\nHostKey {host_key}\n"
                        f"AuthorizedKeysFile {os.path.join(d, 'authorized_keys')}\n"
                        f"PidFile {os.path.join(d, f'sshd_h{h.index}.pid')}\n"
                        "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
                        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                        "StrictModes no\nPrintMotd no\nPrintLastLog no\nMaxStartups 64\n"
                        "MaxSessions 64\nLogLevel ERROR\n")
            _run([sshd, "-t", "-f", cfg])
            log = open(os.path.join(d, f"sshd_h{h.index}.log"), "w")
            self._sshd.append(subprocess.Popen(["ip", "netns", "exec", h.ns, sshd, "-D", "-e", "-f", cfg],
                                               stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                               start_new_session=True))
            log.close()
        self._sshd_pids = [p.pid for p in self._sshd]
        # (a remote command runs under the user's shell, which may read a slow ~/.bashrc)
        deadline = time.monotonic() + 60.0
        for h in self.hosts:  # from host 0 (where horovodrun runs) to every host, the real path
            while True:
                probe = _run(["ip", "netns", "exec", self.hosts[0].ns, wrapper, h.addr, "true"],
                             timeout=15, check=False)
                if probe.returncode == 0:
                    break
                dead = [p for p in self._sshd if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    logs = "".join(open(os.path.join(d, f"sshd_h{k}.log")).read() for k in range(self.n))
                    raise NetClusterError(f"ssh to {h.addr} (host {h.index}) does not work: "
                                          f"{probe.stderr.strip()} {logs.strip()}")
                time.sleep(0.2)

    @property
    def ssh_bin(self) -> str:
        return os.path.join(self.tmpdir, "bin")

    @property
    def ssh_key(self) -> str:
        return os.path.join(self.tmpdir, "id_ed25519")

    # ---- launching
    def env(self, extra: dict | None = None, base: dict | None = None) -> dict:
        """The environment for commands inside the hosts: no launcher variables of ours, Gloo /
        NCCL / TensorPipe pinned to veth0, and (with ssh) the cluster's ssh first on PATH."""
        env = launcher_env(base)
        env.update(GLOO_SOCKET_IFNAME=IFACE, TP_SOCKET_IFNAME=IFACE, NCCL_SOCKET_IFNAME=IFACE,
                   HOROVOD_GLOO_IFACE=IFACE)
        if self.ssh:
            env["PATH"] = self.ssh_bin + os.pathsep + env.get("PATH", os.defpath)
        env.update(extra or {})
        return env

    def command(self, k: int, argv: Sequence[str]) -> list[str]:
        """argv run inside host k."""
        return ["ip", "netns", "exec", self.hosts[k].ns, *argv]

    def _reap(self) -> None:
        """Stop whatever a launch left inside the hosts (e.g. a remote worker whose ssh was
        killed); the sshds stay."""
        keep = set(self._sshd_pids)  # `ip netns exec` execs sshd: the Popen pid is the listener's
        for h in self.hosts:
            _kill_pids(p for p in _ns_pids(h.ns) if p not in keep)

    def launch(self, jobs: list[tuple[int, Sequence[str]]], timeout: float, env: dict | None = None,
               cwd: str | None = None, capture: bool = True, grace_s: float = 20.0) -> list[Result]:
        """Run every (host, argv) at once, each inside its host; bounded by `timeout` seconds."""
        self._check_up()
        if env is None:
            env = self.env()
        full = [(k, self.command(k, argv)) for k, argv in jobs]
        return _bounded(full, timeout, env, cwd, capture, grace_s, after=self._reap)

    def exec(self, k: int, argv: Sequence[str], timeout: float = 60.0, env: dict | None = None,
             cwd: str | None = None, capture: bool = True) -> Result:
        """argv inside host k, bounded by `timeout` seconds."""
        return self.launch([(k, argv)], timeout, env, cwd, capture)[0]

    def torchrun_commands(self, args: Sequence[str], nproc_per_node: int = 1,
                          port: int | None = None) -> list[list[str]]:
        """One `torchrun --nnodes N --node_rank k` per host, static rendezvous on host 0."""
        port = port or random.randint(20000, 39999)  # the namespaces are ours: any port is free
        return [launch_command("torchrun", nproc_per_node, [sys.executable, *args], [
            "--nnodes", str(self.n), "--node_rank", str(h.index), "--master_addr", self.hosts[0].addr,
            "--master_port", str(port), "--max_restarts", "0"]) for h in self.hosts]

    def torchrun(self, args: Sequence[str], nproc_per_node: int = 1, timeout: float = 300.0,
                 env: dict | None = None, cwd: str | None = None, capture: bool = True) -> list[Result]:
        """torchrun multi-node across the hosts (args follow torchrun's options: `-m trainer ...`)."""
        cmds = self.torchrun_commands(args, nproc_per_node)
        return self.launch(list(enumerate(cmds)), timeout, env, cwd, capture)

    def horovodrun_command(self, command: Sequence[str], slots: int = 1,
                           start_timeout: int = 60) -> list[str]:
        if not self.ssh:
            raise NetClusterError("horovodrun reaches the hosts over ssh: build the cluster with ssh=True")
        if not os.path.exists(horovodrun_path(sys.executable)):
            raise NetClusterError(f"horovodrun is not installed next to {sys.executable}")
        hosts = ",".join(f"h{h.index}:{slots}" for h in self.hosts)  # names from the hosts' /etc/hosts
        return launch_command("horovodrun", self.n * slots, command, [
            "-H", hosts, "--network-interfaces", IFACE, "-p", str(SSH_PORT), "--ssh-identity-file", self.ssh_key,
            "--start-timeout", str(int(start_timeout))], python=sys.executable)

    def horovodrun(self, command: Sequence[str], slots: int = 1, timeout: float = 300.0,
                   env: dict | None = None, cwd: str | None = None, capture: bool = True) -> Result:
        """`horovodrun -H h0:slots,h1:slots,... --gloo COMMAND` started on host 0, the others over
        ssh. COMMAND should use absolute paths (e.g. sys.executable); the environment (PYTHONPATH
        etc.) is exported to every host by horovodrun's gloo launcher."""
        argv = self.horovodrun_command(command, slots, start_timeout=min(60, max(10, int(timeout))))
        return self.launch([(0, argv)], timeout, env, cwd, capture)[0]

    def _check_up(self) -> None:
        if not self.hosts:
            raise NetClusterError("the cluster is not up")

    # ---- state (for the command line and cleanup_stale)
    def _write_state(self, ready: bool | None = None) -> None:
        if ready is not None:
            self._ready = ready
        state = {"tag": self.tag, "owner_pid": self._owner[0], "owner_start": self._owner[1],
                 "ready": self._ready, "hosts": [h.__dict__ for h in self.hosts], "bridge_ns": self.bridge_ns,
                 "iface": IFACE, "rate_bits": self.rate_bits, "delay_ms": self.delay_ms,
                 "delay_applied": self.delay_applied, "netem": self.netem, "ssh": self.ssh,
                 "tmpdir": self.tmpdir, "sshd_pids": self._sshd_pids, "held": self.held}
        path = os.path.join(self.tmpdir, "state.json")
        with open(path + ".tmp", "w") as f:
            json.dump(state, f, indent=1)
        os.replace(path + ".tmp", path)

    @classmethod
    def attach(cls, state_path: str) -> "NetCluster":
        """A handle on a cluster another process owns (the command line's holder): it can launch
        and shape, and never tears down."""
        with open(state_path) as f:
            st = json.load(f)
        c = cls(hosts=len(st["hosts"]), ssh=st["ssh"])
        c.tag, c.tmpdir, c.bridge_ns = st["tag"], st["tmpdir"], st["bridge_ns"]
        c.hosts = [Host(**h) for h in st["hosts"]]
        c.rate_bits, c.delay_ms, c.netem = st["rate_bits"], st["delay_ms"], st["netem"]
        c.delay_applied, c._sshd_pids, c.owner = st["delay_applied"], st["sshd_pids"], False
        c._ready, c._owner = st["ready"], (st["owner_pid"], st["owner_start"])
        return c


# ------------------------------------------------------------------ command line
def _clusters() -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}*-*-*", "state.json"))):
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, ValueError):
            continue
        if _alive(st["owner_pid"], st.get("owner_start")):
            st["state_path"] = path
            out.append(st)
    return out


def _find(tag: str | None) -> dict:
    live = [c for c in _clusters() if c.get("held")]  # not a cluster a program made for itself (a test's)
    if tag:
        live = [c for c in live if c["tag"] == tag]
    if not live:
        raise NetClusterError(f"no live cluster{' ' + tag if tag else ''}: start one with `up`")
    if len(live) > 1:
        raise NetClusterError("several live clusters: pick one with --tag (" +
                              ", ".join(c["tag"] for c in live) + ")")
    return live[0]


def _hold(a: argparse.Namespace) -> int:
    """The `up` holder: owns the cluster until SIGTERM (`down`) or the ttl."""
    with NetCluster(a.hosts, a.rate, a.delay_ms, a.ssh, verbose=False, held=True) as c:
        deadline = time.monotonic() + a.ttl
        while time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"netcluster: {c.tag}: ttl of {a.ttl:g}s reached, tearing down", file=sys.stderr)
    return 0


def _cmd_up(a: argparse.Namespace) -> int:
    ok, why = availability()
    if not ok:
        raise NetClusterError(why)
    before = {c["tag"] for c in _clusters()}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{PREFIX}-up-", suffix=".log", delete=False)
    argv = [sys.executable, "-m", "dev.netcluster", "_hold", "--hosts", str(a.hosts),
            "--rate", str(a.rate or "none"), "--delay-ms", str(a.delay_ms), "--ttl", str(a.ttl)]
    argv += ["--ssh"] if a.ssh else []
    holder = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                              start_new_session=True, cwd=ROOT)  # -m dev.netcluster: from the root
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        mine = [c for c in _clusters() if c["owner_pid"] == holder.pid and c["tag"] not in before]
        if mine and mine[0]["ready"]:
            st = mine[0]
            print(json.dumps({k: st[k] for k in ("tag", "hosts", "iface", "rate_bits", "delay_applied",
                                                 "netem", "ssh", "state_path", "owner_pid")}))
            os.unlink(log.name)
            return 0
        if holder.poll() is not None:
            break
        time.sleep(0.2)
    if holder.poll() is None:
        os.kill(holder.pid, signal.SIGTERM)
        holder.wait(60)
    log.seek(0)
    text = log.read()
    os.unlink(log.name)
    raise NetClusterError(f"the cluster did not come up within {a.timeout:g}s:\n{text[-3000:]}")


def _cmd_down(a: argparse.Namespace) -> int:
    st = _find(a.tag)
    os.kill(st["owner_pid"], signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(st["owner_pid"], st.get("owner_start")):
        time.sleep(0.1)
    left = [ns for ns in _namespaces() if ns.startswith(st["tag"] + "-")]
    if left:
        raise NetClusterError(f"{st['tag']}: namespaces left after down: {left} (try cleanup-stale)")
    print(f"netcluster: {st['tag']} is down", file=sys.stderr)
    return 0


def _remainder(a: argparse.Namespace) -> list[str]:
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise NetClusterError("no command given (put it after --)")
    return cmd


def _report(results: list[Result]) -> int:
    for r in results:
        if r.timed_out:
            print(f"netcluster: host {r.host}: stopped after the timeout", file=sys.stderr)
    return max((0 if r.ok else (124 if r.timed_out else (r.returncode or 1))) for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.netcluster", description="Emulated multi-host cluster "
                                 "(network namespaces on a bridge, tc-shaped links).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("up", "_hold"):
        p = sub.add_parser(name, help="start a cluster held by a background process" if name == "up" else None)
        p.add_argument("--hosts", type=int, default=2)
        p.add_argument("--rate", default=None, help="per host link, both ways: 1gbit, 200mbit; none = unshaped")
        p.add_argument("--delay-ms", type=float, default=0.0, help="netem delay per link end (if the kernel has netem)")
        p.add_argument("--ssh", action="store_true", help="start sshd in every host (for horovodrun)")
        p.add_argument("--ttl", type=float, default=3600.0, help="tear down by itself after this many seconds")
        p.add_argument("--timeout", type=float, default=600.0, help="up: give up if not ready by then")
    for name, hlp in (("run", "run a command inside one host"), ("torchrun", "torchrun multi-node across the hosts"),
                      ("horovodrun", "horovodrun over ssh across the hosts")):
        p = sub.add_parser(name, help=hlp)
        p.add_argument("--tag")
        p.add_argument("--timeout", type=float, default=600.0)
        if name == "run":
            p.add_argument("--host", type=int, default=0)
        if name == "torchrun":
            p.add_argument("--nproc-per-node", type=int, default=1)
        if name == "horovodrun":
            p.add_argument("--slots", type=int, default=1)
        p.add_argument("command", nargs=argparse.REMAINDER)
    p = sub.add_parser("shape", help="re-shape the links of a live cluster")
    p.add_argument("--tag")
    p.add_argument("--rate", default=None)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p = sub.add_parser("down", help="tear a cluster down")
    p.add_argument("--tag")
    sub.add_parser("status", help="list live clusters")
    p = sub.add_parser("cleanup-stale", help="remove leftovers of dead runs")
    p.add_argument("--prefix", default=PREFIX)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "_hold":
            return _hold(a)
        if a.cmd == "up":
            return _cmd_up(a)
        if a.cmd == "down":
            return _cmd_down(a)
        if a.cmd == "status":
            for st in _clusters():
                print(json.dumps({k: st[k] for k in ("tag", "owner_pid", "hosts", "rate_bits", "delay_applied", "ssh")}))
            return 0
        if a.cmd == "cleanup-stale":
            if not a.prefix.startswith(PREFIX):
                raise NetClusterError(f"--prefix must start with {PREFIX}")
            removed = cleanup_stale(a.prefix, verbose=True)
            print(json.dumps({"removed": removed}))
            return 0
        c = NetCluster.attach(_find(a.tag)["state_path"])
        if a.cmd == "shape":
            c.shape(a.rate, a.delay_ms)
            return 0
        cmd = _remainder(a)
        if a.cmd == "run":
            if not 0 <= a.host < c.n:
                raise NetClusterError(f"--host {a.host}: the cluster has hosts 0..{c.n - 1}")
            return _report([c.exec(a.host, cmd, a.timeout, capture=False)])
        if a.cmd == "torchrun":
            return _report(c.torchrun(cmd, a.nproc_per_node, a.timeout, capture=False))
        return _report([c.horovodrun(cmd, a.slots, a.timeout, capture=False)])
    except NetClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
