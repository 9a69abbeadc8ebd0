"""Megatron-core integration on 4 CPU gloo ranks (megatron's CUDA calls redirected by the test shim).

One launch per parallel layout (TP=1/DP=4 with a 2-expert MoE at EP=2, and TP=2/DP=2); each
launch runs several checks and the parent asserts on what every rank reports:

* training a tiny GPTModel through ``get_megatron_lioncub_optimizer`` (FP32Optimizer /
  ChainedOptimizer, Megatron's scheduler) lowers the loss;
* parameters stay identical inside every data-parallel group (and expert-DP group);
* no data-parallel gradient all-reduce / reduce-scatter happens (collectives wrapped and
  counted), while the same model with DDP's reduction on does send its gradients;
* tensor-parallel peers keep consistent shards (replicated parameters identical, split ones not);
* momentum sync every K steps, the two-level form (node every step, all every K'), and the drift
  schedule (per optimizer: its signal and syncs against an oracle);
* save / resume through Megatron's dist-checkpointing plus per-rank LionCub files (and the
  ``sync`` mode) continues bit-identically;
* bf16 parameters through ``Float16OptimizerWithFloat16Params`` (LionCub on fp32 main params).

Plus quick single-process checks (no megatron needed): importing ``lioncub_ds.megatron``
without megatron-core, the ``--lioncub-*`` flags, settings validation, node detection and
the DDP settings that local-momentum mode refuses.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import types
import warnings

import pytest
import torch

from dist_helpers import run_ranks
from lioncub_ds import LionCubConfigError
from lioncub_ds.megatron import (LocalMomentumConfigError, MegatronNotAvailableError, add_lioncub_args,
                                 check_local_momentum_ddp, lioncub_settings, lioncub_settings_from_args,
                                 ranks_per_node, require_megatron)

pytestmark = pytest.mark.integration

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")

VOCAB, SEQ, MBS, HIDDEN = 64, 16, 8, 32
TRAIN_STEPS = 10


# ----------------------------------------------------------------------------- no-spawn checks
@pytest.mark.dist
def test_import_does_not_need_megatron(monkeypatch):
    code = ("import sys; import lioncub_ds.megatron; "
            "print(sorted(k for k in sys.modules if k == 'megatron' or k.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(MegatronNotAvailableError, match="pip install megatron-core"):
        require_megatron()
    from lioncub_ds.megatron import disable_dp_grad_reduction, get_megatron_lioncub_optimizer
    with pytest.raises(ImportError, match="megatron-core"):
        get_megatron_lioncub_optimizer(None, [])
    with pytest.raises(ImportError):
        disable_dp_grad_reduction([])


@pytest.mark.unit
def test_lioncub_args_to_settings():
    p = add_lioncub_args(argparse.ArgumentParser())
    args = p.parse_args(["--lioncub-comm", "1bit", "--lioncub-tie-break", "alternate", "--lioncub-beta1", "0.95",
                         "--lioncub-beta2", "0.98", "--lioncub-momentum-dtype", "bf16", "--lioncub-pbit-bits", "4",
                         "--lioncub-bandwidth-gbit", "25", "--lioncub-momentum-sync-group", "node",
                         "--lioncub-momentum-sync-every", "10", "--lioncub-momentum-sync-inter-every", "100",
                         "--lioncub-momentum-sync-layers", "*attn*", "*mlp*", "--lioncub-foreach", "false",
                         "--lioncub-momentum-double-buffer"])
    got = lioncub_settings_from_args(args)
    assert got == {"comm": "1bit", "tie_break": "alternate", "betas": (0.95, 0.98), "momentum_dtype": "bf16",
                   "pbit_bits": 4, "network": {"bandwidth_gbit": 25.0}, "foreach": False,
                   "momentum_double_buffer": True,
                   "momentum_sync": {"group": "node", "every": 10, "inter_every": 100, "layers": ["*attn*", "*mlp*"]}}
    assert args.lioncub_checkpoint_mode == "per_rank" and not args.lioncub_keep_grad_allreduce
    json_args = p.parse_args(["--lioncub-momentum-sync", '{"every": 5, "until": 100}'])
    assert lioncub_settings_from_args(json_args) == {"momentum_sync": {"every": 5, "until": 100}}
    with pytest.raises(LionCubConfigError, match="both"):
        lioncub_settings_from_args(p.parse_args(["--lioncub-beta1", "0.9"]))
    with pytest.raises(LionCubConfigError, match="JSON"):
        lioncub_settings_from_args(p.parse_args(["--lioncub-momentum-sync", "{every: 5"]))


@pytest.mark.unit
def test_lioncub_settings_validation():
    assert lioncub_settings({"comm": "pbit"}, vote="average") == {"comm": "pbit", "vote": "average"}
    with pytest.raises(LionCubConfigError, match="--lr"):
        lioncub_settings({"lr": 1e-3})
    with pytest.raises(LionCubConfigError, match="weight_decay"):
        lioncub_settings(weight_decay=0.1)
    with pytest.raises(LionCubConfigError, match="comm"):
        lioncub_settings({"comm": "2bit"})
    with pytest.raises(LionCubConfigError, match="did you mean 'tie_break'"):
        lioncub_settings({"tie_brake": "zero"})
    with pytest.raises(LionCubConfigError, match="given twice"):
        lioncub_settings({"comm": "1bit"}, comm="pbit")


@pytest.mark.unit
def test_ranks_per_node():
    assert ranks_per_node([0, 1, 2, 3], 2) == 2
    assert ranks_per_node([0, 2, 4, 6, 8, 10, 12, 14], 8) == 4    # TP=2, 8 GPUs per node
    assert ranks_per_node([1, 3], 2) == 1                         # one DP peer per node
    assert ranks_per_node([0, 1, 2, 3], 8) == 4                   # the whole group on one node
    with pytest.raises(LionCubConfigError, match="group_size"):
        ranks_per_node([0, 1, 2], 2)                              # 2 on node 0, 1 on node 1
    with pytest.raises(LionCubConfigError, match="consecutive"):
        ranks_per_node([0, 2, 1, 3], 2)


@pytest.mark.unit
def test_local_momentum_ddp_checks():
    def chunk(**cfg):
        base = dict(use_distributed_optimizer=False, overlap_grad_reduce=False, use_megatron_fsdp=False,
                    num_distributed_optimizer_instances=1)
        base.update(cfg)
        return types.SimpleNamespace(ddp_config=types.SimpleNamespace(**base), bucket_groups=[],
                                     expert_parallel_bucket_groups=[])
    check_local_momentum_ddp(chunk())
    for key, value, hint in (("use_distributed_optimizer", True, "use_distributed_optimizer=False"),
                             ("overlap_grad_reduce", True, "overlap_grad_reduce=False"),
                             ("use_megatron_fsdp", True, "use_megatron_fsdp=False"),
                             ("num_distributed_optimizer_instances", 2, "set it to 1")):
        with pytest.raises(LocalMomentumConfigError, match=hint):
            check_local_momentum_ddp(chunk(**{key: value}))
    with pytest.raises(LocalMomentumConfigError, match="DistributedDataParallel"):
        check_local_momentum_ddp(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- rank-side helpers
class ByteCounter:
    """Wrap torch.distributed collectives; record (op, group ranks, dtype, bytes) while active."""

    OPS = ("all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_into_tensor",
           "all_to_all_single", "broadcast", "all_gather", "reduce_scatter")

    def __init__(self):
        import torch.distributed as dist
        self.records, self.active = [], False
        self._dist = dist
        for name in self.OPS:
            orig = getattr(dist, name, None)
            if orig is not None:
                setattr(dist, name, self._wrap(name, orig))
        from megatron.core.distributed import param_and_grad_buffer as pgb
        pgb.dist_reduce_scatter_func = self._wrap("reduce_scatter_tensor(ddp)", pgb.dist_reduce_scatter_func)

    def _wrap(self, name, fn):
        dist = self._dist

        def wrapper(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                    tuple(range(dist.get_world_size()))
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                t = tensors[-1] if name.startswith("reduce_scatter") and len(tensors) > 1 else \
                    (tensors[0] if tensors else None)
                if t is not None:
                    self.records.append((name, ranks, str(t.dtype), t.numel() * t.element_size()))
            return fn(*args, **kwargs)
        return wrapper

    def float_reduce_bytes(self, ranks) -> int:
        """Bytes of floating-point all-reduce / reduce-scatter over exactly the group ``ranks``."""
        return sum(b for op, r, dt, b in self.records
                   if r == tuple(ranks) and ("all_reduce" in op or "reduce_scatter" in op)
                   and dt in ("torch.float32", "torch.bfloat16", "torch.float16"))

    def bytes_by(self, ranks) -> dict:
        out = {}
        for op, r, dt, b in self.records:
            if r == tuple(ranks):
                out[f"{op}:{dt}"] = out.get(f"{op}:{dt}", 0) + b
        return out


def _setup(tp, ep=1):
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    return ByteCounter()


def _build(tp, experts=None, seed=1234, dtype=torch.float32):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core import parallel_state as ps
    ep = ps.get_expert_model_parallel_world_size()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = dict(num_moe_experts=experts, moe_router_topk=1, moe_router_pre_softmax=True, add_bias_linear=False, moe_token_dispatcher_type="allgather",
               moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep) if experts else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=2 * HIDDEN,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            tensor_model_parallel_size=tp, pipeline_dtype=dtype, params_dtype=dtype,
                            bf16=dtype == torch.bfloat16, **moe)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float32),
                                  model)
    cfg.finalize_model_grads_func = finalize_model_grads
    return cfg, ddp


def _batch(step, seed=0):
    """A learnable stream per data-parallel rank: x[t+1] = (5·x[t] + 3) mod V, random starts."""
    from megatron.core import parallel_state as ps
    g = torch.Generator().manual_seed(10_000 * seed + 100 * ps.get_data_parallel_rank() + step)
    x0 = torch.randint(0, VOCAB, (MBS, 1), generator=g)
    seq = [x0]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    return torch.cat(seq, dim=1)


def _fwd_bwd(ddp, tokens, forward_only=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        x = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, -1)
        out = model(x[:, :-1], pos, None, labels=x[:, 1:])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}
        return out, loss_func

    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[ddp],
                                      num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS,
                                      forward_only=forward_only)
    return float(res[0]["loss"])


def _train_step(ddp, opt, step, sched=None):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = _fwd_bwd(ddp, _batch(step))
    ok, _, _ = opt.step()
    assert ok
    if sched is not None:
        sched.step(1)
    return loss


def _opt_config(**kw):
    from megatron.core.optimizer import OptimizerConfig
    base = dict(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99,
                clip_grad=1.0)
    base.update(kw)
    return OptimizerConfig(**base)


def _fingerprints(ddp):
    return {n: hashlib.sha1(p.detach().float().contiguous().view(-1).numpy().tobytes()).hexdigest()
            for n, p in ddp.named_parameters()}


def _momentum_fp(opt):
    """{'dense': hash, 'expert': hash} of the LionCub momenta."""
    from lioncub_ds.megatron import lioncub_optimizers
    out = {}
    for lc in lioncub_optimizers(opt):
        h = hashlib.sha1()
        for g in lc.param_groups:
            for p in g["params"]:
                h.update(lc.state[p]["exp_avg"].contiguous().view(-1).numpy().tobytes())
        out[lc.megatron_kind] = h.hexdigest()
    return out


def _groups_info():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    return {"dp": tuple(dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))),
            "edp": tuple(dist.get_process_group_ranks(ps.get_expert_data_parallel_group())),
            "tp": tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank()}


def _ckpt_state(ddp, opt, is_loading=False):
    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _save_resume(tp, experts, counter, tmpdir, mode, lioncub):
    """Train 3 steps, save (Megatron dist-ckpt + LionCub extras), train 2 more; rebuild, load, train the
    same 2 steps: parameters and momenta must match the uninterrupted run exactly."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from lioncub_ds.megatron import (after_checkpoint_load, after_checkpoint_save, before_checkpoint_save,
                                     get_megatron_lioncub_optimizer)
    ckpt = os.path.join(tmpdir, f"ckpt-{mode}")
    cfg, ddp = _build(tp, experts)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub=lioncub)
    for s in range(3):
        _train_step(ddp, opt, s)
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    before_checkpoint_save(opt, mode=mode)  # sync mode: average first, then Megatron saves the replica
    dist_checkpointing.save(_ckpt_state(ddp, opt), ckpt)
    after_checkpoint_save(opt, ckpt, mode=mode)  # per_rank mode: every rank's own file
    saved_momentum = _momentum_fp(opt)
    for s in range(3, 5):
        _train_step(ddp, opt, s)
    want = (_fingerprints(ddp), _momentum_fp(opt))

    cfg2, ddp2 = _build(tp, experts, seed=999)  # different init: everything must come from the checkpoint
    opt2 = get_megatron_lioncub_optimizer(_opt_config(), [ddp2], lioncub=lioncub)
    state = dist_checkpointing.load(_ckpt_state(ddp2, opt2, is_loading=True), ckpt)
    ddp2.module.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    replica_momentum = _momentum_fp(opt2)  # what Megatron alone restores (DP rank 0's replica)
    after_checkpoint_load(opt2, ckpt, mode=mode)
    restored_momentum = _momentum_fp(opt2)
    for s in range(3, 5):
        _train_step(ddp2, opt2, s)
    got = (_fingerprints(ddp2), _momentum_fp(opt2))
    return {"mode": mode, "resume_params_equal": want[0] == got[0], "resume_momentum_equal": want[1] == got[1],
            "saved_momentum": saved_momentum, "replica_momentum": replica_momentum,
            "restored_momentum": restored_momentum}


