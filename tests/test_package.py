"""The package as a user installs it: the wheel and sdist build, the wheel installs into a fresh
venv, and the README's quick start and `steptimer --version` run from there."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import steptimer

ROOT = Path(__file__).resolve().parents[1]
DIST_NAME = "torch-steptimer"

# The README's quick start uses a model, loader, loss and optimizer it does not define: these lines
# give it the smallest ones, so what runs below is the README's block as printed.
PREAMBLE = """
import torch
model = torch.nn.Linear(8, 2)
loss_fn = torch.nn.functional.cross_entropy
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(12)]
"""


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_wheel_installs_into_a_fresh_venv_and_runs_the_quick_start(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], check=True,
                   capture_output=True, text=True, timeout=600)  # fmt: skip
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    version = steptimer.__version__
    assert wheel.name.startswith(f"torch_steptimer-{version}-")
    assert sdist.name == f"torch_steptimer-{version}.tar.gz"
    assert "steptimer/_cudart.c" in zipfile.ZipFile(wheel).namelist()  # the CUDA shim's source ships
    with tarfile.open(sdist) as t:
        assert any(n.endswith("/CHANGELOG.md") for n in t.getnames())

    # A fresh venv gets the wheel alone; its dependencies (torch and the rest, already installed for
    # the tests) are reached through a path file instead of downloaded again.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, text=True, timeout=300)  # fmt: skip

    where = subprocess.run([str(py), "-c", "import steptimer; print(steptimer.__file__)"], check=True,
                           capture_output=True, text=True, cwd=tmp_path).stdout  # fmt: skip
    assert where.startswith(site), where  # the installed wheel, not this checkout

    out = subprocess.run([str(env_dir / "bin" / "steptimer"), "--version"], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    assert out.strip() == f"steptimer {version}"

    script = tmp_path / "quick_start.py"
    script.write_text(PREAMBLE + _quick_start() + "assert timer.steps == 12, timer.steps\n")
    run = subprocess.run([str(py), str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "forward" in run.stdout  # the summary table was printed
    assert list((tmp_path / "runs" / "exp1").glob("events.out.tfevents.*"))


def test_one_version_in_one_place() -> None:
    # pyproject takes the version from steptimer.__version__; the changelog's newest entry is it
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "steptimer.__version__"}' in pyproject
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M)  # no second copy in [project]
    first = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert first is not None and first.group(1) == steptimer.__version__
    assert f"pip install {DIST_NAME}" in (ROOT / "README.md").read_text()


# What a hint may name besides this project: the third-party packages steptimer's messages point to.
OTHER_DISTRIBUTIONS = {"nvidia-ml-py"}
HINT = re.compile(r"pip install((?:[ \t]+(?:-\S+|'[^'\n]*'|[\w.\[\],=<>-]+))+)")


def install_hints(text: str) -> list[str]:
    """The distributions each `pip install ...` in ``text`` names, extras and versions dropped."""
    names = []
    for m in HINT.finditer(text):
        for arg in m.group(1).split():
            arg = arg.strip("'\"`;,.):")
            if arg and not arg.startswith("-"):
                names.append(re.split(r"[\[<>=]", arg)[0].lower())
    return names


def test_every_install_hint_names_this_distribution() -> None:
    # "steptimer" on PyPI is another project: a hint must say torch-steptimer (extras included).
    files = [
        *(ROOT / "steptimer").glob("*.py"),
        *(ROOT / "examples").glob("*.py"),
        *(ROOT / "bench").glob("*.py"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
    ]
    hints = {f.relative_to(ROOT).as_posix(): install_hints(f.read_text()) for f in files}
    wrong = {f: [n for n in names if n not in {DIST_NAME} | OTHER_DISTRIBUTIONS] for f, names in hints.items()}
    assert {f: names for f, names in wrong.items() if names} == {}
    assert DIST_NAME in hints["steptimer/lightning.py"] and DIST_NAME in hints["steptimer/hf.py"]


def test_the_install_hint_scan_reads_extras_quotes_and_flags() -> None:
    text = "run `pip install 'steptimer[lightning]'`; or pip install -U torch-steptimer[hf] nvidia-ml-py."
    assert install_hints(text) == ["steptimer", "torch-steptimer", "nvidia-ml-py"]
