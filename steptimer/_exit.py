"""Close the timers still open when the process ends: at ``atexit`` and on SIGTERM (whose default skips
``atexit``), through a handler in front of the one found (as git's ``sigchain``) that closes every live
timer, puts the found handler back and hands the signal on. Timers are held weakly and forgotten in a
forked child (a DataLoader worker must not write the parent's timers)."""

from __future__ import annotations

import atexit
import os
import signal
import threading
import warnings
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

_live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # id -> timer, in order
_chain: _Chain | None = None  # the handler put in for the timers live now


def track(obj: Any) -> None:
    """``obj`` is live: close it at exit or on SIGTERM (``obj._close_at_end()``) unless untracked first."""
    global _chain
    _live[id(obj)] = obj
    # signal.signal() works only in the main thread; atexit still covers the exit.
    if hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread():
        found = signal.getsignal(signal.SIGTERM)
        if found is not _chain and found is not None:  # None: set outside Python, can't be called from here
            _chain = _Chain(found)
            signal.signal(signal.SIGTERM, _chain)


def untrack(obj: object) -> None:
    """``obj`` closed: forget it; with no live timer left, take the handler out if nobody went on top."""
    global _chain
    _live.pop(id(obj), None)
    if _live or _chain is None:
        return
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _chain:
        signal.signal(signal.SIGTERM, _chain.prev)
    # Else a handler put in after ours (Lightning's, the user's) may call ours: it stays valid, closes
    # nothing and hands on to what it found.
    _chain = None


def _close_all(why: str) -> None:
    for obj in reversed(list(_live.values())):
        try:
            obj._close_at_end()
        except Exception as err:  # steptimer's own failure must not hide the signal or the exit
            warnings.warn(f"steptimer: could not close a timer at {why}: {err!r}", stacklevel=2)
    _live.clear()


@dataclass(eq=False)
class _Chain:
    """The SIGTERM handler in front of ``prev``, the disposition it found. Python runs it between two
    bytecodes of the main thread, so closing timers cannot deadlock on a lock held in C."""

    prev: Any

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        global _chain
        on_top = signal.getsignal(signum) is self
        _close_all("SIGTERM")  # each close() untracks its timer: the last one takes our handler out
        if signal.getsignal(signum) is self:  # no timer was live (a handler of ours put back later)
            signal.signal(signum, self.prev)
        if _chain is self:
            _chain = None
        if callable(self.prev):  # now the process's handler again, when ours was on top
            self.prev(signum, frame)
        elif on_top and self.prev == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action again: the process ends as it would have
        # SIG_IGN: ignored, as before. Called by a handler put in after ours (Lightning's calls the
        # one it found): that handler decides what happens next, as it would without steptimer.


atexit.register(_close_all, "exit")
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_live.clear)