def _sync_run(tp, experts, momentum_sync, steps=4):
    """Momentum fingerprints after every step with a given momentum_sync setting."""
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(tp, experts)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"momentum_sync": momentum_sync})
    fps = []
    for s in range(steps):
        _train_step(ddp, opt, s)
        fps.append(_momentum_fp(opt))
    ms = lioncub_optimizers(opt)[0].config.momentum_sync
    return {"fps": fps, "group_size": ms.group_size if ms is not None else None}


def _bruteforce_run(tp, experts, comm, steps=3):
    """Through Megatron's DDP + FP32Optimizer/ChainedOptimizer: after every opt.step(), each parameter
    equals a literal majority vote over its vote group's (gradient, momentum), exactly.

    Literal implementation (docs/conventions.md): c_i = β1·m_i + (1−β1)·g_i, Δ = sign(Σ_i sign(c_i)) over the
    data-parallel group (expert-DP for expert parameters), tie_break="zero", θ ← θ·(1 − η·λ) − η·Δ."""
    import torch.distributed as dist
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(tp, experts)
    opt = get_megatron_lioncub_optimizer(_opt_config(clip_grad=0.0), [ddp],
                                         lioncub={"comm": comm, "tie_break": "zero"})
    lcs = lioncub_optimizers(opt)
    out = {"mismatched": 0, "elements": 0, "moved": 0, "steps": 0, "kinds": sorted(lc.megatron_kind for lc in lcs)}
    for s in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        _fwd_bwd(ddp, _batch(s))
        expected = []
        for lc in lcs:
            group = lc.vote_group
            n = dist.get_world_size(group)
            items = [(g, p) for g in lc.param_groups for p in g["params"]]
            c = []
            for g, p in items:
                grad = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
                m = lc.state[p]["exp_avg"] if "exp_avg" in lc.state[p] else torch.zeros_like(p)
                b1 = g["betas"][0]
                c.append((b1 * m.float() + (1 - b1) * grad.float()).reshape(-1))
            local = torch.cat(c)
            everyone = [torch.zeros_like(local) for _ in range(n)]
            dist.all_gather(everyone, local, group=group)
            delta = torch.sign(torch.stack([torch.sign(e) for e in everyone]).sum(0))
            off = 0
            for g, p in items:
                d = delta[off:off + p.numel()].view_as(p)
                off += p.numel()
                e = p.detach().clone()
                if g["weight_decay"]:
                    e.mul_(1.0 - g["lr"] * g["weight_decay"])
                e.add_(d.mul(-g["lr"]))
                expected.append((p, e, d))
        ok, _, _ = opt.step()
        assert ok
        for p, e, d in expected:
            out["mismatched"] += int((p.detach() != e).sum())
            out["elements"] += p.numel()
            out["moved"] += int((d != 0).sum())
        out["steps"] += 1
    return out


