"""The one configuration of the project: typed dataclasses per concern.

Every knob of every stage lives here. A config is loaded from YAML (or JSON),
then `--set a.b=c` overrides are applied; unknown keys and values of the wrong
type (or NaN numbers) are errors that name the offending key. An override's value is
read as a YAML scalar or list, except for string keys, which take the text after `=`
as it is (quotes around it are removed); `--set data.annotations.test=f.json` sets one
entry of a mapping. A config serialises to JSON and back losslessly, so every shard
set and checkpoint carries the config that made it.

    cfg = load_config("cluster/configs/default.yaml", ["train.max_steps=10"])
    cfg.to_json() ; Config.from_json(text) ; section_hash(cfg.features)

Pure python: no torch, no ray.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.config_build import ConfigError, from_dict  # noqa: F401  (re-exported)
from pipeline.config_retired import RetiredKeyError, is_retired, upgrade_override
from pipeline.config_synthetic import HardOptions, SyntheticConfig  # noqa: F401  (re-exported)

# --------------------------------------------------------------------------- sections


@dataclass
class DataConfig:
    """Where the raw videos and annotations are, and how shards are written."""

    # annotation format of the raw data (synthetic = the corpus the project generates)
    dataset: Literal["synthetic", "longvale", "activitynet", "chronusav", "youcook2"] = "synthetic"
    video_root: str = ""  # local dir or s3:// prefix; "" = <run_dir>/synth/videos
    annotations: dict[str, str] = field(default_factory=dict)  # split -> file (local or s3://)
    # file extensions listed as videos in a folder or bucket
    video_extensions: list[str] = field(default_factory=lambda: [".mp4", ".mkv", ".webm", ".avi", ".mov"])
    shard_target_bytes: int = 64 * 1024 * 1024  # a WebDataset shard is closed once it holds about this many bytes
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class FeaturesConfig:
    """Media decoding and the per-segment audio-visual feature encoders."""

    # visual features: pixels (weight-free), hf_vision (a local SigLIP/CLIP tower), release (the published model's own)
    visual_encoder: Literal["pixels", "hf_vision", "release"] = "pixels"
    # audio features: mel (weight-free), whisper (a local Whisper encoder), release (the published model's own)
    audio_encoder: Literal["mel", "whisper", "release"] = "mel"
    vision_path: str = ""  # local HF SigLIP/CLIP vision model dir (hf_vision)
    audio_path: str = ""  # local HF Whisper model dir (whisper)
    frame_policy: Literal["count", "fps"] = "count"  # how many frames are sampled: count (from the duration and seconds_per_frame) or fps
    fps: float = 2.0  # frame_policy=fps
    seconds_per_frame: float = 0.5  # frame_policy=count: n = clip(round(duration / s), min, max)
    min_frames: int = 64  # frame_policy=count: at least this many frames per video
    max_frames: int = 256  # at most this many frames per video
    frames_per_segment: int = 2  # frames in one segment (the time step of the interleaved audio-visual sequence)
    visual_tokens_per_frame: int = 4  # visual tokens each frame contributes to its segment
    audio_tokens_per_second: int = 2  # audio tokens per second of audio (see audio_tokens_per_segment)
    sample_rate: int = 16000  # audio is decoded to mono at this rate (Hz)
    image_size: int = 32  # frames are resized to this square on decode (hf_vision: the tower's size); 0 = source size
    n_mels: int = 32  # mel bands of the weight-free mel encoder
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where the encoders run: auto = CUDA when there is one
    batch_size: int = 64  # frames per encoder forward
    audio_tokens_per_segment: int = 0  # 0 = max(1, round(audio_tokens_per_second * segment duration)) per video
    audio_batch_size: int = 4  # 30 s windows per Whisper forward
    decode_threads: int = 0  # decord threads per video; 0 = decord's automatic choice
    max_media_bytes: int = 8 * 1024**3  # larger files are rejected (bounds the temp copy of remote files); 0 = no limit
    duration_tolerance_s: float = 2.0  # annotated times up to this far past the media's end are clipped, further is an error
    # the released PadCaptioner-3B's own encoders (visual_encoder = audio_encoder = "release",
    # preprocess/release_encoders.py); frames by min_frames / max_frames / seconds_per_frame
    release_path: str = ""  # the release checkpoint dir whose vision tower and Whisper + Q-Former encode
    release_features: Literal["stored", "online"] = "stored"  # stored: tokens in shards; online: the engine encodes
    release_max_frame_pixels: float = 61250.0  # per-frame pixel budget (scaled up below max_frames frames)
    release_min_frame_pixels: float = 784.0  # per-frame pixel floor of the release's frame sizing


@dataclass
class ModelConfig:
    """The PadCaptioner module: backbone, layout choices, grounding, aggregation, LoRA."""

    backbone: str = "tiny"  # preset name (tiny, qwen2.5-0.5b, qwen2.5-3b) or a local HF path
    tokenizer: Literal["auto", "qwen", "bpe"] = "auto"  # auto: files in the backbone path, else bpe for tiny, else qwen
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # dtype of the model's weights in training
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"  # HF attention implementation of the backbone in training
    # factorized: branches see the prefix and their own anchor, not each other (PadCaptioner); causal: one chain
    mask: Literal["factorized", "causal"] = "factorized"
    av_bidirectional: bool = True  # audio-visual tokens attend to each other both ways (else causally)
    # how caption branches are laid out in a training sequence: blocked (branch after branch) or round_robin
    branch_order: Literal["blocked", "round_robin"] = "blocked"
    eos_padding_loss: bool = True  # the <eos> padding after a branch's end counts in the loss (the branch-EOS loss)
    # ablations (bench/ablation.py): parallel = PadCaptioner; chain = latent planning with the
    # events in one causal chain (needs mask=causal); sequential = "<s>-<e> seconds: caption"
    # per event as plain text; textual_planning = the boundaries as text first, then the captions
    layout: Literal["parallel", "chain", "sequential", "textual_planning"] = "parallel"
    g_visibility: Literal["all", "own"] = "all"  # own: branch i sees only the i-th serial <G>
    # how an event's anchor pools its interval's audio-visual states (attention = the paper's choice)
    aggregation: Literal["attention", "mean", "scoring_head", "none"] = "attention"
    aggregation_layer: int = -1  # -1: the middle layer
    aggregation_jitter: float = 0.1  # training only: aggregation intervals move by up to this many seconds at each end
    grounding_layer: int = -2  # hidden states of the second-to-last layer
    # guide for random-init backbones (pipeline/anchor_attention.py): weight of a hinge on the
    # attention mass each caption-branch row puts on its own anchor at the first layer,
    # zero once the head-averaged mass reaches `anchor_guide_target`; 0 = off
    anchor_guide_weight: float = 0.0
    anchor_guide_target: float = 0.25  # the guide stops pulling once a row's head-averaged mass on its anchor reaches this
    grounding_loss_weight: float = 5.0  # weight of the grounding loss in the total
    branch_loss_weight: float = 1.0  # weight of the caption-branch cross-entropy in the total
    # training aid, not the paper's loss (1 = off): caption-branch tokens that vary with the synthetic
    # grammar's attributes count this many times in the branch loss (train/losses.py)
    attribute_token_weight: float = 1.0
    grounding_threshold: float = 0.5  # relative to the max (0.7 ChronusAV, 0.5 LongVALE)
    grounding_merge_gap: int = 2  # bridge gaps of at most this many segments
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA path
    # backbone projections that get LoRA adapters
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    train_backbone_embeddings: bool = False  # the new <G>/<S> rows always train; random-init presets need this to learn text
    max_seq_len: int = 4096  # longer training sequences are shortened by dropping whole segments (pipeline/fitting.py)
    backbone_seed: int = 0  # random init of preset backbones and of the new modules
    # std of a preset backbone's query and key projections (0 = HF's initializer_range, 0.02): larger ones make the
    # random heads select (attention logits scale with its square) without touching the residual stream
    attention_init_std: float = 0.0
    visual_dim: int = 0  # Dv of the shard features; 0 = taken from the data when the model is built
    audio_dim: int = 0  # Da of the shard features; 0 = likewise
    max_segments: int = 512  # size of the segment-index (time) embedding
    max_caption_tokens: int = 256  # training captions are cut to this many tokens (+ eos)
    instruction: str = "Localize every event in the video and describe what is seen and heard in each one."  # the prompt's instruction text


@dataclass
class TrainConfig:
    """LoRA fine-tuning: optimisation, schedule, checkpoints, distribution."""

    num_workers: int = 2  # Ray Train workers (data-parallel ranks)
    use_gpu: bool = False  # train on GPUs (one or more per worker)
    gpus_per_worker: float = 1.0  # use_gpu: GPUs each worker holds
    cpus_per_worker: float = 1.0  # CPUs each worker holds
    backend: Literal["auto", "ddp", "deepspeed"] = "auto"  # auto: deepspeed on GPU, ddp (gloo) on CPU
    zero_stage: int = 2  # 0-2; 3 is refused (train/deepspeed_config.py says why)
    max_steps: int = 300  # optimizer steps of the run
    batch_size: int = 2  # per worker
    grad_accum: int = 1  # micro-batches accumulated per optimizer step
    lr: float = 2e-3  # peak learning rate (after warm-up)
    # lr multipliers by parameter name: the first key found in a trainable parameter's name
    # (e.g. {"lora_B": 16.0}: LoRA+), else 1; the schedule scales every group alike
    lr_scales: dict[str, float] = field(default_factory=dict)
    min_lr_ratio: float = 0.1  # cosine decays to lr * this at max_steps
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 20  # linear warm-up steps before the cosine decay
    grad_clip: float = 1.0  # 0 = no clipping
    bf16: bool = True  # autocast on GPU only
    gradient_checkpointing: bool = False  # recompute the backbone's activations in the backward pass (less memory, more time)
    checkpoint_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept in storage
    val_every: int = 100  # 0 = only at the end
    val_samples: int = 16  # held-out samples for the periodic validation (0 = all)
    eval_samples: int = 0  # held-out samples for the end-of-stage evaluation (0 = all)
    train_split: str = "train"  # the manifest split trained on
    val_split: str = "test"  # the held-out split (validation and the end-of-stage evaluation)
    shuffle_buffer: int = 64  # per-worker streaming shuffle buffer (records)
    augment_crop: float = 0.0  # random temporal crop: up to this fraction of the segments cut at each end (in gaps)
    augment_noise: float = 0.0  # std of Gaussian noise added to the features when training
    log_every: int = 10  # 0 = the first and last step only
    torch_threads: int = 0  # intra-op threads per worker; 0 = cpus_per_worker
    max_failures: int = 1  # worker failures Ray Train recovers from (restarting from the last checkpoint)
    seed: int = 0  # seed of the LoRA init, the data order and the augmentations
    init_jitter: float = 0.0  # seed studies: every initial weight times (1 + this * N(0, 1)); 1e-7 ~ one fp32 ulp; 0 = none


@dataclass
class InferConfig:
    """Planning and parallel decoding."""

    # planning cap: at most this many events per video (0 = the model's own: the release
    # checkpoint's max_planning_events, else 30)
    max_events: int = 0
    # tokens per caption branch, <eos> included; a branch cut here is marked `capped`
    # (0 = the model's own: 1 + the release checkpoint's max_branch_tokens, else what training
    # teaches, model.max_caption_tokens + 1)
    max_branch_tokens: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass when temperature > 0
    seed: int = 0  # seed of sampling when temperature > 0 (per video, so results do not depend on batching)
    # the attention kernel of the decode step (infer/engine/kernels.py): auto = "flex" (torch FlexAttention,
    # compiled through Triton) on CUDA, "sdpa" (torch scaled_dot_product_attention over the gathered
    # pages) on the CPU; "reference" = the pure-torch oracle. One that cannot run is an error.
    kernel: Literal["auto", "sdpa", "flex", "reference"] = "auto"
    # the gathering kernels (sdpa, reference) run a step's attention as dense calls over gathered pages
    # (infer/engine/packing.py): at most this many per layer, the query blocks packed and padded into them (host
    # ops bounded whatever the videos in flight); 0 = one call per query block, its own rows and pages
    # (no padding: on a 2-core CPU box, 16 videos in flight, decode steps 150 ms against 196, at 2-3 host
    # ops per video per layer; docs/design/decoding.md, bench/packing.py). flex reads each block's own pages and
    # ignores it.
    attention_calls: int = 3
    # parallel = the engine (event-factorized parallel decoding); monolithic = the single-chain baseline
    decoder: Literal["parallel", "monolithic"] = "parallel"
    # CUDA graphs of the step (infer/engine/graphs.py): auto = captured at start-up on CUDA: whole steps (flex
    # kernel, no layered block, up to graph_tokens tokens) and, for every other step up to the budget's largest,
    # its work but attention in pieces per layer (infer/engine/pieces.py: mixed and layered steps too), off
    # elsewhere; static = the graphs' static buffers and padding run eagerly, on any device (what the CPU
    # tests and bench/throughput.py's graph_coverage drive); off = every step eager. A failed capture runs
    # eagerly, with the reason logged.
    cuda_graphs: Literal["auto", "off", "static"] = "auto"
    graph_tokens: int = 256  # whole-step CUDA graphs cover steps of at most this many tokens
    # videos handed to the engine per call (offline: the Ray Data batch of a captioning actor)
    videos_per_call: int = 16
    # continuous batching: at most this many branch rows / videos in one decode step;
    # finished videos make room for new ones (docs/design/decoding.md)
    max_batch_rows: int = 128
    max_batch_videos: int = 16  # at most this many videos in one decode step
    # tokens per decode step (the token budget, infer/engine/scheduler.py): every branch row, then every
    # planning row, then prefill chunks of new videos up to this; 0 = auto (512 on CPU, 2048 on CUDA)
    step_tokens: int = 0
    # the paged KV pool (infer/engine/paged.py): its memory budget in GB (0 = auto: kv_memory_fraction of the
    # free device memory on CUDA, 1 GB on the CPU), keys per page (0 = auto: 128 on CUDA, 16 on the CPU)
    # and query tokens per attention block (0 = auto: 16; prefill chunks attend in blocks of 4x that)
    kv_memory_gb: float = 0.0
    kv_memory_fraction: float = 0.85  # kv_memory_gb=0 on CUDA: this share of the free device memory goes to the KV pool
    page_size: int = 0  # keys per KV page (0 = auto: 128 on CUDA, 16 on the CPU)
    q_block: int = 0  # query tokens per attention block (0 = auto: 16)
    # model dtype for decoding: auto = bfloat16 on CUDA, the model's own dtype on the CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where decoding runs: auto = CUDA when there is one
    # torch intra-op threads when decoding on the CPU (0 = torch's default). On small shared
    # boxes an oversubscribed OpenMP team stalls the K-row steps (measured 4x slower on 2 cores).
    cpu_threads: int = 0
    # offline captioning (infer.offline.job, the caption stage) still succeeds when at most this share
    # of the videos failed with a recorded per-video error (bad media or annotation, a video the
    # engine refuses or fails on alone); more, or the engine failing on every video, fails the job.
    # Not part of the caption rows' hash: changing it re-judges the same rows.
    max_failed_fraction: float = 0.05


@dataclass
class ServeConfig:
    """The Ray Serve endpoint and its safety limits."""

    host: str = "127.0.0.1"  # the HTTP proxy's address (127.0.0.1: this machine only)
    port: int = 8000  # the HTTP proxy's port
    route_prefix: str = "/"  # the endpoint's URL prefix
    model_dir: str = ""  # the served model, when the Serve file's args.model_dir does not name it (naming two is an error)
    allowed_roots: list[str] = field(default_factory=list)  # local dirs and s3://bucket/prefix
    allowed_http_hosts: list[str] = field(default_factory=list)  # hosts the endpoint may fetch http(s):// video URIs from (empty: none)
    max_upload_bytes: int = 256 * 1024 * 1024  # larger uploads are refused with 413
    max_duration_s: float = 3600.0  # longer videos are refused with 422
    decode_timeout_s: float = 120.0  # reading and decoding one video takes at most this long (else 422)
    min_replicas: int = 1  # autoscaling: replicas kept when idle
    max_replicas: int = 2  # autoscaling: most replicas
    target_ongoing_requests: float = 2.0  # autoscaling: requests per replica the autoscaler aims at
    max_ongoing_requests: int = 4  # requests one replica works on at once
    max_queued_requests: int = 16  # requests waiting for a replica; beyond it Serve answers 503 at once (back-pressure)
    num_cpus_per_replica: float = 1.0  # CPUs each replica holds
    num_gpus_per_replica: float = 0.0  # GPUs each replica holds (0 = a CPU replica)
    upscale_delay_s: float = 5.0  # autoscaling: load must last this long before replicas are added
    downscale_delay_s: float = 60.0  # autoscaling: idleness must last this long before replicas are removed
    look_back_period_s: float = 30.0  # the window Serve averages ongoing requests over (Ray's default)
    metrics_interval_s: float = 10.0  # how often handles push those numbers to the controller (Ray's default)
    max_json_bytes: int = 64 * 1024  # JSON request bodies (and the multipart `options` field)
    max_frame_pixels: int = 3840 * 2160  # source width * height; larger videos are rejected before decoding
    fetch_timeout_s: float = 60.0  # s3:// and http(s):// downloads (connect + read)
    upload_dir: str = ""  # temp files for uploads and downloads; "" = the system temp dir
    decode_workers: int = 0  # decode threads and worker processes per replica (media only: the encoders run once, in the replica); 0 = max_ongoing_requests
    max_decoded_bytes: int = 1024**3  # a decode worker's result (frames + audio as arrays); larger is a 413, never sent
    batch_videos: int = 0  # concurrent requests in the replica's decode batch at once; 0 = infer.max_batch_videos


@dataclass
class ClusterConfig:
    """Resources for the Ray stages (local or a real cluster)."""

    address: str = ""  # "" = RAY_ADDRESS if set, else a local instance
    num_cpus: int = 0  # local instance only; 0 = all
    preprocess_actors: int = 2  # featurize actors (decode + encode) of preprocessing and offline captioning
    preprocess_cpus_per_actor: float = 1.0  # CPUs each featurize actor holds
    # GPUs each featurize actor holds when its encoders run on CUDA (features.device=cuda; not with the
    # release encoders online, whose featurize actors only prepare the media); fractions share a GPU
    preprocess_gpus_per_actor: float = 1.0
    caption_actors: int = 1  # engine actors of offline captioning
    caption_gpus_per_actor: float = 0.0  # GPUs each engine actor holds (0 = on the CPU)
    caption_cpus_per_actor: float = 1.0  # CPUs each engine actor holds
    # what GPU work asks for (pipeline/cluster.py): "GPU" = Ray's GPUs; another name = a custom
    # resource the GPU nodes advertise (accelerators Ray does not detect, or a simulated cluster)
    gpu_resource: str = "GPU"
    accelerator_type: str = ""  # e.g. "H100", "A100", "L4": GPU work lands only on nodes of that type
    cpu_node_resource: str = ""  # custom resource only CPU nodes advertise: CPU-only work stays off GPU nodes


@dataclass
class EvalConfig:
    """Which metric protocol the evaluate stage reports."""

    # which metric protocol the report leads with (padcaptioner = F1, Sim, SODA_c, CIDEr, METEOR)
    protocol: Literal["padcaptioner", "densevid", "soda", "etbench"] = "padcaptioner"
    missing: Literal["skip", "zero"] = "skip"  # zero: densevid only (the other protocols always skip)
    seed: int = 0  # seed of the metrics' sampled parts (ETBench's nonsense references)
    # SODA_c pair direction: "published" = fujiso/SODA's (reference scored as METEOR's hypothesis,
    # the papers' numbers), "documented" = METEOR's own (prediction as the hypothesis)
    soda_direction: Literal["published", "documented"] = "published"


@dataclass
class ReleaseConfig:
    """The published PadCaptioner-3B (a release checkpoint as model.backbone, serve's model_dir or
    offline captioning's --model): its test-time settings, which its config.json does not hold.

    positions: "release" = the M-RoPE ids the release computes at test time (what produced the
    published numbers; the parity default), "training" = the ids it was trained on (used for
    fine-tuning). aggregation: "release" = softmax over attention probabilities (the release),
    "renormalised" = probabilities renormalised inside the interval (this project's rule).
    """

    # release: the M-RoPE ids the release uses at test time (parity); training: the ids it was trained on
    positions: Literal["release", "training"] = "release"
    # release: softmax over attention probabilities (as released); renormalised: inside the interval
    aggregation: Literal["release", "renormalised"] = "release"
    grounding_threshold: float = 0.7  # 0.7 ChronusAV (the release's default), 0.5 LongVALE
    grounding_merge_gap: int = 2  # runs of grounded timesteps at most this many apart are merged into one interval
    instruction: str = "Could you outline the incidents that happened during different time periods in the video?"  # the release's prompt instruction
    max_seq_len: int = 32768  # longer prompts are refused (the release's prefill applies a 32768 sliding window)


@dataclass
class Config:
    """The root config: one section per concern."""

    run_dir: str = "runs/default"  # local dir or s3:// prefix
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> Config:
        return from_dict(cls, json.loads(text))


# --------------------------------------------------------------------------- overrides


def _override_type(dotted: str) -> Any:
    """The annotation of what `dotted` sets; an unknown key is an error that names it. Below a
    mapping field (`data.annotations.test`) a key names one entry of that mapping."""
    tp: Any = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if dataclasses.is_dataclass(tp):
            names = sorted(f.name for f in dataclasses.fields(tp))
            if part not in names:
                where = ".".join(parts[:i]) or "the root"
                raise ConfigError(f"unknown config key {here} (valid keys in {where}: {names})")
            tp = typing.get_type_hints(tp)[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            raise ConfigError(f"unknown config key {here} ({'.'.join(parts[:i])} has no keys; in override {dotted}=...)")
    return tp


def _current_key(dotted: str, raw: str) -> str | None:
    """`dotted` with a renamed last key under its new name; None for a removed key at its old
    default; a removed key at another value is an error (pipeline/config_retired.py)."""
    parent, _, last = dotted.rpartition(".")
    section = _override_type(parent) if parent else Config
    if not dataclasses.is_dataclass(section) or not is_retired(section.__name__, last):
        return dotted
    try:
        new = upgrade_override(section.__name__, last, _parse_override(raw, Any), parent + ".")
    except RetiredKeyError as e:
        raise ConfigError(str(e)) from None
    return None if new is None else f"{parent}.{new}".lstrip(".")


def _parse_override(raw: str, tp: Any) -> Any:
    """The value of one override: YAML, except that a string takes the text as it is (YAML would
    cut it at ` #`, make a mapping of `a: b`, an int of `2023`, a bool of `yes`); quotes are removed."""
    text = raw.strip()
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    is_text = tp is str or (typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp)))
    if is_text and not quoted:
        return text
    return yaml.safe_load(text) if text else ""


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `a.b=c` strings; values are parsed as YAML scalars (`3`, `true`, `[a, b]`), string keys verbatim."""
    tree = cfg.to_dict()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = _current_key(key.strip(), raw)
        if key is None:  # a removed knob set to its old default: nothing to set
            continue
        tp = _override_type(key)
        parts = key.split(".")
        node = tree
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = _parse_override(raw, tp)
    return Config.from_dict(tree)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML/JSON preset (None = the built-in defaults) and apply overrides."""
    cfg = Config()
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        cfg = Config.from_dict(data)
    return apply_overrides(cfg, list(overrides or []))


def section_hash(section: Any, length: int = 12) -> str:
    """Stable short hash of a config section (e.g. the feature config that made a shard)."""
    data = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]
