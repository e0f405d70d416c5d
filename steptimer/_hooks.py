"""The one place that puts hooks on a user's model and optimizers (:class:`Hooks`: its ``remove``
leaves nothing of steptimer) and finds those of a loop nobody named (:class:`Discovery`, docs/run.md).
"""

from __future__ import annotations

import copyreg
import functools
import gc
import pickle
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

__all__ = ["Discovery", "Hooks", "batch_counts", "holds", "watch_comm"]

_Fn = Callable[..., Any]


def _eager(fn: _Fn) -> _Fn:
    # torch.compile would otherwise trace a hook into its graph (its clock reads and state changes
    # replayed at the wrong time); disabled, it runs eagerly at a graph break.
    return torch.compiler.disable(fn)  # type: ignore[no-any-return]


class Hooks:
    """Every hook and wrapper one front door put on a user's objects; :meth:`remove` takes all out."""

    def __init__(self, *, eager: bool = True) -> None:
        self._eager = eager
        self._handles: list[Any] = []
        # (an instance's or module's __dict__, a class or copyreg's table; key, ours, the value before)
        self._put: list[tuple[Any, Any, Any, Any]] = []

    def _own(self, fn: _Fn) -> _Fn:
        return _eager(fn) if self._eager else fn

    def forward(
        self, module: nn.Module, pre: _Fn, post: _Fn, *, prepend: bool = False, with_kwargs: bool = False
    ) -> None:
        """A forward pre-hook and a forward hook (``always_call``: it sees a forward that raised)."""
        self._handles += (
            module.register_forward_pre_hook(self._own(pre), prepend=prepend, with_kwargs=with_kwargs),
            module.register_forward_hook(self._own(post), always_call=True),
        )

    def optimizer(self, opt: torch.optim.Optimizer, pre: _Fn | None = None, post: _Fn | None = None) -> None:
        """The optimizer's step pre-hook and/or post-hook."""
        if pre is not None:
            self._handles.append(opt.register_step_pre_hook(self._own(pre)))
        if post is not None:
            self._handles.append(opt.register_step_post_hook(self._own(post)))

    def wrap(self, obj: Any, attr: str, make: Callable[[_Fn], _Fn]) -> None:
        """``obj.attr = make(obj.attr)`` in an instance's or module's ``__dict__``; no ``attr``: nothing."""
        orig = getattr(obj, attr, None)
        if orig is not None and hasattr(obj, "__dict__"):  # `__wrapped__` keeps is_overridden() truthful
            self._replace(obj.__dict__, attr, self._own(functools.wraps(orig)(make(orig))))

    def _replace(self, where: Any, key: Any, ours: Any) -> None:
        self._put.append((where, key, ours, _entries(where).get(key)))
        _assign(where, key, ours)

    def wrap_views(self, opt: torch.optim.Optimizer, attr: str, make: Callable[[_Fn], _Fn]) -> None:
        """:meth:`wrap` for ``opt``'s views, which never reach it (``LightningOptimizer``)."""
        for cls in type(opt).__subclasses__():
            ours = any(w is cls and k == attr for w, k, *_ in self._put)  # another optimizer's view
            if attr not in cls.__dict__ or ours:
                self._replace(cls, attr, self._own(_for_views(opt, getattr(cls, attr), make)))

    def wrap_loaders(self, wrap: Callable[[Any], Any]) -> None:
        """Every ``DataLoader`` iterated in this thread gives ``wrap(its iterator)``."""
        from torch.utils.data import DataLoader

        orig, thread = DataLoader.__iter__, threading.get_ident()

        @functools.wraps(orig)
        def __iter__(loader: Any) -> Any:  # noqa: N807
            it = orig(loader)
            return wrap(it) if threading.get_ident() == thread else it

        self._replace(DataLoader, "__iter__", __iter__)

    def keep_picklable(self, model: nn.Module) -> None:
        """Pickle and copy ``model`` without what we put on it (a copy would feed this timer)."""
        # A copyreg entry for its class: pickle and copy look it up first.
        cls, ref = type(model), weakref.ref(model)
        before = copyreg.dispatch_table.get(cls)

        def reduce(obj: Any) -> Any:
            if obj is not ref() and before is not None:
                return before(obj)
            rv = obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
            if obj is ref() and isinstance(rv, tuple) and len(rv) > 2 and isinstance(rv[2], dict):
                rv = (*rv[:2], self._state_without_us(rv[2], obj), *rv[3:])
            return rv

        self._replace(copyreg.dispatch_table, cls, reduce)

    def _state_without_us(self, state: dict[str, Any], model: Any) -> dict[str, Any]:
        state = dict(state)  # never the live __dict__
        for where, attr, ours, _ in self._put:
            if where is model.__dict__ and state.get(attr) is ours:
                del state[attr]
        ids = {h.id for h in self._handles}  # unique across every hook dict
        # nn.Module keeps its forward hooks and their flags in dicts `_forward_*` keyed by handle id.
        for name, hooks in list(state.items()):
            if name.startswith("_forward_") and isinstance(hooks, dict) and not ids.isdisjoint(hooks):
                state[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in ids)
        return state

    def remove(self) -> None:
        """Take everything out (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for where, key, ours, before in reversed(self._put):
            # Else someone wrapped it after us: ours stays inside theirs, passing every call through
            # (a copyreg entry of ours passes every object to the one before it).
            if _entries(where).get(key) is ours:
                _assign(where, key, before)
        self._put = []


def _entries(where: Any) -> Any:
    return where if isinstance(where, dict) else where.__dict__


def _assign(where: Any, key: Any, value: Any) -> None:
    """``where[key] = value`` (None: delete it) on a dict, or as an attribute of a class."""
    if isinstance(where, dict) and value is None:
        del where[key]
    elif isinstance(where, dict):
        where[key] = value
    elif value is None:
        delattr(where, key)
    else:
        setattr(where, key, value)


def _for_views(opt: torch.optim.Optimizer, orig: _Fn, make: Callable[[_Fn], _Fn]) -> _Fn:
    ours = make(orig)

    @functools.wraps(orig)
    def call(this: Any, *args: Any, **kwargs: Any) -> Any:
        view = getattr(this, "param_groups", None) is opt.param_groups
        return (ours if view else orig)(this, *args, **kwargs)

    return call


def _first_tensor(x: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if depth < 2 and isinstance(x, dict):
        x = [x["input_ids"]] if isinstance(x.get("input_ids"), torch.Tensor) else list(x.values())
    if depth < 2 and isinstance(x, (list, tuple)):
        return next((t for v in x if (t := _first_tensor(v, depth + 1)) is not None), None)
    return None


def batch_counts(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int | None, int | None]:
    """(samples, tokens) of one model call from its first tensor input's shape: no device work."""
    t = _first_tensor(args)
    if t is None:
        t = _first_tensor(kwargs)
    if t is None or t.dim() == 0:
        return None, None
    ids = t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    return int(t.shape[0]), t.numel() if ids else None


