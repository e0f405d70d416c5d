"""The code's shape (issue 52): code as ``ruff format`` writes it, short functions, small classes.

``python -m tests.test_shape [FILES]`` prints what is over a limit.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "steptimer"
MAX_FUNCTION_LINES = 60  # from the ``def`` line to the last line of its body
MAX_CLASS_ATTRIBUTES = 20  # fields and ``self.x`` set in its methods


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)  # a dataclass or NamedTuple field
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
            continue
        me = fn.args.args[0].arg
        for node in ast.walk(fn):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == me:
                        names.add(sub.attr)
    return names


def over_limits(path: Path) -> list[str]:
    """Each function over MAX_FUNCTION_LINES and class over MAX_CLASS_ATTRIBUTES in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.name}:{node.lineno} {node.name}: {n} lines")
        elif isinstance(node, ast.ClassDef):
            n = len(_class_attributes(node))
            if n > MAX_CLASS_ATTRIBUTES:
                out.append(f"{path.name}:{node.lineno} class {node.name}: {n} attributes")
    return out


def test_no_function_over_60_lines_and_no_class_over_20_attributes() -> None:
    over = [line for path in sorted(PACKAGE.glob("**/*.py")) for line in over_limits(path)]
    assert not over, "\n".join(over)


def test_the_code_is_as_ruff_format_writes_it() -> None:
    skipped = [
        f"{p.name}:{i}"
        for p in sorted(PACKAGE.glob("**/*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not skipped, f"code packed by hand (# fmt: skip): {skipped}"


def test_the_limits_catch_a_long_function_and_a_large_class(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    fields = "\n".join(f"        self.a{i} = {i}" for i in range(21))
    src = tmp_path / "m.py"
    src.write_text(f"def f():\n{body}\n\nclass C:\n    def __init__(self):\n{fields}\n")
    assert over_limits(src) == ["m.py:1 f: 61 lines", "m.py:63 class C: 21 attributes"]


if __name__ == "__main__":
    files = [Path(a) for a in sys.argv[1:]] or sorted(PACKAGE.glob("**/*.py"))
    print("\n".join(line for f in files for line in over_limits(f)) or "all within the limits")
