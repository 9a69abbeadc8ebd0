"""The front door, as a new user meets it (issue 33): the README, the docs' commands and links, the
configs table, the pretraining script's flags and messages, the demos' flags and exit, the extras.

Unit tests read files and call the scripts' functions in this process; the ``dist`` test runs
``python -m benchmarks.demo`` as a user does; the ``integration`` tests run the pretraining script
under the ``deepspeed`` launcher on 2 CPU ranks (and HF's own config processing).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGS = ROOT / "configs"
HF_TEMPLATE = CONFIGS / "ds_hf_lioncub.json"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


@pytest.fixture(scope="module")
def ds_pretrain():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from benchmarks import ds_pretrain
    return ds_pretrain


def _configs() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))}


# ----------------------------------------------------------------------------- README and docs
def test_readme_is_at_most_250_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 250, f"README.md has {n} lines; keep it a front door (<= 250): details go to docs/"


def _section(text: str, heading: str) -> list[str]:
    """The lines under ``heading`` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return lines[start:end]


def test_readme_results_are_one_short_row_per_claim():
    """The README's Results table: one row per claim, each <= 200 characters (the figure, its condition and
    a link); the details live in docs/results.md and docs/convergence.md."""
    rows = [ln for ln in _section(README.read_text(encoding="utf-8"), "## Results") if ln.startswith("|")]
    assert rows[0].startswith("| claim |") and len(rows) >= 8, rows[:2]
    long_rows = [f"{len(r)}: {r[:80]}" for r in rows if len(r) > 200]
    assert not long_rows, "\n".join(long_rows)
    for r in rows[2:]:
        assert re.search(r"\]\((docs/[^)]+)\)", r.split("|")[-2]), f"no link in the last cell: {r}"


def test_readme_convergence_section_is_short_and_says_each_figure_once():
    text = README.read_text(encoding="utf-8")
    lines = [ln for ln in _section(text, "### Convergence") if ln.strip()]
    assert 0 < len(lines) <= 12, f"the README's Convergence section has {len(lines)} lines (<= 12)"
    figures = re.findall(r"[+−-]\d+\.\d+% \[[^\]]+\]", text)  # every gap with its interval
    assert len(figures) == len(set(figures)), f"a gap quoted twice in the README: {sorted(figures)}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#+\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def _markdown_files() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


def test_links_in_readme_and_docs_resolve():
    """Every relative link in README.md and docs/ names a file that exists and, for a Markdown file, a
    heading that exists (moving sections out of the README must not leave dead links)."""
    bad = []
    for md in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path) if path else md
            if not dest.exists():
                bad.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_every_documented_python_m_command_names_a_module_that_exists():
    """``python -m X`` in the README, docs/, the Makefile, examples/ and benchmarks/ names an importable module;
    ``python -m benchmarks NAME`` a registered benchmark (the workshop moved out of the wheel)."""
    from benchmarks import BENCHMARKS
    files = _markdown_files() + [ROOT / "Makefile"] + sorted((ROOT / "examples").glob("*.py")) \
        + sorted((ROOT / "benchmarks").glob("*.py"))
    bad, seen = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        for module, rest in re.findall(r"python -m ([A-Za-z_][\w.]*)[ \t]*([\w-]*)", text):
            module = module.rstrip(".")
            seen += 1
            if module == "pytest":
                continue
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                bad.append(f"{f.relative_to(ROOT)}: python -m {module}")
            elif module == "benchmarks" and rest and not rest.startswith("-") and rest not in BENCHMARKS \
                    and rest != "all":
                bad.append(f"{f.relative_to(ROOT)}: python -m benchmarks {rest} (not in benchmarks.BENCHMARKS)")
    assert seen > 20 and not bad, "\n".join(bad)


def test_unit_tier_time_is_stated_alike():
    """The Makefile, the README and pytest.ini give the unit tier's time in the same words."""
    phrase = "about 20 s on 2 idle cores"
    for name in ("Makefile", "README.md", "pytest.ini"):
        text = (ROOT / name).read_text(encoding="utf-8")
        assert phrase in text, f"{name} does not say the unit tier takes {phrase!r}"
        assert not re.search(r"~25 s|about 2 minutes", text), name


