"""The package as a user installs it: the wheel and sdist build, the wheel installs into a fresh
venv, and the README's quick start and `steptimer --version` run from there."""

from __future__ import annotations

import email.parser
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


def _quick_start(page: str) -> str:
    section = page[page.index("## Quick start") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


# `steptimer run`'s script: a plain loop over a DataLoader, no steptimer in it.
TRAIN = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
for x, y in torch.utils.data.DataLoader(data, batch_size=4):
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
print("trained")
"""


def check_metadata(metadata: str) -> str:
    """What PyPI shows of the wheel's METADATA, checked as `twine check` would and beyond; returns the
    long description. Relative links and images don't resolve on PyPI, nor does a clone's ./dev."""
    meta = email.parser.Parser().parsestr(metadata)
    assert meta["Name"] == DIST_NAME and meta["Version"] == steptimer.__version__
    assert meta["Metadata-Version"] and meta["Summary"] and meta["Author"]
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3" in classifiers and "Typing :: Typed" in classifiers
    # PEP 639: a License-Expression excludes license classifiers.
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers
    assert meta["Description-Content-Type"] == "text/markdown"
    description = meta.get_payload()
    targets = re.findall(r"\]\(([^)\s]+)", description) + re.findall(r"(?:src|href)=\"([^\"]+)", description)
    assert [t for t in targets if not t.startswith("https://")] == []
    assert "./dev" not in description and "## Quick start" in description
    assert _quick_start(description) == _quick_start((ROOT / "README.md").read_text())  # one quick start
    return description


def test_wheel_installs_into_a_fresh_venv_and_runs_the_quick_start(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], check=True,
                   capture_output=True, text=True, timeout=600)  # fmt: skip
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    version = steptimer.__version__
    assert wheel.name.startswith(f"torch_steptimer-{version}-")
    assert sdist.name == f"torch_steptimer-{version}.tar.gz"
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0" in license_text
    with zipfile.ZipFile(wheel) as z:
        assert "steptimer/_cudart.c" in z.namelist()  # the CUDA shim's source ships
        info = f"torch_steptimer-{version}.dist-info"
        assert z.read(f"{info}/licenses/LICENSE").decode() == license_text
        description = check_metadata(z.read(f"{info}/METADATA").decode())
    with tarfile.open(sdist) as t:
        names = {n.partition("/")[2] for n in t.getnames()}
        assert {"CHANGELOG.md", "LICENSE", "README.md", "docs/options.md"} <= names  # what the description points to
        pkg_info = t.extractfile(f"torch_steptimer-{version}/PKG-INFO").read().decode()  # type: ignore[union-attr]
        assert check_metadata(pkg_info) == description

    # A fresh venv gets the wheel alone; its dependencies (torch and the rest, already installed for
    # the tests) are reached through a path file instead of downloaded again (no CUDA torch fetched).
    # This environment's pip installs into it (`pip --python`): a pip of its own would cost seconds.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True, text=True, timeout=300)

    where = subprocess.run([str(py), "-c", "import steptimer; print(steptimer.__file__)"], check=True,
                           capture_output=True, text=True, cwd=tmp_path).stdout  # fmt: skip
    assert where.startswith(site), where  # the installed wheel, not this checkout

    out = subprocess.run([str(env_dir / "bin" / "steptimer"), "--version"], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    assert out.strip() == f"steptimer {version}"

    # The quick start as PyPI's page prints it.
    script = tmp_path / "quick_start.py"
    script.write_text(PREAMBLE + _quick_start(description) + "assert timer.steps == 12, timer.steps\n")
    run = subprocess.run([str(py), str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "forward" in run.stdout  # the summary table was printed
    assert list((tmp_path / "runs" / "exp1").glob("events.out.tfevents.*"))

    # `steptimer run` on a script with no steptimer in it, from the venv's own command.
    (tmp_path / "train.py").write_text(TRAIN)
    cmd = [str(env_dir / "bin" / "steptimer"), "run", "--log-dir", "runs/t", "train.py"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("trained\n") and "backward" in run.stdout  # the script's output, then the table
    assert "logging to runs/t" in run.stderr
    assert list((tmp_path / "runs" / "t").glob("events.out.tfevents.*"))


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
