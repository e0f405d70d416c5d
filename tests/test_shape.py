"""The code's shape (issue 52): code as ``ruff format`` writes it, short functions, small classes, and
imports that go down the layers (``LAYERS``).

``python -m tests.test_shape [FILES]`` prints what is over a limit.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "steptimer"
MAX_FUNCTION_LINES = 60  # from the ``def`` line to the last line of its body
MAX_CLASS_ATTRIBUTES = 20  # fields and ``self.x`` set in its methods

# The package's layers, bottom first: a module imports (at run time; type-only imports aside) only
# from its own layer or those below, and the imports hold no cycle.
LAYERS = {
    "basics": "_format _tags _files _records _histogram _native _clock _peaks _options __version__",
    "engine": "_listener _sampling _rows _memory _energy _engine _comm",
    "analysis": "_verdict _slow _window _summary _goodput _dist",
    "outputs": "_reader _trace _profile _kernels _report _table _tensorboard",
    "front doors": "_exit _hooks timer _driver _instrument _run hf lightning cli __init__ __main__",
}


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


def runtime_imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports at run time (not under ``if TYPE_CHECKING:``)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "steptimer":
                parts = child.module.split(".")
                out.update([parts[1]] if len(parts) > 1 else [a.name for a in child.names])
            elif isinstance(child, ast.Import):
                out.update(a.name.split(".")[1] for a in child.names if a.name.startswith("steptimer."))
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def test_imports_go_down_the_layers_without_a_cycle() -> None:
    layer = {m: i for i, names in enumerate(LAYERS.values()) for m in names.split()}
    graph = {p.stem: runtime_imports(p) for p in sorted(PACKAGE.glob("*.py"))}
    assert set(graph) - {"__version__"} <= set(layer), f"modules in no layer: {set(graph) - set(layer)}"
    up = [f"{m} -> {d}" for m, deps in graph.items() for d in sorted(deps) if layer.get(d, 0) > layer[m]]
    assert not up, f"imports up the layers: {up}"
    done: set[str] = set()

    def walk(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join((*path, m))}"
        if m not in done:
            for d in graph.get(m, ()):
                walk(d, (*path, m))
            done.add(m)

    for m in graph:
        walk(m, ())


def test_the_limits_catch_a_long_function_and_a_large_class(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    fields = "\n".join(f"        self.a{i} = {i}" for i in range(21))
    src = tmp_path / "m.py"
    src.write_text(f"def f():\n{body}\n\nclass C:\n    def __init__(self):\n{fields}\n")
    assert over_limits(src) == ["m.py:1 f: 61 lines", "m.py:63 class C: 21 attributes"]


if __name__ == "__main__":
    files = [Path(a) for a in sys.argv[1:]] or sorted(PACKAGE.glob("**/*.py"))
    print("\n".join(line for f in files for line in over_limits(f)) or "all within the limits")
