"""Cluster files: the Ray launcher YAML, the KubeRay manifests, the Serve config and the image.

Each file is checked against the schema of the tool that consumes it (ray's own
ray-schema.json and `ray up` checks, Ray Serve's ServeDeploySchema, KubeRay's
ray.io/v1 shape) and against the project: entrypoints name files that exist,
presets load, deployment options equal the preset's `serve:` section, node and
pod sizes fit the actors the multi-node preset asks for, model paths lie on a
mounted volume. Nothing here starts Ray.

    .venv/bin/python -m pytest tests/test_cluster_files.py -q
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml

from pipeline.cluster import featurize_gpus
from pipeline.config import Config, ServeConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHER = CLUSTER / "ray-cluster.yaml"
SERVE_YAML = CLUSTER / "serve.yaml"
SERVE_FILES = [SERVE_YAML, CLUSTER / "serve-gpu.yaml"]
RAYJOB = CLUSTER / "kuberay" / "rayjob.yaml"
RAYSERVICE = CLUSTER / "kuberay" / "rayservice.yaml"
DOCKERFILE = CLUSTER / "Dockerfile"
PRESETS = sorted((CLUSTER / "configs").glob("*.yaml"))
MULTI_NODE = CLUSTER / "configs" / "multi-node.yaml"
RAY_SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"


# ----------------------------------------------------------------------------- helpers


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _lock_pin(name: str) -> str:
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        m = re.match(rf"^{re.escape(name)}(\[[^\]]*\])?==([^\s;#]+)", line.strip(), re.IGNORECASE)
        if m:
            return m.group(2)
    raise AssertionError(f"{name} is not pinned in requirements.lock")


RAY_VERSION = _lock_pin("ray")


def _docker_image_repo_dir() -> str:
    """The directory the Dockerfile copies the repo into (`COPY ... . <dir>`)."""
    for line in DOCKERFILE.read_text().splitlines():
        parts = line.split()
        if parts and parts[0] == "COPY" and len(parts) >= 3 and parts[-2] == ".":
            return parts[-1].rstrip("/")
    raise AssertionError("cluster/Dockerfile does not COPY the repo (`COPY . <dir>`)")


def _repo_file(path: str, repo_dir: str | None = None) -> Path:
    """A path as a cluster file names it (repo-relative, or inside the image's repo dir)."""
    if repo_dir and path.startswith(repo_dir + "/"):
        path = path[len(repo_dir) + 1:]
    assert not path.startswith("/"), f"{path} is neither repo-relative nor inside the image's repo dir"
    return ROOT / path


def _under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def _local_model_paths(cfg: Config) -> list[str]:
    """Model paths the preset reads from local disk (must exist on every node)."""
    paths = [cfg.features.vision_path, cfg.features.audio_path]
    if cfg.model.backbone.startswith("/"):
        paths.append(cfg.model.backbone)
    return [p for p in paths if p]


def _cpu_quantity(q: str | int | float) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def _pods(manifest: dict) -> Iterator[tuple[str, dict, int]]:
    """(group name, pod spec, max replicas) for the head and every worker group."""
    spec = manifest["spec"]
    cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]["spec"], 1
    for group in cluster.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]["spec"], int(group["maxReplicas"])


def _pod_resources(pod: dict) -> dict[str, float]:
    """What a Ray pod advertises: CPU and GPU from its (first) container's limits."""
    limits = pod["containers"][0]["resources"]["limits"]
    return {"CPU": _cpu_quantity(limits.get("cpu", 0)), "GPU": float(limits.get("nvidia.com/gpu", 0))}


def _fits(demand: dict[str, float], resources: dict[str, float]) -> bool:
    return all(resources.get(k, 0) >= v for k, v in demand.items() if v)


