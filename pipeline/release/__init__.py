"""The published PadCaptioner release (Qwen2.5-VL + Whisper + Q-Former): loading, layout, positions.

See pipeline/release/model.py (loader and model), layout.py (prompt, index sets, M-RoPE
ids in the release's and the training mode), checkpoint.py (strict weight files),
audio.py (Whisper + window Q-Former). Decoding: decoding.py and infer/engine/programs.py; parity with the
release's own inference: `python -m infer.parity DIR`.
"""
