"""Peak resident memory of this process as Linux counts it, for the memory harnesses
(plan_memory.py, zero3_load_memory.py). Linux only: ``/proc/self/status`` and ``clear_refs``.

Start the measured process with :data:`MALLOC_ENV`: glibc then maps every allocation over 64 KiB
and keeps freed memory, so the resident size follows the tensors rather than the allocator's arenas.
"""

from __future__ import annotations

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def status_bytes(key: str) -> int:
    """One ``/proc/self/status`` size in bytes (``key``: e.g. ``VmRSS:``, ``VmHWM:``, ``RssAnon:``)."""
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(key)).split()[1]) * 1024


def reset_peak() -> int:
    """Restart the peak resident size (``VmHWM``) from the current one -> the current resident bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS:")


def peak() -> int:
    """The peak resident bytes since the last :func:`reset_peak` (or the process's start)."""
    return status_bytes("VmHWM:")