DRIFT = {"schedule": "drift", "threshold": 0.01, "min_every": 2}


def _drift_sync_run(tp, experts, steps=8):
    """momentum_sync schedule="drift" with per-rank voters: every LionCub (dense, expert) has its
    own vote group, signal and trigger. Before each step, from a literal vote (c_i = β1·m_i +
    (1−β1)·g_i, Δ the majority over the vote group, ties by the hash rule on the element's index
    and the step): this rank's share of votes that disagree with Δ where both are nonzero, in the
    drift units of lioncub_ds.momentum_sync, summed over the vote group (an all-reduce of the
    test's own); the same DriftTrigger rule on those sums says when to sync. Reports per step and
    kind: what comm_stats says and what the oracle says (the step whose signal was read, that
    summed signal, syncs so far, the last sync's step), and the momenta: bit-identical over the
    vote group and within float rounding of the group's mean of the updated momenta after a sync,
    bit-equal to this rank's own update otherwise."""
    import torch.distributed as dist
    from dist_helpers import DriftDecisions, disagreement
    from lioncub_ds.kernels import reference
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(tp, experts)
    opt = get_megatron_lioncub_optimizer(_opt_config(clip_grad=0.0), [ddp],
                                         lioncub={"comm": "1bit", "tie_break": "hash", "momentum_sync": DRIFT})
    lcs = {lc.megatron_kind: lc for lc in lioncub_optimizers(opt)}
    size = {k: dist.get_world_size(lc.vote_group) for k, lc in lcs.items()}
    decisions = {k: DriftDecisions(DRIFT, size[k]) for k in lcs}
    out = {"rows": {k: d.rows for k, d in decisions.items()}, "seen": {k: [] for k in lcs}, "sync_equal": [],
           "own_equal": [], "sync_close": []}
    for s in range(steps):
        step = s + 1
        ddp.zero_grad_buffer()
        opt.zero_grad()
        _fwd_bwd(ddp, _batch(s))
        updated, synced = {}, {}
        for kind, lc in lcs.items():
            b1, b2 = lc.param_groups[0]["betas"]
            differ = both = 0
            mine = []
            for g in lc.param_groups:
                for p in g["params"]:
                    grad = (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).float().reshape(-1)
                    m = lc.state[p]["exp_avg"].reshape(-1).clone() if "exp_avg" in lc.state[p] else torch.zeros_like(grad)
                    vote = torch.sign(reference.lion_direction(m, grad, b1))
                    every = [torch.zeros_like(vote) for _ in range(size[kind])]
                    dist.all_gather(every, vote, group=lc.vote_group)
                    votes = torch.stack(every)
                    plus, cnt = (votes > 0).sum(0), (votes != 0).sum(0)
                    delta = torch.sign(plus * 2 - cnt).float()
                    ties = (plus * 2 == cnt) & (cnt > 0)
                    delta = torch.where(ties, reference.tie_hash_sign(step, torch.arange(delta.numel())).float(), delta)
                    a, b = disagreement(vote, delta)
                    differ, both = differ + a, both + b
                    reference.momentum_update(m, grad, b2)
                    mine.append(m)
            updated[kind] = mine
            summed = torch.tensor([decisions[kind].units(differ, both)], dtype=torch.int64)
            dist.all_reduce(summed, group=lc.vote_group)
            synced[kind] = decisions[kind].step(step, int(summed))
        ok, _, _ = opt.step()
        assert ok
        for kind, lc in lcs.items():
            st = lc.comm_stats()["momentum_sync"]
            unit = decisions[kind].unit
            out["seen"][kind].append((st["signal_step"], None if st["signal"] is None else round(st["signal"] * unit),
                                      st["syncs"], st["last_sync_step"]))
            got = [lc.state[p]["exp_avg"].reshape(-1) for g in lc.param_groups for p in g["params"]]
            if synced[kind]:
                flat, own = torch.cat(got), torch.cat(updated[kind])
                every = [torch.zeros_like(flat) for _ in range(size[kind])]
                dist.all_gather(every, flat, group=lc.vote_group)
                owns = [torch.zeros_like(own) for _ in range(size[kind])]
                dist.all_gather(owns, own, group=lc.vote_group)
                out["sync_equal"].append(all(torch.equal(e, flat) for e in every))
                out["sync_close"].append(bool(torch.allclose(flat, torch.stack(owns).mean(0), rtol=1e-6, atol=1e-9)))
            else:
                out["own_equal"].append(all(torch.equal(a, b) for a, b in zip(got, updated[kind])))
    return out


