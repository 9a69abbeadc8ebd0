"""Node voters under Megatron: LionCub inside Megatron's distributed optimizer, voting across its instances.

4 gloo ranks on CPU (megatron's CUDA calls redirected by the test shim), TP = 1, a tiny GPTModel:

* K = 2 instances of L = 2 ranks: after every step the parameters equal a brute-force oracle
  (2 voters, each with the mean gradient of its instance's 2 ranks and its own momentum, the
  literal Lion vote with tie_break="zero"), and are bit-identical on all 4 ranks;
* no floating-point tensor larger than a flag crosses instances (the NCCL-contract log of
  every collective, with its group and dtype), and comm_stats counts the votes as inter_node;
* save + resume at the same layout is exact; another layout reshards: K = 2 x 2 -> 1 x 4 and
  4 x 1, and (a 2-rank launch) DP = 2 as 2 x 1 and 1 x 2: every momentum shard equals the
  oracle's resharded momenta (the same K: each instance's own; another K: their mean), the bf16
  run's fp32 main shards come back exactly, then steps against the oracle; with reshard="error"
  it is refused on every rank, naming both layouts;
* K = 1 (one instance of 4): Lion on the DP-mean gradient, no votes (0 inter-node bytes);
* the hash tie rule on the index inside the model parameter, momentum_double_buffer,
  drift_check_every (a drifted shard is found by its shard peer and every rank raises or
  re-synchronizes together), momentum_sync over the voters of a node, and the drift-scheduled
  momentum_sync (the signal, the syncs), against the oracle;
* the flag errors (voters='node' without the distributed optimizer, a node_size that is not DP/K).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
import warnings

import pytest
import torch

from dist_helpers import run_ranks
from lioncub_ds import LionCubConfigError

pytestmark = pytest.mark.integration

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")

VOCAB, SEQ, MBS, HIDDEN = 64, 16, 4, 16
DRIFT_SYNC = {"schedule": "drift", "threshold": 0.01, "min_every": 2}
LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.99)
FLOAT = ("torch.float32", "torch.bfloat16", "torch.float16", "torch.float64")


# ----------------------------------------------------------------------------- rank side
def _init(k, tp=1, pp=1, ep=1, vp=None, etp=None):
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, num_distributed_optimizer_instances=k)


class _Chunks(list):
    """A virtual pipeline's model chunks (each in Megatron's DDP), which the oracle reads as one
    model: parameters named "chunk{i}.<name>", as the optimizer names them."""

    def named_parameters(self):
        for i, chunk in enumerate(self):
            for name, p in chunk.named_parameters():
                yield f"chunk{i}.{name}", p

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def zero_grad_buffer(self):
        for chunk in self:
            chunk.zero_grad_buffer()

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for chunk in self:
                stack.enter_context(chunk.no_sync())
            yield

    @property
    def bucket_groups(self):
        return [b for chunk in self for b in chunk.bucket_groups]


def _chunks(ddp) -> list:
    return list(ddp) if isinstance(ddp, _Chunks) else [ddp]


def _build(k, seed=1234, dtype=torch.float32, overlap=False, experts=None, param_gather=False):
    """A tiny GPTModel in Megatron's DDP with the distributed optimizer's K instances, at the
    tensor / pipeline / expert parallel sizes of the current parallel state (the pipeline's two
    stages untie the embeddings: each stage's gradient is then its own). With a virtual pipeline
    (V chunks per pipeline rank): a :class:`_Chunks` of V such models, one layer each."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    vp = ps.get_virtual_pipeline_model_parallel_world_size()
    moe = dict(num_moe_experts=experts, moe_router_topk=1, moe_router_pre_softmax=True, add_bias_linear=False,
               moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
               expert_model_parallel_size=ps.get_expert_model_parallel_world_size()) if experts else {}
    cfg = TransformerConfig(num_layers=pp * (vp or 1), hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=2 * HIDDEN,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vp, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
                            fp16=dtype == torch.float16, **moe)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=k,
        grad_reduce_in_fp32=dtype != torch.float32, overlap_grad_reduce=overlap, bucket_size=2000 if overlap else None,
        overlap_param_gather=param_gather)
    chunks = []
    for stage in range(vp or 1):
        where = dict(ignore_virtual=False, vp_stage=stage) if vp else {}
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts),
                         vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(**where),
                         post_process=ps.is_pipeline_last_stage(**where), share_embeddings_and_output_weights=pp == 1,
                         **({"vp_stage": stage} if vp else {}))
        if dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module
            model = Float16Module(cfg, model)
        chunks.append(DistributedDataParallel(cfg, ddp_cfg, model))
    cfg.finalize_model_grads_func = finalize_model_grads
    return cfg, (_Chunks(chunks) if vp else chunks[0])


def _opt_config(**kw):
    from megatron.core.optimizer import OptimizerConfig
    base = dict(optimizer="adam", lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], clip_grad=0.0,
                use_distributed_optimizer=True)
    base.update(kw)
    return OptimizerConfig(**base)


def _batch(step):
    """Different data on every data-parallel rank (so the instance means differ)."""
    from megatron.core import parallel_state as ps
    g = torch.Generator().manual_seed(100 * ps.get_data_parallel_rank() + step)
    x0 = torch.randint(0, VOCAB, (MBS, 1), generator=g)
    seq = [x0]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    return torch.cat(seq, dim=1)


def _fwd_bwd(ddp, tokens):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        x = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, -1)
        out = model(x[:, :-1], pos, None, labels=x[:, 1:])
        return out, lambda output: (output.float().mean(), {"loss": output.float().mean().detach()})

    chunks = _chunks(ddp)
    # the interleaved schedule (a virtual pipeline) runs whole rounds of the pipeline's microbatches
    micro = 1 if len(chunks) == 1 else _pp_size()
    data = [iter([tokens] * micro) for _ in chunks]
    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0],
                                      model=chunks, num_microbatches=micro, seq_length=SEQ, micro_batch_size=MBS)
    return float(res[0]["loss"]) if res else 0.0  # (the loss is on the last pipeline stage)


def _pp_size():
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_world_size()


def _forward(ddp):
    """A forward pass without gradients: with --overlap-param-gather its pre-hooks wait for the
    parameters' all-gather (Megatron's own path), as the next training step's forward would.
    Model chunks of a pipeline (whose forward needs the previous stage's activations): Megatron's
    forced parameter sync instead (what Megatron-LM runs before evaluation and checkpoints), which
    waits for an all-gather in flight (the first chunk's, started by the optimizer step)."""
    if isinstance(ddp, _Chunks):
        for chunk in ddp:
            chunk.start_param_sync(force_sync=True)
        return
    with torch.no_grad():
        x = _batch(0)
        ddp(x[:, :-1], torch.arange(SEQ).unsqueeze(0).expand(MBS, -1), None)


