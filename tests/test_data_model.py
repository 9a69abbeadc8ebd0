"""Fast tests for the bundled-text data, the small GPT and the environment report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmarks.data import files_dataset, load_dataset, stdlib_dataset, stdlib_files, token_file_dataset
from benchmarks.models import GPT, PRESETS, build_model, get_config

pytestmark = pytest.mark.unit

CAP = 256 * 1024  # small corpus: fast to build, still hundreds of windows per shard


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return stdlib_dataset(max_bytes=CAP, cache=tmp_path_factory.mktemp("cache"))


# ----------------------------------------------------------------------------- data
def test_stdlib_files_sorted_and_filtered():
    files = stdlib_files()
    rels = [r for r, _ in files]
    assert rels == sorted(rels) and len(rels) > 100
    assert all(r.endswith(".py") for r in rels)
    assert not any(part in ("site-packages", "test", "tests", "__pycache__") for r in rels for part in r.split("/"))


def test_dataset_deterministic_and_cached(tmp_path, ds):
    a = stdlib_dataset(max_bytes=CAP, cache=tmp_path)                 # built
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".u8", ".u8"]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    b = stdlib_dataset(max_bytes=CAP, cache=tmp_path)                 # loaded from the cache
    c = stdlib_dataset(max_bytes=CAP, use_cache=False)                # rebuilt, no cache
    for other in (b, c, ds):
        assert np.array_equal(a.train, other.train) and np.array_equal(a.val, other.val)
    assert a.train.dtype == np.uint8 and a.vocab_size == 256
    assert len(a) <= CAP
    assert 0.01 < len(a.val) / len(a) < 0.25


def test_split_disjoint_by_file(ds):
    # The split is by whole files: no file is in both, and each split's bytes are exactly its
    # files in path order. (Checked by name, not by searching val text in train: two stdlib
    # files can share a 200-byte run, e.g. a license header, on some Python versions.)
    import sysconfig
    from pathlib import Path

    tr, va = ds.files["train"], ds.files["val"]
    assert tr and va and not set(tr) & set(va)
    assert tr == sorted(tr) and va == sorted(va)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert ds.val.tobytes() == b"".join((root / rel).read_bytes() + b"\n" for rel in va)
    assert ds.train.tobytes() == b"".join((root / rel).read_bytes() + b"\n" for rel in tr)


def test_split_by_whole_files_on_written_files(tmp_path):
    """The split is by whole files: each file lies whole in exactly one split. Built from files
    written here (unique content), so the outcome does not depend on the installed stdlib."""
    rng = np.random.default_rng(0)
    for i in range(60):
        body = rng.integers(97, 123, size=int(rng.integers(500, 3000)), dtype=np.uint8).tobytes()
        (tmp_path / f"mod{i:02d}.py").write_bytes(f"# module {i}\n".encode() + body)
    d = stdlib_dataset(max_bytes=10 ** 6, root=tmp_path, use_cache=False)
    train, val = d.train.tobytes(), d.val.tobytes()
    files = {p.name: p.read_bytes() + b"\n" for p in tmp_path.iterdir()}
    assert len(train) + len(val) == sum(len(b) for b in files.values())
    in_val = [name for name, b in files.items() if b in val]
    assert 0 < len(in_val) < len(files)
    for name, b in files.items():
        assert (b in val) != (b in train), name


def test_get_batch_deterministic(ds):
    x1, y1 = ds.get_batch("train", 4, 32, rank=1, world_size=2, step=7, seed=3)
    ds.get_batch("train", 4, 32, rank=0, world_size=2, step=8, seed=3)  # unrelated call in between
    x2, y2 = ds.get_batch("train", 4, 32, rank=1, world_size=2, step=7, seed=3)
    assert x1.shape == (4, 32) and x1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    x3, _ = ds.get_batch("train", 4, 32, rank=1, world_size=2, step=8, seed=3)
    x4, _ = ds.get_batch("train", 4, 32, rank=1, world_size=2, step=7, seed=4)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)


def test_ranks_get_different_shards(ds):
    world = 4
    bounds = [ds.shard_bounds("train", r, world, 32) for r in range(world)]
    for (lo0, hi0), (lo1, hi1) in zip(bounds, bounds[1:]):
        assert hi0 <= lo1  # disjoint, in order
    batches = [ds.get_batch("train", 8, 32, rank=r, world_size=world, step=0, seed=0)[0] for r in range(world)]
    for i in range(world):
        for j in range(i + 1, world):
            assert not torch.equal(batches[i], batches[j])
    # Each rank's windows come from its own shard.
    data = torch.from_numpy(ds.train.astype(np.int64))
    for r, xb in enumerate(batches):
        lo, hi = bounds[r]
        shard = data[lo:hi]
        for row in xb[:2]:
            windows = shard.unfold(0, 32, 1)
            assert (windows == row).all(dim=1).any()


def test_val_batches_and_bad_split(ds):
    x, y = ds.get_batch("val", 2, 16, rank=0, world_size=1, step=0, seed=0)
    assert x.shape == (2, 16) and int(x.max()) < 256
    with pytest.raises(ValueError, match="split"):
        ds.get_batch("test", 2, 16)


def test_files_and_token_file(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text("hello world\n" * 50)
    b.write_text("lorem ipsum\n" * 50)
    fd = files_dataset([a, b], val_fraction=0.1)
    assert len(fd.train) + len(fd.val) == a.stat().st_size + b.stat().st_size + 2
    assert fd.get_batch("train", 2, 8, step=1)[0].shape == (2, 8)

    toks = (np.arange(10_000) % 1000).astype(np.uint16)
    path = tmp_path / "toks.bin"
    toks.tofile(path)
    td = token_file_dataset(path, "uint16", val_fraction=0.1, vocab_size=1000)
    assert isinstance(td.train, np.memmap) and td.vocab_size == 1000
    assert len(td.train) == 9000 and len(td.val) == 1000
    x, y = td.get_batch("train", 3, 16, rank=0, world_size=2, step=0, seed=0)
    assert int(x.max()) < 1000 and torch.equal((x[:, 1:]), y[:, :-1])
    assert load_dataset(token_file=str(path), token_dtype="uint16", vocab_size=1000).vocab_size == 1000


# ----------------------------------------------------------------------------- model
def test_forward_shapes_and_loss(ds):
    model = build_model("tiny", seed=0)
    x, y = ds.get_batch("train", 2, model.cfg.seq_len, step=0)
    logits, loss = model(x, y)
    assert logits.shape == (2, model.cfg.seq_len, 256)
    assert torch.isfinite(loss) and 4.5 < loss.item() < 6.5  # ~ln(256) at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    logits2, none = model(x[:, :10])
    assert logits2.shape == (2, 10, 256) and none is None


def test_same_seed_same_init_and_causal():
    a, b = build_model("tiny", seed=5), build_model("tiny", seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    a.eval()
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(a(x)[0][0, :10], a(x2)[0][0, :10], atol=1e-6)  # the future does not leak


@pytest.mark.parametrize("preset,lo,hi", [("tiny", 0.1e6, 0.4e6), ("demo", 1.0e6, 2.0e6),
                                          ("bench20m", 20e6, 40e6)])
def test_param_count(preset, lo, hi):
    with torch.device("meta"):
        model = GPT(get_config(preset))
    assert lo <= model.param_count() <= hi


def test_param_names_meaningful():
    names = [n for n, _ in build_model("tiny").named_parameters()]
    assert "blocks.0.attn.qkv.weight" in names and "blocks.0.mlp.fc.weight" in names
    assert "tok_emb.weight" in names and "pos_emb.weight" in names and "head.weight" not in names
    untied = [n for n, _ in build_model("tiny", tie_weights=False).named_parameters()]
    assert "head.weight" in untied


@pytest.mark.parametrize("tie", [True, False])
def test_optim_groups_cover_params_once(tie):
    model = build_model("tiny", tie_weights=tie)
    groups = model.optim_groups(0.1)
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    named = dict(model.named_parameters())
    for g in groups:
        assert len(g["names"]) == len(g["params"])
        assert all(named[n] is p for n, p in zip(g["names"], g["params"]))
    decay = next(g for g in groups if g["weight_decay"] > 0)
    no_decay = next(g for g in groups if g["weight_decay"] == 0)
    assert all(p.dim() == 2 for p in decay["params"])
    assert "tok_emb.weight" in no_decay["names"] and "blocks.0.ln1.weight" in no_decay["names"]
    assert any(n.endswith("bias") for n in no_decay["names"])
    torch.optim.AdamW(groups, lr=1e-3)  # a torch optimizer accepts the groups as they are


def test_presets_valid():
    assert set(PRESETS) >= {"tiny", "demo", "bench20m"}
    with pytest.raises(ValueError, match="preset"):
        get_config("nope")
    with pytest.raises(ValueError, match="divisible"):
        get_config("tiny", n_head=3)


# ----------------------------------------------------------------------------- env report
@pytest.mark.dist
def test_env_report_json():
    env = dict(os.environ, LIONCUB_KERNELS="torch")  # no kernel build inside a unit test
    out = subprocess.run([sys.executable, "-m", "lioncub_ds.env", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["torch"] == torch.__version__
    assert info["kernel_backend_cpu"].startswith("torch")
    assert {"python", "deepspeed", "megatron-core", "cuda", "nvcc"} <= set(info)
    assert isinstance(info["cuda"]["available"], bool)


# ----------------------------------------------------------------------------- the training loop
def _demo_args(*extra):
    from benchmarks.demo import build_parser
    return build_parser().parse_args(["--preset", "tiny", "--steps", "30", "--batch-size", "4", "--max-bytes",
                                      str(CAP), "--eval-interval", "30", "--eval-iters", "2", "--log-interval",
                                      "10", "--no-progress", "--lr", "3e-3", *extra])


@pytest.mark.parametrize("optim", ["lion", "lioncub"])
def test_train_one_process(optim, monkeypatch, tmp_path):
    import lioncub_ds
    from benchmarks.demo import check_summary, train

    if optim == "lioncub" and getattr(lioncub_ds, "LionCub", None) is None:
        pytest.skip("LionCub not available yet")
    monkeypatch.setenv("LIONCUB_CACHE_DIR", str(tmp_path))
    summary = train(_demo_args("--optim", optim), 0, 1)
    assert summary["last_val_loss"] < summary["first_val_loss"] - 0.5
    assert check_summary(summary, 0.5) == 0 and summary["params_in_sync"]


@pytest.mark.dist
def test_demo_two_ranks(monkeypatch, tmp_path):
    """The demo's own launcher: 2 gloo ranks, LionCub when it exists (no gradient all-reduce)."""
    import lioncub_ds
    from benchmarks.demo import check_summary, launch

    optim = "lioncub" if getattr(lioncub_ds, "LionCub", None) is not None else "lion"
    monkeypatch.setenv("LIONCUB_CACHE_DIR", str(tmp_path))
    summary = launch(_demo_args("--optim", optim, "--world-size", "2"))
    assert summary["world_size"] == 2 and summary["params_in_sync"]
    assert check_summary(summary, 0.5) == 0
    if optim == "lioncub":
        assert 0 < summary["bytes_sent_per_step"] < summary["fp32_allreduce_bytes_per_step"] / 8
