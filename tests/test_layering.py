"""The layering rules of the package (issue 21), read from the source with ``ast``, so a lazy import
inside a function counts as much as one at the top of a module.

* Communication algorithms (lioncub_ds/comm/) and the settings (config.py) never depend on the kernels:
  the backend is passed in, so a second topology or a new backend changes neither. The fixed
  conventions both sides need live in lioncub_ds/conventions.py.
* conventions.py sits below both: it imports neither the kernels nor comm/.
* The reference kernels re-export those conventions as the very same objects, so nothing is
  declared twice.

Imports are followed through other lioncub_ds modules (comm/base.py -> telemetry.py -> ...), so a
dependency on the kernels cannot hide one module away.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from lioncub_ds import conventions
from lioncub_ds.kernels import reference

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lioncub_ds"


def module_path(name: str) -> Path | None:
    """The source file of lioncub_ds module ``name`` (a package's __init__.py), or None."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved to absolute names; for
    ``from X import y`` also X.y where that is a lioncub_ds module (``from .. import kernels``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if module_path(f"{base}.{alias.name}") is not None)
    return found


def reaches(start: Path, forbidden: str) -> list[str]:
    """The import chain from ``start`` to a module at or below ``forbidden``, following lioncub_ds
    modules only; [] if there is none."""
    chains, seen = [[module_name(start)]], {module_name(start)}
    while chains:
        chain = chains.pop()
        path = module_path(chain[-1])
        for target in sorted(imported_modules(path)):
            if target == forbidden or target.startswith(forbidden + "."):
                return chain + [target]
            if target.startswith(PACKAGE + ".") and target not in seen and module_path(target) is not None:
                seen.add(target)
                chains.append(chain + [target])
    return []


def independent_of_kernels():
    return sorted((ROOT / PACKAGE / "comm").glob("*.py")) + [ROOT / PACKAGE / "config.py"]


@pytest.mark.parametrize("path", independent_of_kernels(), ids=lambda p: str(p.relative_to(ROOT)))
def test_comm_and_config_do_not_import_the_kernels(path):
    chain = reaches(path, f"{PACKAGE}.kernels")
    assert not chain, f"{' -> '.join(chain)}: take what both sides need from lioncub_ds/conventions.py"


@pytest.mark.parametrize("forbidden", [f"{PACKAGE}.kernels", f"{PACKAGE}.comm"])
def test_conventions_import_neither_kernels_nor_comm(forbidden):
    chain = reaches(ROOT / PACKAGE / "conventions.py", forbidden)
    assert not chain, " -> ".join(chain)


def test_the_checker_sees_relative_absolute_and_lazy_imports(tmp_path, monkeypatch):
    """The rule is only as good as the import parser: each spelling of a kernels import is caught."""
    pkg = tmp_path / PACKAGE
    (pkg / "comm").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    for init in (pkg / "__init__.py", pkg / "comm" / "__init__.py", pkg / "kernels" / "__init__.py"):
        init.write_text("")
    (pkg / "kernels" / "reference.py").write_text("")
    (pkg / "helper.py").write_text("from .kernels.reference import x\n")
    spellings = {"relative": "from ..kernels.reference import x\n",
                 "absolute": "import lioncub_ds.kernels.reference\n",
                 "package": "from .. import kernels\n",
                 "lazy": "def f():\n    from lioncub_ds.kernels import reference\n",
                 "indirect": "from ..helper import x\n"}
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for label, source in spellings.items():
        (pkg / "comm" / f"{label}.py").write_text(source)
        assert reaches(pkg / "comm" / f"{label}.py", f"{PACKAGE}.kernels"), label
    (pkg / "comm" / "clean.py").write_text("from ..conventions import x\nimport torch\n")
    assert not reaches(pkg / "comm" / "clean.py", f"{PACKAGE}.kernels")


def test_the_reference_re_exports_the_conventions_unchanged():
    """Tests and kernels keep reading these names from kernels.reference; they must be the very
    objects of conventions.py, not a second declaration that could drift."""
    names = ["TIE_RULES", "VOTE_MODES", "SCALE_KINDS", "LANE_WIDTHS", "TIE_CODES", "VOTE_CODES",
             "SCALE_CODES", "ROUNDINGS", "VOTE_BITS", "enum_code", "padded_numel", "lane_bits_for",
             "int8_levels", "tie_segments"]
    for name in names:
        assert getattr(reference, name) is getattr(conventions, name), name
