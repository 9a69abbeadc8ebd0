"""``"voters": "node"`` through real DeepSpeed engines, under the ``deepspeed`` launcher.

``tests/test_deepspeed_node_voters.py`` runs it ONCE with ``deepspeed --num_accelerators 4``
(DS_ACCELERATOR=cpu, gloo): 4 ranks as 2 node groups × 2 ranks (``node_size: 2``). It plays
every scenario in that one launch (an engine per scenario) and writes ``<out>/rank<r>.json``.

Per precision (fp32, bf16), ZeRO stage 0, ``gradient_clipping`` on:
* train STEPS steps with a checkpoint at SAVE_AT (``engine.save_checkpoint``), and resume a
  freshly initialised engine from it (``engine.load_checkpoint``) to STEPS;
* the same steps with a plain-torch LionCub (voters="node") on the same model, data and local
  clipping rule: the reference the engine must equal bit for bit;
* the same model with today's flat voters (``voters: "rank"``) for the state bytes per rank;
* the collectives of the training steps (the NCCL-contract log: group ranks and dtype of each).

Also: master-only sharding (``voters: "rank"`` with ``node_size: 2``, bf16), ``node_size`` left
out (the deepspeed launcher's ``LOCAL_SIZE`` is the node), and the refusals (ZeRO stage 1/2,
fp16) before any optimizer exists. Like ``deepspeed_script.py`` it
installs the NCCL-contract wrapper before deepspeed is imported. Not a test module itself.
"""
import hashlib
import json
import os
import sys

__test__ = False

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import deepspeed_script as ds_script  # noqa: E402  (instrument, model, batches; imports no deepspeed)

STEPS, SAVE_AT, CLIP = 6, 3, 1.0
NODE = {"voters": "node", "node_size": 2}


def digest(tensors):
    import torch
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def cfg_for(dtype, **params):
    import torch
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 6, "wall_clock_breakdown": False,
           "gradient_clipping": CLIP, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "LionCub", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1,
                                                       "comm": "1bit", **params}}}
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def initialize(cfg, seed=0):
    import deepspeed
    model = ds_script.make_model(seed)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def loss_of(model, rank, step, dtype):
    x, y = ds_script.batch(rank, step, 0, dtype)
    return ((model(x) - y) ** 2).float().mean()


def train(engine, rank, start, stop, dtype):
    losses = []
    for s in range(start, stop):
        loss = loss_of(engine, rank, s, dtype)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def plain_step(model, opt, rank, s, dtype):
    """One plain-torch step with the integration's local clipping rule."""
    import torch
    loss_of(model, rank, s, dtype).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum().sqrt())
    coef = CLIP / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    opt.step()
    opt.zero_grad()


def reference(rank, dtype, settings=NODE):
    """Plain-torch LionCub (voters="node", or ``settings``) with the integration's local clipping rule."""
    import lioncub_ds
    model = ds_script.make_model(0).to(dtype)
    opt = lioncub_ds.LionCub(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, comm="1bit",
                             **settings)
    for s in range(STEPS):
        plain_step(model, opt, rank, s, dtype)
    return digest([p for p in model.parameters()])


