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


def test_the_step_plan_never_asks_which_algorithm_it_holds():
    """Issue 47: the pipeline and the layout call the algorithm interface (comm/base.py:
    ``local_step``, ``launch``, ``count``, ``complete``...) and never branch on which algorithm a
    bucket has. Read with ``ast``: no isinstance() / issubclass() naming an algorithm class, no
    comparison of an algorithm's ``name`` / ``encoding`` / ``type(...)`` against a constant (or a
    class), no table indexed by its name or encoding."""
    comm_classes = {}  # class name -> its bases' names, over every comm module
    for path in sorted((ROOT / PACKAGE / "comm").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                comm_classes[node.name] = {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases}
    algorithms, grew = {"VoteAlgorithm"}, True
    while grew:
        more = {name for name, bases in comm_classes.items() if bases & algorithms} - algorithms
        algorithms |= more
        grew = bool(more)
    assert {"OneBitVote", "BBitVote", "Int8Vote", "PBitVote", "AllGatherVote"} <= algorithms, algorithms

    def names_algorithm(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_algorithm(e) for e in node.elts)
        return getattr(node, "id", getattr(node, "attr", None)) in algorithms

    def is_constant(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return all(is_constant(e) for e in node.elts)
        return isinstance(node, ast.Constant)

    def asks_which(node) -> bool:  # al.name, al.encoding, type(al), al.__class__, type(al).__name__
        if isinstance(node, ast.Attribute):
            return node.attr in ("name", "encoding", "__name__", "__class__")
        return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type"

    def questions(source: str, filename: str) -> list[str]:
        found = []
        for node in ast.walk(ast.parse(source, filename=filename)):
            where = f"{filename}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)}"
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass")
                    and len(node.args) == 2 and names_algorithm(node.args[1])):
                found.append(where)
            elif isinstance(node, ast.Compare):
                operands = [node.left] + node.comparators
                if any(asks_which(a) and any(is_constant(b) or names_algorithm(b) for b in operands if b is not a)
                       for a in operands):
                    found.append(where)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Attribute) and asks_which(node.slice):
                found.append(where)
        return found

    # the checker finds each way of asking (so an empty answer below means something)
    asking = ["isinstance(b.algorithm, Int8Vote)", "isinstance(al, (PBitVote, comm.BBitVote))",
              "issubclass(type(al), OneBitVote)", 'al.name == "bbit"', 'b.algorithm.encoding != "bits"',
              'al.name in ("1bit", "bbit")', "type(al) is Int8Vote", 'type(al).__name__ == "Int8Vote"',
              "al.__class__ is BBitVote", "STEPS[al.name]"]
    for snippet in asking:
        assert questions(snippet, "snippet"), snippet
    assert not questions("al.local_step(job, g, m, be, betas, n, seed)\nkey = (al.name,) + kind\n"
                         "if al.carries_flags and key != cur_key: pass\nisinstance(x, torch.Tensor)\n", "snippet")

    found = [q for name in ("pipeline.py", "layout.py")
             for q in questions((ROOT / PACKAGE / name).read_text(), name)]
    assert not found, ("the step asks which algorithm it holds (ask the algorithm instead: comm/base.py "
                       "VoteAlgorithm): " + "; ".join(found))
