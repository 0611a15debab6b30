"""A step's small tensors across the host/device boundary in one copy each way.

    staging = Staging(device)
    pos, slots = staging.to_device([positions, slots])     # host -> device: one pinned, non-blocking copy
    tokens, rows = to_host([next_tokens, plan_logits])      # device -> host: one copy (and its one sync)

Host to device. A step's metadata is a handful of small host tensors (positions, KV slots, the
attention metadata); copied one by one, each is a blocking copy from pageable memory (a host
round trip per tensor). On CUDA `Staging` packs them as bytes, each at an 8-byte boundary, into a
pinned buffer, copies it with non_blocking=True and views each tensor back, in its dtype and
shape, on the device: one transfer, no kernel. The pinned buffers are a ring: a buffer is
refilled only once the copy that last read it has run (a CUDA event each). Elsewhere (the CPU) the
tensors themselves come back: nothing to copy.

Device to host. `to_host` packs the device tensors as bytes into one device buffer and reads it
with one copy: the step's only synchronisation. The byte packing keeps every value exact
(tokens, fp32 logits, bf16 similarities). Pure torch; no ray.

    >>> st = Staging(torch.device("cpu"))
    >>> a, b = st.to_device([torch.arange(3), torch.tensor([[1, 2]], dtype=torch.int32)])
    >>> a.tolist(), b.dtype, b.shape, st.copies
    ([0, 1, 2], torch.int32, torch.Size([1, 2]), 0)
    >>> x, none, y = to_host([torch.tensor([7, 8]), None, torch.tensor([0.5], dtype=torch.bfloat16)])
    >>> x.tolist(), none, y.dtype, y.tolist()
    ([7, 8], None, torch.bfloat16, [0.5])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

RING = 4  # pinned buffers in turn


def _spans(tensors: Sequence[torch.Tensor | None]) -> tuple[list[int], int]:
    """The byte offset of each tensor in the packed buffer (8-byte aligned: any dtype's view) and the total."""
    at, out = 0, []
    for t in tensors:
        out.append(at)
        if t is not None:
            at += -(-t.numel() * t.element_size() // 8) * 8
    return out, at


def _pack(tensors: Sequence[torch.Tensor | None], into: torch.Tensor, spans: list[int]) -> None:
    for t, at in zip(tensors, spans):
        if t is not None and t.numel():
            b = t.detach().contiguous().view(-1).view(torch.uint8)
            into[at:at + b.numel()].copy_(b)


def _unpack(buf: torch.Tensor, like: Sequence[torch.Tensor | None], spans: list[int]) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for t, at in zip(like, spans):
        if t is None:
            out.append(None)
            continue
        n = t.numel() * t.element_size()
        out.append(buf[at:at + n].view(t.dtype).view(t.shape))
    return out


class Staging:
    """Host tensors to `device` in one copy per call (module doc). copies: the transfers made (CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copies = 0
        self._ring: list[torch.Tensor | None] = [None] * RING
        self._done: list[object] = [None] * RING
        self._turn = 0

    def to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors -> the same on the device (views of one copied buffer on CUDA; themselves elsewhere)."""
        if self.device.type != "cuda":
            return [t.to(self.device) for t in tensors]
        spans, total = _spans(tensors)
        i = self._turn = (self._turn + 1) % RING
        if self._done[i] is not None:
            self._done[i].synchronize()  # the copy that last read this buffer has run
        buf = self._ring[i]
        if buf is None or buf.numel() < total:
            buf = self._ring[i] = torch.empty(max(total, 4096), dtype=torch.uint8, pin_memory=True)
        _pack(tensors, buf, spans)
        dev = buf[:total].to(self.device, non_blocking=True)
        self._done[i] = torch.cuda.Event()
        self._done[i].record()
        self.copies += 1
        return _unpack(dev, tensors, spans)


def to_host(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Device tensors (None: nothing) -> host tensors, in one device-to-host copy (module doc); CPU tensors
    come back as they are."""
    real = [t for t in tensors if t is not None]
    if not real or all(t.device.type == "cpu" for t in real):
        return list(tensors)
    spans, total = _spans(tensors)
    buf = torch.empty(total, dtype=torch.uint8, device=real[0].device)
    _pack(tensors, buf, spans)
    return _unpack(buf.cpu(), tensors, spans)
