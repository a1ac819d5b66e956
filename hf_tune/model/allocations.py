"""Memory read off torch's profiler, as the activation probe measures it: the bytes a profiled region holds at its end
and at its peak, from the allocator's own record (``allocations``), with the profiler's native chatter kept off the
terminal (``quiet_profiler``)."""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import warnings


@contextlib.contextmanager
def quiet_profiler():
    """The profiler's native start / stop lines (kineto writes them to file descriptor 2, whatever its log level)
    kept off the user's terminal; Python's deprecation warnings of the probe's own set-up too."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocations(prof, start: int) -> tuple[int, int]:
    """(bytes held at the end, the most held at once) of a profiled region, from the allocator's own record: every
    allocation and free is a ``[memory]`` event with its size (a free negative), read in time order from the
    profiler's raw results (``prof.events()`` would build every operator's statistics, ten times slower).

    A CPU kernel's workspace is not counted: what an outermost ``aten::`` operator allocates is counted when the
    operator returns, so a buffer it allocates and frees inside (oneDNN's packed copy of a bf16 matmul's weight on a
    CPU with AMX, a reduction's per-thread buffers) cancels out, while its outputs count. Those buffers depend on the
    CPU that runs the probe (with them, Mixtral-8x7B's planned peak per rank was 519 GB on a Xeon with AMX and 46 GB
    on another host), and a GPU kernel's workspace is in the runtime reserve instead."""
    events = list(prof.profiler.kineto_results.events())
    operators: dict[int, list[tuple[int, int]]] = {}  # thread -> outermost aten:: operators' (start, end)
    for event in sorted((e for e in events if e.name().startswith("aten::")), key=lambda e: e.start_ns()):
        spans = operators.setdefault(event.start_thread_id(), [])
        end = event.start_ns() + event.duration_ns()
        if not spans or event.start_ns() >= spans[-1][1]:  # not inside the previous outermost operator
            spans.append((event.start_ns(), end))
    starts = {thread: [span[0] for span in spans] for thread, spans in operators.items()}

    def counted_at(event) -> int:
        spans, at = operators.get(event.start_thread_id(), []), event.start_ns()
        i = bisect.bisect_right(starts.get(event.start_thread_id(), []), at) - 1
        return spans[i][1] if i >= 0 and at <= spans[i][1] else at

    changes = sorted((counted_at(event), event.nbytes()) for event in events if event.name() == "[memory]")
    live = peak = start
    for _, size in changes:
        live += size
        peak = max(peak, live)
    return live - start, peak
