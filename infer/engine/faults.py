"""Which errors leave the device unusable: after a CUDA error the engine's process must not be reused.

    if is_device_fault(error):     # a torch.cuda / accelerator error, "CUDA error: ...", a device-side
        ...                        # assert, an illegal memory access: restart the process, do not retry in it

A CUDA error (an illegal memory access, a device-side assert, a launch failure) poisons the process's
CUDA context: every later kernel fails or, worse, reads memory the faulting kernel wrote. Retrying
the other videos in the same process would caption them on that context, so the callers stop using
the engine instead: the offline caption actor exits and Ray restarts it (infer/offline/job.py), a
Serve replica fails its health check and Serve replaces it (infer/serving/service.py). Running out
of memory is not such an error (the allocator stays consistent; the video that did not fit is
the one to fail). Pure python + torch's exception types; no ray.
"""

from __future__ import annotations

import torch

# what torch's CUDA errors say (c10/cuda/CUDAException.h: "CUDA error: <cudaGetErrorString>", and the
# errors most often met on their own, e.g. in a re-raised or wrapped exception)
DEVICE_FAULT_TEXT = ("cuda error", "device-side assert", "illegal memory access", "unspecified launch failure",
                     "cudaerrorlaunchfailure", "illegal instruction was encountered")
_FAULT_TYPES = tuple(t for t in (getattr(torch, "AcceleratorError", None), getattr(torch.cuda, "CudaError", None))
                     if isinstance(t, type))


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` (or an exception it was raised from) is a CUDA error that poisons the process's context
    (module doc); out-of-memory is not.

    >>> is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    True
    >>> is_device_fault(RuntimeError("shape mismatch")), is_device_fault(torch.OutOfMemoryError("CUDA out of memory."))
    (False, False)
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not isinstance(e, torch.OutOfMemoryError):
            if _FAULT_TYPES and isinstance(e, _FAULT_TYPES):
                return True
            text = str(e).lower()
            if any(t in text for t in DEVICE_FAULT_TEXT):
                return True
        e = e.__cause__ or e.__context__
    return False