def _deployment_from_serve_config(serve: ServeConfig) -> dict[str, Any]:
    """The deployment options a Serve config must carry for this ServeConfig."""
    return {
        "max_ongoing_requests": serve.max_ongoing_requests,
        "max_queued_requests": serve.max_queued_requests,
        "autoscaling_config": {
            "min_replicas": serve.min_replicas,
            "max_replicas": serve.max_replicas,
            "target_ongoing_requests": serve.target_ongoing_requests,
            "upscale_delay_s": serve.upscale_delay_s,
            "downscale_delay_s": serve.downscale_delay_s,
            "look_back_period_s": serve.look_back_period_s,
            "metrics_interval_s": serve.metrics_interval_s,
        },
        "ray_actor_options": {"num_cpus": serve.num_cpus_per_replica, "num_gpus": serve.num_gpus_per_replica},
    }


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads(path):
    assert isinstance(load_config(path), Config)


def test_ray_pin_is_the_installed_ray():
    assert ray.__version__ == RAY_VERSION


# ----------------------------------------------------------------------------- launcher


def test_launcher_validates_against_rays_schema():
    schema = json.loads(RAY_SCHEMA.read_text())
    cfg = _yaml(LAUNCHER)
    jsonschema.validate(cfg, schema)
    # the check has teeth: a misspelt key and a fractional resource are rejected
    bad = copy.deepcopy(cfg)
    bad["max_worker"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = copy.deepcopy(cfg)
    bad["available_node_types"]["gpu"]["resources"]["GPU"] = 0.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_launcher_passes_ray_up_config_checks():
    """What `ray up` runs on the config before it contacts the cloud."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_yaml(LAUNCHER))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_launcher_image_repo_and_setup():
    cfg = _yaml(LAUNCHER)
    image = cfg["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{RAY_VERSION}-py311"), image
    repo = [remote for remote, local in cfg["file_mounts"].items() if local in (".", "./")]
    assert len(repo) == 1, "file_mounts must bring the repo root (.) to the nodes"
    repo_dir = repo[0].rstrip("/")
    assert ".gitignore" in cfg.get("rsync_filter", []), "the venv and runs/ must not be synced"
    assert any(re.search(rf"pip install .*-r {re.escape(repo_dir)}/requirements\.lock", c)
               for c in cfg["setup_commands"]), cfg["setup_commands"]
    assert f"--env PYTHONPATH={repo_dir}" in cfg["docker"]["run_options"]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = [c for c in cfg[key] if "ray start" in c]
        assert len(start) == 1 and f"cd {repo_dir}" in start[0], key
    assert "--head" in " ".join(cfg["head_start_ray_commands"])
    assert "$RAY_HEAD_IP:6379" in " ".join(cfg["worker_start_ray_commands"])


def test_launcher_node_types():
    cfg = _yaml(LAUNCHER)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("CPU") == 0, "nothing but the driver should run on the head"
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    gpu = [v for v in workers.values() if v["resources"].get("GPU", 0) > 0]
    cpu = [v for v in workers.values() if v["resources"].get("GPU", 0) == 0 and v["resources"].get("CPU", 0) > 0]
    assert gpu and cpu
    for t in workers.values():
        assert t["min_workers"] == 0 and t["max_workers"] > 0, "worker types autoscale from zero"
    assert sum(t["max_workers"] for t in workers.values()) <= cfg["max_workers"]


def test_the_one_gpu_presets_caption_on_their_one_gpu():
    """Offline captioning runs its featurize pool and its caption pool at once, each of at least one actor:
    on the one-GPU-box presets both fit the box's GPU (a model trained with the preset keeps its features;
    a release checkpoint encodes in the caption actor), and preprocessing's whole pool fits it too."""
    from infer.loading import release_config
    from infer.offline.job import featurizers_encode

    for name, release in (("gpu-1.yaml", False), ("release-3b.yaml", True)):
        cfg = load_config(CLUSTER / "configs" / name)
        captioning = release_config(cfg, Path(cfg.features.release_path)) if release else cfg
        pools = featurize_gpus(captioning, featurizers_encode(captioning)) + cfg.cluster.caption_gpus_per_actor
        assert pools <= 1.0, f"{name}: captioning needs {pools:g} GPUs at once on a one-GPU box"
        assert featurize_gpus(cfg) <= 1.0 and cfg.cluster.caption_gpus_per_actor <= 1.0


