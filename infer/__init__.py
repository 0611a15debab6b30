"""Captioning with a trained PadCaptioner or the published release: the engine, serving, offline jobs.

    from infer import Captioner     # the Python API (infer/captioner.py), loaded on first use
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.captioner import Captioner

__all__ = ["Captioner"]


def __getattr__(name: str) -> Any:  # PEP 562: `import infer` stays cheap (no torch, no model code)
    if name == "Captioner":
        from infer.captioner import Captioner

        return Captioner
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