# ----------------------------------------------------------------------------- docs/deepspeed.md's configs table
def _configs_table() -> dict[str, dict[str, str]]:
    text = (DOCS / "deepspeed.md").read_text(encoding="utf-8")
    section = text[text.index("## The configs"):]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    table = {}
    for ln in rows[2:]:
        if not ln.startswith("| `configs/"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split(" | ")]
        table[cells[0].strip("`").split("/")[-1]] = dict(zip(header, cells))
    return table


def _precision_and_stage(cfg: dict) -> str:
    for kind in ("bf16", "fp16"):
        enabled = cfg.get(kind, {}).get("enabled", False)
        if enabled == "auto":
            precision = '`"auto"` (HF fills it)'
            break
        if enabled:
            precision = kind
            break
    else:
        precision = "fp32"
    return f"{precision}, stage {cfg.get('zero_optimization', {}).get('stage', 0)}"


def _comm_cell(cfg: dict) -> str:
    params = cfg["optimizer"]["params"]
    if "comm" in params:
        return f'`"{params["comm"]}"`'
    return "not set (no votes at ZeRO 1/2)" if cfg.get("zero_optimization", {}).get("stage", 0) > 0 else "not set"


def _sync_cell(cfg: dict) -> str:
    sync = cfg["optimizer"]["params"].get("momentum_sync")
    return "none" if sync is None else f"`{json.dumps(sync)}`"


def test_deepspeed_configs_table_lists_every_config_as_it_is():
    table = _configs_table()
    configs = _configs()
    assert set(table) == set(configs), f"docs/deepspeed.md's configs table vs configs/: {set(table) ^ set(configs)}"
    for name, cfg in configs.items():
        row = table[name]
        assert row["precision / ZeRO"] == _precision_and_stage(cfg), name
        assert row["`comm`"] == _comm_cell(cfg), name
        assert row["momentum sync"] == _sync_cell(cfg), name
    # the case issue 33 found: the node-voter config syncs momenta (int8, every 20)
    assert table["ds_lioncub_node_voters.json"]["momentum sync"] == '`{"every": 20, "dtype": "int8"}`'


def test_deepspeed_configs_table_quotes_the_files_lr_betas_and_decay():
    """Where a row of the table quotes `lr X`, `betas [a, b]` or `weight_decay X`, they are the file's
    (the recommended config's moved with the chosen preset once; its row must move with it)."""
    configs = _configs()
    quoted = 0
    for name, row in _configs_table().items():
        params = configs[name]["optimizer"]["params"]
        cell = row["other LionCub params"]
        for key, pattern in (("lr", r"`lr ([0-9.e+-]+)`"), ("weight_decay", r"`weight_decay ([0-9.e+-]+)`")):
            m = re.search(pattern, cell)
            if m:
                assert float(m.group(1)) == pytest.approx(float(params[key])), (name, key, cell)
                quoted += 1
        m = re.search(r"`betas \[([0-9.]+), ([0-9.]+)\]`", cell)
        if m:
            assert [float(m.group(1)), float(m.group(2))] == list(params["betas"]), (name, cell)
            quoted += 1
    assert quoted >= 9  # the demo's and the recommended config's three, and the GPU bf16 config's


# ----------------------------------------------------------------------------- the pretraining script: --steps
def _lr_trace(scheduler_cfg: dict, steps: int) -> list[float]:
    """The lr DeepSpeed's own scheduler gives after each of ``steps`` optimizer steps (what the script logs)."""
    import torch
    from deepspeed.runtime import lr_schedules
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(scheduler_cfg["params"].get(
        "warmup_max_lr", 5e-4)))
    sched = getattr(lr_schedules, scheduler_cfg["type"])(opt, **scheduler_cfg["params"])
    out = []
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("steps", [20, 30, 500])
def test_steps_fits_every_scheduler_the_configs_use(ds_pretrain, steps):
    """With --steps N the run ends decayed, past its warm-up, whatever the config's schedule length:
    for every shipped config with a scheduler (the HF template's are HF's to fill)."""
    fitted = 0
    for name, cfg in _configs().items():
        if "scheduler" not in cfg or name == HF_TEMPLATE.name:
            continue
        assert cfg["scheduler"]["type"] in ds_pretrain.SCHEDULE_LENGTHS, f"{name}: --steps cannot fit it"
        note = ds_pretrain.fit_schedule(cfg, steps)
        sp = cfg["scheduler"]["params"]
        assert sp["total_num_steps"] == steps and 1 <= sp["warmup_num_steps"] <= steps, (name, sp)
        assert f"--steps {steps}" in note, note
        lrs = _lr_trace(cfg["scheduler"], steps)
        peak = max(range(steps), key=lrs.__getitem__)
        assert peak < steps - 1 and lrs[-1] < 0.5 * lrs[peak], f"{name}, --steps {steps}: {lrs}"
        fitted += 1
    assert fitted == 10  # every shipped config but the HF template (a positive control: the loop ran)


