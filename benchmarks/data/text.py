"""Byte-level text data: a pinned corpus (the Python sources of exact dependency versions),
the CPython standard library's own source, user text files, or a memory-mapped token file,
with a deterministic per-rank batch sampler.

Conventions (fixed, so every optimizer sees the same data):

* **Pinned corpus** (:func:`pinned_dataset`, ``load_dataset("deps")``): the ``.py`` files
  that the installed distributions listed in :data:`PINNED_CORPUS` (``deepspeed==0.19.8``,
  ``megatron-core==0.16.1``, both pinned by ``requirements.txt``) record in their
  ``RECORD``, minus files generated at install time (:data:`PINNED_EXCLUDE`), in
  (distribution, relative path) order, each followed by one ``\\n``. The concatenation
  must have the SHA-256 :data:`PINNED_SHA256`: the same bytes on every machine, or a
  :class:`CorpusMismatchError` that names the distribution, the version found and the one
  required. Nothing is downloaded: the bytes come from what ``make setup`` installed. The
  val split is whole files chosen exactly as for the stdlib corpus below.

* **Bundled text** (:func:`stdlib_dataset`): every ``.py`` file under
  ``sysconfig.get_paths()["stdlib"]`` except those inside ``site-packages``,
  ``dist-packages``, ``test``, ``tests``, ``idle_test``, ``__pycache__``, ``encodings``
  and ``pydoc_data`` directories (the last two are mostly generated tables) and the
  generated ``_sysconfigdata*.py``, in sorted relative-path order; a file is taken when it fits in what is
  left of ``max_bytes`` (default 8 MB) and skipped otherwise. Each file is followed by one ``\\n``.
  The **val** split is whole files: visiting the taken files in ``crc32(relative path)``
  order, a file goes to val while val stays within ``val_permille``/1000 of the bytes
  (default 50: 5%); the rest, in path order, is **train**. Train and val never share
  a file. The two byte arrays are cached under
  ``$LIONCUB_CACHE_DIR`` (default ``$XDG_CACHE_HOME/lioncub_ds`` or
  ``~/.cache/lioncub_ds``), keyed by Python version, stdlib path, cap and split,
  written atomically (temp file + ``os.replace``).
* **User text files** (:func:`files_dataset`): concatenated in the order given
  (each followed by ``\\n``); the last ``val_fraction`` of the bytes is val.
* **Token file** (:func:`token_file_dataset`): a raw ``uint8`` / ``uint16`` array
  opened with ``numpy.memmap`` (never read into memory); the last ``val_fraction``
  of the tokens is val, unless a separate ``val_path`` is given.

Batches (:meth:`TextDataset.get_batch`): split ``s`` is cut into ``world_size``
contiguous shards and rank ``r`` draws ``batch_size`` random windows from shard
``r`` only, with a generator seeded by ``(seed, split, rank, world_size, step)``:
the result depends on nothing else (not on call order, not on process state).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "TextDataset",
    "stdlib_dataset",
    "files_dataset",
    "token_file_dataset",
    "load_dataset",
    "stdlib_files",
    "cache_dir",
    "DEFAULT_MAX_BYTES",
    "pinned_dataset",
    "pinned_files",
    "PINNED_CORPUS",
    "PINNED_SHA256",
    "PINNED_BYTES",
    "CorpusMismatchError",
]

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
# Tests, third-party code, and two directories of generated tables (the charmap codecs in
# encodings/, the help-topic dump in pydoc_data/) that would swamp a small corpus.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                           "encodings", "pydoc_data"})
EXCLUDED_PREFIXES = ("_sysconfigdata",)  # generated build-flag dictionaries
_SPLIT_IDS = {"train": 0, "val": 1}

# The pinned corpus: (distribution, exact version), in this order. Both are pure-Python
# sources that requirements.txt pins; their .py files are the same on every platform.
PINNED_CORPUS = (("deepspeed", "0.19.8"), ("megatron-core", "0.16.1"))
# Written at install time (machine-dependent build info): never part of the corpus.
PINNED_EXCLUDE = frozenset({"deepspeed/git_version_info_installed.py"})
PINNED_SHA256 = "96b462a0dfcdee0e2592f6abe0336fdf16fdedbb945cf6c206215b5669203267"
PINNED_BYTES = 10730066  # 1116 files


class CorpusMismatchError(RuntimeError):
    """The installed packages do not give the pinned corpus bytes."""
_CACHE_FORMAT = 6


def cache_dir() -> Path:
    """Where cached arrays live: ``$LIONCUB_CACHE_DIR``, else ``$XDG_CACHE_HOME/lioncub_ds``,
    else ``~/.cache/lioncub_ds``."""
    env = os.environ.get("LIONCUB_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lioncub_ds"


def stdlib_files(root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """``(relative posix path, absolute path)`` of the stdlib ``.py`` files, sorted by relative path."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(EXCLUDED_PREFIXES):
                full = Path(dirpath) / name
                out.append((full.relative_to(root).as_posix(), full))
    out.sort(key=lambda t: t[0])
    return out


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@dataclass
class TextDataset:
    """Two 1-D token arrays (numpy, possibly memory-mapped) plus the vocabulary size."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int = 256
    name: str = "text"
    files: dict | None = None  # {"train": [rel path], "val": [rel path]} when built from whole files

    def split(self, split: str) -> np.ndarray:
        if split not in _SPLIT_IDS:
            raise ValueError(f"split={split!r} is not allowed; allowed: train, val")
        return self.train if split == "train" else self.val

    def __len__(self) -> int:
        return int(len(self.train) + len(self.val))

    def shard_bounds(self, split: str, rank: int, world_size: int, seq_len: int) -> tuple[int, int]:
        """``[lo, hi)`` of the tokens that ``rank`` samples from (a contiguous 1/world_size of the split).

        When a shard would be shorter than one window (``seq_len + 1`` tokens), every rank
        falls back to the whole split (still with its own random stream)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} world_size={world_size}: need 0 <= rank < world_size")
        n = len(self.split(split))
        if n < seq_len + 1:
            raise ValueError(f"{self.name} {split} split has {n} tokens, fewer than seq_len+1={seq_len + 1}")
        per = n // world_size
        if per < seq_len + 1:
            return 0, n
        return rank * per, (rank + 1) * per

    def get_batch(self, split: str, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1,
                  step: int = 0, seed: int = 0, device: str | torch.device = "cpu"):
        """``(x, y)`` int64 tensors of shape ``(batch_size, seq_len)``, ``y`` = ``x`` shifted by one.

        Deterministic in all arguments; different ranks draw from disjoint shards."""
        data = self.split(split)
        lo, hi = self.shard_bounds(split, rank, world_size, seq_len)
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, _SPLIT_IDS[split], int(rank), int(world_size),
                                     int(step)])
        starts = lo + rng.integers(0, hi - lo - seq_len, size=batch_size, dtype=np.int64)
        idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
        chunk = torch.from_numpy(np.asarray(data[idx]).astype(np.int64))
        x, y = chunk[:, :-1], chunk[:, 1:]
        if torch.device(device).type != "cpu":
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return x.contiguous(), y.contiguous()