def _bf16_run(tp, experts, steps=3):
    """bf16 params: Float16OptimizerWithFloat16Params around LionCub (fp32 main params)."""
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(tp, experts, dtype=torch.bfloat16)
    opt = get_megatron_lioncub_optimizer(_opt_config(bf16=True, params_dtype=torch.bfloat16), [ddp],
                                         lioncub={"comm": "pbit"})
    init = _fingerprints(ddp)
    losses = [_train_step(ddp, opt, s) for s in range(steps)]
    params = _fingerprints(ddp)
    lc = lioncub_optimizers(opt)[0]
    return {"wrappers": [type(o).__name__ for o in opt.chained_optimizers], "losses": losses, "params": params,
            "expert": sorted(n for n, p in ddp.named_parameters() if not getattr(p, "allreduce", True)),
            "changed": sum(params[n] != init[n] for n in init), "momentum_dtype": str(next(iter(lc.state.values()))[
                "exp_avg"].dtype), "main_dtype": str(lc.param_groups[0]["params"][0].dtype)}


def _scenario(rank, world, tp, ep, experts, tmpdir, lioncub):
    import time
    t0 = time.perf_counter()
    timing = {}
    counter = _setup(tp, ep)
    timing["setup"] = time.perf_counter() - t0
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    import torch.distributed as dist
    from lioncub_ds.megatron import (LocalMomentumConfigError, disable_dp_grad_reduction, dp_grad_reduction_disabled,
                                     get_megatron_lioncub_optimizer, lioncub_optimizers)
    out = {"rank": rank, **_groups_info()}
    dp = out["dp"]

    # Control: the same model with DDP's reduction on does all-reduce its gradients over DP.
    cfg, ddp = _build(tp, experts)
    ddp.zero_grad_buffer()
    counter.records.clear()
    counter.active = True
    _fwd_bwd(ddp, _batch(0))  # the schedule calls finalize_model_grads -> finish_grad_sync
    counter.active = False
    out["control_dp_bytes"] = counter.float_reduce_bytes(dp)
    out["grad_buffer_bytes"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)

    # Local-momentum training through the factory, with Megatron's lr/wd scheduler.
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub=lioncub)
    out["disabled"] = dp_grad_reduction_disabled(ddp)
    out["wrappers"] = [type(o).__name__ for o in opt.chained_optimizers]
    lcs = lioncub_optimizers(opt)
    out["vote_groups"] = [(lc.megatron_kind, tuple(dist.get_process_group_ranks(lc.vote_group))) for lc in lcs]
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2,
                                    lr_decay_steps=TRAIN_STEPS, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=TRAIN_STEPS, wd_incr_style="constant")
    init = _fingerprints(ddp)
    counter.records.clear()
    counter.active = True
    losses = [_train_step(ddp, opt, s, sched) for s in range(TRAIN_STEPS)]
    counter.active = False
    out["losses"] = losses
    out["eval_loss"] = [_fwd_bwd(ddp, _batch(s, seed=7), forward_only=True) for s in range(2)]
    out["train_dp_float_reduce_bytes"] = counter.float_reduce_bytes(dp)
    out["train_bytes_dp"] = counter.bytes_by(dp)
    out["vote_bytes"] = sum(lc.comm_stats()["cumulative"]["bytes_sent"] for lc in lcs)
    out["params"] = _fingerprints(ddp)
    out["changed"] = sum(out["params"][n] != init[n] for n in init)
    out["tp_split"] = sorted(n for n, p in ddp.named_parameters() if getattr(p, "tensor_model_parallel", False))
    out["expert_params"] = sorted(n for n, p in ddp.named_parameters() if not getattr(p, "allreduce", True))
    out["groups"] = [(g.get("wd_mult"), g["weight_decay"], g["lr"], len(g["params"]),
                      g.get("is_expert_parallel")) for lc in lcs for g in lc.param_groups]
    out["sched_lr"] = sched.get_lr(opt.param_groups[0])

    timing["train"] = time.perf_counter() - t0
    # Settings that cannot work in local-momentum mode fail clearly.
    errors = {}
    for name in ("use_distributed_optimizer", "overlap_param_gather"):
        try:
            get_megatron_lioncub_optimizer(_opt_config(**{name: True}), [ddp])
        except LocalMomentumConfigError as exc:
            errors[name] = str(exc)
    ddp.ddp_config.overlap_grad_reduce = True
    try:
        disable_dp_grad_reduction([ddp])
    except LocalMomentumConfigError as exc:
        errors["overlap_grad_reduce"] = str(exc)
    ddp.ddp_config.overlap_grad_reduce = False
    out["errors"] = errors

    # Selective momentum sync: every 2 steps, and two-level (node every step, everyone every 3).
    out["sync_every2"] = _sync_run(tp, experts, {"every": 2}, steps=3)
    out["sync_two_level"] = _sync_run(tp, experts, {"group": "node", "every": 1, "inter_every": 3}, steps=4)
    out["no_sync"] = _sync_run(tp, experts, None, steps=2)

    timing["sync"] = time.perf_counter() - t0
    out["bruteforce"] = _bruteforce_run(tp, experts, lioncub.get("comm", "1bit"))
    # schedule="drift" with TP > 1 is refused (each model-parallel position would decide its own syncs:
    # tests/test_megatron_training.py::test_drift_schedule_with_tensor_parallelism_is_refused_before_anything_changes)
    out["drift_sync"] = _drift_sync_run(tp, experts) if tp == 1 else None
    out["bf16"] = _bf16_run(tp, experts)
    timing["bf16"] = time.perf_counter() - t0
    # Save / resume.
    out["resume"] = [_save_resume(tp, experts, counter, tmpdir, mode, lioncub) for mode in ("per_rank", "sync")]
    timing["resume"] = time.perf_counter() - t0
    out["timing"] = timing
    return out