def test_without_the_fit_the_recommended_schedule_is_still_warming_up(ds_pretrain):
    """The control for the test above: ds_lioncub_recommended.json as written (1,200 steps, 30 of warm-up)
    cut at 20 steps ends inside its warm-up, the lr still rising (what issue 33 saw)."""
    cfg = _configs()["ds_lioncub_recommended.json"]
    lrs = _lr_trace(cfg["scheduler"], 20)
    assert lrs == sorted(lrs) and lrs[-1] < 0.9 * cfg["optimizer"]["params"]["lr"]


def test_steps_help_says_what_it_fits(ds_pretrain, capsys):
    with pytest.raises(SystemExit):
        ds_pretrain.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "WarmupDecayLR or WarmupCosineLR" in text and "warmup_num_steps is scaled" in text


# ----------------------------------------------------------------------------- the HF template
def test_pretraining_script_refuses_the_hf_template_by_name(ds_pretrain):
    with pytest.raises(SystemExit) as exc:
        ds_pretrain.read_config(str(HF_TEMPLATE))
    msg = str(exc.value)
    assert str(HF_TEMPLATE) in msg and "template for the Hugging Face Trainer" in msg
    for key in ("optimizer.params.lr", "optimizer.params.betas", "scheduler.params.total_num_steps",
                "train_micro_batch_size_per_gpu"):
        assert key in msg, msg
    # LionCub's own "auto" values are values, not placeholders: every other shipped config is read
    for name in _configs():
        if name != HF_TEMPLATE.name:
            ds_pretrain.read_config(str(CONFIGS / name))


@pytest.mark.integration
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate", "deepspeed")),
                    reason="needs transformers, accelerate and deepspeed")
