"""The STEPTIMER_REQUIRE_CUDA switch really turns a skipped cuda test into a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent


def test_require_cuda_turns_skip_into_failure(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.cuda\ndef test_gpu():\n    pytest.skip('no gpu here')\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: gpu\n")
    # The copied conftest imports the shared fakes (tests.fakes) from the repository.
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, STEPTIMER_REQUIRE_CUDA="1", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 error" in out.stdout or "1 failed" in out.stdout
    env.pop("STEPTIMER_REQUIRE_CUDA")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    if not torch.cuda.is_available():
        assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout
