"""The GPU clock: CUDA events on the current stream, with the calls bound once for a lean hot path.

A ``_CudaBackend`` bundles the handful of CUDA calls the engine makes. Tests pass a fake one (fake
events on a simulated GPU timeline) through ``StepTimer(_backend=...)``; this seam is how the lag,
pool and wait logic are tested on machines without a GPU.

Costs that shaped this file (H100, torch 2.11): ``torch.cuda.Event.record()`` costs ~12 µs, of which
~8 µs is its own ``torch.cuda.current_stream()`` lookup (it builds a Python ``Stream`` each time);
``record(stream)`` with the stream in hand costs ~3 µs. So the stream is looked up once per step,
through the raw ``(stream_id, device, type)`` tuple, and a ``Stream`` object is built only when that
tuple changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class _CudaBackend:
    """The CUDA calls the engine makes; every one is bound once, outside the hot path."""

    new_event: Callable[[], Any]  # an event with timing enabled
    record: Callable[[Any, Any], None]  # record(event, stream)
    elapsed_ms: Callable[[Any, Any], float]  # elapsed_ms(start_event, end_event)
    wait: Callable[[Any], None]  # block the host until the event completes
    stream_key: Callable[[], tuple[int, int, int]]  # a cheap key of the current stream
    stream_of_key: Callable[[tuple[int, int, int]], Any]  # the stream object for a key
    is_capturing: Callable[[], bool]  # is the current stream capturing a CUDA graph?


def cuda_usable() -> tuple[bool, str]:
    """Whether CUDA timing can be used now, and why not when it can't."""
    import torch

    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not torch.cuda.is_initialized():
        return False, "CUDA is available but not initialized yet (no tensor was put on a GPU)"
    return True, ""


def torch_backend() -> _CudaBackend:
    """The real backend over ``torch.cuda``."""
    import torch

    event_cls = torch.cuda.Event
    # Bind the C implementations, skipping torch.cuda.Event's Python wrappers: a frame saved per call
    # on the hot path. The wait stays on the public wrapper (once per step), so tests can patch it
    # to count waits.
    base = getattr(torch._C, "_CudaEventBase", event_cls)
    get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
    get_device = getattr(torch._C, "_cuda_getDevice", None)

    if get_stream is not None and get_device is not None:

        def stream_key() -> tuple[int, int, int]:
            return get_stream(get_device())  # type: ignore[no-any-return]

        def stream_of_key(key: tuple[int, int, int]) -> Any:
            return torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])

    else:  # pragma: no cover - older or unusual builds

        def stream_key() -> tuple[int, int, int]:
            s = torch.cuda.current_stream()
            return (s.stream_id, s.device_index, s.device_type)

        def stream_of_key(key: tuple[int, int, int]) -> Any:
            return torch.cuda.current_stream()

    return _CudaBackend(
        new_event=lambda: event_cls(enable_timing=True),
        record=base.record,
        elapsed_ms=base.elapsed_time,
        wait=lambda ev: event_cls.synchronize(ev),
        stream_key=stream_key,
        stream_of_key=stream_of_key,
        is_capturing=torch.cuda.is_current_stream_capturing,
    )