def test_hf_template_as_hf_fills_it_draws_no_lioncub_warning(tmp_path):
    """HF's own config processing fills the shipped template; LionCub accepts the result without a
    warning. The control: ``"eps": "auto"`` (HF's own templates have it) draws the one eps warning."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    from lioncub_ds.deepspeed.engine import config_warnings, split_params
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, learning_rate=1e-3, weight_decay=0.1,
                             adam_beta1=0.95, adam_beta2=0.98, report_to=[])
    warnings = {}
    for case in ("shipped", "with eps"):
        cfg = json.loads(HF_TEMPLATE.read_text())
        if case == "with eps":
            cfg["optimizer"]["params"]["eps"] = "auto"
        hf = HfTrainerDeepSpeedConfig(cfg)
        hf.trainer_config_process(args)
        params = hf.config["optimizer"]["params"]
        split_params(dict(params))  # valid
        warnings[case] = config_warnings(params)
    assert warnings["shipped"] == []
    assert len(warnings["with eps"]) == 1 and "ignores optimizer.params eps=1e-08" in warnings["with eps"][0]


# ----------------------------------------------------------------------------- bytes: last step vs mean
def _stats(total, inter=0, intra=0):
    scope = {"inter_node": inter, "intra_node": intra} if inter or intra else {"vote_group": total}
    return {"last_step": {"bytes_sent": total, "by_scope": scope}}


def test_progress_and_done_lines_label_last_step_and_mean(ds_pretrain):
    grad = 4 * 220_544  # fp32 gradients of the tiny GPT
    sent = ds_pretrain.SentBytes(grad, 2)
    ring = 2 * (2 - 1) * grad // 2
    sent.record(_stats(ring // 32 + ring // 2))  # a step with a momentum sync
    for _ in range(19):
        sent.record(_stats(ring // 32))
    assert sent.last().startswith("sent in the last step: ")
    assert "/rank (" in sent.last() and "x less than the fp32 gradient all-reduce" in sent.last()
    mean = sent.mean()
    assert mean.startswith("sent, mean of 20 steps incl. momentum syncs: ") and "/step/rank" in mean
    mean_bytes = (20 * (ring // 32) + ring // 2) / 20
    assert f"({ring / mean_bytes:.0f}x less" in mean and f"({ring / (ring // 32):.0f}x less" in sent.last(), mean
    # more bytes than the baseline is said so, never as "1x less"
    sent.record(_stats(2 * ring))
    assert "2.00x the bytes of the fp32 gradient all-reduce" in sent.last(), sent.last()


def test_node_voter_lines_give_inter_node_bytes_against_a_two_level_all_reduce(ds_pretrain):
    grad = 2 * 1000  # bf16
    one_group = ds_pretrain.SentBytes(grad, 2, dtype="16-bit", nodes=(1, 2))
    one_group.record(_stats(2000, inter=0, intra=2000))
    for line in (one_group.last(), one_group.mean()):
        assert "inter-node: none (one node group of 2 ranks" in line and "less" not in line, line
        assert "intra-node" in line and "(1 node group x 2 ranks)" in line, line
    two = ds_pretrain.SentBytes(grad, 4, dtype="16-bit", nodes=(2, 2))
    two.record(_stats(1000 + 30, inter=30, intra=1000))
    # a two-level all-reduce sends 2 (Nn-1)/Nn x grad / L = 1000 B per rank across nodes
    assert two.summary()["two_level_inter_node_bytes"] == 1000
    assert "inter-node 30 B/rank (33x less than a two-level 16-bit all-reduce's inter-node bytes)" in two.last()


# ----------------------------------------------------------------------------- demo and example flags
def test_demo_flags_take_their_choices_from_the_config(capsys):
    from benchmarks.demo import build_parser, setting_choices
    from lioncub_ds.config import COMM_ALGORITHMS
    assert setting_choices("comm") == COMM_ALGORITHMS and "bbit" in COMM_ALGORITHMS
    parser = build_parser("demo")
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--comm", "1-bit"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid choice: '1-bit'" in err and "'bbit'" in err
    assert len(err.splitlines()) < 15, err
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "bbit" in capsys.readouterr().out


def test_bad_flag_combinations_are_one_message_naming_the_fix(capsys):
    from benchmarks.demo import build_parser, check_lioncub_flags
    parser = build_parser("demo")
    for argv, fix in ((["--comm", "bbit"], "add --quant l1"), (["--comm", "1bit", "--quant", "l1"], "drop --quant")):
        with pytest.raises(SystemExit) as exc:
            check_lioncub_flags(parser, parser.parse_args(argv))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and fix in err and "Traceback" not in err, err
    for argv in (["--comm", "bbit", "--quant", "l1"], ["--comm", "1bit"], ["--optim", "lion", "--comm", "bbit"]):
        check_lioncub_flags(parser, parser.parse_args(argv))


def test_torchrun_example_checks_flags_before_training(capsys):
    spec = importlib.util.spec_from_file_location("example_pretrain_gpt", ROOT / "examples" / "pretrain_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for argv in (["--comm", "1-bit"], ["--comm", "bbit"]):
        with pytest.raises(SystemExit) as exc:
            example.main(argv)
        assert exc.value.code == 2
    assert "add --quant l1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- packaging
def _extras() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_extras_are_bounded_to_the_supported_versions():
    from lioncub_ds.deepspeed import _compat as ds_compat
    from lioncub_ds.megatron import _compat as mc_compat
    extras = _extras()
    (ds,) = extras["deepspeed"]
    (mc,) = extras["megatron"]
    lo, hi = re.fullmatch(r"deepspeed>=([\d.]+),<([\d.]+)", ds).groups()
    assert _version(lo) == ds_compat.MIN_VERSION[:2] and _version(hi) == ds_compat.MAX_VERSION[:2], ds
    lo, hi = re.fullmatch(r"megatron-core>=([\d.]+),<([\d.]+)", mc).groups()
    assert _version(lo) == mc_compat.MIN_VERSION, mc
    for v in mc_compat.TESTED_VERSIONS + mc_compat.CHECKED_AGAINST_SOURCE:
        assert _version(lo) <= _version(v)[:2] < _version(hi), (v, mc)


# ----------------------------------------------------------------------------- runs, as a user runs them
@pytest.mark.dist
def test_demo_ends_without_a_leaked_semaphore_warning(tmp_path):
    """``python -m benchmarks.demo`` on 2 spawned ranks: exit 0, and no resource-tracker warning
    (tqdm's multiprocessing lock in each rank, never released by exit_cleanly's os._exit)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LIONCUB_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.demo", "--steps", "3", "--preset", "tiny",
                           "--batch-size", "4", "--max-bytes", "200000", "--eval-iters", "1", "--log-interval", "3",
                           "--eval-interval", "3", "--min-drop", "-10", "--comm", "1bit"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "sent in the last step" in out and "mean of 3 steps incl. momentum syncs" in out, out[-2000:]
    assert "leaked" not in out and "resource_tracker" not in out, out[-2000:]