def _local_grads(cfg, ddp, step):
    """This rank's own full gradient (Megatron's grad sync off for this pass: finalize not called)."""
    fin = cfg.finalize_model_grads_func
    cfg.finalize_model_grads_func = None
    try:
        ddp.zero_grad_buffer()
        with ddp.no_sync():  # with overlap_grad_reduce the backward hooks would start the reduce-scatter
            _fwd_bwd(ddp, _batch(step))
        return {n: p.main_grad.detach().clone() for n, p in ddp.named_parameters()}
    finally:
        cfg.finalize_model_grads_func = fin
        ddp.zero_grad_buffer()


def _train_step(ddp, opt, step):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = _fwd_bwd(ddp, _batch(step))
    ok, _, _ = opt.step()
    assert ok
    return loss


def _fingerprints(ddp):
    return {n: hashlib.sha1(p.detach().float().contiguous().view(-1).numpy().tobytes()).hexdigest()
            for n, p in ddp.named_parameters()}


def _hyper(config, ddp):
    """{param name: (lr, weight decay)} from Megatron's own parameter groups (no decay on biases / norms)."""
    from megatron.core.optimizer import _get_param_groups
    from lioncub_ds.megatron import _compat
    names = {p: n for n, p in ddp.named_parameters()}
    out = {}
    for g in _get_param_groups(_chunks(ddp), config, _compat.standard_overrides(config)):
        for p in g["params"]:
            out[names[p]] = (LR * g.get("lr_mult", 1.0), WD * g.get("wd_mult", 1.0))
    return out


