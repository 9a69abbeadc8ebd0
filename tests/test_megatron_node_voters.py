"""Node voters under Megatron: LionCub inside Megatron's distributed optimizer, voting across its instances.

4 gloo ranks on CPU (megatron's CUDA calls redirected by the test shim), TP = 1, a tiny GPTModel:

* K = 2 instances of L = 2 ranks: after every step the parameters equal a brute-force oracle
  (2 voters, each with the mean gradient of its instance's 2 ranks and its own momentum, the
  literal Lion vote with tie_break="zero"), and are bit-identical on all 4 ranks;
* no floating-point tensor larger than a flag crosses instances (the NCCL-contract log of
  every collective, with its group and dtype), and comm_stats counts the votes as inter_node;
* save + resume at the same layout is exact; a resume under K = 1 is refused, naming both layouts;
* K = 1 (one instance of 4): Lion on the DP-mean gradient, no votes (0 inter-node bytes);
* the flag errors (voters='node' without the distributed optimizer, a node_size that is not DP/K).
"""
from __future__ import annotations

import argparse
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
LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.99)
FLOAT = ("torch.float32", "torch.bfloat16", "torch.float16", "torch.float64")


# ----------------------------------------------------------------------------- rank side
def _init(k):
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, num_distributed_optimizer_instances=k)


def _build(k, seed=1234, dtype=torch.float32, overlap=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=2 * HIDDEN,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=k,
        grad_reduce_in_fp32=dtype != torch.float32, overlap_grad_reduce=overlap, bucket_size=2000 if overlap else None),
        model)
    cfg.finalize_model_grads_func = finalize_model_grads
    return cfg, ddp


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

    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[ddp],
                                      num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS)
    return float(res[0]["loss"])


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
    for g in _get_param_groups([ddp], config, _compat.standard_overrides(config)):
        for p in g["params"]:
            out[names[p]] = (LR * g.get("lr_mult", 1.0), WD * g.get("wd_mult", 1.0))
    return out


def _oracle_run(k, steps, overlap=False):
    """Train ``steps`` steps; before each, compute the expected parameters by brute force. With
    ``overlap`` Megatron's reduce-scatter of each bucket starts during backward (several buckets)."""
    import torch.distributed as dist
    from lioncub_ds.kernels import reference
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    world = dist.get_world_size()
    size = world // k
    cfg, ddp = _build(k, overlap=overlap)
    config = _opt_config()
    opt = get_megatron_lioncub_optimizer(config, [ddp], lioncub={"voters": "node", "comm": "1bit",
                                                                  "tie_break": "zero"})
    hyper = _hyper(config, ddp)
    names = [n for n, _ in ddp.named_parameters()]
    momenta = {n: [torch.zeros(p.numel()) for _ in range(k)] for n, p in ddp.named_parameters()}
    mismatched, moved, elements, fps = 0, 0, 0, []
    for s in range(steps):
        local = _local_grads(cfg, ddp, s)
        every = {}
        for n in names:
            parts = [torch.zeros_like(local[n]) for _ in range(world)]
            dist.all_gather(parts, local[n])
            every[n] = parts
        expected = {}
        for n, p in ddp.named_parameters():
            lr, wd = hyper[n]
            cs, gbar = [], []
            for j in range(k):  # voter j: the mean gradient of instance j's ranks (consecutive DP ranks)
                acc = every[n][j * size].reshape(-1).clone()
                for r in range(1, size):
                    acc.add_(every[n][j * size + r].reshape(-1))
                gbar.append(acc.div_(size))
                cs.append(reference.lion_direction(momenta[n][j], gbar[j], BETAS[0]))
            votes = torch.sign(torch.stack(cs))
            delta = torch.sign((votes > 0).sum(0) * 2 - (votes != 0).sum(0)).float()  # ties -> 0
            e = p.detach().reshape(-1).clone()
            e.mul_(1.0 - lr * wd)
            e.add_(delta.mul(-lr))
            expected[n] = (e, int((delta != 0).sum()))
            for j in range(k):
                reference.momentum_update(momenta[n][j], gbar[j], BETAS[1])
        _train_step(ddp, opt, s)
        for n, p in ddp.named_parameters():
            e, mv = expected[n]
            mismatched += int((p.detach().reshape(-1) != e).sum())
            moved += mv
            elements += e.numel()
        fps.append(_fingerprints(ddp))
    lc = lioncub_optimizers(opt)[0]
    # Lion's step is blind to a common scale of g and m, the momenta are not: this rank's momentum
    # shard must be its instance's oracle momentum over the same elements (instance-mean scaling)
    dopt = opt.chained_optimizers[0]
    me = dist.get_rank() // size
    momentum_mismatched = 0
    for gi, g in enumerate(lc.param_groups):
        models = [*dopt.model_fp32_groups[gi], *dopt.model_float16_groups[gi]]
        for shard, model_param, name in zip(g["params"], models, g["param_names"]):
            rng = dopt._get_model_param_range_map(model_param)["param"]
            want = momenta[name][me][rng.start:rng.end]
            momentum_mismatched += int((lc.state[shard]["exp_avg"].reshape(-1) != want).sum())
    return {"mismatched": mismatched, "moved": moved, "elements": elements, "fps": fps,
            "momentum_mismatched": momentum_mismatched, "buckets": len(ddp.bucket_groups),
            "scopes": lc.comm_stats()["cumulative"]["by_scope"],
            "vote_group": tuple(dist.get_process_group_ranks(lc.vote_group)),
            "wrappers": [type(o).__name__ for o in opt.chained_optimizers],
            "shard_numel": sum(p.numel() for g in lc.param_groups for p in g["params"]),
            "model_numel": sum(p.numel() for p in ddp.parameters()),
            "state_bytes": lc.state_bytes()}


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
    for s in range(3):
        _train_step(ddp, opt, s)
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    before_checkpoint_save(opt, "per_rank", checkpoint_dir=ckpt)
    dist_checkpointing.save(_ckpt_state(ddp, opt), ckpt)
    # Megatron-LM's legacy format (--ckpt-format torch) also asks for the parameter state file
    legacy = os.path.join(ckpt, f"distrib_optim_{dist.get_rank()}.pt")
    opt.save_parameter_state(legacy)
    dist.barrier()
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
            "sync_error": sync_error,
            "files": sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)}