def test_launcher_fits_the_multi_node_preset():
    cfg = load_config(MULTI_NODE)
    launcher = _yaml(LAUNCHER)
    workers = [v for k, v in launcher["available_node_types"].items() if k != launcher["head_node_type"]]
    _check_capacity(cfg, [(t["resources"], t["max_workers"]) for t in workers])
    volumes = [opt.split()[1].split(":")[1] for opt in launcher["docker"]["run_options"] if opt.startswith("--volume")]
    for path in _local_model_paths(cfg):
        assert _under(path, volumes), f"{path} is not on a volume mounted into the container ({volumes})"


def _check_capacity(cfg: Config, node_types: list[tuple[dict[str, float], int]]) -> None:
    """Every actor the preset asks for fits on some node type; gang-scheduled groups fit in total."""
    t, c, s = cfg.train, cfg.cluster, cfg.serve
    demands = {
        "train worker": {"CPU": t.cpus_per_worker, "GPU": t.gpus_per_worker if t.use_gpu else 0},
        "caption actor": {"CPU": c.caption_cpus_per_actor, "GPU": c.caption_gpus_per_actor},
        "preprocess actor": {"CPU": c.preprocess_cpus_per_actor, "GPU": featurize_gpus(cfg)},
        "serve replica": {"CPU": s.num_cpus_per_replica, "GPU": s.num_gpus_per_replica},
    }
    for name, demand in demands.items():
        assert any(_fits(demand, res) for res, _ in node_types), f"no node type fits a {name} {demand}"
    gpus = sum(res.get("GPU", 0) * n for res, n in node_types)
    assert gpus >= t.num_workers * t.gpus_per_worker, "all train workers must be placeable at once"
    assert gpus >= s.max_replicas * s.num_gpus_per_replica
    # CPU-only preprocessing has a node type of its own
    assert any(res.get("GPU", 0) == 0 and res.get("CPU", 0) >= c.preprocess_cpus_per_actor for res, _ in node_types)


# ----------------------------------------------------------------------------- image


