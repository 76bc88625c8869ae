"""Memory as the scheduler sees it: the peak of one batch, and what to give back after a batch
ran out of memory.

Peak memory per batch (the service's `clusterserve_peak_memory_bytes`, `x-peak-memory-bytes`):
- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`: the allocator's
  exact peak of live tensors during the batch, model weights included.
- CPU (Linux): the process's peak resident set size during the batch. The kernel's
  high-water mark (VmHWM in /proc/self/status) is reset to the current RSS by writing "5"
  to /proc/self/clear_refs before the batch and read after it. It includes the weights and
  the Python runtime, and it under-counts memory the allocator reuses without growing RSS
  (small freed blocks glibc keeps); large tensors are mmap'd and show in full. Where the
  reset is not allowed, nothing is reported rather than a stale process-lifetime peak.
"""

from __future__ import annotations

import gc

import torch


def read_proc_status(field: str) -> int | None:
    """A memory line of /proc/self/status in bytes (e.g. "VmRSS"), None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return None


class PeakMemory:
    """Measures the peak memory of one batch (see the module docstring for what it means)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.available = device.type == "cuda" or self._reset_rss_peak()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.available:
            self._reset_rss_peak()

    def read(self) -> int | None:
        """Peak bytes since the last `reset`, or None where it cannot be measured."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return read_proc_status("VmHWM") if self.available else None

    @staticmethod
    def _reset_rss_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # "5": reset the peak RSS to the current RSS
            return True
        except OSError:
            return False


def free_memory(encoder) -> None:
    """Give back what a failed forward pass held, so the retry (and later batches) can use it:
    the garbage, the captured CUDA graphs (each batch shape holds a memory pool) and the CUDA
    allocator's cache."""
    gc.collect()
    if encoder.graphs is not None:
        encoder.graphs.clear()
    if encoder.device.type == "cuda":
        torch.cuda.empty_cache()