def _nan_run(k):
    """One rank (3) has a NaN in one gradient element at step 1: the element lands in one rank's
    shard only (its instance's reduce-scatter), yet every rank of the data-parallel group must skip
    that step (LionCub's flags: over the shard peers by the vote, over the instance by the
    agreement), and train on together afterwards."""
    import torch.distributed as dist
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    cfg, ddp = _build(k)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"voters": "node"})
    lc = lioncub_optimizers(opt)[0]
    weight = dict(ddp.named_parameters())["module.decoder.layers.0.mlp.linear_fc1.weight"]
    poison = {"on": False}

    def hook(grad):
        if poison["on"] and dist.get_rank() == 3:
            grad = grad.clone()
            grad.view(-1)[7] = float("nan")
        return grad

    weight.register_hook(hook)
    _train_step(ddp, opt, 0)
    before = _fingerprints(ddp)
    poison["on"] = True
    _train_step(ddp, opt, 1)
    poison["on"] = False
    after_nan = _fingerprints(ddp)
    _train_step(ddp, opt, 2)
    return {"unchanged": after_nan == before, "skipped": lc.comm_stats()["skipped_steps"],
            "trained_after": _fingerprints(ddp) != after_nan, "fp": _fingerprints(ddp)}


def _errors():
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer
    out = {}
    cfg, ddp = _build(2)
    for name, config, lioncub in (("no_dist_opt", _opt_config(use_distributed_optimizer=False), {"voters": "node"}),
                                  ("node_size", _opt_config(), {"voters": "node", "node_size": 4})):
        try:
            get_megatron_lioncub_optimizer(config, [ddp], lioncub=lioncub)
        except (LionCubConfigError, ValueError) as exc:
            out[name] = str(exc)
    from lioncub_ds.megatron.ddp import instance_votes_enabled
    out["untouched"] = not instance_votes_enabled(ddp)  # the errors came before any change
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
    out["contract"] = _contract_run(2, steps=2)
    out["contract_overlap"] = _contract_run(2, steps=2, overlap=True)
    out["resume"] = _resume_run(2, tmpdir)
    out["resume_bf16"] = _resume_run(2, tmpdir, torch.bfloat16)
    out["errors"] = _errors()
    out["nan"] = _nan_run(2)
    _init(1)
    out["k1"] = _k1_run(steps=2)
    # a checkpoint of the K = 2 layout, loaded under K = 1 (same DP size, same file names)
    cfg, ddp = _build(1)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"voters": "node"})
    try:
        after_checkpoint_load(opt, out["resume"]["ckpt"], mode="per_rank")
    except CheckpointError as exc:
        out["changed_layout"] = str(exc)
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def results():
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    tmpdir = tempfile.mkdtemp(prefix="lioncub-megatron-node-")
    try:
        yield run_ranks(_scenario, 4, tmpdir, timeout=600)
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
def test_overlapped_reduce_scatter_matches_the_oracle(results):
    """--overlap-grad-reduce: each bucket's reduce-scatter inside the instance starts in backward."""
    for r in results:
        o = r["oracle_overlap"]
        assert o["buckets"] > 1, o["buckets"]
        assert o["mismatched"] == 0 and o["moved"] > 0 and o["momentum_mismatched"] == 0, (r["rank"], o)
        assert o["fps"] == results[0]["oracle_overlap"]["fps"], r["rank"]


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
        assert msg is not None, "loading a K=2 checkpoint under K=1 was not refused"
        assert "--num-distributed-optimizer-instances 2 x 2" in msg and "--num-distributed-optimizer-instances 1 x 4" \
            in msg, msg


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
        assert e["untouched"]


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
    # what node voters still do not support stays in the one early error
    still = megatron_args_problems(p(argv=node + dist_opt + ["--overlap-param-gather", "--overlap-grad-reduce"]))
    assert any(x.startswith("--overlap-param-gather") for x in still), still
    assert not any(x.startswith("--overlap-grad-reduce") for x in still), still  # the instance's reduce-scatter
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
