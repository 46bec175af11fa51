"""Peak resident memory of a code region, sampled from the operating system (works for CPU tensors)."""

from __future__ import annotations

import os
import threading
import time


def resident_bytes() -> int:
    """Current resident set size of this process, in bytes (Linux `/proc`, else the peak from `resource`)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Context manager that samples the resident set size every `interval` seconds and keeps the peak.

    Attributes:
        peak_bytes (`int`): the highest resident size seen inside the block.
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peak_mib(self) -> float:
        """The peak in MiB."""
        return self.peak_bytes / 2**20

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, resident_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        self.peak_bytes = resident_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, resident_bytes())