# ----------------------------------------------------------------------------- parent-side checks
def _scaling_rank(rank, world):
    """Every rank the same batch: a model with Megatron's reduction on and one in local-momentum
    mode hold the same main_grad, dense and expert (EP 2: edp 2 of dp 4, so Megatron's expert
    scale edp/dp is 1/2)."""
    _setup(1, 2)
    from lioncub_ds.megatron import disable_dp_grad_reduction
    g = torch.Generator().manual_seed(4242)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    _, reduced = _build(1, experts=2)
    _, local = _build(1, experts=2)
    disable_dp_grad_reduction([local])
    for m in (reduced, local):
        m.zero_grad_buffer()
        _fwd_bwd(m, tokens)
    out = {}
    for (n, a), (_, b) in zip(reduced.named_parameters(), local.named_parameters()):
        expert = not getattr(a, "allreduce", True)
        out[n] = (expert, bool(torch.allclose(a.main_grad, b.main_grad, rtol=1e-5, atol=1e-7)),
                  float(b.main_grad.norm() / a.main_grad.norm().clamp_min(1e-30)))
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    return out


@needs_megatron
def test_local_gradients_have_megatrons_scale_dense_and_expert():
    for r, res in enumerate(run_ranks(_scaling_rank, 4, timeout=300)):
        assert any(e for e, _, _ in res.values()) and any(not e for e, _, _ in res.values()), res
        bad = {n: ratio for n, (_, ok, ratio) in res.items() if not ok}
        assert not bad, f"rank {r}: main_grad / Megatron's: {bad}"


