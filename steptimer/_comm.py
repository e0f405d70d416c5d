"""A DDP or FSDP2 model's collectives per timed step (``StepTimer.watch_ddp``, ``watch_fsdp``): rows
``comm`` (busy time) and ``comm_exposed`` (the time the compute waited for them), and the rank's arrival
at the step's first collective (``_dist.py``). The rows lie inside other phases, so they have no share
(docs/distributed.md).
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from time import perf_counter
from typing import Any

from steptimer._engine import GPU, HOST
from steptimer._listener import COMM, Listener

Span = Sequence[float]  # (ready, end) on one clock


def union_ms(spans: Sequence[Span], after: float = -float("inf")) -> float:
    """Length of the union of ``(start, end)`` spans, counting only what lies after ``after``."""
    total, end = 0.0, -float("inf")
    for a, b in sorted((max(a, after), b) for a, b in spans if b > after):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def comm_ms(
    spans: Sequence[Span],
    lasts: Sequence[bool],
    waits: Sequence[float | None] = (),
    regions: Sequence[tuple[float, float, int]] = (),
) -> tuple[float, float]:
    """``(comm, exposed)`` of one step from its collectives' spans. ``waits[i]``: host timing, when the
    compute began to wait for span ``i`` (until its end); NaN: span ``i`` is waited for inside a region.
    ``regions``: ``(start, end, n)``, spans of the compute stream where it may have waited (FSDP2's waits
    for an all-gather or a reduce-scatter) for the first ``n`` spans (those launched before it): each
    waited while they ran, from its start until the last of them that ended in it.
    The others (DDP's buckets; FSDP2's reduce-scatters if its final callback is not a region) are
    grouped by backward, ``lasts[i]``: span ``i`` is a backward's last (DDP's ``is_last()``; else the
    step's last): a group's exposed part is its union after its last span was ready, when the compute
    had nothing left to do but wait for it."""
    waits = list(waits) or [None] * len(spans)
    exposed = sum(max(0.0, b - w) for (_, b), w in zip(spans, waits) if w is not None and not math.isnan(w))
    for a, z, n in regions:  # the collectives that ran from its start until the last that ended in it
        e = max([b for _, b in spans[:n] if a < b <= z], default=a)
        exposed += union_ms([(max(r, a), min(b, e)) for r, b in spans[:n] if r < e and b > a])
    grouped = [(span, last) for span, last, w in zip(spans, lasts, waits) if w is None]
    first = 0
    for i, (_, last) in enumerate(grouped):
        if last or i == len(grouped) - 1:
            group = [span for span, _ in grouped[first : i + 1]]
            exposed += union_ms(group, after=max(a for a, _ in group))
            first = i + 1
    return union_ms(spans), exposed


class CommRecorder(Listener):
    """The comm hook, and the timed steps' spans until the engine resolves each: with NCCL and CUDA timing
    two CUDA events (compute stream after the launch; a side stream waiting on the future, complete at
    launch, so nothing of the user's waits), else ``perf_counter`` at the hook and in a callback chained to
    the future, which DDP waits for before backward ends. steptimer's own failure turns it off
    (``Engine.off``): the collectives run as without it, the steps are kept without comm rows."""

    part = COMM

    def __init__(self, engine: Any, inner: Callable[[Any, Any], Any] | None) -> None:
        self._engine = engine
        self._inner = inner  # DDP's comm hook; None: FSDP2's collectives
        # Per timed step, oldest first: (number, on the GPU, spans); a span is [ready, end, last
        # bucket, kind]: CUDA events, or host seconds (end None until it completes); kind: None, "gather"
        # (FSDP2's), "wait" (a region of the compute stream, not a collective) or the host's wait start.
        self._steps: deque[tuple[int, bool, list[list[Any]]]] = deque()
        # The last resolved step's last collective end: the ranks leave it together, so the next
        # step's arrival at its first collective counts from there (no clock shared between hosts).
        self._held: tuple[int, Any] | None = None
        self._free: list[Any] = []  # CUDA events, reused
        self._streams: dict[Any, Any] = {}  # by torch's raw stream key: the Stream object (see _record)
        self._side: Any = None
        self._region = False  # inside an FSDP2 region: a nested one is part of it
        self._final = False  # FSDP2's final backward callback is a region: it holds the reduce-scatters' tail
        self._skip = 0  # a step not measured: its collective's future was not complete at launch
        self.off = False  # the run closed, or steptimer's own failure here

    def run_closed(self) -> None:
        self.off = True
        self._steps.clear()
        self._held = None

    def hook(self, state: Any, bucket: Any) -> Any:
        """DDP's comm hook: the inner hook's collective, with the bucket's span noted on a timed step."""
        t, e = perf_counter(), self._engine
        gpu = bucket.buffer().is_cuda
        number = e.number + 1
        if self.off or e.state < HOST or number == self._skip or (gpu and (e.state != GPU or not _nccl(state))):
            return self._inner(state, bucket)
        fut = self._inner(state, bucket)
        try:
            if not gpu or fut.done():  # else waiting on it, even on a side stream, would block the host
                return self._note(fut, t, gpu, number, bucket)
        except Exception as err:  # noqa: BLE001 - steptimer's own: the collective goes on, comm rows off
            e.off(self.part, err)
            return fut
        self._skip = number
        self.step_dropped(number)
        return fut

    def _note(self, fut: Any, t: float, gpu: bool, number: int, bucket: Any) -> Any:
        """Note the bucket's span for the step ``number``; returns the future DDP waits for."""
        if not self._steps or self._steps[-1][0] != number:
            self._steps.append((number, gpu, []))
        spans = self._steps[-1][2]
        if not gpu:
            span = [t, None, bucket.is_last(), None]
            spans.append(span)

            def stamp(done: Any) -> Any:
                span[1] = perf_counter()
                return done.value()

            return fut.then(stamp)
        import torch

        ready, end = self._event(), self._event()
        self._record(ready)  # after the launch: the collective may start once the compute stream is here
        if self._side is None:
            self._side = torch.cuda.Stream(device=bucket.buffer().device)
        with torch.cuda.stream(self._side):
            fut.wait()
            end.record(self._side)
        spans.append([ready, end, bucket.is_last(), None])
        return fut

    def fsdp(self, call: Callable[[], Any], gpu: bool, async_op: bool, gather: bool) -> Any:
        """An FSDP2 collective ``call()`` (an all-gather if ``gather``, else a reduce-scatter), run on its
        stream, its span noted on a timed step. steptimer's own failure leaves it run once, unmeasured."""
        span = None
        with suppress(Exception):
            e = self._engine
            # An async collective is left out: its end is not in order.
            if not self.off and e.state >= HOST and not async_op and (not gpu or e.state == GPU):
                if not self._steps or self._steps[-1][0] != e.number + 1:
                    self._steps.append((e.number + 1, gpu, []))
                if gpu:
                    ready = self._event()
                    self._record(ready)  # on the collective's stream, once FSDP made it wait for the inputs
                    span = [ready, None, False, "gather" if gather else None]
                else:  # the call returns when the collective has: the compute waited all along
                    t = perf_counter()
                    span = [t, None, False, t]
        out = call()
        if span is not None:
            with suppress(Exception):
                if gpu:
                    end = self._event()
                    self._record(end)  # the stream waits for the collective (a synchronous call)
                else:
                    end = perf_counter()
                span[1] = end
                self._steps[-1][2].append(span)
        return out

    def region(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """FSDP2's ``orig``, in which the compute stream may wait for a collective: its span on the compute
        stream noted on a timed GPU step that has collectives already."""

        def region(*args: Any, **kwargs: Any) -> Any:
            e, steps = self._engine, self._steps
            if self._region or e.state != GPU or not steps or steps[-1][0] != e.number + 1 or not steps[-1][1]:
                return orig(*args, **kwargs)
            try:
                a, z, n = self._event(), self._event(), len(steps[-1][2])
                self._record(a)
            except Exception:  # steptimer's own failure: FSDP goes on, the wait unmeasured
                return orig(*args, **kwargs)
            self._region = True
            try:
                out = orig(*args, **kwargs)
            finally:
                self._region = False
            with suppress(Exception):
                self._record(z)
                steps[-1][2].append([a, z, False, "wait", n])  # it may wait for the n launched before it
            return out

        return region

    def _event(self) -> Any:
        import torch

        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def _record(self, ev: Any) -> None:
        """``ev.record()`` on the current stream, without the ``current_stream()`` that costs 12-45 µs
        a call (an FSDP2 step records about 200): the stream looked up by its raw key, as the engine does."""
        import torch

        key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        ev.record(stream)

    def _release(self, step: tuple[int, bool, list[list[Any]]], keep: Any = None) -> None:
        if step[1]:
            self._free += [ev for span in step[2] for ev in span[:2] if ev is not keep]

    def step_dropped(self, number: int) -> None:
        if self._steps and self._steps[-1][0] == number:
            self._release(self._steps.pop())

    def step_resolved(self, rec: Any, rows: Any) -> None:
        """Add ``(number, on the GPU, comm ms, exposed ms, arrival ms)`` of the resolved step to ``rows`` if
        it has spans, after the engine's wait for it; the arrival counts from the previous step's last
        collective end (None: not measured)."""
        steps, number = self._steps, rec.number
        while steps and steps[0][0] < number:  # resolved without a row of ours
            self._release(steps.popleft())
        if not steps or steps[0][0] != number:
            return
        _, gpu, every = step = steps.popleft()
        spans = [s for s in every if s[3] != "wait"]
        if gpu:
            # The compute stream waited for the spans before the step's end, but DDP's last may trail it
            # by µs (its side stream's record) and FSDP2's gathers are waited for by FSDP: lag 0 for those.
            for span in (spans[-1], *(s for s in spans if s[3] == "gather")):
                if not span[1].query():
                    span[1].synchronize()
            t0 = spans[0][0]
            ms = [(t0.elapsed_time(s[0]), t0.elapsed_time(s[1])) for s in spans]
            # A region may wait for the collectives launched before it (not for those it launches).
            regions = [
                (t0.elapsed_time(s[0]), t0.elapsed_time(s[1]), sum(x[3] != "wait" for x in every[: s[4]]))
                for s in every
                if s[3] == "wait"
            ]
            waits = [math.nan if s[3] == "gather" or self._final else None for s in spans]
        elif any(s[1] is None for s in spans):  # pragma: no cover - DDP waited for each future
            return
        else:
            ms, regions = [(s[0] * 1e3, s[1] * 1e3) for s in spans], []
            waits = [None if s[3] is None else s[3] * 1e3 for s in spans]
        held, end = self._held, spans[max(range(len(ms)), key=lambda i: ms[i][1])][1]
        comm, exposed = comm_ms(ms, [s[2] for s in spans], waits, regions)
        arrival = None
        if held is not None and held[0] == number - 1:
            # DDP: from there to the first collective. FSDP2, whose collectives run all through the
            # step: to the step's last collective end, which the ranks leave together, less the waits.
            if self._inner is None:  # watch_fsdp's
                arrival = (held[1].elapsed_time(end) if gpu else (end - held[1]) * 1e3) - exposed
            else:
                arrival = held[1].elapsed_time(spans[0][0]) if gpu else (spans[0][0] - held[1]) * 1e3
        if held is not None and gpu:
            self._free.append(held[1])
        self._held = (number, end)
        self._release(step, keep=end)
        rows.comm.append((number, gpu, comm, exposed, arrival))


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
    if hook is not None and not callable(hook):
        raise TypeError(
            f"watch_ddp(hook=...) must be a DDP comm hook, a function (state, bucket) -> Future such as "
            f"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook, or None for "
            f"DDP's all-reduce; got {type(hook).__name__} {hook!r:.40}"
        )
    _watched_once(engine, "watch_ddp")
    rec = CommRecorder(engine, hook or allreduce_hook)
    # A lambda: DDP checks a hook's annotations against its own types, and this module's are strings.
    model.register_comm_hook(state, lambda st, bucket: rec.hook(st, bucket))
    engine.attach(rec)  # once DDP took the hook: a refused one leaves the engine as it was
    _WATCHED.add(engine)


# The engines that watched a model's collectives, their recorder since turned off (a failure of
# steptimer's own) or not: DDP takes one comm hook per model, and the first is still registered.
_WATCHED: weakref.WeakSet[Any] = weakref.WeakSet()


def _watched_once(engine: Any, call: str) -> None:
    """One recorder per timer: a second watch would replace the first's (its rows gone), wrap the
    collectives twice, or meet DDP's own refusal of a second comm hook."""
    if engine in _WATCHED:
        raise RuntimeError(
            f"{call}: this timer already watched a model's collectives (watch_ddp or watch_fsdp was called); "
            "call it once per timer, and the first watch goes on"
        )


class _Timed:
    """FSDP2's all-gather or reduce-scatter of one param group (its ``set_custom_*`` protocol: ``allocate``
    and the call), each call timed by the recorder."""

    def __init__(self, inner: Any, rec: CommRecorder, gather: bool) -> None:
        self._inner, self._rec, self._gather = inner, rec, gather

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = kwargs.get("output_tensor", args[0] if args else None)
        gpu, async_op = bool(getattr(out, "is_cuda", False)), bool(kwargs.get("async_op", False))
        return self._rec.fsdp(lambda: self._inner(*args, **kwargs), gpu, async_op, self._gather)


def watch_fsdp(engine: Any, model: Any) -> None:
    """Time the all-gathers and reduce-scatters of every ``fully_shard`` module in ``model`` and the
    compute stream's spans where FSDP2 makes it wait for them (before a module's forward or backward, for
    its all-gather; after its backward, for an earlier reduce-scatter; in the final backward callback,
    for the last ones), through the recorder given to ``engine``."""
    from torch.distributed.fsdp import FSDPModule

    _watched_once(engine, "watch_fsdp")
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise TypeError(
            f"watch_fsdp needs a model with fully_shard modules, got {type(model).__name__}: call it after "
            "fully_shard(...)"
        )
    groups, states = [], [m._get_fsdp_state() for m in mods if hasattr(m, "_get_fsdp_state")]
    for state in states:  # FSDP2's param groups (their comms, waits): a list in torch 2.13, one in 2.11
        found = getattr(state, "_fsdp_param_groups", None)
        groups += found if found is not None else [g for g in [getattr(state, "_fsdp_param_group", None)] if g]
    parts = ("_all_gather_comm", "_reduce_scatter_comm", "wait_for_unshard", "post_backward")
    if not groups or not all(hasattr(g, part) for g in groups for part in parts):
        note = "watch_fsdp: this torch's FSDP2 has no param groups steptimer knows; its collectives are not timed"
        if note not in engine.notes:
            engine.notes.append(note)
        return
    rec = CommRecorder(engine, None)  # no DDP hook: FSDP2's collectives
    engine.attach(rec)
    _WATCHED.add(engine)
    for group in groups:
        group._all_gather_comm = _Timed(group._all_gather_comm, rec, True)
        group._reduce_scatter_comm = _Timed(group._reduce_scatter_comm, rec, False)
        group.wait_for_unshard = rec.region(group.wait_for_unshard)
        group.post_backward = rec.region(group.post_backward)
    # Queued by whichever state's pre-backward runs first; FSDP2 looks it up on the state when it queues.
    final = "_root_post_backward_final_callback"
    rec._final = all(hasattr(state, final) for state in states)
    for state in states if rec._final else ():
        setattr(state, final, rec.region(getattr(state, final)))
