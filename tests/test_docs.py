"""The documentation as a product (issue 47): docs/ holds only pages and the data a page links, within
5 MB; the pages name the recommended configuration as configs/ds_lioncub_recommended.json has it; the
archive page's figures are its JSON's; no page names anything outside the repository; the strict site
build (``make docs``) fails on a broken anchor.

The unit tests read files; the ``dist`` test runs MkDocs in a child process.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
RECOMMENDED = ROOT / "configs" / "ds_lioncub_recommended.json"
MAX_DOCS_BYTES = 5_000_000

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def _pages() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


def _linked_files() -> set[Path]:
    """Every file a page links to (relative links, resolved; anchors dropped), plus the pages the site's
    navigation lists."""
    out = set()
    for page in _pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path = target.partition("#")[0]
            if path:
                out.add((page.parent / path).resolve())
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    out |= {(DOCS / m).resolve() for m in re.findall(r"^\s*- [^:]+: (\S+\.md)$", nav, re.M)}
    return out


@pytest.mark.unit
def test_docs_holds_only_what_a_page_links():
    """No orphan plots, studies or pages: a file in docs/ that no page links is either linked or deleted
    (superseded studies go to docs/archive/ behind its page; per-run files of a study to studies/)."""
    linked = _linked_files()
    orphans = [str(f.relative_to(ROOT)) for f in sorted(DOCS.rglob("*")) if f.is_file() and f.resolve() not in linked]
    assert not orphans, "files in docs/ that no page links:\n" + "\n".join(orphans)


@pytest.mark.unit
def test_docs_fit_in_5_mb():
    files = [f for f in DOCS.rglob("*") if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    biggest = sorted(files, key=lambda f: -f.stat().st_size)[:5]
    assert total <= MAX_DOCS_BYTES, (f"docs/ holds {total / 1e6:.2f} MB (limit {MAX_DOCS_BYTES / 1e6:.0f} MB); "
                                     "largest: " + ", ".join(f"{f.relative_to(DOCS)} {f.stat().st_size / 1e6:.2f} MB"
                                                              for f in biggest))


@pytest.mark.unit
def test_convergence_page_is_the_chosen_presets():
    """docs/convergence.md is one preset's page (<= 300 lines) whose tables the report writes between its
    markers (tests/test_converge_report.py checks them against the JSON); the superseded presets are behind
    the archive page it links."""
    text = (DOCS / "convergence.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, f"docs/convergence.md has {len(text.splitlines())} lines (<= 300)"
    assert "<!-- w300-tables -->" in text and "<!-- /w300-tables -->" in text
    assert "](archive/README.md)" in text
    for old in ("lion_w150-tables", "lion-tables", "<!-- trend -->", "docs/long/", "docs/converge.json"):
        assert old not in text, old


# ----------------------------------------------------------------------------- one recommended configuration
def _recommended() -> dict:
    return json.loads(RECOMMENDED.read_text())["optimizer"]["params"]


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]


RECOMMENDING_PAGES = ("README.md", "docs/convergence.md", "docs/deepspeed.md", "docs/hyperparameters.md")


@pytest.mark.unit
@pytest.mark.parametrize("name", RECOMMENDING_PAGES)
def test_pages_name_the_recommended_configuration_as_the_config_has_it(name):
    """Every paragraph that recommends something names the config's `comm` and `momentum_sync` (and no
    other value of them), and never a recommendation without the momentum sync (what convergence.md
    said once, against the README)."""
    cfg = _recommended()
    comm = f'comm="{cfg["comm"]}"'
    sync = f'momentum_sync={json.dumps(cfg["momentum_sync"])}'
    text = (ROOT / name).read_text(encoding="utf-8")
    recommending = [p for p in _paragraphs(text) if re.search(r"recommend", p, re.I)]
    assert recommending, f"{name} names no recommendation"
    for p in recommending:
        assert not re.search(r"no momentum sync[^.]*recommend|recommend[^.]*no momentum sync", p, re.I), (name, p)
        for found in re.findall(r'comm="(\w+)"', p):
            assert found == cfg["comm"], (name, found, p)
        for found in re.findall(r"momentum_sync=(\{[^}]*\})", p):
            assert json.loads(found) == cfg["momentum_sync"], (name, found, p)
    if name == "docs/deepspeed.md":  # the configs table's row for the file
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `configs/{RECOMMENDED.name}`"))
        assert f'`"{cfg["comm"]}"`' in row and f'`{json.dumps(cfg["momentum_sync"])}`' in row, row
    else:
        assert comm in text and sync in text, f"{name} does not name {comm} with {sync}"


@pytest.mark.unit
def test_pages_quote_the_recommended_files_lr_betas_and_decay():
    """Where convergence.md and hyperparameters.md quote the file's lr, betas and weight decay, they are the
    file's (the file moved with the chosen preset once; its quotes must move with it)."""
    cfg = _recommended()
    conv = " ".join((DOCS / "convergence.md").read_text(encoding="utf-8").split())
    i = conv.index(f"`configs/{RECOMMENDED.name}` carries")
    m = re.search(r"lr ([0-9.e-]+), β \(([0-9.]+), ([0-9.]+)\), weight decay ([0-9.]+)", conv[i:i + 300])
    assert m, conv[i:i + 300]
    assert float(m.group(1)) == cfg["lr"] and [float(m.group(2)), float(m.group(3))] == cfg["betas"]
    assert float(m.group(4)) == cfg["weight_decay"]
    row = next(ln for ln in (DOCS / "hyperparameters.md").read_text(encoding="utf-8").splitlines()
               if ln.startswith(f"| `configs/{RECOMMENDED.name}`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) == cfg["lr"] and cells[2] == f"({cfg['betas'][0]}, {cfg['betas'][1]})", row
    assert float(cells[3]) == cfg["weight_decay"], row


# ----------------------------------------------------------------------------- the archive page
FIGURE = re.compile(r"`([\w:]+)` N = (\d+): ([+-]\d+\.\d\d)% \[([+-]\d+\.\d\d), ([+-]\d+\.\d\d)\]")


def _summaries(path: Path) -> list[dict]:
    recs = json.loads(path.read_text())
    recs = recs if isinstance(recs, list) else []  # a screen's JSON is one record of rows, no summaries
    return [r for r in recs if r.get("bench") in ("converge_summary", "converge_trend")]


@pytest.mark.unit
def test_archive_figures_are_their_json():
    """Each figure of the archive's summary table (`variant` N = n: gap [lo, hi]) is a summary record of
    a JSON its row links, at the table's rounding."""
    page = DOCS / "archive" / "README.md"
    rows = [ln for ln in page.read_text(encoding="utf-8").splitlines() if ln.startswith("| ") and "](" in ln]
    checked, bad = 0, []
    for row in rows:
        files = [page.parent / t for t in LINK.findall(row) if t.endswith(".json")]
        recs = [r for f in files for r in _summaries(f)]
        for variant, n, gap, lo, hi in FIGURE.findall(row):
            want = (float(gap), float(lo), float(hi))
            if not any(r["variant"] == variant and r["world_size"] == int(n)
                       and (round(r["gap_pct"], 2), round(r["ci_lo_pct"], 2), round(r["ci_hi_pct"], 2)) == want
                       for r in recs):
                bad.append(f"{variant} N = {n}: {gap}% [{lo}, {hi}] not in {[str(f.relative_to(DOCS)) for f in files]}")
            checked += 1
    assert checked >= 15 and not bad, f"{checked} figures checked\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the pages speak of the project alone
OUTSIDE = (r"\.\./shared", r"GPU\.md", r"give_back", r"the `?run`? tool", r"\blent\b", r"/work/", r"`device` call")


@pytest.mark.unit
def test_no_page_names_anything_outside_the_repository():
    bad = []
    for page in _pages():
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            bad += [f"{page.relative_to(ROOT)}:{n}: {pat}" for pat in OUTSIDE if re.search(pat, line)]
    assert not bad, "\n".join(bad)


@pytest.mark.unit
def test_every_relative_link_stays_inside_the_repository():
    """Pages link files of the repository only (a link above the repository root leads nowhere on a clone)."""
    bad = []
    for page in _pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:", target) and ROOT not in (page.parent / target.partition("#")[0]).resolve().parents \
                    and (page.parent / target.partition("#")[0]).resolve() != ROOT:
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- the strict site build
@pytest.mark.dist
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs / mkdocstrings not installed (make setup installs them)")
def test_strict_site_build_passes_and_fails_on_a_broken_anchor(tmp_path):
    """``make docs`` (mkdocs build --strict) passes on the committed pages; the same build fails when a page
    links an anchor that no heading has."""
    def build(root: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                               "-d", str(tmp_path / "site")], cwd=root, capture_output=True, text=True, timeout=600)

    res = build(ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "lioncub_ds").symlink_to(ROOT / "lioncub_ds")  # the API reference reads the package
    page = copy / "docs" / "step.md"
    page.write_text(page.read_text() + "\nSee [the bytes](conventions.md#no-such-heading).\n")
    res = build(copy)
    assert res.returncode != 0 and "no-such-heading" in res.stdout + res.stderr, res.stderr[-4000:]
