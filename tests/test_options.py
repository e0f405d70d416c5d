from __future__ import annotations

import dataclasses

import pytest

import steptimer
from steptimer import Options, StepTimer


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> list[Options]:
    """Each Options built (its checks run in ``__post_init__``), in order."""
    built: list[Options] = []
    check = Options.__post_init__

    def counted(self: Options) -> None:
        built.append(self)
        check(self)

    monkeypatch.setattr(Options, "__post_init__", counted)
    return built


def test_an_options_object_passes_into_the_timer_and_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "Options" in steptimer.__all__
    opts = Options(cuda=False, warmup_steps=0, print_summary=False, sample_every=1)
    built = _count_checks(monkeypatch)
    timer = StepTimer(options=opts)
    assert timer.options is opts and built == []
    for _ in range(3):
        with timer.step(), timer.phase("forward"):
            pass
    summary = timer.close()
    assert (summary.steps, summary.timed_steps) == (3, 3)
    # dataclasses.replace builds a new one: checked then
    with pytest.raises(ValueError, match="lag must be an int >= 0, got -1"):
        dataclasses.replace(opts, lag=-1)


def test_options_and_keywords_together_or_not_an_options_are_refused() -> None:
    with pytest.raises(ValueError, match="pass options or keywords, not both: StepTimer got options and lag"):
        StepTimer(options=Options(cuda=False), lag=0)
    with pytest.raises(TypeError, match=r"StepTimer's options must be a steptimer.Options .*got dict"):
        StepTimer(options={"lag": 0})  # type: ignore[arg-type]