class Discovery:
    """Finds a loop's optimizers and models (docs/run.md) and calls ``on_found`` (with the model call
    that triggered it). Optimizers not given are watched until :meth:`remove`: one nobody found that
    steps (a fine-tuning's second stage) calls ``on_lost`` and is found again the same way. No global
    module hook, ever: a model compiled under one stays slow after it is gone (85 % slower steps on GPT-2).
    """

    def __init__(
        self,
        on_found: Callable[[Discovery, Any, Any, Any], None],
        *,
        on_lost: Callable[[torch.optim.Optimizer], None] | None = None,
        models: Sequence[nn.Module] | None = None,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
    ) -> None:
        self._on_found, self._on_lost = on_found, on_lost
        self._thread = threading.get_ident()
        self._given_models = list(models) if models else None
        self._given_opts = list(optimizers) if optimizers else None
        self._stepped: dict[int, torch.optim.Optimizer] = {}  # in the order of their first step
        self.optimizer_steps = 0  # optimizer.step() calls seen before the hooks went in
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.problem: str | None = None  # why discovery gave up, for the summary
        self.rounds = 0  # times found: a second is a new optimizer's
        self._beside: set[int] = set()  # ids of those that stepped but train none of the models
        self._pending: set[int] = set()
        # A subclass's step() calling super().step() fires the hooks twice when torch patched both
        # classes (a plain instance of the base was made too): the nested pair is one step.
        self.stepping: torch.optim.Optimizer | None = None  # the optimizer whose step() is running
        self._handles = [
            register_optimizer_step_pre_hook(_eager(self._on_step)),
            register_optimizer_step_post_hook(_eager(self._on_stepped)),
        ]
        self._once: list[Any] = []  # the models' forward pre-hooks, out when the model is called

    def _on_stepped(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == self._thread:
            self.stepping = None

    def _on_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._handles or threading.get_ident() != self._thread or self.stepping is opt:
            return
        self.stepping = opt
        if self.problem is not None:  # gave up; the hook comes out at close (not here: see remove())
            return
        if self.models and not self._once:  # found: the front door's hooks time the loop's optimizers
            if self._given_opts is not None or id(opt) in self._beside or any(opt is o for o in self.optimizers):
                return
            # One nobody found steps: the loop changed (a new stage); it is found as the first was.
            self.models, self.optimizers, self.optimizer_steps = [], [], 0
            if self._on_lost is not None:
                self._on_lost(opt)
        self.optimizer_steps += 1
        if self.models:  # the rest of this iteration's optimizers: the next one starts at a forward
            self._pending.discard(id(opt))
        elif self._given_opts is None and id(opt) not in self._stepped:
            self._stepped[id(opt)] = opt
        elif self._given_opts is None or any(opt is o for o in self._given_opts):
            # Given, or an optimizer steps again: one whole iteration seen.
            self._decide(self._given_opts or list(self._stepped.values()), opt)

    def _decide(self, opts: list[torch.optim.Optimizer], now: torch.optim.Optimizer) -> None:
        self._stepped = {}
        models = list(self._given_models) if self._given_models is not None else trained_modules(opts)
        # The optimizers whose parameters those models hold; none of them: every one that stepped.
        mine = [o for o in opts if holds(o, models)] or opts
        self._beside |= {id(o) for o in opts if o not in mine}
        opts = mine
        if not models:
            names = ", ".join(type(o).__name__ for o in opts)
            self.problem = (
                f"the optimizer ({names}) stepped, but no module holds its parameters, so there is no model to time"
            )
            return
        self.models, self.optimizers = models, opts
        self._pending = {id(o) for o in opts if o is not now}  # still to step in this iteration (a GAN's)
        # One-shot instance pre-hooks on the models: their dicts are not the one torch iterates now.
        # with_kwargs: the first timed call's keyword batch is counted too.
        self._once = [m.register_forward_pre_hook(_eager(self._on_forward), with_kwargs=True) for m in models]

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self._once or self._pending or threading.get_ident() != self._thread:
            return
        # torch iterates a copy of the forward hooks: safe to take these out inside one.
        for h in self._once:
            h.remove()
        self._once = []
        self.rounds += 1
        self._on_found(self, module, args, kwargs)

    def remove(self) -> None:
        """Take discovery's hooks out; not from inside an optimizer step (torch iterates that dict)."""
        for h in self._handles + self._once:
            h.remove()
        self._handles, self._once = [], []


def watch_comm(timer: Any, models: Sequence[Any]) -> None:
    """For a front door that takes no code from the user: ``timer.watch_ddp`` or ``timer.watch_fsdp``
    on the first DDP-wrapped or FSDP2-sharded model of ``models``, unless the timer watches one.
    One that can't be watched (DDP with a comm hook of its own) is a note; training goes on."""
    if not timer.enabled or timer._engine.comm is not None or not torch.distributed.is_available():
        return
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule

        sharded: tuple[type, ...] = (FSDPModule,)
    except ImportError:  # no FSDP2 in this torch
        sharded = ()
    for model in models:
        if isinstance(model, DistributedDataParallel):
            call = "watch_ddp"
        elif isinstance(model, nn.Module) and any(isinstance(m, sharded) for m in model.modules()):
            call = "watch_fsdp"
        else:
            continue
        try:
            getattr(timer, call)(model)
        except Exception as err:  # steptimer's own failure never stops training
            timer.note(
                f"{call}: the collectives of {type(model).__name__} are not timed ({err}); "
                f"call timer.{call}(model) before training, with its comm hook if it has one"
            )
        return


def holds(opt: torch.optim.Optimizer, models: Sequence[nn.Module]) -> bool:
    """Whether ``opt`` holds a parameter of one of ``models``."""
    held = {id(p) for m in models for p in m.parameters()}
    return any(id(p) in held for g in opt.param_groups for p in g["params"])


def trained_modules(optimizers: Sequence[torch.optim.Optimizer]) -> list[nn.Module]:
    """The models those optimizers train (docs/run.md), by one scan of the live objects."""
    ids = dict.fromkeys(id(p) for o in optimizers for g in o.param_groups for p in g["params"])
    order = {k: i for i, k in enumerate(ids)}
    found: list[tuple[int, nn.Module]] = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), nn.Module):  # type(), not isinstance: no __class__ lookups
            continue
        try:
            params = list(obj.parameters())
        except Exception:  # a half-built or broken module: not a model
            continue
        # One trainable parameter these optimizers don't hold: not (all of) one of their models.
        if not any(id(p) not in order and p.requires_grad for p in params):
            mine = [order[id(p)] for p in params if id(p) in order]
            if mine:
                found.append((min(mine), obj))
    inner = {id(sub) for _, m in found for sub in m.modules() if sub is not m}
    return [m for _, m in sorted(found, key=lambda f: f[0]) if id(m) not in inner]
