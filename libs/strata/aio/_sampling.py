"""What a heartbeat reports about this process: CPU share, resident memory, GPU use and memory."""

from __future__ import annotations

import os
import sys
import time

from strata.events.models import MAX_CPU_PERCENT, MAX_GPU_PERCENT


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    # Without /proc only the peak is known; macOS reports it in bytes, the others in KiB.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class ProcessSampler:
    """CPU use of the whole process between two samples, and its resident memory."""

    def __init__(self) -> None:
        self._cpu = self._cpu_seconds()
        self._wall = time.monotonic()
        self._percent: float | None = None
        self._gpu_utilization_works = True

    @staticmethod
    def _cpu_seconds() -> float:
        times = os.times()
        return times.user + times.system

    def sample(self) -> tuple[float | None, int | None]:
        cpu, wall = self._cpu_seconds(), time.monotonic()
        # Over a very short span the clock ticks make the figure noise; keep the previous one.
        if wall - self._wall >= 0.05:
            percent = (cpu - self._cpu) / (wall - self._wall) * 100.0
            self._percent = round(min(max(percent, 0.0), float(MAX_CPU_PERCENT)), 1)
            self._cpu, self._wall = cpu, wall
        return self._percent, _rss_bytes()

    def gpu(self) -> tuple[float | None, int | None]:
        """Utilisation and allocated memory of this process's busiest GPU, if torch uses CUDA."""
        # Only a torch the training code already imported: importing it here would cost seconds.
        torch = sys.modules.get("torch")
        if torch is None:
            return None, None
        try:
            cuda = torch.cuda
            if not cuda.is_available() or not cuda.is_initialized():
                return None, None
            allocated, device = max(
                (int(cuda.memory_allocated(d)), d) for d in range(cuda.device_count())
            )
        except Exception:
            return None, None
        utilization: float | None = None
        if self._gpu_utilization_works:
            try:
                utilization = min(max(float(cuda.utilization(device)), 0.0), float(MAX_GPU_PERCENT))
            except Exception:  # needs pynvml; without it, stop asking
                self._gpu_utilization_works = False
        return utilization, allocated
