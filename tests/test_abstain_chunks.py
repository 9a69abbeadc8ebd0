"""Abstentions that come in runs (comm/abstain.py, chunks mode; issue 46 item 6).

The chunk code against the planes it encodes (unused embedding rows, whole tensors, scattered
zeros, none, all; odd sizes; N = 2..8; the reference and C++ backends build the lists alike),
the mode machine, the wire-byte formula at the 1bit floor, and real gloo ranks (N = 2, 3, 4,
every comm that carries abstentions) against the brute-force vote, step by step through
list -> chunks -> plane -> chunks -> list.
"""
from __future__ import annotations

import pytest
import torch

import lioncub_ds
from lioncub_ds import kernels
from lioncub_ds.comm import make_algorithm
from lioncub_ds.comm.abstain import (CHUNK, ChunkCode, any_voter, encode, list_capacity, next_mode, plane_source,
                                     real_mask, summed_flags)
from lioncub_ds.kernels import reference
from dist_helpers import run_ranks
from test_distributed import _brute_force

LAYOUTS = {  # parameter sizes of one bucket (odd: not multiples of 8, 32 or N)
    "embedding+head": [16384, 16384, 256],
    "odd-small": [69, 121, 37],
    "one-tensor": [80000],
    "odd-large": [64000, 8003, 1001],
}
PATTERNS = ("none", "all", "rows", "tensor", "scattered-few", "scattered-many")


class _Ref:
    abstain_list = staticmethod(reference.abstain_list)


def _backends():
    out = [_Ref]
    cpu = kernels.backend_for("cpu")
    if cpu.abstain_list is not reference.abstain_list:  # the C++ extension is built: its lists too
        out.append(cpu)
    return out


def _layout(numels, n):
    offsets, off = [], 0
    for k in numels:
        offsets.append(off)
        off += (k + 7) // 8 * 8
    total = (off + 8 * n - 1) // (8 * n) * (8 * n)
    return offsets, total, real_mask(offsets, numels, total, "cpu")


