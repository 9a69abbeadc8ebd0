"""Text made from the settings' declarations (:class:`lioncub_ds.config.LionCubConfig`'s fields):
the README table's cells (:mod:`lioncub_ds.config_doc`), the command-line help
(:mod:`lioncub_ds.megatron.args`) and LionCub's docstring."""
from __future__ import annotations

import re
import textwrap
from dataclasses import MISSING, fields

from .config import CONSTRUCTOR_ONLY, LionCubConfig


def plain(markdown: str) -> str:
    """The README's Markdown help as plain text: no backticks; a link in parentheses (a pointer into
    the docs) is dropped, any other link becomes its words."""
    text = re.sub(r" \(\[[^\]]*\]\([^)]*\)\)", "", markdown)
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "")


def constructor_doc(positional: tuple) -> str:
    """The Args section of LionCub's docstring, made from the settings (one line each, wrapped)."""
    out = ["    Args (every setting is a LionCubConfig field; README \"LionCub arguments\" for allowed values):",
           "        params: tensors, ``named_parameters()`` or param groups (with optional 'param_names')."]
    for f in fields(LionCubConfig):
        where = "positional or keyword" if f.name in positional else "keyword"
        text = f"{f.name} ({where}, default {plain(default_text(f))}): {plain(f.metadata['help'])}."
        out += textwrap.wrap(text, width=100, initial_indent=" " * 8, subsequent_indent=" " * 12)
    for name, (default, allowed, meaning) in CONSTRUCTOR_ONLY.items():
        text = f"{name} (keyword, default {plain(default)}): {plain(meaning)}."
        out += textwrap.wrap(text, width=100, initial_indent=" " * 8, subsequent_indent=" " * 12)
    return "\n".join(out) + "\n"


def _value(v) -> str:
    return f'`"{v}"`' if isinstance(v, str) else f"`{v!r}`"


def default_text(f) -> str:
    meta = f.metadata
    if meta.get("default_doc"):
        return meta["default_doc"]
    value = f.default if f.default is not MISSING else f.default_factory()
    return _value(value)


def allowed_text(f) -> str:
    meta = f.metadata
    if meta.get("allowed"):
        return meta["allowed"]
    values = list(meta["choices"])
    if f.default is None:
        values.insert(0, None)
    return ", ".join(_value(v) for v in values)