def _launch(tp, ep, experts, lioncub):
    tmpdir = tempfile.mkdtemp(prefix="lioncub-megatron-")
    try:
        return run_ranks(_scenario, 4, tp, ep, experts, tmpdir, lioncub, timeout=900,
                         env={"LOCAL_WORLD_SIZE": "2"})  # pretend 2 nodes x 2 ranks
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _peers(res, r, kind):
    return r["dp"] if kind == "dense" else r["edp"]


def _same(res, r, key, idx, kind_groups=("dense", "expert")):
    """True/False per kind: is momentum fingerprint ``key``[idx] equal on all peers of r?"""
    out = {}
    for kind in kind_groups:
        if kind not in r[key]["fps"][idx]:
            continue
        out[kind] = all(res[p][key]["fps"][idx][kind] == r[key]["fps"][idx][kind] for p in _peers(res, r, kind))
    return out


def _check_common(res, tp):
    world = len(res)
    for r in res:
        assert r["disabled"]
        # training lowers the loss
        first, last = sum(r["losses"][:2]) / 2, sum(r["losses"][-2:]) / 2
        assert last < first - 0.3, (r["rank"], r["losses"])
        assert r["changed"] == len(r["params"])
        # DDP does reduce gradients when on (control) ...
        assert r["control_dp_bytes"] == r["grad_buffer_bytes"] > 0
        # ... and sends no floating-point gradient bytes over data-parallel ranks in local mode
        assert r["train_dp_float_reduce_bytes"] == 0, r["train_bytes_dp"]
        assert r["vote_bytes"] > 0
        # no weight decay on biases / norms; scheduler's lr lands in every group
        assert {g[0] for g in r["groups"]} == {0.0, 1.0}, r["groups"]
        for g in r["groups"]:
            assert g[1] == pytest.approx(0.1 * g[0]) and g[2] == pytest.approx(r["sched_lr"]), r["groups"]
        # clear errors for settings that cannot work
        assert set(r["errors"]) == {"use_distributed_optimizer", "overlap_param_gather", "overlap_grad_reduce"}
        assert "overlap_grad_reduce=False" in r["errors"]["overlap_grad_reduce"]
    # identical parameters inside every data-parallel group
    for r in res:
        for peer in r["dp"]:
            expert = set(r["expert_params"])
            dense_mine = {n: h for n, h in r["params"].items() if n not in expert}
            dense_peer = {n: h for n, h in res[peer]["params"].items() if n not in expert}
            assert dense_mine == dense_peer, (r["rank"], peer)
        for peer in r["edp"]:
            for n in r["expert_params"]:
                assert r["params"][n] == res[peer]["params"][n], (n, r["rank"], peer)
    # momenta differ across DP ranks without sync (local momentum), identical after a sync step
    for r in res:
        for kind in r["no_sync"]["fps"][-1]:
            for peer in _peers(res, r, kind):
                if peer != r["rank"]:
                    assert r["no_sync"]["fps"][-1][kind] != res[peer]["no_sync"]["fps"][-1][kind]
    for r in res:  # syncs after step indices 0 and 2
        assert all(_same(res, r, "sync_every2", 0).values()) and all(_same(res, r, "sync_every2", 2).values())
        assert not any(_same(res, r, "sync_every2", 1).values())
    # brute force: every parameter, every step, equals the literal vote over its vote group
    for r in res:
        bf = r["bruteforce"]
        assert bf["steps"] == 3 and bf["mismatched"] == 0 and bf["moved"] > 0, (r["rank"], bf)
    # the drift-scheduled momentum sync: the signal read and the syncs, per optimizer, are the oracle's
    for r in res:
        d = r["drift_sync"]
        if d is None:
            continue
        assert d["seen"] == d["rows"], (r["rank"], d["seen"], d["rows"])
        assert all(d["sync_equal"]) and all(d["sync_close"]) and all(d["own_equal"]), d
    # bf16 through Float16OptimizerWithFloat16Params: LionCub steps fp32 main params, replicas stay equal
    for r in res:
        b = r["bf16"]
        assert b["wrappers"][0] == "Float16OptimizerWithFloat16Params", b["wrappers"]
        assert b["changed"] == len(b["params"]) and b["main_dtype"] == "torch.float32"
        assert b["momentum_dtype"] == "torch.float32"
        for n in b["params"]:
            for peer in (r["edp"] if n in b["expert"] else r["dp"]):
                assert b["params"][n] == res[peer]["bf16"]["params"][n], (n, r["rank"], peer)
    # save / resume
    for r in res:
        for rr in r["resume"]:
            assert rr["resume_params_equal"] and rr["resume_momentum_equal"], (r["rank"], rr)
            assert rr["restored_momentum"] == rr["saved_momentum"], (r["rank"], rr["mode"])
    by_mode = lambda r, m: next(x for x in r["resume"] if x["mode"] == m)  # noqa: E731
    dp_size = len(res[0]["dp"])
    if dp_size > 1:
        # Megatron alone restores one replica per DP group: the per-rank files are what keeps resume exact
        nonzero_dp = [r for r in res if r["dp_rank"] != 0]
        assert any(by_mode(r, "per_rank")["replica_momentum"] != by_mode(r, "per_rank")["saved_momentum"]
                   for r in nonzero_dp)
        # sync mode: every rank saved the same (averaged) momentum, which is the replica
        for r in res:
            assert by_mode(r, "sync")["replica_momentum"] == by_mode(r, "sync")["saved_momentum"]
    return world


