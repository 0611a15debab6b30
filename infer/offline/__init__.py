"""Offline mass captioning of a video archive with Ray Data (`python -m infer.offline.job`)."""
