"""What a step did to GPU memory and what it compiled, for the step's record
(`shards/<k>/steps/<step>.json`).

A step that runs at the edge of memory is slow long before it fails: when the caching allocator
cannot find a block it frees its cache and tries again (`alloc_retries`, each a device-wide sync),
and the AR scheduler halves its batch on an OOM (`oom_retries` in the scheduler's stats). Neither
fails a row, so neither shows anywhere else. The peaks say how close the step came."""

from __future__ import annotations

from typing import Any

import torch

GIB = 1 << 30


class StepMemory:
    """Started at a step's beginning (peaks reset there); `stats()` at its end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.start: dict[str, int] = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_stats(device)

    def stats(self, parallel: Any = None) -> dict[str, Any]:
        """Peak allocated / reserved GiB and the allocator's retries and OOMs during the step; under
        tensor or pipeline parallelism the worst rank's (a collective: every rank calls it)."""
        if not self.cuda:
            return {}
        now = torch.cuda.memory_stats(self.device)
        values = [now.get("allocated_bytes.all.peak", 0), now.get("reserved_bytes.all.peak", 0),
                  now.get("num_alloc_retries", 0) - self.start.get("num_alloc_retries", 0),
                  now.get("num_ooms", 0) - self.start.get("num_ooms", 0)]
        if parallel is not None:
            values = parallel.agree_max(values)
        peak_allocated, peak_reserved, retries, ooms = values
        return {"peak_allocated_gib": round(peak_allocated / GIB, 2),
                "peak_reserved_gib": round(peak_reserved / GIB, 2),
                "total_gib": round(torch.cuda.get_device_properties(self.device).total_memory / GIB, 2),
                "alloc_retries": int(retries), "ooms": int(ooms)}


class StepCompiles:
    """How many frames Dynamo compiled during a step and the seconds that took (tracing, and Inductor's
    compile or its cache's load), for the step's record: with warm compile caches a process still
    traces every graph once, so a job's first shard is slower than its second by about this much."""

    def __init__(self) -> None:
        self.start = _compile_totals()

    def stats(self, parallel: Any = None) -> dict[str, Any]:
        """Frames compiled and seconds spent; under tensor or pipeline parallelism the worst rank's (a
        collective: every rank calls it)."""
        (frames, seconds), (frames_before, seconds_before) = _compile_totals(), self.start
        values = [frames - frames_before, round((seconds - seconds_before) * 1000)]
        if parallel is not None:
            values = parallel.agree_max(values)
        return {"frames": int(values[0]), "seconds": round(values[1] / 1000, 2)}


def _compile_totals() -> tuple[int, float]:
    """Frames Dynamo compiled in this process so far and their seconds (0, 0.0 before any compile)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
    durations = utils.compilation_time_metrics.get("_compile.compile_inner", []) if utils is not None else []
    return len(durations), float(sum(durations))
