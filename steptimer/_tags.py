"""The tag grammar of steptimer's TensorBoard values (docs/tensorboard.md), shared by writer and reader:
``<group>/<family>/<name>_<measure>`` for a row, ``<group>/<measure>`` for the whole window. A name may
hold ``_``, ``.``, ``-`` and ``/``, so a tag splits at its measure (:data:`MEASURES`). On disk a row's
values sit in a run of their own, without its name (:func:`split_tag`, :func:`join_tag`)."""

from __future__ import annotations

from typing import NamedTuple

MAIN = "steptimer"  # window means, shares, throughput, memory
TAILS = "steptimer-tails"  # p90 and max of the window's steps
CAUGHT = "steptimer-caught-up"  # fraction of steps in which the GPU caught up inside the phase
HIST = "steptimer-hist"  # the window's steps on the fixed log grid
RANKS = "steptimer-ranks"  # the spread across ranks (_dist.py)
RUN = "steptimer-run"  # facts about the run, never charted
# A warm-up window's values, each tag under it, as tensors no dashboard draws. Tags of their own:
# TensorBoard gives a tag's whole series the kind of its first value.
WARMUP = "steptimer-warmup"
# On disk: a row's run is ``<dir>/steptimer/<name>``, its event files end with the suffix.
EVENT_FILE_PREFIX = "events.out.tfevents."
PHASE_DIR = "steptimer"
PHASE_SUFFIX = ".steptimer"
# The communication rows of a watched DDP or FSDP model (_comm.py): their names are reserved.
COMM_ROWS = ("comm", "comm_exposed")
PAD_SUFFIX = ".pad"  # an empty run that fills a block of TensorBoard's colours (_tensorboard.py): no data
# The flight recorder's traces around the slowest steps: ``<dir>/steptimer-slow/<run id>/step-<N>.trace.json``.
FLIGHT_DIR = "steptimer-slow"
FLIGHT_FILE = "step-{step}.trace.json"

# No measure ends with ``_`` and another of its family, so the split is unambiguous.
MEASURES: dict[tuple[str, str], tuple[str, ...]] = {
    **{(MAIN, c): ("ms", "pct") for c in ("host", "gpu")},
    (MAIN, "mem"): ("peak_mib", "alloc_mib"),
    **{(TAILS, c): ("p90_ms", "max_ms") for c in ("host", "gpu")},
    (CAUGHT, "gpu"): ("frac",),
    **{(HIST, c): ("ms",) for c in ("host", "gpu")},
    **{(RANKS, c): ("min_ms", "mean_ms", "max_ms", "argmax") for c in ("host", "gpu")},
    (RANKS, "mem"): ("peak_min_mib", "peak_mean_mib", "peak_max_mib", "peak_argmax"),
}

# A row's statistics as tagged: (group, measure, the SeriesStats field it holds).
ROW_STATS = ((MAIN, "ms", "mean_ms"), (TAILS, "p90_ms", "p90_ms"), (TAILS, "max_ms", "max_ms"))
# Whole-window tags. The rates, each named as the field of ``Rates`` (and ``Summary``) it holds:
RATES = tuple(f"{MAIN}/{rate}" for rate in ("steps_per_s", "samples_per_s", "tokens_per_s", "tflops_per_s", "mfu"))
STEPS_PER_S, SAMPLES_PER_S, TOKENS_PER_S, TFLOPS_PER_S, MFU = RATES
RESERVED_MIB = f"{MAIN}/mem/reserved_mib"
# The GPU's energy (_energy.py), written one window late: its closing reading is taken off-thread.
JOULES_PER_STEP, JOULES_PER_SAMPLE, JOULES_PER_TOKEN, WATTS = (
    f"{MAIN}/{x}" for x in ("joules_per_step", "joules_per_sample", "joules_per_token", "watts")
)
WARMUP_STEPS = f"{RUN}/warmup_steps"
# On the window a run that ended inside its warm-up writes at its close: its steps, all warm-up, summarized.
ALL_WARMUP = f"{RUN}/all_warmup_steps"
# Which steps were timed, logged once: one in N (``sample_every``), or as the cost budget allowed.
SAMPLE_EVERY = f"{RUN}/sample_every"
COST_BUDGET = f"{RUN}/cost_budget"
# The timed device, logged once as text: the GPU's name with CUDA timing, else the CPU's (or "cpu").
DEVICE = f"{RUN}/device"


class Tag(NamedTuple):
    group: str
    family: str
    name: str
    measure: str


def tag(group: str, family: str, name: str, measure: str) -> str:
    """``tag("steptimer", "host", "forward", "ms")`` -> ``steptimer/host/forward_ms``."""
    return f"{group}/{family}/{name}_{measure}"


def run_tag(group: str, family: str, measure: str) -> str:
    """A row's tag inside its own run: ``steptimer/host_ms``."""
    return f"{group}/{family}_{measure}"


def parse(tag_: str) -> Tag | None:
    """A row's tag in parts (``steptimer-tails/host/pool_max_max_ms``: name ``pool_max``), else None."""
    group, _, rest = tag_.partition("/")
    family, _, rest = rest.partition("/")
    for measure in MEASURES.get((group, family), ()):
        if rest.endswith("_" + measure) and len(rest) > len(measure) + 1:
            return Tag(group, family, rest[: -len(measure) - 1], measure)
    return None


def split_tag(tag_: str, names: object) -> tuple[str | None, str]:
    """``steptimer-tails/gpu/fwd/attn_p90_ms`` -> ``("fwd/attn", "steptimer-tails/gpu_p90_ms")`` when
    ``fwd/attn`` is in ``names`` (the rows with a run), else ``(None, tag)``."""
    t = parse(tag_)
    if t is None or t.name not in names:  # type: ignore[operator]
        return None, tag_
    return t.name, run_tag(t.group, t.family, t.measure)


def join_tag(name: str, run_tag_: str) -> str:
    """The inverse of :func:`split_tag`: ``("forward", "steptimer/host_ms")`` -> ``steptimer/host/forward_ms``."""
    group, _, rest = run_tag_.partition("/")
    family, _, measure = rest.partition("_")
    return tag(group, family, name, measure)