def _launch(tmp_path, *args, ranks=2, timeout=600):
    launcher = Path(sys.executable).with_name("deepspeed")
    from lioncub_ds.testing.spawn import free_port
    cmd = [str(launcher) if launcher.exists() else "deepspeed", "--num_accelerators", str(ranks), "--master_port",
           str(free_port()), str(ROOT / "examples" / "pretrain_gpt_deepspeed.py"), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               LIONCUB_CACHE_DIR=str(tmp_path / "cache"))
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions"))
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=timeout)
    return proc, proc.stdout + proc.stderr


@pytest.mark.integration
@needs_deepspeed
def test_readme_cpu_launch_fits_the_recommended_schedule(tmp_path):
    """The README's CPU command for the deepspeed launcher runs, and with --steps 30 the recommended
    config's WarmupCosineLR ends at its floor (lr x cos_min_ratio), not inside its warm-up."""
    cmd = ("deepspeed --num_accelerators 2 examples/pretrain_gpt_deepspeed.py \\\n"
           "    --deepspeed_config configs/ds_lioncub_recommended.json --preset tiny --steps 30")
    assert cmd in README.read_text(encoding="utf-8")
    out_json = tmp_path / "run.json"
    proc, log = _launch(tmp_path, "--deepspeed_config", "configs/ds_lioncub_recommended.json", "--preset", "tiny",
                        "--steps", "30", "--json-out", str(out_json), "--no-progress", "--log-interval", "10")
    assert proc.returncode == 0, log[-6000:]
    summary = json.loads(out_json.read_text())
    cfg = _configs()["ds_lioncub_recommended.json"]
    floor = cfg["optimizer"]["params"]["lr"] * cfg["scheduler"]["params"]["cos_min_ratio"]
    assert summary["lrs"][-1][0] == 30 and summary["lrs"][-1][1] == pytest.approx(floor, rel=1e-6), summary["lrs"]
    assert summary["params_in_sync"]
    assert "WarmupCosineLR fitted to the run (total_num_steps 1200 -> 30" in log
    assert "sent in the last step: " in log and "sent, mean of 30 steps incl. momentum syncs: " in log, log[-3000:]


@pytest.mark.integration
@needs_deepspeed
def test_pretraining_script_hf_template_and_one_node_group(tmp_path):
    """The HF template is refused in one message (no traceback); the node-voter config on 2 ranks
    (one node group of 2) says that no bytes cross nodes instead of "1x less"."""
    proc, log = _launch(tmp_path, "--deepspeed_config", str(HF_TEMPLATE), "--preset", "tiny", "--steps", "2")
    assert proc.returncode != 0 and "template for the Hugging Face Trainer" in log, log[-4000:]
    assert "Traceback" not in log and "invalid literal" not in log, log[-4000:]
    proc, log = _launch(tmp_path, "--deepspeed_config", "configs/ds_lioncub_node_voters.json", "--preset", "tiny",
                        "--steps", "4", "--log-interval", "2", "--eval-iters", "1", "--no-progress")
    assert proc.returncode == 0, log[-6000:]
    done = [ln for ln in log.splitlines() if "[pretrain] done" in ln]
    assert len(done) == 1 and "inter-node: none (one node group of 2 ranks" in done[0], done
    assert "1x less" not in log


@pytest.mark.integration
@needs_deepspeed
def test_a_mistyped_lioncub_setting_is_one_line_from_rank_0(tmp_path):
    """A typo in optimizer.params under the deepspeed launcher: one message naming the key and the
    suggestion, from rank 0, before any process group; no per-rank tracebacks."""
    cfg = _configs()["ds_cpu_demo.json"]
    cfg["optimizer"]["params"]["weight_decy"] = cfg["optimizer"]["params"].pop("weight_decay")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(cfg))
    proc, log = _launch(tmp_path, "--deepspeed_config", str(path), "--preset", "tiny", "--steps", "2")
    assert proc.returncode != 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    lines = [ln for ln in log.splitlines() if "unknown ds_config optimizer.params key 'weight_decy'" in ln]
    assert len(lines) == 1 and "did you mean 'weight_decay'" in lines[0], log[-4000:]
