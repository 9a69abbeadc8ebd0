"""The step pipeline on real gloo ranks: abstention lists (few) vs planes (many) against a
brute-force vote, overflow, communication batches, and overlap with backward (hooks,
no_sync, missing gradients, NaN skip, in-place clipping, zero_grad) bit-identical to the
plain step."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lioncub_ds
from lioncub_ds.comm import make_algorithm
from lioncub_ds.comm.abstain import ChunkCode, decode_lists, list_capacity, real_mask
from lioncub_ds.kernels.reference import abstain_list
from dist_helpers import run_ranks
from test_distributed import _brute_force

pytestmark = pytest.mark.dist


# ----------------------------------------------------------------------------- the list codec
@pytest.mark.unit
def test_list_codec_round_trip_exact():
    gen = torch.Generator().manual_seed(3)
    offsets, numels, total = [0, 72, 200], [69, 121, 37], 240
    mask = real_mask(offsets, numels, total, "cpu")
    # bit i of the mask is 1 exactly at the real elements
    bits = ((mask.reshape(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)
    want = torch.zeros(total, dtype=torch.uint8)
    for o, n in zip(offsets, numels):
        want[o:o + n] = 1
    assert torch.equal(bits, want)
    for n_abstain, cap in ((0, 3), (2, 3), (3, 3), (5, 3), (4, 0)):
        nz = mask.clone()
        pos = torch.randperm(int(want.sum()), generator=gen)[:n_abstain]
        real = want.nonzero().reshape(-1)[pos]
        for e in real.tolist():
            nz[e // 8] &= ~(1 << (e % 8)) & 0xFF
        lst = abstain_list(nz, mask, cap)
        count = int(lst[0])
        assert count == int((nz != mask).sum())
        planes = decode_lists(torch.stack([lst, lst]), mask, cap)
        if count <= cap:
            assert torch.equal(planes[0], nz) and torch.equal(planes[1], nz)
        else:  # an overflowing list is not exact: the step's flags say so and the planes travel
            assert not torch.equal(planes[0], nz)


@pytest.mark.unit
@pytest.mark.parametrize("algo", ["allgather", "1bit", "pbit"])
def test_list_mode_bytes_near_the_vote_floor(algo):
    """Issue 12's target: abstentions cost bytes only where they occur. For a 25 MB bucket at
    N = 4, list mode stays within 1.05x of the plane-less vote."""
    n, numel = 4, 25 * 2 ** 20 // 4
    numel = (numel + 8 * n - 1) // (8 * n) * (8 * n)
    a = make_algorithm(algo)
    with_list = a.wire_bytes(numel, n, mode="list")
    with_plane = a.wire_bytes(numel, n, mode="plane")
    assert list_capacity(numel // 8, n) > 100
    floor = {"allgather": (n - 1) * numel // 8, "1bit": 2 * (n - 1) * numel // 8 // n,
             "pbit": 2 * (n - 1) * numel * a.lane_bits(n) // 8 // n if algo == "pbit" else 0}[algo]
    assert floor < with_list <= 1.05 * floor, (algo, with_list, floor)
    assert with_plane > 1.2 * with_list


# ----------------------------------------------------------------------------- lists vs brute force
N_BIG = 80_000  # elements: large enough for abstention lists at N = 4 (capacity 2)


def _abstentions_vs_brute_force(rank, n):
    """Exact-zero gradients, few (lists) then many on one rank (overflow, then planes), then
    few again: every step equals the brute-force vote; bytes follow the mode."""
    out = {}
    for comm in ("allgather", "1bit", "pbit"):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(N_BIG))
        v = torch.nn.Parameter(torch.randn(37))
        opt = lioncub_ds.LionCub([w, v], lr=1e-2, comm=comm, tie_break="hash")
        gen = torch.Generator().manual_seed(10 + rank)
        mismatched, modes, bytes_ = 0, [], []
        zeros_per_step = [2, 0, 3000 if rank == 1 else 1, 1, 0]
        for step, nzero in enumerate(zeros_per_step):
            for p in (w, v):
                p.grad = torch.randn(p.shape, generator=gen)
            if nzero:  # exact zeros where the momentum is zero too (step 0: m = 0 everywhere)
                idx = torch.randperm(N_BIG, generator=gen)[:nzero]
                w.grad[idx] = 0.0
                if step > 0:
                    opt.state[w]["exp_avg"][idx] = 0.0
            if step == 0:
                assert opt.plan is not None  # built now (the layout the brute force reads)
            modes.append(opt.plan.buckets[0].mode)
            before = {p: p.detach().clone() for p in (w, v)}
            grads = {p: p.grad.clone() for p in (w, v)}
            momenta = {p: opt.momenta.get(p).clone() for p in (w, v)}
            expected = _brute_force(opt, before, grads, momenta, n)
            opt.step()
            mismatched += sum(not torch.equal(p.detach(), expected[p]) for p in (w, v))
            bytes_.append(dict(opt.comm_stats()["last_step"]["by_algorithm"]))
        out[comm] = {"mismatched": mismatched, "modes": modes, "bytes": bytes_,
                     "params": torch.cat([w.detach(), v.detach()]),
                     "numel": opt.plan.buckets[0].numel, "capacity": opt.plan.buckets[0].capacity}
    return out


def test_abstention_lists_and_overflow_equal_brute_force():
    n = 4
    res = run_ranks(_abstentions_vs_brute_force, n, timeout=600)
    for comm, r0 in res[0].items():
        for r in range(n):
            assert res[r][comm]["mismatched"] == 0, (comm, r)
            assert torch.equal(res[r][comm]["params"], r0["params"]), (comm, r)
        assert r0["capacity"] >= 2
        # few abstentions: lists; rank 1's 3000 zeros overflow at step 2, so step 3 sends the chunk
        # code (comm/abstain.py), whose flags say that every list fits again: step 4 sends lists
        assert r0["modes"] == ["list", "list", "list", "chunks", "list"], (comm, r0["modes"])
        algo = make_algorithm(comm)
        numel = r0["numel"]
        want_list = algo.wire_bytes(numel, n, mode="list")
        want_chunks = algo.wire_bytes(numel, n, mode="chunks")
        assert r0["bytes"][0][comm] == want_list and r0["bytes"][4][comm] == want_list, (comm, r0["bytes"])
        assert r0["bytes"][3][comm] == want_chunks, (comm, r0["bytes"])
        assert "abstain_planes" not in r0["bytes"][3]
        # the overflow step fetches the planes once (exact), in the step it happened: 1bit (majority)
        # sends each rank only its shard of every plane (all-to-all), the others every whole plane
        sharded = comm == "1bit"
        refetch = (n - 1) * numel // 8 // (n if sharded else 1)
        assert r0["bytes"][2].get("abstain_planes", 0) == refetch, (comm, r0["bytes"][2])
        assert r0["bytes"][2][comm] + refetch == algo.wire_bytes(numel, n, mode="list", abstain=True, overflow=True)
        assert "abstain_planes" not in r0["bytes"][1]
        want_plane = algo.wire_bytes(numel, n, mode="plane")
        if sharded:  # 4 bit-planes' worth in plane mode (votes, nonzero shards, Δ sign + nonzero) ...
            assert want_plane == 4 * (n - 1) * numel // 8 // n
            # ... where every whole plane to every rank would cost (N−1)·P/8 on top of the vote
            assert want_plane < 2 * (n - 1) * numel // 8 // n + (n - 1) * numel // 8
            # chunks: the vote's two planes, the list and the zero-chunk bits of shard r's window,
            # the result's full-chunk bits
            code = ChunkCode(numel // 8, n)
            assert want_chunks == (n - 1) * (2 * numel // 8 // n + code.shard_payload_bytes + code.window_bytes)
        assert want_chunks < want_plane


def _sharded_vs_whole_planes(rank, n):
    """The overflow / plane-mode scenario above for the comms whose planes travel sharded, run
    twice: as shipped, and with every rank's whole plane sent to every rank (the protocol before
    sharding). Parameters must match bit for bit at every step; the sharded run sends fewer bytes."""
    out = {}
    cases = [("1bit", "hash", "majority"), ("1bit", "zero", "majority"), ("bbit", "hash", "majority"),
             ("1bit", "hash", "average")]
    for comm, tie, vote in cases:
        runs = {}
        for whole in (False, True):
            torch.manual_seed(0)
            w = torch.nn.Parameter(torch.randn(N_BIG + 13))  # odd: not a multiple of 8, 32 or N
            v = torch.nn.Parameter(torch.randn(37))
            extra = {"quant": "l1"} if comm == "bbit" else {}
            opt = lioncub_ds.LionCub([w, v], lr=1e-2, comm=comm, tie_break=tie, vote=vote, **extra)
            gen = torch.Generator().manual_seed(10 + rank)
            params, modes, sent = [], [], 0
            # list, list (overflow), chunks (overflow: scattered zeros), plane, plane, list (overflow), chunks
            scattered = 3000 if rank == 1 else 1
            for step, nzero in enumerate([2, scattered, scattered, scattered, 1, 4000, 0]):
                for p in (w, v):
                    p.grad = torch.randn(p.shape, generator=gen)
                if nzero:
                    idx = torch.randperm(w.numel(), generator=gen)[:nzero]
                    w.grad[idx] = 0.0
                    if step > 0:
                        opt.state[w]["exp_avg"][idx] = 0.0
                if step == 0:
                    assert opt.plan is not None
                    if whole:  # every bucket's algorithm sends whole planes
                        for b in opt.plan.buckets:
                            b.algorithm.shards_planes = lambda vote: False
                modes.append(opt.plan.buckets[0].mode)
                opt.step()
                params.append(torch.cat([w.detach(), v.detach()]).clone())
                sent += sum(opt.comm_stats()["last_step"]["by_algorithm"].values())
            runs[whole] = (params, modes, sent)
        out[(comm, tie, vote)] = runs
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_sharded_planes_equal_whole_planes(n):
    res = run_ranks(_sharded_vs_whole_planes, n, timeout=600)
    for case, runs in res[0].items():
        (sharded, modes, sent_sharded), (whole, modes_whole, sent_whole) = runs[False], runs[True]
        assert modes == modes_whole == ["list", "list", "chunks", "plane", "plane", "list", "chunks"], (case, modes)
        for step, (a, b) in enumerate(zip(sharded, whole)):
            assert torch.equal(a, b), (case, step)
        for r in range(1, n):  # replicas identical
            assert all(torch.equal(a, b) for a, b in zip(res[r][case][False][0], sharded)), (case, r)
        if case[2] == "majority":
            assert sent_sharded < sent_whole, (case, sent_sharded, sent_whole)
        else:  # the averaging vote needs every rank's whole plane: unchanged
            assert sent_sharded == sent_whole, case


# ----------------------------------------------------------------------------- overlap
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 24)   # rows 30..39 never used: abstentions
        self.fc1 = torch.nn.Linear(24, 50)
        self.fc2 = torch.nn.Linear(50, 7)
        self.side = torch.nn.Linear(7, 3)       # used on some steps only (missing gradients)

    def forward(self, idx, use_side):
        h = self.fc2(torch.tanh(self.fc1(self.emb(idx).mean(1))))
        return h.sum() if not use_side else h.sum() + self.side(h).pow(2).sum()


def _train(model, opt, gen, rank, overlap):
    """Micro-batch accumulation (no_sync), a NaN step, in-place clipping, a discarded backward."""
    for step in range(8):
        opt.zero_grad()
        micro = 2 if step % 3 == 0 else 1
        for k in range(micro):
            idx = torch.randint(0, 30, (5, 3), generator=gen)
            use_side = (step + rank) % 2 == 0
            last = k == micro - 1
            ctx = opt.no_sync() if not last else _null()
            with ctx:
                loss = model(idx, use_side)
                if step == 5 and rank == 1:
                    loss = loss * float("nan")  # one rank's NaN: the step is skipped everywhere
                loss.backward()
        if step == 4:  # in-place clipping after the votes started in backward: voted again
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if step == 6:  # a backward whose gradients are thrown away, then a fresh one
            opt.zero_grad()
            model(torch.randint(0, 30, (5, 3), generator=gen), False).backward()
        opt.step()
    momenta = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.comm_stats()["skipped_steps"], momenta


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _overlap_vs_plain(rank, n):
    out = {}
    for comm, vote in (("allgather", "majority"), ("1bit", "majority"), ("1bit", "average"), ("pbit", "majority"),
                       ("int8", "majority"), ("bbit", "majority")):
        res = {}
        for overlap, double in ((False, False), (True, False), (False, True), (True, True)):
            torch.manual_seed(0)
            model = Net()
            opt = lioncub_ds.LionCub(model.parameters(), lr=1e-2, comm=comm, vote=vote,
                                     quant="l1" if comm in ("int8", "bbit") else "sign", bucket_size_mb=0.004,
                                     comm_bucket_mb=0.0002, overlap=overlap, momentum_double_buffer=double)
            gen = torch.Generator().manual_seed(50 + rank)
            res[overlap, double] = _train(model, opt, gen, rank, overlap)
            res[f"batches_{overlap}"] = len(opt.plan.batches)
            res[f"buckets_{overlap}"] = len(opt.plan.buckets)
        out[(comm, vote)] = res
    return out


def test_overlap_and_double_buffer_are_bit_identical_to_the_plain_step():
    """overlap=True and momentum_double_buffer=True (each, and both) give the plain step's
    parameters and momenta bit for bit, through accumulation, a NaN skip, clipping and a discarded
    backward."""
    n = 2
    res = run_ranks(_overlap_vs_plain, n, timeout=600)
    for key, r0 in res[0].items():
        assert r0["buckets_True"] > 2 and r0["batches_True"] > 1, key  # several buckets and batches
        for r in range(n):
            plain = res[r][key][False, False]
            for variant in ((True, False), (False, True), (True, True)):
                other = res[r][key][variant]
                assert torch.equal(plain[0], other[0]), (key, variant, r)
                assert torch.equal(plain[2], other[2]), (key, variant, r)  # momenta too
                assert other[1] == 1, (key, variant, r)  # the NaN step skipped on every rank
            assert torch.equal(plain[0], r0[False, False][0]), (key, r)  # replicas identical
            assert plain[1] == 1, (key, r)


def _launch_condition_run(rank, n):
    """A training loop that owns the accumulation boundary: set_launch_condition instead of no_sync()."""
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = Net()
        opt = lioncub_ds.LionCub(model.parameters(), lr=1e-2, comm="1bit", bucket_size_mb=0.004,
                                 comm_bucket_mb=0.0002, overlap=overlap)
        boundary = {"now": False}
        opt.set_launch_condition(lambda: boundary["now"])
        gen = torch.Generator().manual_seed(70 + rank)
        for step in range(4):
            for k in range(3):
                boundary["now"] = k == 2
                model(torch.randint(0, 30, (5, 3), generator=gen), True).backward()
            opt.step()
            opt.zero_grad()
        out[overlap] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                        opt.comm_stats()["overlap"], len(opt.plan.batches))
    return out


def test_launch_condition_lets_only_the_boundary_backward_launch():
    res = run_ranks(_launch_condition_run, 2, timeout=300)
    for r in res:
        assert torch.equal(r[False][0], r[True][0]) and torch.equal(r[True][0], res[0][True][0])
        stats, batches = r[True][1], r[True][2]
        # steps 2..4 launched every batch from the boundary backward, and nothing was voted on twice
        assert stats == {"batches_launched_in_backward": 3 * batches, "revotes": 0}, stats
        assert r[False][1] == {"batches_launched_in_backward": 0, "revotes": 0}


@pytest.mark.unit
def test_launch_condition_must_be_callable():
    opt = lioncub_ds.LionCub([torch.nn.Parameter(torch.zeros(3))], overlap=True)
    with pytest.raises(TypeError, match="callable"):
        opt.set_launch_condition(True)
    opt.set_launch_condition(None)


# ----------------------------------------------------------------------------- carried flags
def _flag_collectives(rank, n):
    from lioncub_ds.flags import flag_bytes

    out = {}
    for comm in ("1bit", "allgather", "pbit", "int8", "bbit"):
        for mode in ("step", "overlap", "prepare_step"):
            torch.manual_seed(0)
            model = Net()
            opt = lioncub_ds.LionCub(model.parameters(), lr=1e-2, comm=comm,
                                     quant="l1" if comm in ("int8", "bbit") else "sign",
                                     bucket_size_mb=0.004, comm_bucket_mb=0.0002, overlap=mode == "overlap")
            gen = torch.Generator().manual_seed(7 + rank)
            for step in range(3):
                opt.zero_grad()
                loss = model(torch.randint(0, 30, (5, 3), generator=gen), True)
                if step == 1 and rank == 0:
                    loss = loss * float("nan")  # skipped on every rank, agreed through the (carried) flags
                loss.backward()
                if mode == "prepare_step":
                    opt.prepare_step()  # launched before step(): the flags need their own all-reduce
                opt.step()
            last = opt.comm_stats()["last_step"]
            out[comm, mode] = {"by_collective": dict(last["by_collective"]), "control": last["by_algorithm"]["control"],
                               "want_carried": flag_bytes(len(opt.plan.buckets), n, True),
                               "want_reduced": flag_bytes(len(opt.plan.buckets), n, False),
                               "skipped": opt.comm_stats()["skipped_steps"],
                               "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    return out


def test_flags_ride_in_the_last_batch_of_gather_like_algorithms():
    """1bit, bbit and allgather launched from step(): no flag all-reduce (the flags ride in the last
    batch's first phase, counted as control bytes); pbit, int8, overlap=True and prepare_step()
    keep the all-reduce. Either way a NaN on one rank skips the step everywhere, and the
    parameters do not depend on how the flags travelled."""
    n = 2
    res = run_ranks(_flag_collectives, n, timeout=600)
    for (comm, mode), r in res[0].items():
        carried = comm in ("1bit", "allgather", "bbit") and mode == "step"
        assert ("all_reduce" in r["by_collective"]) == (not carried or comm in ("pbit", "int8")), (comm, mode, r)
        assert r["control"] == (r["want_carried"] if carried else r["want_reduced"]), (comm, mode, r)
        assert r["skipped"] == 1, (comm, mode)
        for rank in range(n):
            assert torch.equal(res[rank][comm, mode]["params"], r["params"]), (comm, mode, rank)
        assert torch.equal(res[0][comm, "step"]["params"], r["params"]), (comm, mode)


# ----------------------------------------------------------------------------- a rank that cannot vote
def _unusable_gradient_on_one_rank(rank, n):
    from lioncub_ds.errors import StepInputError

    out = {}
    for comm in ("allgather", "1bit", "pbit", "int8", "bbit"):
        torch.manual_seed(0)
        model = Net()
        opt = lioncub_ds.LionCub(model.parameters(), lr=1e-2, comm=comm,
                                 quant="l1" if comm in ("int8", "bbit") else "sign", bucket_size_mb=0.004)
        gen = torch.Generator().manual_seed(90 + rank)
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        if rank == 1:  # this rank's votes cannot be computed: it sends the algorithm's well-formed zeros
            model.emb.weight.grad = model.emb.weight.grad.to_sparse()
        try:
            opt.step()
            error = None
        except StepInputError as exc:
            error = str(exc)
        unchanged = torch.equal(before, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        for p in model.parameters():  # the collectives stayed matched: the next step runs
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        out[comm] = {"error": error, "unchanged": unchanged,
                     "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    return out


def test_a_rank_that_cannot_vote_sends_zeros_in_every_algorithm():
    """A sparse gradient on one rank: that rank sends its algorithm's zero votes (VoteAlgorithm.
    no_votes), every rank raises StepInputError with nothing changed, and the next step runs."""
    n = 2
    res = run_ranks(_unusable_gradient_on_one_rank, n, timeout=600)
    for comm, r0 in res[0].items():
        for rank in range(n):
            r = res[rank][comm]
            assert r["error"] is not None and "unusable input" in r["error"], (comm, rank, r["error"])
            assert r["unchanged"], (comm, rank)
            assert torch.equal(r["params"], r0["params"]), (comm, rank)
    assert "sparse" in res[1]["1bit"]["error"]  # the rank with the sparse gradient names it