def _plane(pattern, offsets, numels, total, gen):
    """One rank's nonzero plane: 1 at real elements except the pattern's abstentions."""
    bits = torch.zeros(total, dtype=torch.bool)
    for o, k in zip(offsets, numels):
        bits[o:o + k] = True
    if pattern == "all":
        bits[:] = False
    elif pattern == "rows":  # 64-element rows at 64-aligned bucket offsets, 60% of them unused
        rows = torch.rand((total + 63) // 64, generator=gen) < 0.6
        bits &= ~rows.repeat_interleave(64)[:total]
    elif pattern == "tensor":  # one whole parameter (its ends need not be on a chunk boundary)
        i = int(torch.randint(len(numels), (1,), generator=gen))
        bits[offsets[i]:offsets[i] + numels[i]] = False
    elif pattern.startswith("scattered"):
        k = 2 if pattern == "scattered-few" else max(50, total // 50)
        bits[torch.randperm(total, generator=gen)[:k]] = False
    return reference.pack_bits(bits)


def _base_by_loop(mask, nonzero):
    """The chunks-mode base by plain loops: the mask, cleared on every 8-byte chunk where the
    plane is all zero (the last chunk may be short)."""
    base = mask.clone()
    for c in range(0, mask.numel(), CHUNK):
        if int(nonzero[c:c + CHUNK].max()) == 0:
            base[c:c + CHUNK] = 0
    return base


@pytest.mark.unit
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunk_code_round_trip(n, layout):
    """Every rank's plane back from the chunk code, exactly (whole payloads, and each shard
    owner's rows), and the result's nonzero plane rebuilt from the owners' full-chunk bits and the
    lists: the OR of the planes. The flag entries say exactly when a list would overflow."""
    numels = LAYOUTS[layout]
    offsets, total, mask = _layout(numels, n)
    code = ChunkCode(total // 8, n)
    k_list = list_capacity(total // 8, n)
    gen = torch.Generator().manual_seed(n * 100 + len(layout))
    decoded = 0
    for pattern in PATTERNS:
        planes = torch.stack([_plane(pattern, offsets, numels, total, gen) for _ in range(n)])
        payloads, over = [], []
        for r in range(n):
            base = _base_by_loop(mask, planes[r])
            long, short = int((planes[r] != mask).sum()), int((planes[r] != base).sum())
            got = [encode(planes[r], mask, mode, k_list, n, be) for be in _backends() for mode in ("chunks", "plane")]
            for payload, flags in got:
                assert flags.tolist() == [int(long > k_list), int(short > code.capacity)], (pattern, r)
            for payload, _ in got[2::2]:  # every backend's chunk code is the reference's, bit for bit
                assert torch.equal(payload, got[0][0]), (pattern, r)
            assert torch.equal(got[1][0], planes[r])  # plane mode sends the plane
            lst, flags = encode(planes[r], mask, "list", k_list, n, _Ref)
            assert flags.tolist() == [int(long > k_list), int(long > 0)]
            assert got[0][0].numel() == code.payload_bytes
            payloads.append(got[0][0])
            over.append(short > code.capacity)
        received = torch.stack(payloads)
        if any(over):  # not exact, and the flags said so: the planes travel (tests of the step)
            continue
        decoded += 1
        whole, lists = code.decode(received, mask)
        assert torch.equal(whole, planes), pattern
        union = any_voter(planes)
        full = []
        for r in range(n):
            rows = torch.stack([code.payload_rows(p)[r] for p in payloads])
            assert rows.shape[1] == code.shard_payload_bytes
            lo, hi = r * code.shard, (r + 1) * code.shard
            shard, _ = code.decode(rows, mask, r)
            assert torch.equal(shard, planes[:, lo:hi]), (pattern, r)
            full.append(code.full_bits(union[lo:hi], mask[lo:hi], r))
        assert torch.equal(code.result_nonzero(torch.stack(full), lists, mask), union), pattern
    assert decoded >= 3  # none, all, rows (and more) decode here, not only in the step tests


@pytest.mark.unit
def test_runs_cost_no_list_entries():
    """An Embedding(256, 64) + Linear(64, 256) bucket with 60% of the rows unused and a whole
    tensor zero: every run is whole chunks, so the list is empty and the payload is the count
    and 1 bit per 64 elements."""
    n = 4
    numels = [256 * 64, 256 * 64, 256]
    offsets, total, mask = _layout(numels, n)
    gen = torch.Generator().manual_seed(5)
    nz = _plane("rows", offsets, numels, total, gen)
    payload, flags = encode(nz, mask, "chunks", list_capacity(total // 8, n), n, _Ref)
    words = payload[:ChunkCode(total // 8, n).list_bytes].view(torch.int32)
    assert int(words[0]) == 0 and flags.tolist() == [1, 0]
    assert payload.numel() == 4 * (1 + 2 * ChunkCode(total // 8, n).capacity) + (total // 64 + 7) // 8


@pytest.mark.unit
def test_summed_flags_drive_the_modes():
    """summed_flags (a simulation's view of the step's flags): unused rows overflow a list and
    fit the chunks; dense planes go back to lists; nobody abstaining needs no planes."""
    n = 4
    numels = [256 * 64, 256 * 64, 256]
    offsets, total, mask = _layout(numels, n)
    gen = torch.Generator().manual_seed(7)
    k = list_capacity(total // 8, n)
    rows = [_plane("rows", offsets, numels, total, gen) for _ in range(n)]
    dense = [_plane("none", offsets, numels, total, gen) for _ in range(n)]
    assert summed_flags(rows, mask, "list", k, n, reference) == (n, n)
    assert next_mode("list", n, n) == "chunks" and plane_source("list", n, n) == "fetch"
    assert summed_flags(rows, mask, "chunks", k, n, reference) == (n, 0)
    assert next_mode("chunks", n, 0) == "chunks" and plane_source("chunks", n, 0) == "payload"
    assert summed_flags(dense, mask, "chunks", k, n, reference) == (0, 0)
    assert next_mode("chunks", 0, 0) == "list"
    assert summed_flags(dense, mask, "list", k, n, reference) == (0, 0) and plane_source("list", 0, 0) == "none"


@pytest.mark.unit
def test_mode_machine():
    """Flag entries [first, second], summed over ranks: list mode [list overflows, abstains];
    chunks and plane modes [list would overflow, chunk list overflows]."""
    assert [plane_source("list", f, s) for f, s in ((0, 0), (0, 2), (1, 3))] == ["none", "payload", "fetch"]
    assert [plane_source("chunks", f, s) for f, s in ((0, 0), (3, 0), (3, 1))] == ["payload", "payload", "fetch"]
    assert [plane_source("plane", f, s) for f, s in ((0, 0), (3, 3))] == ["payload", "payload"]
    assert [next_mode("list", f, s) for f, s in ((0, 0), (0, 4), (1, 4))] == ["list", "list", "chunks"]
    assert [next_mode("chunks", f, s) for f, s in ((0, 0), (2, 0), (2, 1))] == ["list", "chunks", "plane"]
    assert [next_mode("plane", f, s) for f, s in ((0, 1), (2, 0), (2, 1))] == ["list", "chunks", "plane"]


@pytest.mark.unit
@pytest.mark.parametrize("numel", [33024, 25 * 2 ** 20 // 4, 50257 * 768])
def test_chunks_mode_bytes_near_the_floor(numel):
    """The chunks mode costs at most 5% over the dense vote (the list mode without abstentions)
    for 1bit, bbit and allgather at N = 2..64 (pbit: its payloads ride in N slots, up to N = 16),
    where the plane mode costs 1.6-9x."""
    for n in (2, 4, 8, 16, 32, 64):
        padded = (numel + 8 * n - 1) // (8 * n) * (8 * n)
        for name in ("1bit", "bbit", "allgather", "pbit"):
            if name == "pbit" and n > 16:
                continue
            a = make_algorithm(name)
            dense, chunks = a.wire_bytes(padded, n, mode="list"), a.wire_bytes(padded, n, mode="chunks")
            assert dense < chunks <= 1.05 * dense < a.wire_bytes(padded, n, mode="plane"), (name, n)
        one = make_algorithm("1bit")  # the sharded chunk code is N-independent; whole payloads grow with N
        code = ChunkCode(padded // 8, n)
        assert one.wire_bytes(padded, n, mode="chunks") == (n - 1) * (2 * padded // 8 // n + code.shard_payload_bytes
                                                                      + code.window_bytes)


# ----------------------------------------------------------------------------- real ranks
V, D = 512, 64  # the embedding: 64-element rows from offset 0 of the bucket (whole chunks)
MODES = ["list", "chunks", "chunks", "chunks", "chunks", "plane", "chunks", "list"]
FETCH = {0, 4}  # steps whose list (step 0) or chunk list (step 4) overflows: the planes travel again


def _zeros(step, rank, name, shape, gen):
    """Where this rank's c is exactly 0 at this step (bool, the parameter's shape)."""
    z = torch.zeros(shape, dtype=torch.bool)
    if step == 3:  # nobody votes anywhere: Δ = 0, weight decay alone
        return torch.ones(shape, dtype=torch.bool)
    if step >= 6:
        return z
    if name == "emb":  # this rank's unused rows (30% / 40% used), whole chunks
        used = torch.rand(V, generator=gen) < (0.3 if step == 0 else 0.4)
        return (~used).view(-1, 1).expand(V, D).clone()
    if name == "dead":  # a whole tensor whose gradient is 0 (its last chunk is shared with head)
        return torch.ones(shape, dtype=torch.bool)
    if name == "head" and step == 2 and rank == 0:  # one scattered zero: a list entry
        z.view(-1)[1234] = True
    if name == "head" and step == 4 and rank == 1:  # many scattered zeros: the chunk list overflows
        z.view(-1)[torch.randperm(z.numel(), generator=gen)[:600]] = True
    return z


def _chunks_vs_brute_force(rank, n):
    out = {}
    cases = [("1bit", "hash", "majority"), ("1bit", "zero", "majority"), ("1bit", "hash", "average"),
             ("allgather", "hash", "majority"), ("pbit", "hash", "majority"), ("bbit", "hash", "majority")]
    for comm, tie, vote in cases:
        torch.manual_seed(0)
        shapes = {"emb": (V, D), "dead": (1040,), "head": (77, D), "bias": (77,), "side": (37,)}
        params = {k: torch.nn.Parameter(torch.randn(s)) for k, s in shapes.items()}
        extra = {"quant": "l1"} if comm == "bbit" else {}
        opt = lioncub_ds.LionCub(list(params.values()), lr=1e-2, weight_decay=0.1, comm=comm, tie_break=tie,
                                 vote=vote, **extra)
        gen = torch.Generator().manual_seed(10 + rank)
        mismatched, modes, sent = [], [], []
        for step in range(len(MODES)):
            for name, p in params.items():
                z = _zeros(step, rank, name, p.shape, gen)
                p.grad = torch.randn(p.shape, generator=gen).masked_fill_(z, 0.0)
                opt.momenta.get(p).masked_fill_(z, 0.0)  # c = 0 exactly there
            assert opt.plan is not None and len(opt.plan.buckets) == 1
            modes.append(opt.plan.buckets[0].mode)
            before = {p: p.detach().clone() for p in params.values()}
            grads = {p: p.grad.clone() for p in params.values()}
            momenta = {p: opt.momenta.get(p).clone() for p in params.values()}
            expected = _brute_force(opt, before, grads, momenta, n)
            opt.step()
            mismatched.append(sum(not torch.equal(p.detach(), expected[p]) for p in params.values()))
            sent.append(dict(opt.comm_stats()["last_step"]["by_algorithm"]))
        out[(comm, tie, vote)] = {"mismatched": mismatched, "modes": modes, "sent": sent,
                                  "numel": opt.plan.buckets[0].numel,
                                  "params": torch.cat([p.detach().reshape(-1) for p in params.values()])}
    return out


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 3, 4])
def test_chunks_mode_equals_brute_force(n):
    """Unused embedding rows, a zero tensor, one and many scattered zeros, all zeros, none: every
    step of every comm that carries abstentions equals the brute-force vote (even N: ties, hash
    and zero rules), the modes follow the agreed flags, and the bytes are the formula's."""
    res = run_ranks(_chunks_vs_brute_force, n, timeout=900)
    for case, r0 in res[0].items():
        comm, tie, vote = case
        for r in range(n):
            assert res[r][case]["mismatched"] == [0] * len(MODES), (case, r, res[r][case]["mismatched"])
            assert torch.equal(res[r][case]["params"], r0["params"]), (case, r)
        assert r0["modes"] == MODES, (case, r0["modes"])
        algo, numel = make_algorithm(comm, quant="l1"), r0["numel"]
        for step, (mode, sent) in enumerate(zip(MODES, r0["sent"])):
            want = algo.wire_bytes(numel, n, mode=mode, vote=vote, tie_break=tie, abstain=step < 6,
                                   overflow=step in FETCH)
            fetched = sent.get("abstain_planes", 0)
            assert (fetched > 0) == (step in FETCH), (case, step, sent)
            assert sent[comm] + fetched == want, (case, step, sent, want)


@pytest.mark.dist
def test_bench_embedding_case_at_the_floor():
    """``bench comm --zeros``'s rank function on 2 ranks: with 60% of the Embedding(256, 64) rows
    never used, 1bit settles in chunks mode within 1.1x the bytes of the same model with every
    row used (the plane mode it replaces costs about 2x)."""
    from benchmarks.comm import ZERO_GOAL, _zeros_rank

    n = 2
    res = run_ranks(_zeros_rank, n, 256, 64, 0.4, 4, 64, 3, [("1bit", {"comm": "1bit"})], timeout=600)
    zero, dense = res[0]
    assert all(r[0]["sent"] == zero["sent"] and r[1]["sent"] == dense["sent"] for r in res)
    assert zero["modes"] == ["list", "chunks", "chunks"] and dense["modes"] == ["list"] * 3
    plane = make_algorithm("1bit").wire_bytes(zero["numel"], n, mode="plane") + zero["control"]
    assert dense["sent"][-1] < zero["sent"][-1] <= ZERO_GOAL * dense["sent"][-1] < plane
