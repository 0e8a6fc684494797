"""A real two-node Ray cluster on this machine, each node started with `ray start` (its own
GCS-connected raylet, object store and agents, in a temp dir and on ports of its own), and
`tandem serve --address ...` in front of it: what an operator runs on two hosts, on one.

Two raylets on one host need two node addresses: the head takes the address Ray picks for
this machine, the second node 127.0.0.2 (all of 127.0.0.0/8 is loopback on Linux, nothing to
set up). Every port that Ray would otherwise take at a fixed default (8265, 10001, 52365,
worker ports 10002-19999) is a free one, so that this cluster never meets another Ray on the
machine. Cleanup never runs `ray stop` (it stops every Ray on the machine, other tests'
too): each `ray start` runs in a session of its own, and its process group, with the Ray
worker processes its raylet spawned (each in a group of its own), is killed by id.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
TANDEM = str(BIN / "tandem")
SECOND_NODE_IP = "127.0.0.2"
KV_SECRET = "the-two-node-test-kv-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_env() -> dict[str, str]:
    """The environment of every process of the cluster: this one's (TRITON_INTERPRET and
    the model cache reach the workers through their raylet), with Ray's token authentication
    off and no usage stats. (Ray 2.60: a head that finds a token, ~/.ray/auth_token, which
    any local ray.init() such as the other cluster tests' writes, turns authentication on,
    and a node joining with `ray start --address` then fails unless told RAY_AUTH_MODE=token.)
    The KV sockets between the nodes are encrypted with the keys of KV_SECRET."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TANDEM_KV_SECRET=KV_SECRET)
    for name in ("RAY_ADDRESS", "TANDEM_AUTH_TOKEN"):
        env.pop(name, None)
    return env