def node_scenario(dtype, rank, out_dir):
    import torch
    import lioncub_ds
    import lioncub_ds.deepspeed as lds
    cfg = cfg_for(dtype, **NODE)
    engine = initialize(cfg)
    mark = len(ds_script.NC.log())
    losses = train(engine, rank, 0, SAVE_AT, dtype)
    calls = list(ds_script.NC.log()[mark:])
    ckpt = os.path.join(out_dir, f"ckpt_{str(dtype).split('.')[-1]}")
    engine.save_checkpoint(ckpt, tag="mid")
    losses += train(engine, rank, SAVE_AT, STEPS, dtype)
    opt = engine.basic_optimizer
    res = {"losses": losses, "digest": digest(engine.module.parameters()),
           "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
           "stepped_dtypes": sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}),
           "wrapper": type(engine.optimizer).__name__, "summary": engine.lioncub.summary(),
           "state_bytes": lds.state_bytes(engine), "lioncub_state_bytes": opt.state_bytes(),
           "shard_numels": [t.numel() for _, t in sorted(opt.momenta.shards["momentum"].items())],
           "by_scope": lds.comm_stats(engine)["cumulative"]["by_scope"], "step_count": opt.step_count,
           "grad_norm": float(engine.get_global_grad_norm()), "calls": [list(map(str, e)) for e in calls],
           "calls_raw": [[e[0], list(e[1]) if e[1] else None, e[2], list(e[3]) if e[3] else None] for e in calls
                         if len(e) >= 4],
           "files": sorted(f for f in os.listdir(os.path.join(ckpt, "mid")) if f.startswith("lioncub-rank"))}
    engine2 = initialize(cfg, seed=123)  # another init: everything must come from the checkpoint
    path, _ = engine2.load_checkpoint(ckpt, tag="mid")
    res["resume_path"] = path
    res["loaded_digest"] = digest(engine2.module.parameters())
    res["resumed_losses"] = train(engine2, rank, SAVE_AT, STEPS, dtype)
    res["resumed_digest"] = digest(engine2.module.parameters())
    res["reference_digest"] = reference(rank, dtype)
    # the same files into 1 group x 4 ranks: resharded by engine.load_checkpoint exactly as
    # lioncub_ds.checkpoint.load reshards them for a plain-torch LionCub (tests/test_reshard.py checks
    # that one against the oracle); then one more step of each
    other = initialize(cfg_for(dtype, voters="node", node_size=4), seed=5)
    other.load_checkpoint(ckpt, tag="mid")
    plain_model = ds_script.make_model(0).to(dtype)
    plain_model.load_state_dict(other.module.state_dict())
    plain = lioncub_ds.LionCub(plain_model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, comm="1bit",
                               voters="node", node_size=4)
    lioncub_ds.checkpoint.load(plain, os.path.join(ckpt, "mid"))
    mine, theirs = other.basic_optimizer.state_dict()["lioncub"]["node"], plain.state_dict()["lioncub"]["node"]
    same = all(sorted(mine[k]) == sorted(theirs[k]) and all(digest([mine[k][i]]) == digest([theirs[k][i]])
                                                          for i in mine[k]) for k in ("momentum", "master"))
    res["resharded"] = {"same_state": same, "step": other.basic_optimizer.step_count,
                        "masters": sorted(mine["master"]), "layout": [mine["voters"], mine["node_size"]]}
    train(other, rank, SAVE_AT, SAVE_AT + 1, dtype)
    plain_step(plain_model, plain, rank, SAVE_AT, dtype)
    res["resharded"]["stepped_equal"] = digest(other.module.parameters()) == digest(plain_model.parameters())
    # node voters -> flat voting through the engine: the weights and every rank's momentum (the mean
    # of the 2 groups', as the plain-torch load reshards it); fp32: one more step equals plain torch
    flat_resume = initialize(cfg_for(dtype), seed=6)
    try:
        flat_resume.load_checkpoint(ckpt, tag="mid")
        res["to_flat"] = {"error": None, "weights": digest(flat_resume.module.parameters()) == res["loaded_digest"]}
        plain_model = ds_script.make_model(0).to(dtype)
        plain_model.load_state_dict(flat_resume.module.state_dict())
        plain = lioncub_ds.LionCub(plain_model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1,
                                   comm="1bit")
        lioncub_ds.checkpoint.load(plain, os.path.join(ckpt, "mid"))
        res["to_flat"]["momenta"] = all(
            digest([flat_resume.basic_optimizer.state[p]["exp_avg"]]) == digest([plain.state[q]["exp_avg"]])
            for p, q in zip(flat_resume.basic_optimizer.param_groups[0]["params"], plain.param_groups[0]["params"]))
        train(flat_resume, rank, SAVE_AT, SAVE_AT + 1, dtype)
        plain_step(plain_model, plain, rank, SAVE_AT, dtype)
        res["to_flat"]["stepped_equal"] = digest(flat_resume.module.parameters()) == digest(plain_model.parameters())
        res["to_flat"]["digest"] = digest(flat_resume.module.parameters())
    except Exception as exc:  # noqa: BLE001 - the test reports it
        res["to_flat"] = {"error": f"{type(exc).__name__}: {exc}"}
    # today's stage 0 (every rank votes, full replicas of the state) on the same model
    flat = initialize(cfg_for(dtype))
    train(flat, rank, 0, 1, dtype)
    res["flat_state_bytes"] = lds.state_bytes(flat)
    res["flat_wrapper"] = type(flat.optimizer).__name__
    return res


MASTER_ONLY = {"voters": "rank", "node_size": 2}


def master_only_scenario(rank, out_dir):
    """bf16 with master-only sharding: every rank votes with its full momentum; LionCub keeps the
    fp32 master of its 1/L shard (no DeepSpeed wrapper); checkpoint and resume."""
    import torch
    import lioncub_ds.deepspeed as lds
    dtype = torch.bfloat16
    cfg = cfg_for(dtype, **MASTER_ONLY)
    engine = initialize(cfg)
    losses = train(engine, rank, 0, SAVE_AT, dtype)
    ckpt = os.path.join(out_dir, "ckpt_master_only")
    engine.save_checkpoint(ckpt, tag="mid")
    losses += train(engine, rank, SAVE_AT, STEPS, dtype)
    opt = engine.basic_optimizer
    res = {"losses": losses, "digest": digest(engine.module.parameters()),
           "wrapper": type(engine.optimizer).__name__, "summary": engine.lioncub.summary(),
           "state_bytes": lds.state_bytes(engine), "step_count": opt.step_count,
           "master_numels": [t.numel() for _, t in sorted(opt.momenta.shards["master"].items())],
           "by_scope": lds.comm_stats(engine)["cumulative"]["by_scope"]}
    engine2 = initialize(cfg, seed=123)
    res["resume_path"], _ = engine2.load_checkpoint(ckpt, tag="mid")
    res["resumed_losses"] = train(engine2, rank, SAVE_AT, STEPS, dtype)
    res["resumed_digest"] = digest(engine2.module.parameters())
    res["reference_digest"] = reference(rank, dtype, MASTER_ONLY)
    flat = initialize(cfg_for(dtype))
    train(flat, rank, 0, 1, dtype)
    res["flat_state_bytes"] = lds.state_bytes(flat)
    return res