@needs_megatron
def test_megatron_tp1_dp4_with_experts():
    res = _launch(tp=1, ep=2, experts=2, lioncub={"comm": "1bit"})
    _check_common(res, tp=1)
    r0 = res[0]
    assert r0["dp"] == (0, 1, 2, 3) and r0["edp"] == (0, 2)
    assert r0["wrappers"] == ["FP32Optimizer", "FP32Optimizer"]
    assert dict(r0["vote_groups"]) == {"dense": (0, 1, 2, 3), "expert": (0, 2)}
    assert r0["expert_params"], "the MoE model should have expert parameters"
    # the drift schedule both synced and waited, in the dense and in the expert optimizer
    for r in res:
        rows = r["drift_sync"]["rows"]
        assert all(0 < rows[kind][-1][2] < len(rows[kind]) - 1 for kind in ("dense", "expert")), rows
        assert r["drift_sync"]["sync_equal"], r["drift_sync"]
    # two-level, dense (DP group 0..3): node groups {0,1} and {2,3}; across nodes after step indices 0 and 3
    assert {r["sync_two_level"]["group_size"] for r in res} == {2}
    fp = [[f["dense"] for f in r["sync_two_level"]["fps"]] for r in res]
    for s in (0, 3):
        assert len({f[s] for f in fp}) == 1, s
    for s in (1, 2):
        assert fp[0][s] == fp[1][s] and fp[2][s] == fp[3][s] and fp[0][s] != fp[2][s], s
    # expert (expert-DP groups {0,2}, {1,3}: one rank per node): only the inter-node syncs average
    for r in res:
        assert _same(res, r, "sync_two_level", 0)["expert"] and _same(res, r, "sync_two_level", 3)["expert"]
        assert not _same(res, r, "sync_two_level", 1)["expert"]