def stdlib_dataset(max_bytes: int = DEFAULT_MAX_BYTES, val_permille: int = 50, *, root=None,
                   use_cache: bool = True, cache: str | os.PathLike | None = None) -> TextDataset:
    """The bundled corpus: CPython's own standard-library source, byte level (see module doc)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes} must be > 0")
    if not 0 < val_permille < 1000:
        raise ValueError(f"val_permille={val_permille} must be in (0, 1000)")
    root = str(root if root is not None else sysconfig.get_paths()["stdlib"])
    ver = ".".join(map(str, sys.version_info[:3]))
    root_tag = hashlib.sha1(root.encode()).hexdigest()[:8]
    key = f"stdlib-{sys.implementation.name}{ver}-{root_tag}-cap{max_bytes}-val{val_permille}-v{_CACHE_FORMAT}"
    cdir = Path(cache) if cache is not None else cache_dir()
    paths = {s: cdir / f"{key}.{s}.u8" for s in ("train", "val")}
    meta_path = cdir / f"{key}.json"
    name = f"stdlib(py{ver}, {max_bytes} B cap)"
    if use_cache:
        hit = _load_cached(paths, meta_path, name)
        if hit is not None:
            return hit
    chosen = []  # (rel, bytes) in sorted path order, within the cap
    total = 0
    for rel, full in stdlib_files(root):
        try:
            data = full.read_bytes() + b"\n"
        except OSError:
            continue
        if total + len(data) > max_bytes:
            continue  # too big for what is left of the cap: skip it, smaller files may still fit
        total += len(data)
        chosen.append((rel, data))
    return _split_and_cache(chosen, val_permille, root, use_cache, paths, meta_path, name,
                            empty_msg=f"no stdlib .py files found under {root} within {max_bytes} bytes")


def _split_files(chosen, val_permille):
    """(rel, bytes) files -> ({train, val}: bytes, {train, val}: [rel]) (whole files; see module doc)."""
    total = sum(len(d) for _, d in chosen)
    # Val: files visited in crc32(path) order, each taken while val stays within its byte target.
    target = total * val_permille // 1000
    val_names, val_bytes = set(), 0
    for rel, data in sorted(chosen, key=lambda t: (zlib.crc32(t[0].encode()), t[0])):
        if val_bytes + len(data) <= target:
            val_names.add(rel)
            val_bytes += len(data)
    names = {"train": [r for r, _ in chosen if r not in val_names], "val": [r for r, _ in chosen if r in val_names]}
    blobs = {"train": b"".join(d for r, d in chosen if r not in val_names),
             "val": b"".join(d for r, d in chosen if r in val_names)}
    return blobs, names


def _split_and_cache(chosen, val_permille, root, use_cache, paths, meta_path, name, empty_msg):
    blobs, names = _split_files(chosen, val_permille)
    nfiles = {k: len(v) for k, v in names.items()}
    if not blobs["train"] or not blobs["val"]:  # tiny cap: fall back to a tail split of the bytes
        allb = blobs["train"] + blobs["val"]
        if not allb:
            raise RuntimeError(empty_msg)
        cut = len(allb) - max(1, len(allb) * val_permille // 1000)
        blobs = {"train": allb[:cut], "val": allb[cut:]}
        names = {"train": [], "val": []}
    if use_cache:
        try:
            for s, p in paths.items():
                _atomic_write_bytes(p, blobs[s])
            meta = {"key": meta_path.stem, "root": root, "files": nfiles, "train_bytes": len(blobs["train"]),
                    "val_bytes": len(blobs["val"]), "train_files": names["train"], "val_files": names["val"]}
            _atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())  # written last: the marker
        except OSError:
            pass  # read-only home: run uncached
    return TextDataset(np.frombuffer(blobs["train"], dtype=np.uint8).copy(),
                       np.frombuffer(blobs["val"], dtype=np.uint8).copy(), 256, name,
                       {"train": names["train"], "val": names["val"]})


def _load_cached(paths, meta_path, name):
    if meta_path.exists() and all(p.exists() for p in paths.values()):
        try:
            meta = json.loads(meta_path.read_text())
            arrays = {s: np.fromfile(p, dtype=np.uint8) for s, p in paths.items()}
            if all(len(arrays[s]) == meta[f"{s}_bytes"] for s in arrays):
                return TextDataset(arrays["train"], arrays["val"], 256, name,
                                   {"train": meta.get("train_files", []), "val": meta.get("val_files", [])})
        except (OSError, ValueError, KeyError):
            pass  # a broken cache entry is rebuilt
    return None


def pinned_files(corpus=PINNED_CORPUS, *, check_versions: bool = True) -> list[tuple[str, Path]]:
    """``(dist/relative path, absolute path)`` of the pinned corpus' files, in corpus order.

    Raises :class:`CorpusMismatchError` naming the distribution when one is missing or has
    another version than pinned (``check_versions``)."""
    from importlib import metadata

    out = []
    for dist_name, version in corpus:
        try:
            d = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise CorpusMismatchError(
                f"pinned corpus: distribution {dist_name}=={version} is not installed (run `make setup`, or "
                f"`pip install {dist_name}=={version}`; or use the stdlib corpus: --data stdlib)") from None
        if check_versions and d.version != version:
            raise CorpusMismatchError(
                f"pinned corpus: {dist_name} {d.version} is installed but the corpus pins {dist_name}=={version} "
                f"(its .py sources are the text; another version gives other bytes). Install "
                f"`pip install {dist_name}=={version}` (`make setup` does), or use --data stdlib")
        rels = sorted(str(f) for f in (d.files or []) if str(f).endswith(".py") and str(f) not in PINNED_EXCLUDE
                      and "__pycache__" not in str(f) and not str(f).startswith(".."))
        if not rels:
            raise CorpusMismatchError(f"pinned corpus: {dist_name} {d.version} lists no .py files in its RECORD")
        out += [(f"{dist_name}/{r}", Path(d.locate_file(r))) for r in rels]
    return out


def pinned_dataset(val_permille: int = 50, *, use_cache: bool = True, cache: str | os.PathLike | None = None,
                   corpus=PINNED_CORPUS, expected_sha256: str | None = PINNED_SHA256) -> TextDataset:
    """The pinned corpus (see module doc): identical bytes on every machine, checked by SHA-256."""
    if not 0 < val_permille < 1000:
        raise ValueError(f"val_permille={val_permille} must be in (0, 1000)")
    tag = hashlib.sha1(repr(tuple(corpus)).encode()).hexdigest()[:8]
    sha_tag = (expected_sha256 or "unchecked")[:12]
    key = f"pinned-{tag}-{sha_tag}-val{val_permille}-v{_CACHE_FORMAT}"
    cdir = Path(cache) if cache is not None else cache_dir()
    paths = {s: cdir / f"{key}.{s}.u8" for s in ("train", "val")}
    meta_path = cdir / f"{key}.json"
    name = "pinned(" + ", ".join(f"{d}=={v}" for d, v in corpus) + ")"
    if use_cache:
        hit = _load_cached(paths, meta_path, name)
        if hit is not None:
            return hit
    files = pinned_files(corpus)
    chosen, h = [], hashlib.sha256()
    for rel, full in files:
        try:
            data = full.read_bytes() + b"\n"
        except OSError as exc:
            raise CorpusMismatchError(f"pinned corpus: cannot read {rel} ({full}): {exc}") from exc
        h.update(data)
        chosen.append((rel, data))
    got = h.hexdigest()
    if expected_sha256 is not None and got != expected_sha256:
        vers = ", ".join(f"{d}=={v}" for d, v in corpus)
        raise CorpusMismatchError(
            f"pinned corpus: the .py sources of {vers} hash to sha256 {got} ({sum(len(d) for _, d in chosen)} "
            f"bytes, {len(chosen)} files), expected {expected_sha256} ({PINNED_BYTES} bytes). The versions match, "
            f"so an installed file was modified (an editable or patched install?): reinstall with "
            f"`pip install --force-reinstall --no-deps {' '.join(f'{d}=={v}' for d, v in corpus)}`")
    return _split_and_cache(chosen, val_permille, f"sha256:{got}", use_cache, paths, meta_path, name,
                            empty_msg="pinned corpus is empty")


def _tail_split(arr: np.ndarray, val_fraction: float, what: str):
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    n = len(arr)
    n_val = max(1, int(round(n * val_fraction)))
    if n - n_val < 2:
        raise ValueError(f"{what}: {n} tokens are too few to split")
    return arr[: n - n_val], arr[n - n_val:]


def files_dataset(paths: Sequence[str | os.PathLike], val_fraction: float = 0.05) -> TextDataset:
    """Byte-level dataset from the user's own text files (concatenated in the given order)."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("files_dataset needs at least one path")
    blob = b"".join(p.read_bytes() + b"\n" for p in paths)
    arr = np.frombuffer(blob, dtype=np.uint8).copy()
    train, val = _tail_split(arr, val_fraction, "text files")
    return TextDataset(train, val, 256, f"files({len(paths)})")