def _oracle_steps(cfg, ddp, opt, k, momenta, first, last, hyper, tie="zero", masters=None, sync=(), scale=None,
                  settle=None, drift=None):
    """Train steps first..last; before each, compute the expected parameters by brute force: k
    voters, voter j with the mean gradient of instance j (the instance's ranks holding the
    parameter, over the instance's data-parallel size L; expert parameters: its part of the expert
    data-parallel group) and its momentum ``momenta[name][j]`` (updated in place), the literal Lion
    vote (ties: "zero", or "hash" on the element's index inside its parameter and the step).
    ``masters``: {name: fp32 master} for 16-bit parameters (updated); ``sync``: groups of voters
    whose momenta are averaged after every step (fp32); ``scale``: the loss scale (gradients are
    unscaled by it); ``settle``: called after each step, before the parameters are read;
    ``drift``: a :class:`_DriftOracle` (momentum_sync with schedule "drift", all voters, fp32)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from lioncub_ds.kernels import reference
    dp_group = {False: ps.get_data_parallel_group(with_context_parallel=True),
                True: ps.get_expert_data_parallel_group()}
    size = dist.get_world_size(dp_group[False]) // k
    mismatched, moved, elements, fps = 0, 0, 0, []
    oracle = drift
    for s in range(first, last + 1):
        local = _local_grads(cfg, ddp, s)
        expected, cast = {}, {}
        for n, p in ddp.named_parameters():
            group = dp_group[not getattr(p, "allreduce", True)]  # Megatron marks expert parameters allreduce=False
            every = [torch.zeros_like(local[n]) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, local[n], group=group)
            part = len(every) // k
            lr, wd = hyper[n]
            cs, gbar = [], []
            for j in range(k):  # instance j: consecutive data-parallel ranks
                acc = every[j * part].reshape(-1).float().clone()
                for r in range(1, part):
                    acc.add_(every[j * part + r].reshape(-1).float())
                acc.div_(size)
                if scale is not None:
                    acc.mul_(1.0 / scale)
                gbar.append(acc)
                cs.append(reference.lion_direction(momenta[n][j], gbar[j], BETAS[0]))
            votes = torch.sign(torch.stack(cs))
            plus, cnt = (votes > 0).sum(0), (votes != 0).sum(0)
            delta = torch.sign(plus * 2 - cnt).float()
            if tie == "hash":
                ties = (plus * 2 == cnt) & (cnt > 0)
                delta = torch.where(ties, reference.tie_hash_sign(s + 1, torch.arange(delta.numel())).float(), delta)
            e = (masters[n] if masters is not None else p.detach().reshape(-1)).clone()
            e.mul_(1.0 - lr * wd)
            e.add_(delta.mul(-lr))
            expected[n] = (e, int((delta != 0).sum()))
            cast[n] = (votes, delta)
            for j in range(k):
                reference.momentum_update(momenta[n][j], gbar[j], BETAS[1])
            for voters in sync:  # momentum_sync: the voters' mean, summed in fp32
                _average_voters(momenta[n], voters)
        if oracle is not None:
            oracle.after_update(s + 1, cast, momenta, k)
        _train_step(ddp, opt, s)
        if oracle is not None:
            oracle.read(opt)
        if settle is not None:
            settle(ddp)
        for n, p in ddp.named_parameters():
            e, mv = expected[n]
            if masters is not None:
                masters[n] = e
            mismatched += int((p.detach().reshape(-1) != e.to(p.dtype)).sum())
            moved += mv
            elements += e.numel()
        fps.append(_fingerprints(ddp))
    return mismatched, moved, elements, fps


class _DriftOracle:
    """momentum_sync schedule="drift" with node voters, by brute force: each rank's signal is its
    voter's share of votes that disagree with the agreed Δ on this rank's shard (where both are
    nonzero), in the fixed-point units of lioncub_ds.momentum_sync, summed over the data-parallel
    ranks (the oracle sums them with an all-reduce of its own); the same DriftTrigger rule decides
    the syncs, which average the K voters' momenta. ``rows``: per step, what LionCub's
    comm_stats()["momentum_sync"] should say after it (the step whose signal was read, that summed
    signal, syncs so far, the last sync's step); ``seen``: what it said."""

    def __init__(self, sync, opt):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from dist_helpers import DriftDecisions
        self.group = ps.get_data_parallel_group(with_context_parallel=True)
        self.decisions = DriftDecisions(sync, dist.get_world_size(self.group))
        self.rows = self.decisions.rows
        self.pieces = [(name, start, shard.numel()) for _, name, start, shard in _shards(opt)]
        self.voter = _voter(_shards(opt)[0][0])
        self.seen = []

    def after_update(self, step, cast, momenta, k):
        """Step ``step`` (1-based) was voted (``cast``: {name: (votes [K, n], Δ)}) and the momenta updated."""
        import torch.distributed as dist
        from dist_helpers import disagreement
        differ = both = 0
        for name, start, length in self.pieces:
            votes, delta = cast[name]
            a, b = disagreement(votes[self.voter][start:start + length], delta[start:start + length])
            differ, both = differ + a, both + b
        summed = torch.tensor([self.decisions.units(differ, both)], dtype=torch.int64)
        dist.all_reduce(summed, group=self.group)
        if self.decisions.step(step, int(summed)):  # after this step's momentum update
            for per_voter in momenta.values():
                _average_voters(per_voter, range(k))

    def read(self, opt):
        from lioncub_ds.megatron import lioncub_optimizers
        st = lioncub_optimizers(opt)[0].comm_stats()["momentum_sync"]
        self.seen.append((st["signal_step"], None if st["signal"] is None else round(st["signal"] * self.decisions.unit),
                          st["syncs"], st["last_sync_step"]))


def _average_voters(per_voter, voters):
    """One parameter's momenta of ``voters`` replaced by their mean, summed in fp32 (a momentum sync)."""
    voters = list(voters)
    acc = per_voter[voters[0]].clone()
    for j in voters[1:]:
        acc.add_(per_voter[j])
    acc.div_(len(voters))
    for j in voters:
        per_voter[j].copy_(acc)


def _shards(opt):
    """(LionCub, name, first element, shard parameter) of every shard this rank's LionCubs step."""
    out = []
    for dopt in opt.chained_optimizers:
        lc = dopt.optimizer
        for gi, g in enumerate(lc.param_groups):
            models = [*dopt.model_fp32_groups[gi], *dopt.model_float16_groups[gi]]
            for shard, model_param, name in zip(g["params"], models, g["param_names"]):
                out.append((lc, name, dopt._get_model_param_range_map(model_param)["param"].start, shard))
    return out


def _voter(lc):
    """This rank's voter: its instance (its place in the inter-instance vote group)."""
    import torch.distributed as dist
    return dist.get_rank(lc.vote_group) if dist.get_world_size(lc.vote_group) > 1 else 0


def _momentum_mismatches(opt, momenta):
    """Elements of this rank's momentum shards that differ from its voter's ``momenta[name]`` (bitwise)."""
    bad = 0
    for lc, name, start, shard in _shards(opt):
        want = momenta[name][_voter(lc)][start:start + shard.numel()]
        bad += int((lc.state[shard]["exp_avg"].reshape(-1).view(torch.int32) != want.view(torch.int32)).sum())
    return bad


def _oracle_run(k, steps, overlap=False, extra=None, dtype=torch.float32, experts=None, sync=(), scale=None,
                param_gather=False, with_step=False):
    """Train ``steps`` steps; before each, compute the expected parameters by brute force. With
    ``overlap`` Megatron's reduce-scatter of each bucket starts during backward (several buckets);
    ``extra``: more lioncub settings; ``scale``: fp16 with Megatron's constant loss scale;
    ``param_gather``: --overlap-param-gather (the all-gather waits for the next forward: a
    forward pass without gradients then runs before the parameters are read); ``with_step``:
    --overlap-param-gather-with-optimizer-step (a virtual pipeline's first chunk has its own
    optimizer, and its all-gather starts while the other chunks' optimizer steps)."""
    import torch.distributed as dist
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(k, overlap=overlap, dtype=dtype, experts=experts, param_gather=param_gather)
    half = {torch.bfloat16: dict(bf16=True, params_dtype=dtype), torch.float16: dict(
        fp16=True, params_dtype=dtype, loss_scale=scale)}.get(dtype, {})
    config = _opt_config(**half, overlap_param_gather=param_gather, overlap_param_gather_with_optimizer_step=with_step)
    settings = {"voters": "node", "comm": "1bit", "tie_break": "zero", **(extra or {})}
    opt = get_megatron_lioncub_optimizer(config, _chunks(ddp), lioncub=settings)
    if scale is not None:
        cfg.grad_scale_func = opt.scale_loss  # as Megatron-LM's training loop does
    momenta = {n: [torch.zeros(p.numel()) for _ in range(k)] for n, p in ddp.named_parameters()}
    masters = {n: p.detach().float().reshape(-1).clone() for n, p in ddp.named_parameters()} \
        if dtype != torch.float32 else None
    ms = settings.get("momentum_sync")
    drift = _DriftOracle(ms, opt) if isinstance(ms, dict) and ms.get("schedule") == "drift" else None
    mismatched, moved, elements, fps = _oracle_steps(cfg, ddp, opt, k, momenta, 0, steps - 1, _hyper(config, ddp),
                                                     tie=settings["tie_break"], masters=masters, sync=sync,
                                                     scale=scale, settle=_forward if param_gather else None,
                                                     drift=drift)
    lc = lioncub_optimizers(opt)[0]
    # Lion's step is blind to a common scale of g and m, the momenta are not: this rank's momentum
    # shard must be its instance's oracle momentum over the same elements (instance-mean scaling)
    momentum_mismatched = _momentum_mismatches(opt, momenta)
    dispatched = None
    if with_step:  # one step more: when step() returns, which chunks' all-gathers has it started?
        _train_step(ddp, opt, steps)
        dispatched = [all(b.param_gather_dispatched for b in chunk.bucket_groups) for chunk in _chunks(ddp)]
        _forward(ddp)
    return {"mismatched": mismatched, "moved": moved, "elements": elements, "fps": fps,
            "momentum_mismatched": momentum_mismatched,
            "kinds": [o.optimizer.megatron_kind for o in opt.chained_optimizers],
            # which model chunks each optimizer steps ("chunk{i}." of the parameter names; "" = the only one)
            "chunks_by_kind": {o.optimizer.megatron_kind: sorted({(n or "").partition(".")[0] if len(_chunks(ddp)) > 1
                                                                  else "" for g in o.optimizer.param_groups
                                                                  for n in g["param_names"]})
                               for o in opt.chained_optimizers},
            "dispatched_in_step": dispatched,
            "drift": None if drift is None else {"rows": drift.rows, "seen": drift.seen},
            "starts_with_step": [bool(getattr(c, "overlap_param_gather_with_optimizer_step", False))
                                 for c in _chunks(ddp)],
            "buckets": len(ddp.bucket_groups),
            "scopes": lc.comm_stats()["cumulative"]["by_scope"],
            "vote_group": tuple(dist.get_process_group_ranks(lc.vote_group)),
            "wrappers": [type(o).__name__ for o in opt.chained_optimizers],
            "shard_numel": sum(p.numel() for g in lc.param_groups for p in g["params"]),
            "model_numel": sum(p.numel() for p in ddp.parameters()),
            "state_bytes": lc.state_bytes()}


# ----------------------------------------------------------------------------- resharding
RESHARD_STEPS = 3


def _save(ddp, opt, ckpt):
    """Megatron's dist-checkpointing save, with LionCub's per-rank files written first."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    _train_then_write_files(ddp, opt, 0, ckpt)
    dist_checkpointing.save(_ckpt_state(ddp, opt), ckpt)
    dist.barrier()


def _load(k, ckpt, reshard="average", dtype=torch.float32):
    """A fresh model and optimizer (another init) under K instances, loaded from ``ckpt``: Megatron's
    state, then the per-rank files (resharded when the layout differs)."""
    from megatron.core import dist_checkpointing
    from lioncub_ds.megatron import after_checkpoint_load, get_megatron_lioncub_optimizer
    bf16 = dict(bf16=True, params_dtype=torch.bfloat16) if dtype == torch.bfloat16 else {}
    cfg, ddp = _build(k, seed=999, dtype=dtype)
    config = _opt_config(**bf16)
    opt = get_megatron_lioncub_optimizer(config, [ddp], lioncub={"voters": "node", "comm": "1bit",
                                                                  "tie_break": "zero"})
    state = dist_checkpointing.load(_ckpt_state(ddp, opt, is_loading=True), ckpt)
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    after_checkpoint_load(opt, ckpt, mode="per_rank", reshard=reshard)
    return cfg, ddp, config, opt


def _reshard_source(k, tmpdir):
    """K instances (fp32): RESHARD_STEPS steps against the oracle, then saved. Returns the oracle's
    momenta per instance (the same on every rank) and the checkpoint."""
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer
    ckpt = os.path.join(tmpdir, f"reshard-k{k}")
    cfg, ddp = _build(k)
    config = _opt_config()
    opt = get_megatron_lioncub_optimizer(config, [ddp], lioncub={"voters": "node", "comm": "1bit",
                                                                  "tie_break": "zero"})
    momenta = {n: [torch.zeros(p.numel()) for _ in range(k)] for n, p in ddp.named_parameters()}
    mismatched, _, _, _ = _oracle_steps(cfg, ddp, opt, k, momenta, 0, RESHARD_STEPS - 1, _hyper(config, ddp))
    _save(ddp, opt, ckpt)
    return {"ckpt": ckpt, "momenta": momenta, "mismatched": mismatched, "fp": _fingerprints(ddp)}


def _resharded_momenta(momenta, k):
    """The definition: K unchanged keeps every instance's momentum; otherwise each new instance
    starts from the mean of the old ones (fp32, summed from zero in instance order, divided)."""
    old = len(next(iter(momenta.values())))
    if old == k:
        return {n: [m.clone() for m in ms] for n, ms in momenta.items()}
    out = {}
    for n, ms in momenta.items():
        acc = torch.zeros_like(ms[0])
        for m in ms:
            acc += m
        out[n] = [acc / old for _ in range(k)]
    return out


def _reshard_target(k, source, steps):
    """Load ``source``'s checkpoint under K instances: this rank's momentum shards must be the
    resharded oracle momenta bit for bit, the model Megatron's; then ``steps`` steps against the
    oracle from there (only where the instances' reduce-scatter sums two ranks or fewer: a sum of
    more has gloo's order, not the oracle's)."""
    cfg, ddp, config, opt = _load(k, source["ckpt"])
    momenta = _resharded_momenta(source["momenta"], k)
    out = {"momentum_mismatched": _momentum_mismatches(opt, momenta), "loaded_fp": _fingerprints(ddp),
           "step": opt.chained_optimizers[0].optimizer.step_count}
    if steps:
        out["mismatched"], out["moved"], _, out["fps"] = _oracle_steps(
            cfg, ddp, opt, k, momenta, RESHARD_STEPS, RESHARD_STEPS + steps - 1, _hyper(config, ddp))
    return out


def _full_masters(opt):
    """{name: the whole fp32 master} assembled from every rank's main shards (the test's own
    gathering over the world, by Megatron's shard ranges)."""
    import torch.distributed as dist
    mine = [(name, start, shard.detach().clone()) for _, name, start, shard in _shards(opt)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for part in every:
        for name, start, values in part:
            out.setdefault(name, {})[start] = values.reshape(-1)
    return {name: torch.cat([pieces[s] for s in sorted(pieces)]) for name, pieces in out.items()}


def _master_mismatches(opt, masters):
    bad = 0
    for _, name, start, shard in _shards(opt):
        want = masters[name][start:start + shard.numel()]
        bad += int((shard.detach().reshape(-1).view(torch.int32) != want.view(torch.int32)).sum())
    return bad


def _dp2_scenario(rank, world, source):
    """Another data-parallel size: 2 ranks load the 4-rank K = 2 checkpoint, as K = 2 instances of
    one rank (the same 2 voters: each keeps its momentum) and as K = 1 instance of 2 (the mean)."""
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    out = {}
    for k in (2, 1):
        _init(k)
        out[k] = _reshard_target(k, source, steps=2)
    return out


def _k1_run(steps):
    """K = 1: every step equals Lion on this rank's shard of the DP-mean gradient (one voter, no vote)."""
    import torch.distributed as dist
    from lioncub_ds.kernels import reference
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(1)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"voters": "node"})
    lc = lioncub_optimizers(opt)[0]
    names = [n for n, _ in ddp.named_parameters()]
    out = {"mismatched": 0, "moved": 0, "grad_err": 0.0, "fps": []}
    momenta = {}
    for s in range(steps):
        local = _local_grads(cfg, ddp, s)
        mean = {}
        for n in names:  # the DP mean, for the gradient LionCub must see (up to the collective's sum order)
            t = local[n].clone()
            dist.all_reduce(t)
            mean[n] = t / dist.get_world_size()
        before = {id(p): p.detach().clone() for g in lc.param_groups for p in g["params"]}
        _train_step(ddp, opt, s)
        dopt = opt.chained_optimizers[0]
        for gi, g in enumerate(lc.param_groups):
            models = [*dopt.model_fp32_groups[gi], *dopt.model_float16_groups[gi]]
            for p, model_param, name in zip(g["params"], models, g["param_names"]):
                grad = p.grad.detach().reshape(-1)  # what LionCub stepped with (Megatron's reduce-scattered shard)
                m = momenta.setdefault(id(p), torch.zeros(p.numel()))
                c = reference.lion_direction(m, grad, BETAS[0])
                e = before[id(p)].reshape(-1).clone()
                e.mul_(1.0 - g["lr"] * g["weight_decay"])
                e.add_(torch.sign(c).mul(-g["lr"]))
                out["mismatched"] += int((p.detach().reshape(-1) != e).sum())
                out["moved"] += int((c != 0).sum())
                reference.momentum_update(m, grad, BETAS[1])
                # ... and that gradient is this shard of the DP-mean gradient (up to the sum order of
                # the reduce-scatter over 4 ranks)
                rng = dopt._get_model_param_range_map(model_param)["param"]
                want = mean[name].reshape(-1)[rng.start:rng.end]
                out["grad_err"] = max(out["grad_err"], float((grad - want).abs().max() / want.abs().max()))
        out["fps"].append(_fingerprints(ddp))
    out["scopes"] = lc.comm_stats()["cumulative"]["by_scope"]
    out["vote_size"] = dist.get_world_size(lc.vote_group)
    return out


