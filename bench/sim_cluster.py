"""A simulated multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), and where actors ran.

    sim = SimCluster.start()             # head (0 CPUs, the driver) + 2 CPU nodes + 1 "GPU" node
    cfg = load_config(preset, [*SIM_OVERRIDES, ...])   # GPU work asks for `sim_gpu`, CPU work for `cpu_node`
    sim.kinds_of(actor_nodes("FeaturizeVideos"))       # -> {"cpu"}: the kinds of node those actors ran on
    sim.remove(node) ; sim.add("cpu") ; sim.shutdown()

Shared by bench/autoscale.py and the node-loss tests (tests/test_cluster_sim.py), so it lives with
the benchmarks: no product or bench module imports test code. Every node is a real raylet with its own object store (capped small: a raylet per node is
memory hungry), bound to 127.0.0.1. The "GPU" node advertises the custom resource
`sim_gpu` instead of GPUs (there are none); the CPU nodes advertise `cpu_node`. The head
has no CPUs (like `cluster/ray-cluster.yaml`'s head) and runs the dashboard, which the state
API (`ray.util.state`) reads. Placement is read from that API, never from logs. Serve's
autoscaling metrics are pushed every `METRIC_PUSH_S` seconds (Ray's default is 10 s) so
that scaling decisions come in seconds; the variables are set before the raylets start,
whose workers inherit them.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Read when ray is imported: import this module (or set these) before ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every service binds to 127.0.0.1
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ROOT = Path(__file__).resolve().parents[2]
GPU_RESOURCE = "sim_gpu"
CPU_RESOURCE = "cpu_node"
SIM_OVERRIDES = [f"cluster.gpu_resource={GPU_RESOURCE}", f"cluster.cpu_node_resource={CPU_RESOURCE}"]
OBJECT_STORE_BYTES = 120 * 1024 * 1024
METRIC_PUSH_S = "0.5"
NODE_SHAPES: dict[str, dict[str, Any]] = {
    "cpu": {"num_cpus": 3, "resources": {CPU_RESOURCE: 1.0}},
    "gpu": {"num_cpus": 2, "resources": {GPU_RESOURCE: 2.0}},
}


@dataclass
class SimCluster:
    """The cluster and the kind (head / cpu / gpu) of every node it ever had, by node id."""

    cluster: Any
    nodes: dict[str, list[Any]] = field(default_factory=lambda: {"cpu": [], "gpu": []})
    kind_by_id: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, cpu_nodes: int = 2, gpu_nodes: int = 1) -> SimCluster:
        import ray
        from ray.cluster_utils import Cluster

        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", METRIC_PUSH_S)
        os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", METRIC_PUSH_S)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES, "node_ip_address": "127.0.0.1",
            "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port()})
        sim = cls(cluster)
        sim.kind_by_id[cluster.head_node.node_id] = "head"
        for _ in range(cpu_nodes):
            sim.add("cpu")
        for _ in range(gpu_nodes):
            sim.add("gpu")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        return sim

    def add(self, kind: str):
        node = self.cluster.add_node(object_store_memory=OBJECT_STORE_BYTES, node_ip_address="127.0.0.1",
                                     **NODE_SHAPES[kind])
        self.nodes[kind].append(node)
        self.kind_by_id[node.node_id] = kind
        return node

    def remove(self, node) -> None:
        """Kill a worker node (all its processes), as a lost machine."""
        for kind, nodes in self.nodes.items():
            if node in nodes:
                nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def node(self, node_id: str):
        return next(n for nodes in self.nodes.values() for n in nodes if n.node_id == node_id)

    def kinds_of(self, node_ids) -> set[str]:
        return {self.kind_by_id.get(n, f"unknown:{n}") for n in node_ids}

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def actors(name: str, alive_only: bool = False) -> list[Any]:
    """Actors (any state, unless `alive_only`) whose class or repr name contains `name`, from the
    state API: e.g. "FeaturizeVideos" (a Ray Data actor pool's `MapWorker(...)`), "ServeReplica",
    "RayTrainWorker"."""
    from ray.util.state import list_actors

    filters = [("state", "=", "ALIVE")] if alive_only else None
    found = list_actors(filters=filters, detail=True, limit=10000, raise_on_missing_output=False)
    return [a for a in found if name in (a.class_name or "") or name in (a.repr_name or "")]


def actor_nodes(name: str, alive_only: bool = False) -> list[str]:
    """The node ids the matching actors ran (or run) on."""
    return [a.node_id for a in actors(name, alive_only) if a.node_id]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the dashboard)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def box_scale() -> float:
    """How much longer than on an idle box things may take here: `PADCAP_TEST_TIME_SCALE` when set,
    else the 1-minute load average per core (at least 1, at most 4). Deadlines (never the
    expected outcome) are multiplied by it, so a loaded box waits longer instead of failing."""
    env = os.environ.get("PADCAP_TEST_TIME_SCALE")
    if env:
        return max(1.0, float(env))
    return min(4.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """`seconds` (a deadline measured on an idle box) times `box_scale()`."""
    return seconds * box_scale()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    """Poll `predicate` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
