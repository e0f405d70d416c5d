"""Close the timers still open when the process ends: at interpreter exit, and on SIGTERM.

A normal exit, an unhandled exception and an unhandled Ctrl-C all reach interpreter exit, where
``atexit`` closes every live timer. SIGTERM (schedulers, ``docker stop``, torchrun, preemption) with
its default action kills the process without running ``atexit``; so while a timer is live, steptimer
puts a handler in front of the one it finds, as git's ``sigchain`` and Lightning's
``_HandlersCompose`` do. The handler closes every live timer (the last window written, the summary
printed), puts the handler it found back and hands the signal on: to that handler if it is a
function, else by raising the signal again under the default action, so the process ends exactly as
it would have (killed by SIGTERM: exit status -15, 143 in a shell). It never swallows the signal.

Signals and ``atexit`` belong to the process, so this registry is process-wide. It holds the timers
weakly (a timer nobody holds is gone, as it would be without steptimer) and forgets them in a forked
child (a DataLoader worker must not write the parent's timers).
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import warnings
import weakref
from types import FrameType
from typing import Any, Protocol


class _Closes(Protocol):
    def _close_at_end(self) -> None: ...


_live: dict[int, weakref.ref[_Closes]] = {}  # id -> timer (or Instrumented), in the order they began
_chain: _Chain | None = None  # the handler put in for the timers live now


def track(obj: _Closes) -> None:
    """``obj`` is live: close it at exit or on SIGTERM (``obj._close_at_end()``) unless untracked first."""
    global _chain
    _live[id(obj)] = weakref.ref(obj)
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return  # signal.signal() works only in the main thread; atexit still covers the exit
    found = signal.getsignal(signal.SIGTERM)
    if found is _chain or found is None:  # ours already, or set outside Python (it can't be called from here)
        return
    _chain = _Chain(found)
    signal.signal(signal.SIGTERM, _chain)


def untrack(obj: object) -> None:
    """``obj`` closed: forget it; with no live timer left, take the handler out if nobody went on top."""
    global _chain
    _live.pop(id(obj), None)
    if any(ref() is not None for ref in _live.values()) or _chain is None:
        return
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _chain:
        signal.signal(signal.SIGTERM, _chain.prev)
    # Else a handler put in after ours (Lightning's, the user's) may call ours: it stays valid, closes
    # nothing and hands on to what it found.
    _chain = None


def _close_all(why: str) -> None:
    for ref in reversed(list(_live.values())):
        obj = ref()
        if obj is None:
            continue
        try:
            obj._close_at_end()
        except Exception as err:  # steptimer's own failure must not hide the signal or the exit
            warnings.warn(f"steptimer: could not close a timer at {why}: {err!r}", stacklevel=2)
    _live.clear()


class _Chain:
    """The SIGTERM handler in front of ``prev``, the disposition it found when it went in.

    Python runs it in the main thread between two bytecodes, not in the C signal handler, so closing
    timers here (waiting for the GPU's last events, writing files, printing) is ordinary Python and
    cannot deadlock on a lock the interrupted code holds in C. The interrupted code can be steptimer's
    own step bookkeeping: the step in progress is dropped, every completed one is written, and the
    closed timer then answers every call as a no-op, for a run that goes on (``prev`` may let it).
    """

    __slots__ = ("prev",)

    def __init__(self, prev: Any) -> None:
        self.prev = prev

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        global _chain
        on_top = signal.getsignal(signum) is self
        _close_all("SIGTERM")  # each close() untracks its timer: the last one takes our handler out
        if signal.getsignal(signum) is self:  # no timer was live (a handler of ours put back later)
            signal.signal(signum, self.prev)
        if _chain is self:
            _chain = None
        prev = self.prev  # now the process's handler again, when ours was on top
        if callable(prev):
            prev(signum, frame)
        elif on_top and prev == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action again: the process ends as it would have
        # SIG_IGN: ignored, as before. Called by a handler put in after ours (Lightning's calls the
        # one it found): that handler decides what happens next, as it would without steptimer.


def _forget_in_child() -> None:
    _live.clear()


atexit.register(_close_all, "exit")
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