def _contract_run(k, steps, overlap=False):
    """A plain training run; returns the NCCL-contract log entries of the steps."""
    from lioncub_ds.testing import nccl_contract
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer
    cfg, ddp = _build(k, overlap=overlap)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"voters": "node", "comm": "1bit"})
    start = len(nccl_contract.log())
    losses = [_train_step(ddp, opt, s) for s in range(steps)]
    return {"log": [tuple(e) for e in nccl_contract.log()[start:]], "losses": losses}


def _train_then_write_files(ddp, opt, steps, ckpt):
    """``steps`` training steps, then every rank writes its LionCub per-rank files into ``ckpt``
    (as before Megatron's save)."""
    import torch.distributed as dist
    from lioncub_ds.megatron import before_checkpoint_save
    for s in range(steps):
        _train_step(ddp, opt, s)
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    before_checkpoint_save(opt, "per_rank", checkpoint_dir=ckpt)


def _ckpt_state(ddp, opt, is_loading=False):
    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _resume_run(k, tmpdir, dtype=torch.float32):
    """3 steps, save (Megatron's dist-checkpointing + per-rank LionCub files, LionCub's before
    Megatron's as Megatron-LM's patched save does), 2 more; rebuild, load, the same 2 steps.
    With bf16 the fp32 main shards come back from the per-rank files (Megatron's checkpoint
    holds the bf16 weights only)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from lioncub_ds.megatron import (after_checkpoint_load, before_checkpoint_save, get_megatron_lioncub_optimizer,
                                     lioncub_optimizers)
    ckpt = os.path.join(tmpdir, f"ckpt-{str(dtype)[6:]}")
    bf16 = dict(bf16=True, params_dtype=torch.bfloat16) if dtype == torch.bfloat16 else {}
    cfg, ddp = _build(k, dtype=dtype)
    opt = get_megatron_lioncub_optimizer(_opt_config(**bf16), [ddp], lioncub={"voters": "node"})
    main_dtype = str(lioncub_optimizers(opt)[0].param_groups[0]["params"][0].dtype)
    try:
        before_checkpoint_save(opt, "sync")
        sync_error = None
    except ValueError as exc:
        sync_error = str(exc)
    _train_then_write_files(ddp, opt, 3, ckpt)
    dist_checkpointing.save(_ckpt_state(ddp, opt), ckpt)
    # Megatron-LM's legacy format (--ckpt-format torch) also asks for the parameter state file
    legacy = os.path.join(ckpt, f"distrib_optim_{dist.get_rank()}.pt")
    opt.save_parameter_state(legacy)
    dist.barrier()
    masters = _full_masters(opt)  # the fp32 main shards as saved (a resharded load must give them back)
    for s in range(3, 5):
        _train_step(ddp, opt, s)
    want = _fingerprints(ddp)
    cfg2, ddp2 = _build(k, seed=999, dtype=dtype)  # another init: everything must come from the checkpoint
    opt2 = get_megatron_lioncub_optimizer(_opt_config(**bf16), [ddp2], lioncub={"voters": "node"})
    state = dist_checkpointing.load(_ckpt_state(ddp2, opt2, is_loading=True), ckpt)
    ddp2.module.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    opt2.load_parameter_state(legacy)
    after_checkpoint_load(opt2, ckpt, mode="per_rank")
    for s in range(3, 5):
        _train_step(ddp2, opt2, s)
    return {"resume_equal": _fingerprints(ddp2) == want, "ckpt": ckpt, "fp": want, "main_dtype": main_dtype,
            "sync_error": sync_error, "masters": masters,
            "files": sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)}


def _nan_run(k, dtype=torch.float32, bad=float("nan"), scale=None):
    """One rank (3) has a NaN (or ``bad``) in one gradient element at step 1: the element lands in
    one rank's shard only (its instance's reduce-scatter), yet every rank of the data-parallel group
    must skip that step (LionCub's flags: over the shard peers by the vote, over the instance by the
    agreement; with fp16's loss ``scale``: Megatron's found-inf, agreed once over the world), and
    train on together afterwards."""
    import torch.distributed as dist
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(k, dtype=dtype)
    half = dict(fp16=True, params_dtype=dtype, loss_scale=scale) if dtype == torch.float16 else {}
    opt = get_megatron_lioncub_optimizer(_opt_config(**half), [ddp], lioncub={"voters": "node"})
    if scale is not None:
        cfg.grad_scale_func = opt.scale_loss  # as Megatron-LM's training loop does
    lc = lioncub_optimizers(opt)[0]
    weight = next(p for n, p in ddp.named_parameters() if n.endswith("decoder.layers.0.mlp.linear_fc1.weight"))
    poison = {"on": False}

    def hook(grad):
        if poison["on"] and dist.get_rank() == 3:
            grad = grad.clone()
            grad.view(-1)[7] = bad
        return grad

    weight.register_hook(hook)
    _train_step(ddp, opt, 0)
    before = _fingerprints(ddp)
    poison["on"] = True
    ddp.zero_grad_buffer()
    opt.zero_grad()
    _fwd_bwd(ddp, _batch(1))
    ok, _, _ = opt.step()
    poison["on"] = False
    after_nan = _fingerprints(ddp)
    _train_step(ddp, opt, 2)
    return {"ok": ok, "unchanged": after_nan == before, "skipped": lc.comm_stats()["skipped_steps"],
            "trained_after": _fingerprints(ddp) != after_nan, "fp": _fingerprints(ddp)}


def _drift_run(action):
    """drift_check_every=1: rank 2's shard is moved (+1 on one element) before step 1; the check
    after that step finds it (its shard peer, rank 0, holds another value), and every rank of the
    data-parallel group raises ReplicaDriftError together, or the shards are re-synchronized from
    the first instance and the replicas are identical again."""
    import torch.distributed as dist
    from lioncub_ds import ReplicaDriftError
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(2)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"voters": "node", "drift_check_every": 1,
                                                                        "drift_action": action})
    lc = lioncub_optimizers(opt)[0]
    _train_step(ddp, opt, 0)
    if dist.get_rank() == 2:
        with torch.no_grad():
            lc.param_groups[0]["params"][0].view(-1)[0] += 1.0
    try:
        _train_step(ddp, opt, 1)
        error = None
    except ReplicaDriftError as exc:
        error = str(exc)
    out = {"error": error}
    if action == "resync":
        _train_step(ddp, opt, 2)
        out["fp"] = _fingerprints(ddp)
    return out


def _errors():
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer
    out = {}
    cfg, ddp = _build(2)
    for name, config, lioncub in (("no_dist_opt", _opt_config(use_distributed_optimizer=False), {"voters": "node"}),
                                  ("node_size", _opt_config(), {"voters": "node", "node_size": 4}),
                                  ("one_chunk_with_step", _opt_config(overlap_param_gather=True,
                                                                      overlap_param_gather_with_optimizer_step=True),
                                   {"voters": "node"})):
        try:
            get_megatron_lioncub_optimizer(config, [ddp], lioncub=lioncub)
        except (LionCubConfigError, ValueError) as exc:
            out[name] = str(exc)
    from lioncub_ds.megatron.ddp import instance_votes_enabled
    # the errors came before any change
    out["untouched"] = not instance_votes_enabled(ddp) and not ddp.overlap_param_gather_with_optimizer_step
    # a failure while Megatron's distributed optimizer is built (after the all-reduce across the
    # instances was switched off): switched back on
    from lioncub_ds.megatron import optimizer as mopt
    real = mopt._distributed_optimizer

    def failing(*a, **k):
        raise RuntimeError("a build failure (test)")

    mopt._distributed_optimizer = failing
    try:
        get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"voters": "node"})
    except RuntimeError as exc:
        out["build_error"] = str(exc)
    finally:
        mopt._distributed_optimizer = real
    out["restored_after_build_error"] = not instance_votes_enabled(ddp)
    return out


def _scenario(rank, world, tmpdir):
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from lioncub_ds.checkpoint import CheckpointError
    from lioncub_ds.megatron import after_checkpoint_load, get_megatron_lioncub_optimizer
    out = {"rank": rank}
    _init(2)
    out["oracle"] = _oracle_run(2, steps=3)
    out["oracle_overlap"] = _oracle_run(2, steps=2, overlap=True)
    # the hash tie rule on the element's index inside its parameter (not inside this rank's shard),
    # with momentum_double_buffer; a drift check every step (it finds nothing to report)
    out["oracle_hash_double_buffer"] = _oracle_run(2, steps=3, extra={"tie_break": "hash",
                                                                      "momentum_double_buffer": True})
    out["oracle_drift_check"] = _oracle_run(2, steps=2, extra={"drift_check_every": 1})
    out["oracle_drift_sync"] = _oracle_run(2, steps=10, extra={"tie_break": "hash", "momentum_sync": DRIFT_SYNC})
    out["drift_raise"] = _drift_run("raise")
    out["drift_resync"] = _drift_run("resync")
    out["contract"] = _contract_run(2, steps=2)
    out["contract_overlap"] = _contract_run(2, steps=2, overlap=True)
    out["resume"] = _resume_run(2, tmpdir)
    out["resume_bf16"] = _resume_run(2, tmpdir, torch.bfloat16)
    out["errors"] = _errors()
    out["nan"] = _nan_run(2)
    out["reshard_source"] = _reshard_source(2, tmpdir)
    _init(1)
    out["k1"] = _k1_run(steps=2)
    # a checkpoint of the K = 2 layout under K = 1 (same DP size, same file names): resharded (the
    # mean of the 2 instances' momenta; the fp32 main shards exactly), or refused with "error"
    out["reshard_k1"] = _reshard_target(1, out["reshard_source"], steps=0)
    cfg, ddp, config, opt = _load(1, out["resume_bf16"]["ckpt"], dtype=torch.bfloat16)
    out["reshard_k1_bf16_masters"] = _master_mismatches(opt, out["resume_bf16"]["masters"])
    cfg, ddp = _build(1)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"voters": "node"})
    before = _fingerprints(ddp)
    try:
        after_checkpoint_load(opt, out["resume"]["ckpt"], mode="per_rank", reshard="error")
    except CheckpointError as exc:
        out["changed_layout"] = str(exc)
    out["changed_layout_untouched"] = _fingerprints(ddp) == before and \
        all("exp_avg" not in st for st in opt.chained_optimizers[0].optimizer.state.values())
    _init(4)  # K = 4 instances of one rank: the mean, then steps against the oracle
    out["reshard_k4"] = _reshard_target(4, out["reshard_source"], steps=2)
    # momentum_sync over the voters on one node: pairs of instances (group_size 2), every step
    out["oracle_sync_node"] = _oracle_run(4, steps=3, sync=[[0, 1], [2, 3]], extra={
        "momentum_sync": {"group": "node", "group_size": 2, "every": 1}})
    dist.barrier()
    return out


def _param_gather_scenario(rank, world):
    """--overlap-grad-reduce with --overlap-param-gather (K = 2 instances of 2 ranks), fp32 and bf16."""
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    _init(2)
    return {dtype: _oracle_run(2, steps=3, overlap=True, param_gather=True, dtype=dtype)
            for dtype in (torch.float32, torch.bfloat16)}


# ----------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def results():
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    tmpdir = tempfile.mkdtemp(prefix="lioncub-megatron-node-")
    try:
        four = run_ranks(_scenario, 4, tmpdir, timeout=600)
        source = {"ckpt": four[0]["reshard_source"]["ckpt"], "momenta": four[0]["reshard_source"]["momenta"]}
        two = run_ranks(_dp2_scenario, 2, source, timeout=600)
        for r, x in enumerate(two):
            four[r]["dp2"] = x
        yield four
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@needs_megatron
def test_two_instances_match_the_oracle_and_replicas_agree(results):
    for r in results:
        o = r["oracle"]
        assert o["wrappers"] == ["DistributedOptimizer"]
        assert o["mismatched"] == 0 and o["moved"] > 0, (r["rank"], o["mismatched"], o["moved"], o["elements"])
        assert o["momentum_mismatched"] == 0, (r["rank"], o["momentum_mismatched"])
        # the voters are the instances: rank r votes with the rank at its place in the other instance
        assert o["vote_group"] == ((0, 2) if r["rank"] % 2 == 0 else (1, 3)), o["vote_group"]
        # a shard of the parameters (the instance's 2 ranks hold every element once), and the
        # momentum of that shard only
        partner = results[r["rank"] ^ 1]["oracle"]
        assert o["shard_numel"] + partner["shard_numel"] == o["model_numel"], (o["shard_numel"], o["model_numel"])
        assert o["shard_numel"] < 0.6 * o["model_numel"]
        assert o["state_bytes"]["momentum"] == 4 * o["shard_numel"]
        # the votes crossed instances: counted as inter_node
        assert o["scopes"].get("inter_node", 0) > 0, o["scopes"]
        assert set(o["scopes"]) <= {"inter_node", "intra_node"}, o["scopes"]
        for step in range(len(o["fps"])):
            assert o["fps"][step] == results[0]["oracle"]["fps"][step], (r["rank"], step)


@needs_megatron
@pytest.mark.parametrize("case", ["oracle_hash_double_buffer", "oracle_drift_check", "oracle_sync_node"])
def test_hash_ties_double_buffer_drift_check_and_node_sync_match_the_oracle(results, case):
    """tie_break='hash' keys on the index inside the model parameter (the oracle's), whatever the
    shard; momentum_double_buffer; drift_check_every=1; momentum_sync over the voters of a node
    (K = 4 instances of one rank, pairs averaged every step)."""
    for r in results:
        o = r[case]
        assert o["mismatched"] == 0 and o["moved"] > 0 and o["momentum_mismatched"] == 0, (r["rank"], case, o)
        assert o["fps"] == results[0][case]["fps"], (r["rank"], case)


@needs_megatron
def test_drift_scheduled_momentum_sync_matches_the_oracle(results):
    """momentum_sync schedule="drift": a rank's signal is its voter's disagreeing votes on its
    shard, summed over the 4 data-parallel ranks; the oracle computes it from its own votes and
    decides with the same rule (hash ties: with 2 voters every disagreement is a tie, which
    Δ = 0 would leave out). After every step: the parameters, the momentum shards, and what
    comm_stats says (the signal read, syncs so far, the last sync's step); replicas identical."""
    for r in results:
        o = r["oracle_drift_sync"]
        assert o["mismatched"] == 0 and o["moved"] > 0 and o["momentum_mismatched"] == 0, (r["rank"], o)
        rows, seen = o["drift"]["rows"], o["drift"]["seen"]
        assert seen == rows, (r["rank"], seen, rows)
        assert 0 < rows[-1][2] < len(rows) - 1, rows  # the schedule both synced and waited
        assert o["fps"] == results[0]["oracle_drift_sync"]["fps"], r["rank"]


@needs_megatron
def test_drift_is_found_on_the_shard_peers_and_agreed_by_every_rank(results):
    for r in results:
        raised = r["drift_raise"]["error"]
        assert raised and "differ" in raised, (r["rank"], raised)
        if r["rank"] in (0, 2):  # the shard peers that differ name the parameter
            assert "module." in raised, raised
        assert r["drift_resync"]["error"] is None, r["drift_resync"]
        assert r["drift_resync"]["fp"] == results[0]["drift_resync"]["fp"], r["rank"]


@needs_megatron
def test_overlapped_reduce_scatter_matches_the_oracle(results):
    """--overlap-grad-reduce: each bucket's reduce-scatter inside the instance starts in backward."""
    for r in results:
        o = r["oracle_overlap"]
        assert o["buckets"] > 1, o["buckets"]
        assert o["mismatched"] == 0 and o["moved"] > 0 and o["momentum_mismatched"] == 0, (r["rank"], o)
        assert o["fps"] == results[0]["oracle_overlap"]["fps"], r["rank"]


@needs_megatron
def test_overlapped_parameter_all_gather_matches_the_oracle():
    """--overlap-param-gather: Megatron's all-gather of the instance's updated shards waits for the
    next forward's pre-hooks; the parameters the forward sees equal the oracle's, on every rank."""
    res = run_ranks(_param_gather_scenario, 4, timeout=600)
    for dtype in (torch.float32, torch.bfloat16):
        for r, out in enumerate(res):
            o = out[dtype]
            assert o["buckets"] > 1, o["buckets"]
            assert o["mismatched"] == 0 and o["moved"] > 0 and o["momentum_mismatched"] == 0, (r, str(dtype), o)
            assert o["fps"] == res[0][dtype]["fps"], (r, str(dtype))


@needs_megatron
def test_nothing_full_precision_crosses_instances(results):
    instance = lambda x: x // 2  # noqa: E731 - DP rank = global rank at TP = PP = 1; instances of 2
    crossing = 0
    for r, c in [(r, r[key]) for r in results for key in ("contract", "contract_overlap")]:
        assert c["log"], "the contract log recorded nothing"
        for op, ranks, dtype, shape, *_ in c["log"]:
            if not ranks or len({instance(x) for x in ranks}) < 2:
                continue
            crossing += 1
            numel = 1
            for d in (shape or ()):
                numel *= d
            # votes (uint8 bits), flags (int32), or a float of at most a few flag values
            assert dtype not in FLOAT or numel <= 8, (r["rank"], op, ranks, dtype, shape)
        # and Megatron's intra-instance traffic is there (reduce-scatter / all-gather of fp32)
        assert any(len({instance(x) for x in e[1] or ()}) == 1 and len(e[1] or ()) == 2 and e[2] == "torch.float32"
                   for e in c["log"]), c["log"]
    assert crossing > 0  # the votes did cross


@needs_megatron
def test_another_instance_count_or_data_parallel_size_reshards(results):
    """K = 2 x 2 ranks -> K = 1 x 4, K = 4 x 1 (same DP size), and DP = 2 as 2 x 1 (the same 2
    voters: each keeps its momentum) and 1 x 2: every rank's momentum shards equal the resharded
    oracle momenta bit for bit, the bf16 run's fp32 main shards come back exactly, and where the
    oracle's instance sums are exact the next steps equal it too."""
    for r in results:
        src = r["reshard_source"]
        assert src["mismatched"] == 0, src["mismatched"]
        assert r["reshard_k1_bf16_masters"] == 0, r["reshard_k1_bf16_masters"]
    cases = [("K=1 x 4", [r["reshard_k1"] for r in results], src["fp"]),
             ("K=4 x 1", [r["reshard_k4"] for r in results], src["fp"]),
             ("DP=2, K=2 x 1", [r["dp2"][2] for r in results if "dp2" in r], src["fp"]),
             ("DP=2, K=1 x 2", [r["dp2"][1] for r in results if "dp2" in r], src["fp"])]
    for name, ranks, saved_fp in cases:
        assert ranks, name
        for rank, case in enumerate(ranks):
            assert case["momentum_mismatched"] == 0 and case["step"] == RESHARD_STEPS, (name, rank, case)
            assert case["loaded_fp"] == saved_fp, (name, rank)  # Megatron's model, as saved
            if "fps" in case:
                assert case["mismatched"] == 0 and case["moved"] > 0, (name, rank, case["mismatched"], case["moved"])
                assert case["fps"] == ranks[0]["fps"], (name, rank)


@needs_megatron
def test_resume_is_exact_and_another_layout_is_refused(results):
    for r in results:
        assert r["resume"]["resume_equal"], r["rank"]
        assert any(f.endswith(f"lioncub-rank{r['rank']:05d}-of-00004.pt") for f in r["resume"]["files"]), \
            r["resume"]["files"]
        assert r["resume"]["sync_error"] and "per_rank" in r["resume"]["sync_error"]
        b = r["resume_bf16"]  # bf16 weights, fp32 main shards (Megatron's) that LionCub steps
        assert b["resume_equal"] and b["main_dtype"] == "torch.float32", (r["rank"], b["main_dtype"])
        assert b["fp"] == results[0]["resume_bf16"]["fp"], r["rank"]  # replicas identical in bf16 too
        msg = r.get("changed_layout")
        assert msg is not None, "loading a K=2 checkpoint under K=1 with reshard='error' was not refused"
        assert "--num-distributed-optimizer-instances 2 x 2" in msg and "--num-distributed-optimizer-instances 1 x 4" \
            in msg and "reshard='average'" in msg, msg
        assert r["changed_layout_untouched"]


@needs_megatron
def test_one_instance_is_lion_on_the_mean_gradient(results):
    for r in results:
        k1 = r["k1"]
        assert k1["vote_size"] == 1
        assert k1["mismatched"] == 0 and k1["moved"] > 0, k1
        assert k1["grad_err"] < 1e-5, k1["grad_err"]
        assert k1["scopes"].get("inter_node", 0) == 0, k1["scopes"]  # no votes sent
        assert k1["fps"] == results[0]["k1"]["fps"], r["rank"]


@needs_megatron
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(results):
    for r in results:
        n = r["nan"]
        assert n["unchanged"] and n["skipped"] == 1, (r["rank"], n["unchanged"], n["skipped"])
        assert n["trained_after"] and n["fp"] == results[0]["nan"]["fp"], r["rank"]


@needs_megatron
def test_flag_errors(results):
    for r in results:
        e = r["errors"]
        assert "--use-distributed-optimizer" in e["no_dist_opt"], e
        assert "--lioncub-node-size 4" in e["node_size"] and "--num-distributed-optimizer-instances 2" in \
            e["node_size"] and "allowed: --lioncub-node-size 2" in e["node_size"], e
        # Megatron splits the first of several model chunks off: one chunk has nothing to overlap with
        assert "--overlap-param-gather-with-optimizer-step" in e["one_chunk_with_step"] and \
            "virtual pipeline" in e["one_chunk_with_step"] and "got one model chunk" in e["one_chunk_with_step"], e
        assert e["untouched"]
        assert e["build_error"] == "a build failure (test)" and e["restored_after_build_error"], e


# ----------------------------------------------------------------------------- Megatron-LM flags (no spawn)
from test_megatron_training import GOOD, standins  # noqa: E402,F401 - Megatron-LM stand-in modules (fixture)


@pytest.mark.unit
def test_megatron_lm_flags_for_node_voters(standins):  # noqa: F811
    from lioncub_ds.megatron.training import LionCubMegatronArgsError, megatron_args_problems
    p = standins.arguments.parse_args
    node = GOOD + ["--lioncub-voters", "node"]
    dist_opt = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    # node voters without the distributed optimizer: one early error naming the flag to add
    with pytest.raises(LionCubMegatronArgsError) as info:
        standins.arguments.validate_args(p(argv=node), {})
    assert "--lioncub-voters node" in str(info.value) and "--use-distributed-optimizer" in str(info.value)
    assert standins.validate_calls == []  # before Megatron's own validation (before any model)
    # with it (and K instances): accepted
    assert megatron_args_problems(p(argv=node + dist_opt)) == []
    # without node voters the distributed optimizer stays refused, with the way out named
    plain = megatron_args_problems(p(argv=GOOD + dist_opt))
    assert any(x.startswith("--use-distributed-optimizer") and "--lioncub-voters node" in x for x in plain), plain
    assert any(x.startswith("--num-distributed-optimizer-instances 2") for x in plain), plain
    # Megatron's own overlaps of the instance's reduce-scatter and all-gather are accepted
    overlaps = ["--overlap-param-gather", "--overlap-grad-reduce"]
    assert megatron_args_problems(p(argv=node + dist_opt + overlaps)) == []
    assert megatron_args_problems(p(argv=GOOD + ["--overlap-param-gather"])) != []  # flat LionCub: no all-gather
    # the first model chunk's all-gather during the other chunks' optimizer steps: node voters only
    with_step = overlaps + ["--overlap-param-gather-with-optimizer-step"]
    assert megatron_args_problems(p(argv=node + dist_opt + with_step)) == []
    assert any(x.startswith("--overlap-param-gather-with-optimizer-step") for x in megatron_args_problems(
        p(argv=GOOD + ["--overlap-param-gather-with-optimizer-step"])))
    # node_size must be DP / K once Megatron has derived the data-parallel size
    args = p(argv=node + dist_opt + ["--lioncub-node-size", "4"])
    args.data_parallel_size = 4
    bad = megatron_args_problems(args)
    assert any(x.startswith("--lioncub-node-size 4") and "allowed: --lioncub-node-size 2" in x
               and "--num-distributed-optimizer-instances 2" in x for x in bad), bad
    args.lioncub_node_size = 2
    assert megatron_args_problems(args) == []
    sync = megatron_args_problems(p(argv=node + dist_opt + ["--lioncub-checkpoint-mode", "sync"]))
    assert any(x.startswith("--lioncub-checkpoint-mode sync") and "per_rank" in x for x in sync), sync
    # node_size without node voters (master-only sharding) is refused under Megatron
    assert any(x.startswith("--lioncub-node-size 2") for x in megatron_args_problems(
        p(argv=GOOD + ["--lioncub-node-size", "2"])))


@pytest.mark.unit
def test_node_sync_groups_the_instances_that_share_a_node():
    """momentum_sync={"group": "node"} with node voters: the voters (one rank per instance, in vote
    group order) that LOCAL_WORLD_SIZE puts on one node."""
    from lioncub_ds.megatron.optimizer import instance_sync_group_size
    assert instance_sync_group_size([0, 1, 2, 3], 2) == 2   # 4 instances of 1 rank, 2 ranks per node
    assert instance_sync_group_size([1, 3], 4) == 2         # 2 instances of 2 ranks on one node of 4
    assert instance_sync_group_size([0, 8, 16], 8) == 1     # one instance per node: a sync of one
    with pytest.raises(LionCubConfigError, match="not split evenly"):
        instance_sync_group_size([0, 1, 2], 2)
