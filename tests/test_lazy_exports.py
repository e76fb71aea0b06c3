"""The stage packages export their names lazily (``kvbits._lazy``): what an eager package gave must still work in a
fresh interpreter, before any name was used: ``dir()`` / ``help()``, a submodule as an attribute, clear errors."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("analyze", "calibrate", "tune", "report", "monitor", "export")


def _fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter (no name of a lazy package used yet) and return its last stdout line."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.rstrip("\n").rsplit("\n", 1)[-1]


def test_dir_lists_exports_not_used_yet_and_imports_no_torch() -> None:
    code = (
        "import importlib, sys\nmissing = []\n"
        f"for p in {PACKAGES!r}:\n"
        "    m = importlib.import_module('kvbits.' + p)\n"
        "    missing += [f'{p}.{n}' for n in m.__all__ if n not in dir(m)]\n"
        "print(missing, 'torch' in sys.modules)"
    )
    assert _fresh(code) == "[] False"


def test_help_lists_the_exported_functions_and_classes() -> None:
    code = (
        "import pydoc, kvbits.export as m\n"
        "t = pydoc.render_doc(m, renderer=pydoc.plaintext)\n"
        "print('export_vllm(' in t, 'class VllmCacheArgs' in t)"
    )
    assert _fresh(code) == "True True"


def test_submodules_are_attributes_of_the_imported_package() -> None:
    """``import kvbits.report`` then ``kvbits.report.render.write_report`` worked when the package imported its
    submodules eagerly; a misspelled name is still an ``AttributeError`` naming the package."""
    code = (
        "import kvbits.report, kvbits.calibrate, kvbits.tune\n"
        "ok = [kvbits.report.render.write_report is kvbits.report.write_report,\n"
        "      kvbits.calibrate.artifact.CalibrationArtifact is kvbits.calibrate.CalibrationArtifact,\n"
        "      kvbits.tune.knapsack.__name__ == 'kvbits.tune.knapsack',\n"
        "      callable(kvbits.calibrate.calibrate)]\n"
        "try:\n    kvbits.calibrate.calibrat\nexcept AttributeError as e:\n    ok.append(\"'kvbits.calibrate'\" in str(e))\n"
        "print(ok)"
    )
    assert _fresh(code) == "[True, True, True, True, True]"


def test_an_attribute_error_inside_a_lazy_submodule_is_not_read_as_a_missing_name(tmp_path: Path) -> None:
    """An ``AttributeError`` raised while the defining submodule is imported made ``hasattr`` False and ``from pkg
    import f`` an ImportError that named neither the submodule nor the cause: it is now an ImportError that does."""
    (tmp_path / "lzpkg").mkdir()
    (tmp_path / "lzpkg" / "__init__.py").write_text(
        "from kvbits._lazy import lazy_exports\n__getattr__ = lazy_exports(__name__, {'f': 'mod'})\n"
    )
    (tmp_path / "lzpkg" / "mod.py").write_text("import os\nX = os.no_such_thing\ndef f(): pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        lzpkg = importlib.import_module("lzpkg")
        with pytest.raises(ImportError, match=r"lzpkg\.mod .*no_such_thing"):
            hasattr(lzpkg, "f")
        with pytest.raises(ImportError, match=r"lzpkg\.mod .*no_such_thing"):
            from lzpkg import f  # noqa: F401
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("lzpkg", "lzpkg.mod"):
            sys.modules.pop(name, None)


def test_an_attribute_error_inside_a_submodule_attribute_is_not_read_as_a_missing_name(tmp_path: Path) -> None:
    """A submodule reached as a package attribute (``pkg.mod``, not an export) that raised ``AttributeError`` while
    importing read as a missing name (hasattr False, "module 'pkg' has no attribute 'mod'"): now an ImportError
    naming the submodule and the cause, as for an export."""
    (tmp_path / "lzpkg2").mkdir()
    (tmp_path / "lzpkg2" / "__init__.py").write_text(
        "from kvbits._lazy import lazy_exports\n__getattr__ = lazy_exports(__name__, {})\n"
    )
    (tmp_path / "lzpkg2" / "mod.py").write_text("import os\nX = os.no_such_thing\n")
    sys.path.insert(0, str(tmp_path))
    try:
        lzpkg2 = importlib.import_module("lzpkg2")
        with pytest.raises(ImportError, match=r"lzpkg2\.mod .*no_such_thing"):
            hasattr(lzpkg2, "mod")
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            lzpkg2.nothing  # noqa: B018
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("lzpkg2", "lzpkg2.mod"):
            sys.modules.pop(name, None)
