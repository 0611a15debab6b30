"""Ray start-up and resource mapping: the one place that says how the config becomes Ray requests.

    init_ray(cfg)                                   # RAY_ADDRESS / cluster.address, else a private local instance
    placement(cfg.cluster, num_cpus=1, num_gpus=1)  # -> {"num_cpus": 1, "num_gpus": 1} or a custom resource
    featurize_gpus(cfg)                             # -> GPUs a featurize actor asks for (0 on the CPU)
    train_resources(cfg.cluster, cpus, gpus, use_gpu)  # -> (ScalingConfig use_gpu, resources_per_worker)

The driver (`pipeline/run.py`), the trainer, offline captioning, the preprocess job and the
Serve app all ask here, so the rule is the same everywhere:

- GPU work (a unit that asks for GPUs: caption actors, Serve replicas with
  `num_gpus_per_replica`, train workers with `use_gpu`, feature actors on `cuda`) asks for
  `cluster.gpu_resource`. `"GPU"` is Ray's own GPU resource (`num_gpus`); any other name
  is a custom resource that nodes advertise (`ray start --resources '{"sim_gpu": 4}'`),
  for accelerators Ray does not detect, or to stand in for GPUs on a simulated cluster
  (`tests/test_cluster_sim.py`). With `cluster.accelerator_type` set, GPU work also asks for
  Ray's `accelerator_type` (e.g. "H100", "A100", "L4"), so it lands only on nodes of that type.
- CPU work (a unit that asks for no GPU) asks, when `cluster.cpu_node_resource` is set, for a
  sliver (`CPU_NODE_SHARE`) of that custom resource, which only CPU nodes advertise: decoding
  and featurizing then never take the CPUs of a GPU node.

Pure python until `init_ray` is called (no ray import at module level).
"""

from __future__ import annotations

import os
from typing import Any

from pipeline.config import ClusterConfig, Config, ConfigError

GPU = "GPU"
# What one CPU unit asks of the CPU-node marker resource: small enough that a node
# advertising 1 of it holds any number of units (the CPUs are what limits them).
CPU_NODE_SHARE = 0.001


def init_ray(cfg: Config) -> None:
    """Connect to the cluster the config names (`cluster.address`, else `RAY_ADDRESS`), or start a
    private local instance on 127.0.0.1 with `cluster.num_cpus` CPUs (0 = all). No-op if connected.

    The private instance is asked for by address "local": with no address, ray.init would attach to
    the last cluster `ray start` left on this machine (its /tmp/ray/ray_current_cluster, stale after a
    killed one) and then refuse the CPU count."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind to 127.0.0.1
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local instance
        kwargs: dict[str, Any] = {"address": "local", "include_dashboard": False, "_node_ip_address": "127.0.0.1"}
        if cfg.cluster.num_cpus:
            kwargs["num_cpus"] = cfg.cluster.num_cpus
        ray.init(**kwargs)


def placement(cc: ClusterConfig, num_cpus: float, num_gpus: float = 0.0) -> dict[str, Any]:
    """Ray remote options (`num_cpus`, `num_gpus`, `resources`, `accelerator_type`) for one actor,
    task or replica that needs `num_cpus` CPUs and `num_gpus` GPUs, by the rule of this module."""
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    resources: dict[str, float] = {}
    if num_gpus > 0:
        if cc.gpu_resource != GPU:  # a custom resource: no CUDA device is assigned with it
            resources[cc.gpu_resource] = num_gpus
        else:
            opts["num_gpus"] = num_gpus
        if cc.accelerator_type:
            opts["accelerator_type"] = cc.accelerator_type
    elif cc.cpu_node_resource:
        resources[cc.cpu_node_resource] = CPU_NODE_SHARE
    if resources:
        opts["resources"] = resources
    return opts


def featurize_gpus(cfg: Config, encodes: bool = True) -> float:
    """GPUs one featurize actor (preprocessing's, offline captioning's) asks for: with features.device=cuda,
    `cluster.preprocess_gpus_per_actor`, so its encoders find a device there; none when they run on the
    CPU, or elsewhere (`encodes` False: offline captioning with the release encoders online, whose
    featurize actors only prepare the media while the caption actor encodes).

    >>> cfg = Config()
    >>> featurize_gpus(cfg), cfg.features.device
    (0.0, 'auto')
    >>> cfg.features.device = "cuda"
    >>> featurize_gpus(cfg), featurize_gpus(cfg, encodes=False)
    (1.0, 0.0)
    >>> cfg.cluster.preprocess_gpus_per_actor = 0
    >>> featurize_gpus(cfg)
    Traceback (most recent call last):
    pipeline.config_build.ConfigError: features.device=cuda needs cluster.preprocess_gpus_per_actor > 0 (got 0): a featurize actor without a GPU has no CUDA device
    """
    if cfg.features.device != "cuda" or not encodes:
        return 0.0
    gpus = cfg.cluster.preprocess_gpus_per_actor
    if gpus <= 0:
        raise ConfigError(f"features.device=cuda needs cluster.preprocess_gpus_per_actor > 0 (got {gpus:g}): "
                          "a featurize actor without a GPU has no CUDA device")
    return float(gpus)


def train_resources(cc: ClusterConfig, cpus: float, gpus: float, use_gpu: bool) -> tuple[bool, dict[str, float], str | None]:
    """Ray Train's form of `placement` for one worker: (ScalingConfig.use_gpu, resources_per_worker,
    accelerator_type). With a custom GPU resource the worker takes it but Ray assigns no CUDA
    device, so the loop runs on the CPU (what a simulated GPU node is for)."""
    opts = placement(cc, cpus, gpus if use_gpu else 0.0)
    resources = {"CPU": cpus, **opts.get("resources", {})}
    if "num_gpus" in opts:
        resources[GPU] = opts["num_gpus"]
    return "num_gpus" in opts, resources, opts.get("accelerator_type")
