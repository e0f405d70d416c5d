"""A DDP model's gradient collectives per timed step (``StepTimer.watch_ddp``): rows ``comm`` (busy time)
and ``comm_exposed`` (after each backward's last bucket was ready), and the rank's arrival at the step's
first collective (``_dist.py``). Both rows lie inside ``backward``, so they have no share (docs/distributed.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from time import perf_counter
from typing import Any

from steptimer._engine import GPU, HOST

Span = Sequence[float]  # (ready, end) on one clock


def union_ms(spans: Sequence[Span], after: float = -float("inf")) -> float:
    """Length of the union of ``(start, end)`` spans, counting only what lies after ``after``."""
    total, end = 0.0, -float("inf")
    for a, b in sorted((max(a, after), b) for a, b in spans if b > after):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def comm_ms(spans: Sequence[Span], lasts: Sequence[bool]) -> tuple[float, float]:
    """``(comm, exposed)`` of one step from its buckets' spans. ``lasts[i]``: span ``i`` is a backward's
    last bucket (DDP's ``is_last()``); each backward's exposed part is its spans' union after its last
    bucket was ready, when the compute had nothing left to do but wait."""
    exposed, first = 0.0, 0
    for i, last in enumerate(lasts):
        if last or i == len(lasts) - 1:
            group = spans[first : i + 1]
            exposed += union_ms(group, after=max(a for a, _ in group))
            first = i + 1
    return union_ms(spans), exposed


class CommRecorder:
    """The comm hook, and the timed steps' spans until the engine resolves each (:meth:`take`): with NCCL
    and CUDA timing two CUDA events (compute stream after the launch; a side stream waiting on the
    future, complete at launch, so nothing of the user's waits), else ``perf_counter`` at the hook and
    in a callback chained to the future, which DDP waits for before backward ends."""

    def __init__(self, engine: Any, inner: Callable[[Any, Any], Any]) -> None:
        self._engine = engine
        self._inner = inner
        # Per timed step, oldest first: (number, on the GPU, spans); a span is [ready, end, last
        # bucket]: CUDA events, or host seconds (end None until it completes).
        self._steps: deque[tuple[int, bool, list[list[Any]]]] = deque()
        # The last resolved step's last collective end: the ranks leave it together, so the next
        # step's arrival at its first collective counts from there (no clock shared between hosts).
        self._held: tuple[int, Any] | None = None
        self._free: list[Any] = []  # CUDA events, reused
        self._side: Any = None
        self._skip = 0  # a step not measured: its collective's future was not complete at launch

    def hook(self, state: Any, bucket: Any) -> Any:
        """DDP's comm hook: the inner hook's collective, with the bucket's span noted on a timed step."""
        t, e = perf_counter(), self._engine
        gpu = bucket.buffer().is_cuda
        number = e.number + 1
        if e.state < HOST or number == self._skip or (gpu and (e.state != GPU or not _nccl(state))):
            return self._inner(state, bucket)
        fut = self._inner(state, bucket)
        with suppress(Exception):  # steptimer's own failure: the collective goes on, this step unmeasured
            if not gpu or fut.done():  # else waiting on it, even on a side stream, would block the host
                return self._note(fut, t, gpu, number, bucket)
        self._skip = number
        self.drop(number)
        return fut

    def _note(self, fut: Any, t: float, gpu: bool, number: int, bucket: Any) -> Any:
        """Note the bucket's span for the step ``number``; returns the future DDP waits for."""
        if not self._steps or self._steps[-1][0] != number:
            self._steps.append((number, gpu, []))
        spans = self._steps[-1][2]
        if not gpu:
            span = [t, None, bucket.is_last()]
            spans.append(span)

            def stamp(done: Any) -> Any:
                span[1] = perf_counter()
                return done.value()

            return fut.then(stamp)
        import torch

        ready, end = self._event(), self._event()
        ready.record()  # after the launch: the collective may start once the compute stream is here
        if self._side is None:
            self._side = torch.cuda.Stream(device=bucket.buffer().device)
        with torch.cuda.stream(self._side):
            fut.wait()
            end.record(self._side)
        spans.append([ready, end, bucket.is_last()])
        return fut

    def _event(self) -> Any:
        import torch

        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def _release(self, step: tuple[int, bool, list[list[Any]]], keep: Any = None) -> None:
        if step[1]:
            self._free += [ev for ready, end, _ in step[2] for ev in (ready, end) if ev is not keep]

    def drop(self, number: int) -> None:
        """The open step ``number`` was dropped (it raised): forget its spans."""
        if self._steps and self._steps[-1][0] == number:
            self._release(self._steps.pop())

    def take(self, number: int) -> tuple[int, bool, float, float, float | None] | None:
        """``(number, on the GPU, comm ms, exposed ms, arrival ms)`` of the resolved step ``number`` if it
        has spans, after the engine's wait for it; the arrival counts from the previous step's last
        collective end (None: not measured). Its own failure leaves the step without comm rows."""
        try:
            return self._take(number)
        except Exception:
            self._steps.clear()
            self._held = None
            return None

    def _take(self, number: int) -> tuple[int, bool, float, float, float | None] | None:
        steps = self._steps
        while steps and steps[0][0] < number:  # resolved without a row of ours
            self._release(steps.popleft())
        if not steps or steps[0][0] != number:
            return None
        _, gpu, spans = step = steps.popleft()
        if gpu:
            if not spans[-1][1].query():  # lag 0: the side stream's record may trail the step's end by µs
                spans[-1][1].synchronize()
            t0 = spans[0][0]
            ms = [(t0.elapsed_time(r), t0.elapsed_time(x)) for r, x, _ in spans]
        elif any(s[1] is None for s in spans):  # pragma: no cover - DDP waited for each future
            return None
        else:
            ms = [(r * 1e3, x * 1e3) for r, x, _ in spans]
        held, end = self._held, spans[max(range(len(ms)), key=lambda i: ms[i][1])][1]
        arrival = None
        if held is not None and held[0] == number - 1:
            arrival = held[1].elapsed_time(spans[0][0]) if gpu else (spans[0][0] - held[1]) * 1e3
        if held is not None and gpu:
            self._free.append(held[1])
        self._held = (number, end)
        self._release(step, keep=end)
        return (number, gpu, *comm_ms(ms, [s[2] for s in spans]), arrival)


def _nccl(state: Any) -> bool:
    """The collective runs on NCCL (its futures are complete at launch, with CUDA events)."""
    import torch.distributed as dist

    try:
        return dist.get_backend(state if isinstance(state, dist.ProcessGroup) else None) == "nccl"
    except (RuntimeError, ValueError):
        return False


def watch(engine: Any, model: Any, hook: Callable[[Any, Any], Any] | None = None, state: Any = None) -> None:
    """Register the recorder's hook on the DDP ``model`` and give it to ``engine``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"watch_ddp needs a DistributedDataParallel model, got {type(model).__name__}: pass the "
            "model that DistributedDataParallel(...) returned"
        )
    engine.comm = rec = CommRecorder(engine, hook or allreduce_hook)
    # A lambda: DDP checks a hook's annotations against its own types, and this module's are strings.
    model.register_comm_hook(state, lambda st, bucket: rec.hook(st, bucket))
