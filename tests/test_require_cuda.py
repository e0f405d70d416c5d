"""The STEPTIMER_REQUIRE_CUDA switch really turns a skipped cuda test into a failure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]

HERE = Path(__file__).parent


def test_require_cuda_turns_skip_into_failure(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real pytest sessions, in this process (pytester), with this suite's conftest: it reads the switch
    when it is imported, and each session imports it afresh."""
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pytester.makepyfile(test_x="import pytest\n\n@pytest.mark.cuda\ndef test_gpu():\n    pytest.skip('no gpu here')\n")
    pytester.makeini("[pytest]\nmarkers =\n    cuda: gpu\n")
    monkeypatch.setenv("STEPTIMER_REQUIRE_CUDA", "1")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == 1, result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) + outcomes.get("failed", 0) == 1, outcomes
    monkeypatch.delenv("STEPTIMER_REQUIRE_CUDA")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    if not torch.cuda.is_available():
        assert result.ret == 0 and result.parseoutcomes() == {"skipped": 1}, result.stdout.str()


def test_a_module_fixtures_tests_share_one_xdist_group(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `./dev test` (--dist loadgroup) a module-scoped fixture is set up once per worker that runs
    one of its tests: its tests get one group, so two workers set it up once; a cuda test keeps the cuda
    group alone."""
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    cuda: gpu\n    xdist_group: xdist\n")
    pytester.makepyfile(
        test_m="""
        import pytest

        @pytest.fixture(scope="module")
        def launch():
            with open("launches.txt", "a") as f:
                f.write("1\\n")
            return 1

        def test_a(launch): pass
        def test_b(launch): pass
        def test_alone(tmp_path): pass

        @pytest.mark.parametrize("k", range(6))  # enough that two workers would both get some
        def test_more(launch, k): pass

        @pytest.mark.cuda
        def test_gpu(launch): pass
        """
    )
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    groups = {i.name: [m.args[0] for m in i.iter_markers("xdist_group")] for i in items if "[" not in i.name}
    assert groups == {"test_a": ["test_m.py"], "test_b": ["test_m.py"], "test_alone": [], "test_gpu": ["cuda"]}
    # Two real workers: the fixture's tests go to one of them, which sets it up once.
    monkeypatch.setenv("PYTHONPATH", str(HERE.parent))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-k", "not gpu")
    assert result.ret == 0, result.stdout.str()
    assert (pytester.path / "launches.txt").read_text() == "1\n"
