"""The Ray Serve deployment of the captioning service: a thin shell around CaptionService.

    serve run cluster/serve.yaml                 # import_path: infer.serving.deployment:app_builder
    python -m infer.serving.deployment --config cluster/configs/default.yaml --model DIR [--set serve.port=8001]

`app_builder(args)` takes `config` (a YAML preset path), `model_dir` (a saved
PadCaptioner or a release checkpoint dir; "random:tiny" = a fresh `tiny` random-init
model, the smoke mode: the endpoint works end to end but its captions are noise) and
`overrides` (a list of "key=value" strings, like `--set`). The model may be named by
`model_dir` or by the override `serve.model_dir`; naming it both ways differently, or
not at all, is an error before any replica starts. Autoscaling, concurrency and back-pressure
come from the `serve` section: min/max replicas, target_ongoing_requests,
max_ongoing_requests, and max_queued_requests (beyond it Ray Serve answers 503
at once instead of queueing). Each replica loads the model once (on the GPU when
serve.num_gpus_per_replica > 0 and infer.device allows it) and builds the
feature encoders once (on features.device); its decode worker processes decode
media only. See infer/serving/service.py for what one request does.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ray import serve
from ray.serve import Application

from infer.loading import RANDOM_MODEL, load_engine, serving_model
from infer.serving.api import build_app
from infer.serving.service import CaptionService
from pipeline.cluster import init_ray, placement
from pipeline.config import ClusterConfig, Config, ServeConfig, load_config

log = logging.getLogger("padcap.serve")


def _replica_service() -> CaptionService:
    return serve.get_replica_context().servable_object


fastapi_app = build_app(_replica_service)


@serve.deployment(name="PadCaptioner")
@serve.ingress(fastapi_app)
class CaptionDeployment(CaptionService):
    """One replica: the model, the encoders and the thread pools, loaded once (the decode workers: media only)."""

    def __init__(self, cfg_json: str, model_dir: str):
        cfg = Config.from_json(cfg_json)
        engine_factory, card, cfg = load_engine(cfg, model_dir)
        super().__init__(cfg, engine_factory, card, warm=True)  # the decode workers boot while the encoders load
        log.info("replica ready: model %s on %s", card.model_id, card.device)


def deployment_options(sc: ServeConfig, cc: ClusterConfig | None = None) -> dict[str, Any]:
    """Ray Serve deployment options from the serve section; the replica's resources are mapped
    by the cluster section's rule (pipeline/cluster.py: GPU resource name, accelerator type)."""
    actor = placement(cc or ClusterConfig(), sc.num_cpus_per_replica, sc.num_gpus_per_replica)
    return {
        "autoscaling_config": {
            "min_replicas": sc.min_replicas,
            "max_replicas": sc.max_replicas,
            "target_ongoing_requests": sc.target_ongoing_requests,
            "upscale_delay_s": sc.upscale_delay_s,
            "downscale_delay_s": sc.downscale_delay_s,
            "look_back_period_s": sc.look_back_period_s,
            "metrics_interval_s": sc.metrics_interval_s,
        },
        "max_ongoing_requests": sc.max_ongoing_requests,
        "max_queued_requests": sc.max_queued_requests,
        "ray_actor_options": actor,
    }


def build_application(cfg: Config, model_dir: str = "") -> Application:
    """The bound Serve application for this config and model (`serving_model`)."""
    model = serving_model(cfg, model_dir)
    return CaptionDeployment.options(**deployment_options(cfg.serve, cfg.cluster)).bind(cfg.to_json(), model)


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for `serve run` / a Serve config file (import_path infer.serving.deployment:app_builder)."""
    known = {"config", "model_dir", "overrides"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown app_builder args {unknown}; expected {sorted(known)}")
    overrides = args.get("overrides") or []
    if isinstance(overrides, str):
        overrides = [overrides]
    cfg = load_config(args.get("config") or None, list(overrides))
    return build_application(cfg, args.get("model_dir") or "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.serving.deployment",
                                 description="Run the captioning endpoint on a local or existing Ray cluster.")
    ap.add_argument("--config", default="", help="YAML preset (default: built-in defaults)")
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--model", "--model-dir", dest="model", default="",
                       help="a trained model dir or a release checkpoint dir (or serve.model_dir in --set)")
    model.add_argument("--random-model", action="store_true",
                       help="serve a random tiny model (smoke test: its captions are noise)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override one config key (repeatable)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config or None, args.overrides)
    app = build_application(cfg, RANDOM_MODEL if args.random_model else args.model)  # refuses before Ray starts
    init_ray(cfg)  # the cluster section (address, num_cpus), as `pipeline/run.py` starts Ray
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(app, route_prefix=cfg.serve.route_prefix, blocking=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