def node_size_one_scenario(rank):
    """voters="node" whose node size resolves to 1 is flat voting (issue 47: the mode is decided once,
    by the resolved strategy): bf16 at stage 0 gets DeepSpeed's wrapper like a flat LionCub, and
    trains bit for bit as the flat config does."""
    import torch
    dtype = torch.bfloat16
    one = initialize(cfg_for(dtype, voters="node", node_size=1))
    flat = initialize(cfg_for(dtype))
    train(one, rank, 0, 3, dtype)
    train(flat, rank, 0, 3, dtype)
    s = one.basic_optimizer.strategy
    return {"wrapper": type(one.optimizer).__name__, "flat_wrapper": type(flat.optimizer).__name__,
            "mode": s.mode, "voters": s.voters, "node_size": s.node_size, "summary": one.lioncub.summary(),
            "digest": digest(one.module.parameters()), "flat_digest": digest(flat.module.parameters())}


def default_node_size(rank):
    import torch
    engine = initialize(cfg_for(torch.float32, voters="node"))
    t = engine.basic_optimizer.topology
    train(engine, rank, 0, 1, torch.float32)
    return {"node_size": t.node_size, "groups": t.world_size, "summary": engine.lioncub.summary()}


def shipped_config(rank):
    """configs/ds_lioncub_node_voters.json as shipped (no node_size: the launcher's machine is the
    group), with only the batch and accumulation made small for the tiny model."""
    import torch
    with open(os.path.join(os.path.dirname(HERE), "configs", "ds_lioncub_node_voters.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    engine = initialize(cfg)
    losses = train(engine, rank, 0, 3, torch.bfloat16)
    return {"losses": losses, "digest": digest(engine.module.parameters()), "summary": engine.lioncub.summary(),
            "step_count": engine.basic_optimizer.step_count}


def expect_error(cfg, client=None):
    import deepspeed
    import lioncub_ds
    model = ds_script.make_model(0)
    kw = {}
    if client is not None:
        del cfg["optimizer"]
        kw["optimizer"] = lioncub_ds.LionCub(model.parameters(), lr=1e-3, **client)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)
        return {"error_type": None, "error": None}
    except Exception as exc:  # noqa: BLE001
        return {"error_type": type(exc).__name__, "error": str(exc)}


def overlap_scenario(rank):
    """fp32 node voters with "overlap": true (the group's reduce-scatter from backward's hooks; the
    engine's gradient clipping after them makes every rank redo it): the same parameters as the
    plain-torch reference without overlap."""
    import torch
    engine = initialize(cfg_for(torch.float32, **NODE, overlap=True))
    losses = train(engine, rank, 0, STEPS, torch.float32)
    return {"losses": losses, "digest": digest(engine.module.parameters()),
            "reference": reference(rank, torch.float32), "summary": engine.lioncub.summary()}


def main():
    args = ds_script.parse_args()
    ds_script.instrument()
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.set_num_threads(1)
    # The fp16 refusals are LionCub's, checked after DeepSpeed's own "fp16 is not supported on your
    # device", which the CPU accelerator says on CPUs without AVX512-FP16: overridden as in
    # deepspeed_script.py (test-only), so that the test reaches LionCub's check on every x86-64.
    get_accelerator().is_fp16_supported = lambda: True
    import lioncub_ds.deepspeed  # noqa: F401  (the .pth hook registered it already; the helpers)
    scenarios = {
        "node_fp32": lambda: node_scenario(torch.float32, rank, args.out),
        "node_bf16": lambda: node_scenario(torch.bfloat16, rank, args.out),
        "node_overlap_fp32": lambda: overlap_scenario(rank),
        "default_node_size": lambda: default_node_size(rank),
        "node_size_one_bf16": lambda: node_size_one_scenario(rank),
        "shipped_config": lambda: shipped_config(rank),
        "err_zero1": lambda: expect_error(dict(cfg_for(torch.float32, **NODE), zero_optimization={"stage": 1})),
        "err_zero2_client": lambda: expect_error(dict(cfg_for(torch.float32), zero_optimization={"stage": 2}),
                                                 client=NODE),
        "err_fp16": lambda: expect_error(dict(cfg_for(torch.float32, **NODE), fp16={"enabled": True})),
        "master_only_bf16": lambda: master_only_scenario(rank, args.out),
        "err_master_only_zero1": lambda: expect_error(dict(cfg_for(torch.float32, **MASTER_ONLY),
                                                           zero_optimization={"stage": 1})),
        "err_master_only_fp16": lambda: expect_error(dict(cfg_for(torch.float32, **MASTER_ONLY),
                                                          fp16={"enabled": True})),
    }
    result = {"world_size": torch.distributed.get_world_size(), "LOCAL_SIZE": os.environ.get("LOCAL_SIZE"),
              "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE")}
    ds_script.play(scenarios, args.only, result)
    ds_script.write_result(args.out, rank, result)


if __name__ == "__main__":
    main()
    ds_script.exit_now()
