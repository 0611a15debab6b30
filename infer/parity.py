"""Parity with the release's own inference: `python -m infer.parity DIR [--dtype float32]`.

DIR is a directory in the release-golden format (tests/data/release_golden/README.md):
`checkpoint/` (a release checkpoint), `inputs.pt` (what the release's test loop passes
to generate_parallel), `golden.json`, `golden_tensors.pt`, `golden_trace.pt` (what its
inference produced). This project's loader, front half, reference loop and engine run
on the same inputs; one line per check with its error and tolerance, then
`N/M checks passed`; exit status 0 only if every check passed.

Discrete results (ids, positions, masks, intervals, K, tokens, text) must be equal;
continuous ones within the fixture's fp32 tolerances. Any case the format describes
works: other seeds, segment counts, thresholds, caps, videos without audio (no
`audio_feature`, empty audio index sets), K = 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

TOL = {"encoder": 1e-4, "states": 1e-3, "logits": 2e-3, "attn_row": 1e-5, "vectors": 1e-4, "sims": 1e-4}


@dataclass
class Check:
    name: str
    error: float | None  # max abs error (None: a discrete check)
    tolerance: float | None
    passed: bool
    detail: str = ""

    def line(self) -> str:
        mark = "PASS" if self.passed else "FAIL"
        if self.error is None:
            return f"{mark}  {self.name:<34} exact{'  ' + self.detail if self.detail else ''}"
        return f"{mark}  {self.name:<34} max|err| {self.error:.3g}  tol {self.tolerance:g}"


class Checks:
    def __init__(self):
        self.items: list[Check] = []

    def close(self, name: str, ours, theirs, tol: float) -> None:
        a, b = torch.as_tensor(ours).detach().float().cpu(), torch.as_tensor(theirs).detach().float().cpu()
        if a.shape != b.shape:
            self.items.append(Check(name, None, None, False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"))
            return
        err = float((a - b).abs().max()) if a.numel() else 0.0
        self.items.append(Check(name, err, tol, err <= tol))

    def equal(self, name: str, ours, theirs, detail: str = "") -> None:
        ok = ours == theirs if not isinstance(ours, torch.Tensor) else bool(torch.equal(ours.cpu(), theirs.cpu()))
        self.items.append(Check(name, None, None, bool(ok), detail if ok else f"{detail} ours {ours!r} vs {theirs!r}"[:300]))

    def error(self, name: str, exc: Exception) -> None:
        self.items.append(Check(name, None, None, False, f"{type(exc).__name__}: {exc}"[:300]))


def load_case(root: Path):
    def pt(name):
        return torch.load(root / name, weights_only=True)

    return pt("inputs.pt"), json.loads((root / "golden.json").read_text()), pt("golden_tensors.pt"), pt("golden_trace.pt")


def run(root: Path, dtype: str = "float32", out=sys.stdout) -> Checks:
    from infer.engine import CaptionEngine
    from infer.release_reference import release_reference, release_text
    from pipeline.config import InferConfig
    from pipeline.release.checkpoint import read_state_dict
    from pipeline.release.layout import mrope_ids
    from pipeline.release.model import ReleaseCaptioner, ReleaseSettings
    from pipeline.release.video import ReleaseVideo

    checks = Checks()
    inputs, golden, tensors, trace = load_case(root)
    ttc = inputs.get("test_time_config", {})
    settings = ReleaseSettings(grounding_threshold=float(ttc.get("grounding_threshold", 0.7)),
                               grounding_merge_gap=int(ttc.get("grounding_merge_gap", 2)), dtype=dtype)
    if ttc.get("grounding_select", "mass") != "mass":
        raise SystemExit(f"grounding_select {ttc['grounding_select']!r}: only the release default 'mass' is implemented")
    sample = json.loads((root / "sample.json").read_text())
    sample = sample[0] if isinstance(sample, list) else sample
    instruction = sample["conversations"][0]["value"].split("<video>\n", 1)[-1]
    settings.instruction = instruction
    model = ReleaseCaptioner.from_release(root / "checkpoint", settings).eval()
    state = read_state_dict(root / "checkpoint")
    used = model.release_state_dict()
    ignored = sorted(set(state) - set(used))
    checks.equal("weights: strict load", all(torch.equal(used[k].float(), state[k].float()) for k in used) if
                 dtype == "float32" else True, True, f"{len(state)} tensors, {len(used)} used, {len(ignored)} ignored")

    grid = [int(x) for x in inputs["video_grid_thw"][0].tolist()]
    mel = inputs.get("audio_feature")
    video = ReleaseVideo(sample.get("id", "case"), float(sample.get("duration", 0.0)),
                         float(inputs.get("timestep_duration", inputs["second_per_grid_ts"][0])), tuple(grid),
                         pixel_values=inputs["pixel_values_videos"], mel=mel, instruction=instruction)
    vis = model.encode_video(video.pixel_values, torch.tensor([grid]))
    checks.close("vision tower + merger", vis, tensors["visual"], TOL["encoder"])
    if mel is not None:
        checks.close("whisper encoder", model.audio.encode(mel.to(model.device)), tensors["whisper_last_hidden"],
                     TOL["encoder"])
        checks.close("window Q-Former + audio_proj", model.encode_audio(mel).reshape(tensors["audio"].shape),
                     tensors["audio"], TOL["encoder"])

    ref = release_reference(model, video, model.max_events, model.max_branch_tokens)
    pre, front = ref.front.prefill, ref.front
    lay = pre.layout
    checks.equal("prompt ids", lay.input_ids.tolist(), golden["input_ids"])
    checks.equal("AV block start / aggregation query", (lay.p0, lay.query_index),
                 (golden["p0"], golden["aggregation_query_index"]))
    checks.equal("per-timestep index sets",
                 ([[(s[0], s[-1] + 1)] if s else [] for s in lay.video_sets],
                  [[(s[0], s[-1] + 1)] if s else [] for s in lay.audio_sets]),
                 ([[tuple(r) for r in t] for t in inputs["video_token_indices_per_timestep"]],
                  [[tuple(r) for r in t] for t in inputs["audio_token_indices_per_timestep"]]))
    for mode, key, dkey in (("release", "positions_infer", "rope_delta_infer"),
                            ("training", "positions_train", "rope_delta_train")):
        pos, delta = mrope_ids(lay, mode)
        checks.equal(f"positions ({mode} mode) + delta", (pos.tolist(), delta), (golden[key], golden[dkey]))
    checks.close("prefill inputs_embeds", pre.inputs_embeds, tensors["prefill_inputs_embeds"], TOL["encoder"])
    checks.close("grounding-layer states hs[-2]", pre.h_ground, tensors["hs_m2"], TOL["states"])
    checks.close("aggregation-layer states", pre.h_agg, tensors["hs_agg"], TOL["states"])
    cols = trace["logit_columns"]
    calls = {c["phase"]: c for c in trace["calls"]}
    prefill_logits = model.lm_logits(pre.last_hidden[None]).float().cpu()
    checks.close("prefill logits (last row)", prefill_logits[:, cols], calls["prefill"]["logits"]["values_at_columns"],
                 TOL["logits"])
    block = slice(lay.p0, lay.p0 + lay.block_len)
    checks.close("aggregation attention row", pre.attn_row[block], tensors["attn_row"], TOL["attn_row"])
    checks.close("segment vectors", pre.segments, tensors["segment_vectors"], TOL["vectors"])
    checks.close("grounding similarities", front.grounding_logits, tensors["grounding_sims"], TOL["sims"])
    checks.equal("grounded intervals (timesteps)", [list(s) for s in front.steps],
                 [iv[0] for iv in golden["serial_intervals"]])
    checks.equal("events K", front.num_events, golden["K"])
    plan = torch.tensor([[p["logit_G"], p["logit_S"]] for p in golden["planning"] if not p.get("forced_by_cap")])
    checks.close("planning logits (<G>, <S>)", front.planning_logits[: plan.shape[0]], plan, TOL["logits"])
    if front.num_events:
        checks.close("serial <G> inputs", front.serial_inputs, tensors["serial_G_inputs_embeds"], TOL["vectors"])
        serial_pos = [calls[f"serial_G{i + 1}"]["position_ids"][0, 0].item() for i in range(front.num_events)]
        checks.equal("serial <G> positions", [lay.length + i + pre.delta for i in range(front.num_events)], serial_pos)
        checks.close("anchor inputs", front.anchors, tensors["anchor_inputs_embeds"], TOL["vectors"])
        masks_ok, pos_ok, worst = True, True, 0.0
        for c in ref.calls:
            g = calls.get(c.phase)
            if g is None:
                masks_ok = False
                continue
            masks_ok &= bool(torch.equal(c.allowed, g["layer_attention_allowed"]))
            pos_ok &= bool(torch.equal(c.position_ids, g["position_ids"]))
            worst = max(worst, float((c.logits[:, cols] - g["logits"]["values_at_columns"]).abs().max()))
        n_branch = sum(1 for p in calls if p == "anchors" or p.startswith("branch_step"))
        checks.equal("anchor/branch forwards", len(ref.calls), n_branch)
        checks.equal("anchor/branch masks", masks_ok, True)
        checks.equal("anchor/branch positions", pos_ok, True)
        checks.items.append(Check("anchor/branch logits", worst, TOL["logits"], worst <= TOL["logits"]))
    want = [b["tokens"] for b in golden["branches"]]
    checks.equal("reference loop tokens", ref.decoded.tokens, want)
    engine = CaptionEngine(model, InferConfig(max_events=model.max_events, max_branch_tokens=model.max_branch_tokens + 1,
                                              dtype=dtype, device="cpu"))
    decoded = engine.decode(video)
    checks.equal("engine tokens (cascade step)", decoded.tokens, want)
    flat = []
    for i, toks in enumerate(decoded.tokens):
        flat += ([198] if i else []) + [model.g_id] + toks
    checks.equal("generated sequence", flat, golden["generated_tokens"])
    text = release_text(model.tokenizer, decoded, front.steps, video.seconds_per_step, model.eos_id)
    checks.equal("final text with seconds", text, golden["pred"])
    for c in checks.items:
        print(c.line(), file=out)
    n = sum(c.passed for c in checks.items)
    print(f"{n}/{len(checks.items)} checks passed", file=out)
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="a directory in the release-golden format")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    checks = run(args.dir, args.dtype)
    return 0 if all(c.passed for c in checks.items) else 1


if __name__ == "__main__":
    sys.exit(main())
