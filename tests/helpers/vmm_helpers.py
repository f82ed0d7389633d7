"""Measurements the data-plane tests share: physical memory as the OS/driver
sees it, independent of kvcached's own counters."""

from __future__ import annotations

import os

from kvcached import _C


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def physical_bytes(device: str) -> int:
    """Bytes of physical memory held right now, measured outside kvcached.

    Host: the committed size of every kvcached memfd this process holds
    (st_blocks of /proc/self/fd entries named memfd:kvcached-page).
    CUDA: device memory in use as the driver reports it (total - free),
    less what torch's caching allocator holds (temporaries of the checks).
    """
    if device == "cpu":
        total = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("/memfd:kvcached-page"):
                    total += os.fstat(int(fd)).st_blocks * 512
            except OSError:
                continue
        return total
    import torch

    torch.cuda.synchronize()
    info = _C.backend_info(device)
    return info["total_bytes"] - info["free_bytes"] - torch.cuda.memory_reserved()


def live_handles(device: str) -> int:
    return _C.backend_info(device)["live_handles"]