@needs_megatron
def test_megatron_tp2_dp2():
    res = _launch(tp=2, ep=1, experts=None, lioncub={"comm": "allgather", "tie_break": "alternate"})
    _check_common(res, tp=2)
    assert [r["dp"] for r in res] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r["tp"] for r in res] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert res[0]["wrappers"] == ["FP32Optimizer"]
    # TP peers: replicated parameters identical, split shards differ (and stay consistent per DP group)
    for a, b in ((0, 1), (2, 3)):
        split = set(res[a]["tp_split"])
        assert split
        for n, h in res[a]["params"].items():
            if n in split:
                assert h != res[b]["params"][n], n
            else:
                assert h == res[b]["params"][n], n
    # two-level with LOCAL_WORLD_SIZE=2: each DP group {0,2} / {1,3} has one rank per node, so the
    # node-level sync is a no-op and only the inter-node sync (step indices 0 and 3) averages.
    assert {r["sync_two_level"]["group_size"] for r in res} == {1}
    for r in res:
        assert _same(res, r, "sync_two_level", 0) == {"dense": True}
        assert _same(res, r, "sync_two_level", 3) == {"dense": True}
        assert _same(res, r, "sync_two_level", 1) == {"dense": False}
        assert _same(res, r, "sync_two_level", 2) == {"dense": False}
