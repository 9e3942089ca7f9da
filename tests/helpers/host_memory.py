"""Host memory of this process, measured honestly: the peak resident set size over a block of code.

RSS here is what Linux's VmRSS / VmHWM in /proc/self/status count: anonymous memory (malloc, torch CPU tensors)
AND file-backed pages mapped into the process (an mmap'd safetensors file, once touched). The second part is
what makes "loads lazily" claims checkable: pages a memory map has touched are resident memory too.

The peak is exact on Linux: entering the block writes "5" to /proc/self/clear_refs, which resets the high-water
mark VmHWM to the current RSS, and VmHWM is read at exit. Where clear_refs cannot be written (non-Linux,
some sandboxes), a thread samples RSS every `sample_interval_s` instead; that misses spikes shorter than an
interval, so it can only under-report (and if VmHWM is readable and rose during the block, it is used, exactly).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")

# Measurements in progress, so a nested one (which resets the shared high-water mark) does not blind the outer.
_active: list[HostMemoryPeak] = []
_active_lock = threading.Lock()


def _status_bytes(field: str) -> int | None:
    """A "VmXXX:  1234 kB" line of /proc/self/status, in bytes (None where there is no such file or line)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    """Resident memory of this process now (anonymous + file-backed), in bytes."""
    rss = _status_bytes("VmRSS")
    if rss is not None:
        return rss
    try:
        import psutil
    except ImportError:
        raise RuntimeError("current_rss_bytes needs Linux's /proc/self/status or the psutil package") from None
    return psutil.Process().memory_info().rss


def release_free_memory() -> None:
    """Collect garbage and hand freed heap back to the OS, so memory already freed does not count as resident."""
    gc.collect()
    try:  # glibc only; musl and macOS have no malloc_trim
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (True), or say it cannot be done here (False)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class HostMemoryPeak:
    """`with HostMemoryPeak() as m: ...`, then m.peak_bytes: peak RSS during the block minus RSS at entry.

    Also m.start_bytes / m.end_bytes (RSS at entry / exit) and m.method ("clear_refs", or "sampling" for the
    fallback described in the module docstring). Threads share one address space, so memory other threads
    allocate during the block counts too.
    """

    def __init__(self, sample_interval_s: float = 0.001):
        self.sample_interval_s = sample_interval_s
        self.peak_bytes = self.start_bytes = self.end_bytes = 0
        self.method = ""
        self._floor = 0  # an absolute peak seen before a nested measurement reset the high-water mark
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> HostMemoryPeak:
        release_free_memory()
        with _active_lock:
            hwm = _status_bytes("VmHWM")
            for outer in _active:  # about to reset the mark they rely on: hand them what it says now
                outer._floor = max(outer._floor, hwm or 0)
            if _reset_high_water_mark():
                self.method = "clear_refs"
            else:
                self.method = "sampling"
                self._hwm_at_entry = hwm
            self.start_bytes = current_rss_bytes()
            _active.append(self)
        if self.method == "sampling":
            self._sampled = self.start_bytes
            self._sampler = threading.Thread(target=self._sample, name="HostMemoryPeak", daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            self._sampled = max(self._sampled, current_rss_bytes())

    def __exit__(self, *exc) -> None:
        with _active_lock:
            self.end_bytes = current_rss_bytes()
            hwm = _status_bytes("VmHWM")
            _active.remove(self)
        if self.method == "clear_refs":
            peak = hwm
        else:
            self._stop.set()
            self._sampler.join()
            peak = max(self._sampled, self.end_bytes)
            if hwm is not None and self._hwm_at_entry is not None and hwm > self._hwm_at_entry:
                peak = max(peak, hwm)  # a new all-time high was reached inside the block: that is the peak
        self.peak_bytes = max(peak, self._floor, self.end_bytes) - self.start_bytes

    def __repr__(self) -> str:
        mib = 2**20
        return (
            f"HostMemoryPeak(peak={self.peak_bytes / mib:.1f} MiB, start={self.start_bytes / mib:.1f} MiB, "
            f"end={self.end_bytes / mib:.1f} MiB, method={self.method!r})"
        )
