"""GPU truth tests (issue 2's GPU list), run on the device machine.

Every timed loop runs under ``torch.cuda.set_sync_debug_mode("error")`` with ``torch.cuda.synchronize``,
``torch.cuda.Event.synchronize`` and ``torch.cuda.Stream.synchronize`` patched to count (and the engine's
event waits through its native CUDA calls, which bypass torch, counted with them): steptimer must
make no device-wide or stream sync and at most one event wait per step. Lengths of known kernels come
from the profiler (CUPTI), never from the events under test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import pytest
import torch

from bench._stats import median
from bench.truth import RecordingTimer, profile_run, sleep_cycles_per_ms
from tests.fakes import engine_waits_counted

pytestmark = pytest.mark.cuda


@contextmanager
def strict_syncs() -> Iterator[dict[str, int]]:
    """Sync debug mode "error" and counted syncs; restored on exit (before the profiler's own sync)."""
    counts = {"device": 0, "event": 0, "stream": 0}
    orig = (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize)

    def device_sync(*a: Any, **k: Any) -> None:
        counts["device"] += 1
        orig[0](*a, **k)

    def event_sync(self: Any) -> None:
        counts["event"] += 1
        orig[1](self)

    def native_wait() -> None:  # the engine's waits through steptimer's native CUDA calls
        counts["event"] += 1

    def stream_sync(self: Any) -> None:
        counts["stream"] += 1
        orig[2](self)

    torch.cuda.synchronize = device_sync  # type: ignore[assignment]
    torch.cuda.Event.synchronize = event_sync  # type: ignore[method-assign]
    torch.cuda.Stream.synchronize = stream_sync  # type: ignore[method-assign]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with engine_waits_counted(native_wait):
            yield counts
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize = orig  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    torch.zeros(1, device="cuda")  # initialize CUDA so StepTimer(cuda=None) picks the GPU
    return sleep_cycles_per_ms()


def _known_length_run(cyc: float, steps: int, queue_ms: float) -> tuple[Any, Any, dict[str, int]]:
    timer = RecordingTimer.make(cuda=True)
    counts: dict[str, int] = {}
    from torch.profiler import record_function

    def body() -> None:
        with strict_syncs() as c:
            for i in range(1, steps + 1):
                with record_function(f"truthstep:{i}"), timer.step():
                    if queue_ms:
                        with timer.phase("queue"):
                            torch.cuda._sleep(int(queue_ms * cyc))  # the host runs ahead of this
                    with record_function(f"truth:{i}:sleep"), timer.phase("sleep"):
                        torch.cuda._sleep(int(2 * cyc))
            timer.close()
        counts.update(c)

    att = profile_run(body)
    return timer, att, counts


def test_known_phase_length_within_5_percent_no_syncs(cycles_per_ms: float) -> None:
    steps = 12
    timer, att, counts = _known_length_run(cycles_per_ms, steps, queue_ms=10)
    assert counts["device"] == 0 and counts["stream"] == 0
    assert counts["event"] <= steps
    checked = 0
    for s in timer.resolved:
        if s.number <= 2:
            continue
        kernel_ms = att.phases[(s.number, "sleep")].ms  # one kernel: its CUPTI duration
        assert att.phases[(s.number, "sleep")].n == 1
        assert s.gpu_ms["sleep"] == pytest.approx(kernel_ms, rel=0.05)
        checked += 1
    assert checked == steps - 2


def test_host_and_gpu_differ_when_host_runs_ahead(cycles_per_ms: float) -> None:
    # The host only launches the 2 ms kernel (µs); the GPU runs it (2 ms). A host timer reports the
    # launch; steptimer's GPU number reports the kernel, and the phase is not flagged launch-bound.
    steps = 12
    timer, att, counts = _known_length_run(cycles_per_ms, steps, queue_ms=10)
    assert counts["device"] == 0 and counts["stream"] == 0 and counts["event"] <= steps
    host = median([s.host_ms["sleep"] for s in timer.resolved if s.number > 2])
    gpu = median([s.gpu_ms["sleep"] for s in timer.resolved if s.number > 2])
    kernel = median([att.phases[(s.number, "sleep")].ms for s in timer.resolved if s.number > 2])
    assert gpu == pytest.approx(kernel, rel=0.05)
    assert host < 0.25 * kernel
    summary = timer.close()
    assert not summary["sleep"].launch_bound
    # The wait for step N-1 lands at the end of step N: the host's step time holds the backlog.
    assert summary["wait"].host.median_ms > 0.5 * kernel


def test_gpu_idle_grows_with_a_host_stall_between_steps(cycles_per_ms: float) -> None:
    timer = RecordingTimer.make(cuda=True)
    steps, stall_s = 10, 0.005
    slept: dict[int, float] = {}
    def loader() -> Any:
        for i in range(1, 2 * steps + 1):
            if i > steps:  # second half: the data loader stalls the host before each step
                t0 = perf_counter()
                time.sleep(stall_s)
                slept[i] = perf_counter() - t0
            yield i

    with strict_syncs() as counts:
        for _ in timer.data(loader()):
            with timer.step(), timer.phase("work"):
                torch.cuda._sleep(int(0.5 * cycles_per_ms))
        timer.close()
    assert counts["device"] == 0 and counts["stream"] == 0
    assert counts["event"] <= 2 * steps
    idle_fast = [s.gpu_ms["idle"] for s in timer.resolved if 2 < s.number <= steps]
    idle_stall = [s.gpu_ms["idle"] for s in timer.resolved if s.number > steps + 1]
    data_stall = [(s.host_ms["data"], slept[s.number] * 1e3) for s in timer.resolved if s.number > steps + 1]
    # Without a stall the host keeps the GPU fed (0.5 ms kernels, µs of host work): little idle.
    assert median(idle_fast) < 0.2
    # With a 5 ms stall the queue drains: the GPU idles for about the stall minus the 0.5 ms backlog.
    assert median(idle_stall) > median(idle_fast) + 0.6 * stall_s * 1e3
    assert median(idle_stall) < stall_s * 1e3 * 1.2
    for data_ms, slept_ms in data_stall:
        assert data_ms == pytest.approx(slept_ms, rel=0.05)
