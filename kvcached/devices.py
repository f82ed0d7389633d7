"""The one device-string parser: every device kvcached is handed becomes "cpu" or "cuda:N".

Accepted forms: None (the default device), "cpu", "cuda", "cuda:N", an int N
(CUDA device N), a ``torch.device`` or anything with ``.type`` / ``.index`` of
type cpu or cuda. ROCm builds of torch report their GPUs as "cuda" and the
extension maps "cuda:N" to its HIP backend there, so "hip" / "hip:N" (what
that backend reports back) are accepted as the same device "cuda:N". A bare "cuda" means the current
CUDA device when torch is loaded, else device 0 (torch is never imported for
it: tools must work without the GPU stack).
"""

from __future__ import annotations

import re
import sys
from typing import Any

from kvcached.errors import InvalidArgumentError

ACCEPTED = "None, 'cpu', 'cuda', 'cuda:N', an int N or a torch.device of type cpu or cuda"

_CUDA = re.compile(r"(?:cuda|hip)(?::(\d+))?")


def _bad(device: Any) -> InvalidArgumentError:
    return InvalidArgumentError(f"kvcached has no backend for device {device!r}; use {ACCEPTED}")


def _current_cuda_index() -> int:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return int(torch.cuda.current_device())
        except Exception:  # torch without CUDA support
            pass
    return 0


def default_device() -> str:
    """cuda:<current> when torch sees a GPU, else "cpu" (the host backend)."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
    except Exception:  # no torch, or torch without CUDA support
        pass
    return "cpu"


def normalize_device(device: Any = None) -> str:
    """``device`` as "cpu" or "cuda:N"; raises InvalidArgumentError (one line, naming
    the accepted forms) for anything else."""
    if device is None:
        return default_device()
    if isinstance(device, bool):
        raise _bad(device)
    if isinstance(device, int):
        if device < 0:
            raise _bad(device)
        return f"cuda:{device}"
    if isinstance(device, str):
        s = device.strip()
        if s in ("cpu", "cpu:0"):
            return "cpu"
        m = _CUDA.fullmatch(s)
        if m is None:
            raise _bad(device)
        return f"cuda:{int(m.group(1)) if m.group(1) is not None else _current_cuda_index()}"
    kind = getattr(device, "type", None)
    if isinstance(kind, str) and hasattr(device, "index"):
        idx = device.index
        if kind == "cpu":
            return "cpu"
        if kind in ("cuda", "hip") and (
            idx is None or (isinstance(idx, int) and not isinstance(idx, bool) and idx >= 0)
        ):
            return f"cuda:{_current_cuda_index() if idx is None else idx}"
    raise _bad(device)


def is_cpu(device: Any) -> bool:
    """True when ``device`` names the host backend."""
    return normalize_device(device) == "cpu"


def same_device(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` name the same device."""
    return normalize_device(a) == normalize_device(b)


__all__ = ["ACCEPTED", "default_device", "is_cpu", "normalize_device", "same_device"]