@dataclass
class Started:
    """A process this test started in a session of its own (its id is its group's)."""
    name: str
    process: subprocess.Popen
    log: Path
    children: set[psutil.Process] = field(default_factory=set)

    def tail(self, chars: int = 4000) -> str:
        try:
            return f"--- {self.name} ({self.log}) ---\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"--- {self.name}: {e}"

    def remember_children(self) -> None:
        """Every process in its group now, and their children (Ray workers: their raylet
        puts each in a group of its own), so that stop() finds them all."""
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.process.pid:
                    self.children.add(p)
                    self.children.update(p.children(recursive=True))
            except (psutil.Error, ProcessLookupError):
                pass

    def signal(self, sig: int) -> None:
        """`sig` to its group, and to the children found (see remember_children)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)
        for p in self.children:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def alive(self) -> bool:
        if self.process.poll() is None:
            return True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, 0)
            return True
        return any(_running(p) for p in self.children)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class TwoNodeRay:
    """A head node and a second node, each with one pool's custom resource and one CPU."""

    def __init__(self, root: Path, head_resources: dict[str, float], node_resources: dict[str, float]) -> None:
        self.root = root
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        """The head's API server (started even without the dashboard): `ray start` would take
        8265 and fail when another Ray holds it."""
        self.started: list[Started] = []
        self.probes: list[InventoryProbe] = []
        self.head_resources = head_resources
        self.node_resources = node_resources

    @property
    def address(self) -> str:
        """What `ray start --address` and `tandem serve --address` take (Ray itself turns
        127.0.0.1 into the head's node address)."""
        return f"127.0.0.1:{self.gcs_port}"

    def _ray_start(self, name: str, args: list[str]) -> None:
        argv = [RAY, "start", *args, "--num-cpus=1", "--object-store-memory=100000000",
                f"--temp-dir={self.root / name}", f"--dashboard-agent-listen-port={free_port()}",
                "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats"]
        started = self.popen(f"ray-{name}", argv)
        if started.process.wait(timeout=120) != 0:
            raise RuntimeError(f"`ray start` failed for the {name} node\n{started.tail()}")
        started.remember_children()

    def start(self) -> None:
        self._ray_start("head", ["--head", f"--port={self.gcs_port}", f"--resources={json.dumps(self.head_resources)}",
                                 "--include-dashboard=false", f"--dashboard-port={self.dashboard_port}", "--no-monitor",
                                 f"--ray-client-server-port={free_port()}"])
        self._ray_start("node", [f"--address={self.address}", f"--node-ip-address={SECOND_NODE_IP}",
                                 f"--resources={json.dumps(self.node_resources)}"])

    def popen(self, name: str, argv: list[str]) -> Started:
        """Start a process (e.g. `tandem serve`) in a session of its own, logging to a file;
        stopped before the Ray nodes."""
        log = self.root / f"{name}.log"
        with log.open("w") as out:
            process = subprocess.Popen(argv, env=ray_env(), stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        started = Started(name, process, log)
        self.started.append(started)
        return started

    def inventory_probe(self, namespace: str, names: list[str]) -> InventoryProbe:
        """An InventoryProbe of this cluster's workers `names` (in the Ray `namespace` of
        the driver that started them), closed with the cluster."""
        probe = InventoryProbe(self.address, namespace, names)
        self.probes.append(probe)
        return probe

    def stop(self) -> None:
        """Every process started: the drivers (`tandem serve`) first, given time to stop
        their workers, then both nodes at once (SIGTERM; SIGKILL after a few seconds)."""
        for probe in self.probes:
            probe.close()
        drivers = [s for s in self.started if not s.name.startswith("ray-")]
        nodes = [s for s in self.started if s.name.startswith("ray-")]
        for group, grace in ((drivers, 20.0), (nodes, 1.0)):
            for s in group:
                s.remember_children()
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                for s in group:
                    s.signal(sig)
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and any(s.alive() for s in group):
                    time.sleep(0.1)

    def tails(self) -> str:
        return "\n".join(s.tail() for s in self.started)


@contextlib.contextmanager
def two_node_ray(head_resources: dict[str, float], node_resources: dict[str, float]) -> Iterator[TwoNodeRay]:
    """A started TwoNodeRay, stopped on every exit. Its temp dir is short (Ray's socket paths
    must fit in 107 bytes) and kept only when the test failed."""
    root = Path(tempfile.mkdtemp(prefix="tnd-", dir="/tmp"))
    cluster = TwoNodeRay(root, head_resources, node_resources)
    ok = False
    try:
        cluster.start()
        yield cluster
        ok = True
    except BaseException:
        print(f"two-node Ray in {root}:\n{cluster.tails()}", file=sys.stderr)
        raise
    finally:
        cluster.stop()
        if ok:
            shutil.rmtree(root, ignore_errors=True)


def wait_for_line(started: Started, needle: str, timeout: float) -> str:
    """Wait until `needle` appears in the process's log; -> that line. Fails, with the log,
    when the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        text = started.log.read_text(errors="replace")
        for line in text.splitlines():
            if needle in line:
                return line
        if started.process.poll() is not None:
            raise AssertionError(f"{started.name} exited ({started.process.returncode}) before {needle!r}\n"
                                 f"{started.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {needle!r} from {started.name} within {timeout} s\n{started.tail()}")
        time.sleep(0.25)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return response.read().decode()


@dataclass(frozen=True)
class ActorPlace:
    name: str
    namespace: str
    node_id: str
    node_ip: str
    pid: int


def live_actors(address: str) -> dict[str, ActorPlace]:
    """Every live named actor of the cluster and where it runs, from the GCS's own tables
    (ray.util.state's list_actors needs the dashboard, which a minimal Ray install lacks).
    Works from any process: this one need not be (and, in a session that also runs the
    one-Ray cluster tests, is not) a driver of this cluster."""
    from ray._private.internal_api import get_state_from_address
    from ray.core.generated import gcs_pb2

    state = get_state_from_address(address)
    # ray's gcs_pb2 has no stubs: protobuf makes its classes when it is imported.
    alive = gcs_pb2.ActorTableData.ActorState.Value("ALIVE")  # type: ignore[attr-defined]
    places = {}
    for raw in state._connect_and_get_accessor().get_actor_table(None, None):
        actor = gcs_pb2.ActorTableData.FromString(raw)  # type: ignore[attr-defined]
        if actor.name and actor.state == alive:
            places[actor.name] = ActorPlace(actor.name, actor.ray_namespace, actor.address.node_id.hex(),
                                            actor.address.ip_address, actor.pid)
    return places


def nodes(address: str) -> dict[str, dict]:
    """The cluster's live nodes by node id: {"NodeManagerAddress", "Resources", ...}."""
    from ray._private.internal_api import get_state_from_address

    return {n["NodeID"]: n for n in get_state_from_address(address).node_table() if n["Alive"]}


_INVENTORIES = """
import json, sys, time
import ray
address, namespace, timeout, *names = sys.argv[1:]
ray.init(address=address, namespace=namespace, logging_level="ERROR", log_to_driver=False)
handles = [ray.get_actor(name) for name in names]
sys.stdin.read()  # connected: wait for the word (stdin closed)
deadline = time.monotonic() + float(timeout)
while True:
    found = {i.instance: i.leaks() for i in ray.get([h.inventory.remote() for h in handles], timeout=30)}
    if not any(found.values()) or time.monotonic() > deadline:
        break
    time.sleep(0.1)
print("LEAKS " + json.dumps(found))
"""


class InventoryProbe:
    """What each named worker still holds (WorkerInventory.leaks, the check of
    tests/worker_checks.py), asked through Ray by a driver of its own: a subprocess (see
    live_actors), started ahead (connecting takes seconds) and asked once with `leaks`."""

    def __init__(self, address: str, namespace: str, names: list[str], timeout: float = 15) -> None:
        self.timeout = timeout
        self.process = subprocess.Popen([sys.executable, "-c", _INVENTORIES, address, namespace, str(timeout), *names],
                                        env=ray_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)

    def leaks(self) -> dict[str, list[str]]:
        """Wait up to `timeout` for every worker to be at rest: -> {name: what it holds}, all
        [] at rest."""
        try:
            out, err = self.process.communicate("", timeout=self.timeout + 120)
        finally:
            self.close()
        for line in out.splitlines():
            if line.startswith("LEAKS "):
                return json.loads(line[len("LEAKS "):])
        raise AssertionError(f"no inventories (exit {self.process.returncode}):\n{out[-3000:]}\n{err[-3000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def tcp_links(pid: int) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """-> (the addresses process `pid` listens on, the remote addresses of its established
    TCP connections)."""
    listening, connected = set(), set()
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN:
            listening.add((c.laddr.ip, c.laddr.port))
        elif c.status == psutil.CONN_ESTABLISHED and c.raddr:
            connected.add((c.raddr.ip, c.raddr.port))
    return listening, connected
