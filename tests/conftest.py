"""Shared test set-up: the `cuda` marker (its tests run one at a time, in one worker); the fake
clock and GPU that engine tests share.

Tests marked ``@pytest.mark.cuda`` are skipped where CUDA is absent. On the GPU machine,
``STEPTIMER_REQUIRE_CUDA=1`` turns any such skip into a failure, so a green run proves they ran.
"""

from __future__ import annotations

import os

# `./dev test` runs one pytest-xdist worker per core: one intra-op thread each (inherited by the
# scripts tests start), so two workers' thread pools don't fight over the cores while timing tests
# compare known sleeps with what steptimer measured.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import steptimer._engine as engine_mod  # noqa: E402
from tests.fakes import FakeClock, FakeGPU  # noqa: E402

REQUIRE_CUDA = os.environ.get("STEPTIMER_REQUIRE_CUDA") == "1"


# First: pytest-xdist's worker reads the groups in its own hook of this name (into the test ids it
# schedules by), which otherwise runs before this one and sees none.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if "cuda" not in item.keywords:
            # A module-scoped fixture of the test's module (torchrun launches, spawned ranks, a
            # build: seconds each) is set up once per worker that runs one of its tests, and again
            # each time a worker comes back to the module: its tests share one worker, in a row.
            defs = getattr(item, "_fixtureinfo", None)
            module = item.nodeid.split("::")[0]
            shared = defs is not None and any(
                d.scope != "function" and d.baseid == module for ds in defs.name2fixturedefs.values() for d in ds
            )
            if shared and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(module))
            continue
        # GPU tests time kernels of known length: two at once on one GPU would slow each other, so
        # under pytest-xdist (`./dev test` runs with --dist loadgroup) they all share one worker.
        item.add_marker(pytest.mark.xdist_group("cuda"))
        if not cuda and not REQUIRE_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "cuda" in item.keywords and REQUIRE_CUDA and not torch.cuda.is_available():
        pytest.fail("STEPTIMER_REQUIRE_CUDA=1 but CUDA is absent")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    # Any skip of a cuda test (pytest.skip inside the test too) fails when CUDA is required.
    if REQUIRE_CUDA and report.skipped and "cuda" in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"STEPTIMER_REQUIRE_CUDA=1: cuda test {item.nodeid} was skipped"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The engine's host clock, moved by the test (``clock.advance_ms``)."""
    c = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", c)
    return c


@pytest.fixture
def gpu(clock: FakeClock) -> FakeGPU:
    """A simulated GPU on that clock (tests/fakes.py)."""
    return FakeGPU(clock)
