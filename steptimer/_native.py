"""Build and load ``_cudart.c``, the engine's CUDA calls without torch's Python layer, with the system C
compiler, cached per source and Python build (as Triton's launcher stubs are). Whatever goes wrong
leaves steptimer on torch's API (same numbers, higher host cost), with the reason in the summary."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("_cudart.c")
MODULE = "_steptimer_cudart"


class NativeUnavailable(Exception):
    """Why the native CUDA calls can't be used here (steptimer then uses torch's API)."""


def usable_here() -> bool:
    """False where the native calls are never tried: ``STEPTIMER_NATIVE=0``, or not Linux."""
    return os.environ.get("STEPTIMER_NATIVE", "1") != "0" and sys.platform.startswith("linux")


def cache_dir() -> Path:
    """``STEPTIMER_CACHE_DIR``, else ``$XDG_CACHE_HOME/steptimer`` or ``~/.cache/steptimer``."""
    env = os.environ.get("STEPTIMER_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "steptimer"


def compiler() -> list[str]:
    """The C compiler command: ``$CC``, Python's own ``CC``, then ``cc`` / ``gcc`` / ``clang``."""
    for cand in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        argv = shlex.split(cand or "")
        if argv and shutil.which(argv[0]):
            return argv
    raise NativeUnavailable("no C compiler found (set CC, or install gcc)")


def _usable_dir(path: Path, *, private: bool = False) -> bool:
    """Whether builds can go to ``path`` (made if missing); ``private``: ours alone, as in a shared tmp."""
    try:
        path.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    if private and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return False
    return os.access(path, os.W_OK | os.X_OK)


def build(out_dir: Path | None = None) -> Path:
    """The built extension's path, compiled unless cached; in ``cache_dir()``, else a private temp folder."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    key = hashlib.sha256(SOURCE.read_bytes() + sys.version.encode() + suffix.encode()).hexdigest()[:16]
    name = f"{MODULE}-{key}{suffix}"
    if out_dir is None:
        out_dir = cache = cache_dir()
        if not (cache / name).exists() and not _usable_dir(cache):
            out_dir = Path(tempfile.gettempdir()) / f"steptimer-{os.getuid()}"
            if not _usable_dir(out_dir, private=True):
                raise NativeUnavailable(f"no folder to build in: {cache} can't be written, {out_dir} isn't private")
    target = out_dir / name
    if target.exists():
        return target
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeUnavailable(f"Python's C headers are missing ({include}/Python.h; install python3-dev)")
    if not _usable_dir(out_dir):
        raise NativeUnavailable(f"cannot write the build to {out_dir}")
    # Build next to the target and rename: ranks of one job may build at the same time.
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{MODULE}-", suffix=suffix)
    os.close(fd)
    cmd = [*compiler(), "-O2", "-shared", "-fPIC", "-I", include, str(SOURCE), "-o", tmp, "-ldl", "-lm"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise NativeUnavailable(f"compiling {SOURCE.name} failed: {' '.join(cmd)}\n{res.stderr.strip()}")
        os.chmod(tmp, 0o755)  # mkstemp makes it 0o600: readable by others, like any shared library
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"compiling {SOURCE.name} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:  # pragma: no cover - only for a path that isn't an extension
        raise NativeUnavailable(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def loaded_cudart() -> str:
    """The path of the CUDA runtime library loaded in this process (torch's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libcudart" in line}
    except OSError as e:
        raise NativeUnavailable(f"cannot read /proc/self/maps to find torch's CUDA runtime: {e}") from e
    paths = {p for p in paths if os.path.basename(p).startswith("libcudart.so")}
    if len(paths) != 1:
        found = ", ".join(sorted(paths)) or "none"
        raise NativeUnavailable(f"expected one CUDA runtime library loaded in this process, found {found}")
    return paths.pop()


def cudart() -> ModuleType:
    """The extension, built, loaded and bound to torch's CUDA runtime; raises ``NativeUnavailable``."""
    if not usable_here():
        linux = sys.platform.startswith("linux")
        raise NativeUnavailable("disabled by STEPTIMER_NATIVE=0" if linux else f"Linux only (this is {sys.platform})")
    lib = loaded_cudart()
    path = build()
    try:
        mod = load(path)
        mod.init(lib)
    except (ImportError, OSError) as e:
        raise NativeUnavailable(f"cannot load {path}: {e}") from e
    return mod
