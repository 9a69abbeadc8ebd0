"""The README's "LionCub arguments" table, made from :class:`lioncub_ds.config.LionCubConfig`.

    python -m lioncub_ds.config_doc README.md           # rewrite the table in place
    python -m lioncub_ds.config_doc --check README.md   # exit 1 if it differs (tests/test_settings.py)

The table is the run of ``|`` lines right after the heading ``## LionCub arguments``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from .config import CONSTRUCTOR_ONLY, LionCubConfig
from .config_text import allowed_text, default_text

HEADING = "## LionCub arguments"


def readme_table() -> list[str]:
    rows = ["| argument | default | allowed | meaning |", "|---|---|---|---|"]
    for f in fields(LionCubConfig):
        rows.append(f"| `{f.name}` | {default_text(f)} | {allowed_text(f)} | {f.metadata['help']} |")
    for name, (default, allowed, meaning) in CONSTRUCTOR_ONLY.items():
        rows.append(f"| `{name}` | {default} | {allowed} | {meaning} |")
    return rows


def _table_span(lines: list[str]) -> tuple[int, int]:
    try:
        start = lines.index(HEADING) + 1
    except ValueError:
        raise SystemExit(f"no line {HEADING!r} in the README") from None
    while start < len(lines) and not lines[start].startswith("|"):
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def readme_with_table(text: str) -> str:
    lines = text.split("\n")
    start, end = _table_span(lines)
    return "\n".join(lines[:start] + readme_table() + lines[end:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lioncub_ds.config_doc", description=__doc__.splitlines()[0])
    p.add_argument("readme", nargs="?", default="README.md")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if the table is out of date")
    args = p.parse_args(argv)
    with open(args.readme, encoding="utf-8") as fh:
        text = fh.read()
    new = readme_with_table(text)
    if new == text:
        return 0
    if args.check:
        print(f"{args.readme}: the LionCub arguments table is out of date; run python -m lioncub_ds.config_doc "
              f"{args.readme}", file=sys.stderr)
        return 1
    with open(args.readme, "w", encoding="utf-8") as fh:
        fh.write(new)
    print(f"{args.readme}: LionCub arguments table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
