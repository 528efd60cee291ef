"""The package's layers, read from the sources (``ast``, nothing imported), so that they hold as the
code grows:

- the core (everything but the tools: ``verispec/bench``, ``verispec/training`` and the command
  line ``verispec/cli.py``) never imports a tool, lazily inside a function included: the engine, the
  server and the drafters run without the benchmark or the training pipeline;
- the runtime drafters (``verispec/heads``) never import the training that makes them;
- no module is over :data:`MAX_LINES` lines (small modules, one concept each);
- no ``global`` statement: state lives in objects a caller holds, never in a module.

Each failure names the file and line that break a rule, and the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verispec"
TOOLS = ("verispec.bench", "verispec.training", "verispec.cli")
"""Modules built on the core that the core must never import."""
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path, root: Path = ROOT) -> str:
    """The dotted module name of a file under ``root/verispec/`` (a package by its ``__init__``)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _imports(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in the file, at the top or inside a function: ``import a.b``,
    ``from a import b`` (as ``a.b``, since ``b`` may be a module), relative imports resolved, and
    ``importlib.import_module("a.b")`` with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = _name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def _is_tool(module: str) -> bool:
    return any(_under(module, tool) for tool in TOOLS)


def test_the_core_never_imports_the_tools():
    broken = [
        f"{_relative(path)}:{line} imports {module} (the core never imports {', '.join(TOOLS)})"
        for path in _modules()
        if not _is_tool(_name(path))
        for line, module in _imports(path)
        if _is_tool(module)
    ]
    assert not broken, "\n".join(broken)


def test_the_runtime_drafters_never_import_the_training():
    broken = [
        f"{_relative(path)}:{line} imports {module} (verispec/heads runs the drafters training makes)"
        for path in sorted((PACKAGE / "heads").rglob("*.py"))
        for line, module in _imports(path)
        if _under(module, "verispec.training")
    ]
    assert not broken, "\n".join(broken)


def test_no_module_is_over_the_line_limit():
    lengths = {_relative(p): len(p.read_text(encoding="utf-8").splitlines()) for p in _modules()}
    broken = [
        f"{name} has {n} lines (at most {MAX_LINES}: split it along its seams)"
        for name, n in lengths.items()
        if n > MAX_LINES
    ]
    assert not broken, "\n".join(broken)


def test_no_global_statements():
    broken = [
        f"{_relative(path)}:{node.lineno} declares global {', '.join(node.names)} (keep state in an object)"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        if isinstance(node, ast.Global)
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import verispec.bench.plan\n", "verispec.bench.plan"),
        ("from verispec import training\n", "verispec.training"),
        ("def f():\n    from verispec.cli import main\n", "verispec.cli"),
        ("from ..bench import plan\n", "verispec.bench"),
        ("import importlib\nimportlib.import_module('verispec.training.train')\n", "verispec.training.train"),
    ],
)
def test_the_import_reader_sees_every_form(tmp_path, source, found):
    """The checks above are only as good as the reader: each form of import is found (a relative one
    resolved from a module inside the package), so a rule cannot pass by a form it misses."""
    module = tmp_path / "verispec" / "models" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(source)
    modules = [m for _, m in _imports(module, tmp_path)]
    assert found in modules and _is_tool(found), modules
