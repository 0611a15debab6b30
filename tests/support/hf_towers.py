"""Tiny random HF towers saved with save_pretrained, for the `hf_vision` and `whisper` encoders' tests.

    dirs = tiny_vision_dirs(root)   # {"siglip", "siglip_full", "clip"}: 32 px input, 8 px patches, width 32
    path = tiny_whisper_dir(root)   # Whisper of d_model 32, 80 mel bins, its feature extractor
"""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_vision_dirs(root: Path) -> dict[str, str]:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipConfig,
        SiglipImageProcessor,
        SiglipModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    torch.manual_seed(0)
    small = dict(hidden_size=32, image_size=32, patch_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    dirs = {}
    SiglipVisionModel(SiglipVisionConfig(**small)).save_pretrained(root / "siglip")
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "siglip")
    dirs["siglip"] = root / "siglip"
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64)
    SiglipModel(SiglipConfig(text_config=text, vision_config=small)).save_pretrained(root / "siglip_full")
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "siglip_full")
    dirs["siglip_full"] = root / "siglip_full"
    CLIPVisionModel(CLIPVisionConfig(**small)).save_pretrained(root / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "clip")
    dirs["clip"] = root / "clip"
    return {k: str(v) for k, v in dirs.items()}


def tiny_whisper_dir(root: Path) -> str:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
                        max_source_positions=1500, max_target_positions=64)
    WhisperForConditionalGeneration(cfg).save_pretrained(root)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(root)
    return str(root)