def test_dockerfile_builds_on_the_pinned_ray_and_installs_the_lock():
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+(\S+)", text, re.MULTILINE).group(1)
    assert base.startswith(f"rayproject/ray:{RAY_VERSION}-py311"), base
    repo_dir = _docker_image_repo_dir()
    assert re.search(rf"pip install .*-r {re.escape(repo_dir)}/requirements\.lock", text)
    assert re.search(rf"PYTHONPATH={re.escape(repo_dir)}\b", text)
    ignore = (CLUSTER / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", "runs", ".git"} <= set(ignore)


# ----------------------------------------------------------------------------- KubeRay


def _manifest(path: Path, kind: str) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(docs) == 1, f"{path.name}: expected one document"
    doc = docs[0]
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    assert doc["metadata"]["name"]
    return doc


MANIFESTS = [(RAYJOB, "RayJob"), (RAYSERVICE, "RayService")]


@pytest.mark.parametrize("path, kind", MANIFESTS, ids=["rayjob", "rayservice"])
def test_kuberay_manifest_shape(path, kind):
    doc = _manifest(path, kind)
    cluster = doc["spec"]["rayClusterSpec" if kind == "RayJob" else "rayClusterConfig"]
    assert cluster["rayVersion"] == RAY_VERSION
    pods = list(_pods(doc))
    images = {c["image"] for _, pod, _ in pods for c in pod["containers"]}
    assert len(images) == 1, f"one image for every pod, got {images}"
    assert f"ray{RAY_VERSION}" in images.pop(), "the image tag names the Ray version it was built on"
    for group in cluster.get("workerGroupSpecs", []):
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    assert cluster["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"
    gpu_groups = [name for name, pod, _ in pods if _pod_resources(pod)["GPU"] > 0]
    assert gpu_groups and "head" not in gpu_groups, "a GPU worker group requests nvidia.com/gpu"
    for name, pod, _ in pods:
        res = pod["containers"][0]["resources"]
        gpus = res["limits"].get("nvidia.com/gpu")
        if gpus is not None:
            assert res["requests"].get("nvidia.com/gpu", gpus) == gpus, name


@pytest.mark.parametrize("path, kind", MANIFESTS, ids=["rayjob", "rayservice"])
def test_kuberay_s3_credentials_come_from_a_secret(path, kind):
    for name, pod, _ in _pods(_manifest(path, kind)):
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        secrets = set()
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == var and not ref.get("optional", False), (name, var)
            secrets.add(ref["name"])
        endpoint = env["AWS_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"]
        assert endpoint["optional"] is True, "AWS_ENDPOINT_URL is only for S3-compatible stores"
        secrets.add(endpoint["name"])
        assert len(secrets) == 1, f"{name}: one secret holds the S3 settings, got {secrets}"
        assert not any("value" in e for e in env.values() if e["name"].startswith("AWS_")), "no literal credentials"


@pytest.mark.parametrize("path, kind", MANIFESTS, ids=["rayjob", "rayservice"])
def test_kuberay_model_paths_are_on_a_volume(path, kind):
    cfg = load_config(MULTI_NODE)
    for name, pod, _ in _pods(_manifest(path, kind)):
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims]
        for model_path in _local_model_paths(cfg):
            assert _under(model_path, mounts), f"{name}: {model_path} is not on a mounted PVC ({mounts})"


def test_rayjob_entrypoint_runs_the_driver_on_an_existing_preset():
    doc = _manifest(RAYJOB, "RayJob")
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[0].startswith("python") and argv[1] == "pipeline/run.py"
    assert (ROOT / argv[1]).is_file()
    config = argv[argv.index("--config") + 1]
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert _repo_file(config).is_file(), config
    cfg = load_config(_repo_file(config), overrides)
    assert cfg.train.use_gpu and cfg.run_dir.startswith("s3://")
    runtime_env = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == _docker_image_repo_dir(), "the entrypoint's paths are relative to the repo"
    assert all(isinstance(v, str) for v in runtime_env.get("env_vars", {}).values())


def test_rayjob_fits_the_multi_node_preset():
    doc = _manifest(RAYJOB, "RayJob")
    groups = [(_pod_resources(pod), n) for name, pod, n in _pods(doc) if name != "head"]
    for group in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        assert group["minReplicas"] == 0, f"{group['groupName']}: a job's worker groups scale from zero"
    _check_capacity(load_config(MULTI_NODE), groups)


# ----------------------------------------------------------------------------- Serve


def _serve_schema(data: dict):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(data)
    for app in data["applications"]:
        for dep in app.get("deployments", []):
            auto = dep.get("autoscaling_config") or {}
            unknown = set(auto) - set(AutoscalingConfig.model_fields)
            assert not unknown, f"unknown autoscaling_config keys {unknown}"
            AutoscalingConfig(**auto)
    return schema


def _rayservice_serve_config() -> dict:
    return yaml.safe_load(_manifest(RAYSERVICE, "RayService")["spec"]["serveConfigV2"])


@pytest.mark.parametrize("path", SERVE_FILES, ids=lambda p: p.name)
def test_serve_yaml_validates_against_serve_schema(own_ray_cluster, path):
    """(own_ray_cluster: no Ray instance is up, so the last line checks validating starts none.)"""
    data = _yaml(path)
    schema = _serve_schema(data)
    assert len(schema.applications) == 1
    app = schema.applications[0]
    assert app.import_path == "infer.serving.deployment:app_builder"
    assert app.route_prefix == "/"
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == 8000
    assert set(app.args) == {"config", "model_dir", "overrides"}
    # the check has teeth: an invalid deployment option is rejected
    bad = copy.deepcopy(data)
    bad["applications"][0]["deployments"][0]["max_ongoing_requests"] = 0
    with pytest.raises(Exception):
        _serve_schema(bad)
    assert not ray.is_initialized()


@pytest.mark.parametrize("source", ["serve.yaml", "serve-gpu.yaml", "rayservice.yaml"])
def test_serve_options_equal_the_presets_serve_section(source):
    data = _yaml(CLUSTER / source) if source.startswith("serve") else _rayservice_serve_config()
    schema = _serve_schema(data)
    (app_data,) = data["applications"]
    repo_dir = _docker_image_repo_dir()
    config = _repo_file(app_data["args"]["config"], repo_dir)
    assert config.is_file(), config
    cfg = load_config(config, app_data["args"].get("overrides", []))
    assert app_data["route_prefix"] == cfg.serve.route_prefix
    assert schema.http_options.host == cfg.serve.host and schema.http_options.port == cfg.serve.port
    (dep,) = app_data["deployments"]
    got = {k: dep[k] for k in ("max_ongoing_requests", "max_queued_requests", "autoscaling_config", "ray_actor_options")}
    assert got == _deployment_from_serve_config(cfg.serve)


def test_rayservice_embeds_the_serve_yaml_application():
    local = _serve_schema(_yaml(SERVE_YAML)).applications[0]
    remote = _serve_schema(_rayservice_serve_config()).applications[0]
    assert (remote.name, remote.import_path, remote.route_prefix) == (local.name, local.import_path, local.route_prefix)
    assert [d.name for d in remote.deployments] == [d.name for d in local.deployments]
    assert set(remote.args) == set(local.args)


def test_rayservice_gpu_group_holds_the_replicas():
    doc = _manifest(RAYSERVICE, "RayService")
    serve = load_config(MULTI_NODE, _rayservice_serve_config()["applications"][0]["args"]["overrides"]).serve
    groups = [(_pod_resources(pod), n) for name, pod, n in _pods(doc) if name != "head"]
    assert any(_fits({"CPU": serve.num_cpus_per_replica, "GPU": serve.num_gpus_per_replica}, r) for r, _ in groups)
    assert sum(r["GPU"] * n for r, n in groups) >= serve.max_replicas * serve.num_gpus_per_replica
    start_gpus = sum(_pod_resources(g["template"]["spec"])["GPU"] * g["replicas"]
                     for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"])
    assert start_gpus >= serve.min_replicas * serve.num_gpus_per_replica, "the starting pods hold min_replicas"


def test_serve_yaml_deployment_name_exists_in_the_app():
    """The deployment named in serve.yaml must be one infer/serving/deployment.py defines (else `serve deploy` fails)."""
    import importlib

    from ray.serve.deployment import Deployment

    module = importlib.import_module("infer.serving.deployment")
    names = {v.name for v in vars(module).values() if isinstance(v, Deployment)}
    if not names:  # built inside app_builder: build it (no Ray needed to build an Application)
        (app,) = _yaml(SERVE_YAML)["applications"]
        names = {module.app_builder(dict(app["args"]))._bound_deployment.name}
    wanted = {d["name"] for d in _yaml(SERVE_YAML)["applications"][0]["deployments"]}
    assert wanted <= names, f"serve.yaml names deployments {wanted}; infer/serving/deployment.py defines {names}"


@pytest.mark.parametrize("path", SERVE_FILES, ids=lambda p: p.name)
def test_serve_files_say_what_hardware_they_are_for(path):
    (app,) = _yaml(path)["applications"]
    gpus = app["deployments"][0]["ray_actor_options"]["num_gpus"]
    assert (gpus > 0) == (path.name == "serve-gpu.yaml")
    assert ("GPU" in path.read_text().split("proxy_location")[0]) and ("CPU" in path.read_text().split("proxy_location")[0])


def test_a_model_override_is_applied_or_refused_never_ignored():
    """A serve file's model, and a `serve.model_dir` override: the same model is applied, another is refused."""
    from infer.serving.deployment import app_builder
    from pipeline.config import ConfigError

    (app,) = _yaml(SERVE_YAML)["applications"]
    args = dict(app["args"])
    bound = app_builder(dict(args, overrides=[f"serve.model_dir={args['model_dir']}"]))
    assert bound._bound_deployment.init_args[1] == args["model_dir"]
    with pytest.raises(ConfigError, match="named twice"):
        app_builder(dict(args, overrides=["serve.model_dir=/models/PadCaptioner-3B"]))
    only_override = app_builder(dict(args, model_dir="", overrides=["serve.model_dir=/models/PadCaptioner-3B"]))
    assert only_override._bound_deployment.init_args[1] == "/models/PadCaptioner-3B"
    with pytest.raises(ConfigError, match="no model given"):
        app_builder(dict(args, model_dir=""))