def token_file_dataset(path: str | os.PathLike, dtype: str = "uint8", val_fraction: float = 0.05, *,
                       val_path: str | os.PathLike | None = None, vocab_size: int | None = None) -> TextDataset:
    """Memory-mapped raw token file (``uint8`` or ``uint16``), as written by ``arr.tofile(path)``."""
    if dtype not in ("uint8", "uint16"):
        raise ValueError(f"dtype={dtype!r} is not allowed; allowed: uint8, uint16")
    mm = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    if val_path is not None:
        train, val = mm, np.memmap(val_path, dtype=np.dtype(dtype), mode="r")
    else:
        train, val = _tail_split(mm, val_fraction, str(path))
    if vocab_size is None:
        vocab_size = 256 if dtype == "uint8" else 65536
    return TextDataset(train, val, int(vocab_size), f"tokens({Path(path).name})")


def load_dataset(data: str = "stdlib", *, max_bytes: int = DEFAULT_MAX_BYTES, files: Iterable[str] | None = None,
                 token_file: str | None = None, token_dtype: str = "uint8", val_fraction: float = 0.05,
                 vocab_size: int | None = None) -> TextDataset:
    """One entry point for the command lines: ``token_file`` wins, then ``files``, else ``data``:
    ``"stdlib"`` (this Python's standard library) or ``"deps"`` (the pinned corpus, same bytes everywhere)."""
    if token_file:
        return token_file_dataset(token_file, token_dtype, val_fraction, vocab_size=vocab_size)
    files = list(files or [])
    if files:
        return files_dataset(files, val_fraction)
    if data == "deps":
        return pinned_dataset()
    if data != "stdlib":
        raise ValueError(f"data={data!r} is not allowed; allowed: deps, stdlib (or pass files / token_file)")
    return stdlib_dataset(max_bytes=max_bytes)
