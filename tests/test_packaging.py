"""Packaging: the source imports on the oldest Python that ``pyproject.toml``'s ``requires-python`` admits.

The project's machines run Python 3.11, so an import of a name the standard library gained later (``typing.Self``,
3.11) passes every other test and fails only for a user on 3.10: ``from kvbits.monitor import CacheMonitor`` raised
``ImportError: cannot import name 'Self' from 'typing'`` there. This reads each module's runtime imports (those
outside ``if TYPE_CHECKING:``) and compiles it under the oldest admitted Python where that interpreter is installed.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvbits"

# standard-library names by the Python that added them (those a typed code base reaches for)
NEWER_NAMES: dict[str, dict[str, tuple[int, int]]] = {
    "typing": {
        **dict.fromkeys(
            ("Self", "LiteralString", "Never", "assert_never", "assert_type", "reveal_type", "Required",
             "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform", "get_overloads", "clear_overloads"),
            (3, 11),
        ),
        **dict.fromkeys(("override", "TypeAliasType"), (3, 12)),
    },
    "enum": {"StrEnum": (3, 11), "verify": (3, 11), "member": (3, 11), "nonmember": (3, 11)},
    "itertools": {"batched": (3, 12)},
    "contextlib": {"chdir": (3, 11)},
    "hashlib": {"file_digest": (3, 11)},
}
NEWER_MODULES = {"tomllib": (3, 11), "wsgiref.types": (3, 11)}


def _min_python() -> tuple[int, int]:
    """The lower bound of ``requires-python`` (``>=3.10`` -> ``(3, 10)``)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)', text, re.MULTILINE)
    assert m, "pyproject.toml has no requires-python = \">=X.Y\""
    return int(m.group(1)), int(m.group(2))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run (not in the body of ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _too_new(path: Path, oldest: tuple[int, int]) -> list[str]:
    """``path``'s runtime imports of what the standard library of Python ``oldest`` lacks, one line each."""
    problems = []
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{node.lineno}"
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                added = NEWER_NAMES.get(node.module, {}).get(alias.name)
                if added and added > oldest:
                    problems.append(f"{where}: {node.module}.{alias.name} (Python {added[0]}.{added[1]})")
            added = NEWER_MODULES.get(node.module)
        else:
            added = next((NEWER_MODULES[a.name] for a in getattr(node, "names", []) if a.name in NEWER_MODULES), None)
        if added and added > oldest:
            problems.append(f"{where}: module {getattr(node, 'module', None) or node.names[0].name} "
                            f"(Python {added[0]}.{added[1]})")
    return problems


def test_runtime_imports_exist_on_oldest_python() -> None:
    oldest = _min_python()
    problems = [f"{path.parent.relative_to(ROOT)}/{p}" for path in sorted(SRC.rglob("*.py")) for p in _too_new(path, oldest)]
    assert not problems, (
        f"requires-python admits {oldest[0]}.{oldest[1]}, whose standard library lacks what these import at run time "
        f"(import it under `if TYPE_CHECKING:` from typing_extensions, or raise requires-python): {problems}"
    )


def test_checker_sees_a_runtime_self_import(tmp_path: Path) -> None:
    """The check itself: a runtime ``typing.Self`` is caught, one under ``TYPE_CHECKING`` is not."""
    bad, good = tmp_path / "bad.py", tmp_path / "good.py"
    bad.write_text("from typing import Any, Self\n")
    good.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from typing import Self\n")
    assert len(_too_new(bad, (3, 10))) == 1 and not _too_new(good, (3, 10)) and not _too_new(bad, (3, 11))


def test_source_compiles_on_oldest_python() -> None:
    """Syntax too (a nested same-quote f-string is 3.12+): compiled by the oldest admitted interpreter, if here."""
    oldest = _min_python()
    exe = shutil.which(f"python{oldest[0]}.{oldest[1]}")
    if exe is None:
        pytest.skip(f"no python{oldest[0]}.{oldest[1]} on PATH")
    code = (
        "import pathlib, sys\n"
        "bad = []\n"
        "for p in sorted(pathlib.Path(sys.argv[1]).rglob('*.py')):\n"
        "    try:\n"
        "        compile(p.read_text(), str(p), 'exec')\n"
        "    except SyntaxError as e:\n"
        "        bad.append(f'{p}: {e}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([exe, "-c", code, str(SRC)], capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0 and not proc.stdout.strip():  # the interpreter itself failed (a pyenv shim, say)
        pytest.skip(f"python{oldest[0]}.{oldest[1]} did not run: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, f"does not compile on Python {oldest[0]}.{oldest[1]}:\n{proc.stdout}"


@pytest.mark.parametrize("links", ["{d}", "/nonexistent {d}", "file://{d}", "{d} https://example.invalid/links"])
def test_make_setup_finds_local_cpu_torch_in_any_find_links_entry(tmp_path: Path, links: str) -> None:
    """``make setup`` pins the local CPU wheel of torch wherever PIP_FIND_LINKS names its folder: it looked for
    ``$PIP_FIND_LINKS/torch-2.13.0*.whl`` as one path, so a second entry (a URL beside the folder) or a file://
    URL gave an unpinned ``torch``, for which pip takes a CUDA build of several GB."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    env = {"PATH": "/usr/bin:/bin", "PIP_FIND_LINKS": links.format(d=tmp_path)}

    def spec(env: dict[str, str]) -> str:
        proc = subprocess.run(
            [make, "-s", "--no-print-directory", "-C", str(ROOT), "--eval", "print-torch: ; @echo $(TORCH_SPEC)",
             "print-torch"], capture_output=True, text=True, env=env, timeout=60, check=True,
        )
        return proc.stdout.strip()

    assert spec(env) == "torch==2.13.0"
    assert spec({**env, "PIP_FIND_LINKS": "/nonexistent"}) == "torch"  # no local wheel: pip picks, unpinned


def test_sdist_ships_no_partial_test_suite(tmp_path: Path) -> None:
    """setuptools puts ``tests/test*.py`` in an sdist by default, but not ``conftest.py`` or the ``tests/_*.py``
    helpers they import (nor the benchmarks/ and docs some read): from an unpacked sdist those tests failed at
    collection. ``MANIFEST.in`` prunes tests/; the package itself is still shipped."""
    import sys
    import tarfile

    tree = tmp_path / "tree"
    for name in ("pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)  # built in a copy: no egg-info in the checkout
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=ignore)
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=tree, check=True, capture_output=True)
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert not [n for n in names if n.startswith("tests/")], names
    assert "src/kvbits/__init__.py" in names and "src/kvbits/py.typed" in names
