"""The config conventions: experiment=, debug=, paths=, the optional local config, tags, the
objective a job returns to a sweeper, and the Optuna sweeper's place behind the security gate."""

from __future__ import annotations

import json
import math
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework import cli
from framework.config import security
from framework.config.compose import Source, compose
from framework.config.validate import validate
from framework.errors import ConfigError
from tests.conftest import REPO, run_cli


@pytest.fixture(autouse=True)
def _no_hydra_config():
    yield
    cli._clear_hydra_config()


def small(tmp_path: Path, run: str = "run", **extra) -> list[str]:
    """A small grid and model that leave the trainer's own values to the config under test."""
    o = {
        "hydra.run.dir": str(tmp_path / run),
        "data.root": str(tmp_path / "data"),
        "data.grid": "[16,16]",
        "data.hours_per_year": 48,
        "data.batch_size": 4,
        "model.model_channels": 8,
        "trainer.progress": "false",
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def rows(run_dir: Path, split: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == split]


# -- composition ------------------------------------------------------------------------------------
def test_an_experiment_applies_after_the_recipe_and_debug_after_both():
    plain = validate(compose([]))
    exp = validate(compose(["experiment=tiny_regression"]))
    assert exp.recipe == "tiny" and exp.optim.lr == 3e-3 != plain.optim.lr  # the recipe says 2e-3
    assert exp.raw.optim._target_ == "torch.optim.AdamW" and exp.trainer.grad_accum == 2
    assert exp.tags == ("stormcast", "regression", "tiny") and list(exp.raw.tags) == list(exp.tags)
    both = validate(compose(["experiment=tiny_regression", "debug=default"]))
    assert both.trainer.max_steps == 5 and both.optim.lr == 3e-3  # debug's steps, the experiment's lr
    assert both.checkpoint.name == "none" and not both.trainer.figures and both.trainer.progress
    # the command line still has the last word
    assert validate(compose(["debug=default", "trainer.max_steps=7"])).trainer.max_steps == 7


@pytest.mark.parametrize(
    "option,key,value",
    [
        ("overfit", "overfit_batches", 1),
        ("anomaly", "detect_anomaly", True),
        ("profile", "profile_steps", 3),
    ],
)
def test_each_debug_config_is_the_smoke_run_plus_its_knob(option, key, value):
    run = validate(compose([f"debug={option}"]))
    assert getattr(run.trainer, key) == value
    assert run.checkpoint.name == "none" and run.logger.name == "console" and not run.trainer.figures


def test_paths_move_the_data_and_the_run_dirs(tmp_path):
    cfg = compose(
        [f"paths.data_dir={tmp_path}/d", f"paths.output_dir={tmp_path}/o", f"paths.multirun_dir={tmp_path}/m"],
        with_hydra=True,
    )
    assert cfg.data.root == f"{tmp_path}/d/synthetic_32x32"
    assert re.fullmatch(rf"{tmp_path}/o/tiny/\d{{4}}-\d\d-\d\d/\d\d-\d\d-\d\d", cfg.hydra.run.dir)
    assert cfg.hydra.sweep.dir.startswith(f"{tmp_path}/m/tiny/")
    # the defaults keep the run-dir contract: outputs/<recipe>/<date>/<time>, multirun/... for sweeps
    default = compose([], with_hydra=True)
    assert default.hydra.run.dir.startswith("outputs/tiny/") and default.hydra.sweep.dir.startswith("multirun/tiny/")
    assert default.data.root == "data/synthetic_32x32"
    # what the run saves names them absolutely
    assert validate(compose([])).raw.paths.data_dir == str(Path("data").resolve())
    with pytest.raises(ConfigError, match=r"^paths\.output_dir: is empty$"):
        validate(compose(["paths.output_dir=''"]))


def test_the_local_config_is_optional_and_git_ignored(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf, ignore=shutil.ignore_patterns("local"))
    source = Source(config_dir=str(conf))
    assert compose([], source).data.root == "data/synthetic_32x32"  # none: nothing changes
    (conf / "local").mkdir(exist_ok=True)
    (conf / "local" / "default.yaml").write_text(
        "# @package _global_\npaths:\n  data_dir: /scratch/weather\ntrainer:\n  progress: false\n"
    )
    cfg = compose([], source)
    assert cfg.data.root == "/scratch/weather/synthetic_32x32" and cfg.trainer.progress is False
    assert compose(["trainer.progress=true"], source).trainer.progress is True  # the command line wins
    if (REPO / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "conf/local/default.yaml"], cwd=REPO)
        assert ignored.returncode == 0, "conf/local/default.yaml must be git-ignored"


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("tags=[ok,'']", r"^tags\[1\]: must be a printable name of 1 to 64 characters"),
        (f"tags=[{'x' * 65}]", r"^tags\[0\]: must be a printable name"),
        ("tags=[a,a]", r"^tags: has duplicates"),
        ("objective=loss", r"^objective: must be val/<key of the validation row> \(val/loss, \.\.\.\) or train/loss"),
        ("objective=val/", r"^objective: must be val/"),
    ],
)
def test_bad_tags_and_objectives_are_one_line(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        validate(compose([override]))
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_a_resume_may_change_tags_objective_and_paths_but_not_the_model():
    from framework.config.resume import check_resume, schema_rules
    from framework.config.schema import TopConfig

    def plain(overrides):
        run = validate(compose(overrides))
        return run, OmegaConf.to_container(run.raw, resolve=True)

    _, saved = plain(["tags=[a]"])
    run, now = plain(["tags=[a,b]", "objective=val/rmse", "paths.output_dir=/elsewhere"])
    rules = (*schema_rules(run), *TopConfig.RESUME_RULES)  # as the trainer passes them
    changed = {c.key for c in check_resume(saved, now, rules=rules)}
    assert {"tags", "objective", "paths.output_dir"} <= changed
    run, now = plain(["model.compiled_norm=explicit", "model.checkpoint_level=1"])  # how it computes
    changed = {c.key for c in check_resume(saved, now, rules=(*schema_rules(run), *TopConfig.RESUME_RULES))}
    assert {"model.compiled_norm", "model.checkpoint_level"} <= changed
    run, now = plain(["model.model_channels=8"])
    with pytest.raises(ConfigError, match=r"^model\.model_channels: cannot change when resuming"):
        check_resume(saved, now, rules=(*schema_rules(run), *TopConfig.RESUME_RULES))


def test_overfit_batches_repeat_the_first_global_batches():
    from framework.data.sampler import GlobalBatchSampler
    from framework.train.trainer import FirstBatches

    plain = GlobalBatchSampler(40, 4, seed=3)
    first = [plain.global_batch_indices(k) for k in range(2)]
    assert first[0] != first[1]
    for start in (0, 5):  # a resumed run keeps cycling the same two
        sampler = FirstBatches(40, 4, seed=3, start_step=start, repeat=2)
        it = iter(sampler)
        got = [next(it) for _ in range(6)]
        assert got == [first[(start + i) % 2] for i in range(6)]


# -- the objective ----------------------------------------------------------------------------------
def test_a_job_returns_its_objective_as_a_float_with_the_summary(tmp_path):
    from framework.runtime import JobResult, objective_value, run_job

    args = [a for a in small(tmp_path) if not a.startswith("hydra.")]
    args += ["trainer.max_steps=2", "trainer.val_batches=1", "trainer.figures=false", "checkpoint=none"]
    result = run_job(validate(compose([*args, "objective=val/rmse"])), run_dir=tmp_path / "run")
    val = rows(tmp_path / "run", "val")[-1]
    assert isinstance(result, float) and float(result) == pytest.approx(val["rmse"]) and val["rmse"] != val["loss"]
    assert result["steps"] == 2 and result["val"]["rmse"] == val["rmse"] and result["objective"] == "val/rmse"
    assert result.get("resumed_from") is None and "final_loss" in result
    assert objective_value("train/loss", result["final_loss"], result["val"]) == result["final_loss"]
    assert math.isnan(objective_value("val/loss", None, {}))  # nothing validated: NaN, a failed trial
    back = pickle.loads(pickle.dumps(result))  # a submitit job's return travels pickled
    assert isinstance(back, JobResult) and float(back) == float(result) and back["val"] == result["val"]


def test_an_objective_the_task_does_not_log_stops_at_the_first_validation(tmp_path):
    over = small(
        tmp_path, **{"trainer.max_steps": 4, "trainer.val_every": 2, "trainer.log_every": 1, "checkpoint": "none"}
    )
    proc = run_cli([*over, "objective=val/nope", "trainer.figures=false", "trainer.val_batches=1"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: objective: 'val/nope' is not in the validation row"), err
    assert "val/loss" in err[0] and "val/rmse/t2m" in err[0]
    assert [r["step"] for r in rows(tmp_path / "run", "train")][-1] == 2  # stopped at the first validation


# -- debug runs through the CLI ---------------------------------------------------------------------
def test_debug_default_is_a_smoke_run_in_one_override(tmp_path):
    proc = run_cli([*small(tmp_path), "debug=default"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    assert [r["step"] for r in rows(run, "train")] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows(run, "val")] == [5]
    assert not (run / "checkpoints").exists() and not (run / "plots").exists()


def test_debug_overfit_drives_the_loss_down_on_one_batch(tmp_path):
    proc = run_cli([*small(tmp_path), "debug=overfit", "trainer.max_steps=30"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "run" / "framework.log").read_text()
    assert "trainer.overfit_batches=1: training on the first 1 global batch(es) only" in log
    losses = [r["loss"] for r in rows(tmp_path / "run", "train")]
    assert losses[-1] < losses[0] / 2, losses


def test_debug_anomaly_names_the_op_behind_a_nan_gradient(tmp_path):
    # lr=1e30 blows the weights up after the first step: the second backward makes NaN
    proc = run_cli([*small(tmp_path), "debug=anomaly", "optim.lr=1e30"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback of forward call that caused the error" in proc.stderr
    assert re.search(r"Function '\w+Backward\d*' returned nan values", proc.stderr), proc.stderr[-3000:]
    # without it the same run stops on the non-finite loss (exit 4), naming no op
    proc = run_cli([*small(tmp_path, "plain"), "debug=default", "optim.lr=1e30"], cwd=tmp_path)
    assert proc.returncode == 4 and "returned nan values" not in proc.stderr, proc.stderr[-3000:]


def test_debug_profile_writes_a_trace_into_the_run_dir(tmp_path):
    proc = run_cli([*small(tmp_path), "debug=profile"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run" / "profile"
    trace = json.loads((out / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any("ProfilerStep" in str(n) for n in names) and "aten::convolution" in names
    assert "aten::" in (out / "ops_rank0.txt").read_text()
    assert "profile: steps 3-5 traced to" in (tmp_path / "run" / "framework.log").read_text()
    with pytest.raises(ConfigError, match=r"^trainer\.profile_steps: 3 traced steps need trainer\.max_steps >= 5"):
        validate(compose(["debug=profile", "trainer.max_steps=4"]))


# -- tags in wandb ---------------------------------------------------------------------------------
def test_tags_are_the_wandb_runs_tags(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from framework.logging.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = validate(compose(["logger=wandb", "experiment=tiny_regression"]))

    class Started:  # what WandbSink.start reads of the trainer
        run_id = "tagstest0001"

    sink = WandbSink(run.logger, run, tmp_path)
    sink.start(Started())
    try:
        assert sink.wb is not None and tuple(sink.wb.tags) == ("stormcast", "regression", "tiny")
        assert list(sink.wb.config["tags"]) == ["stormcast", "regression", "tiny"]
    finally:
        sink.close()


# -- the Optuna sweeper behind the gate -------------------------------------------------------------
def gate(overrides):
    cfg = compose(overrides, with_hydra=True)
    return cli.check_composed(cfg, Source(), overrides, multirun=True)


@pytest.mark.parametrize(
    "overrides",
    [
        ["hparams_search=optuna_lr"],
        ["hydra/sweeper=optuna", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=1"],
        ["hydra/sweeper=optuna", "hydra/sweeper/sampler=grid"],
        ["hydra/sweeper=optuna", "hydra/sweeper/sampler=cmaes", "hydra.sweeper.sampler.sigma0=0.5"],
        ["hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "objective=val/rmse"],
        ["hydra/sweeper=optuna", "hydra.sweeper.direction=[minimize,maximize]"],
    ],
)
def test_the_optuna_sweeper_passes_with_its_own_fields(overrides):
    gate(overrides)


EVIL = {"_target_": "evilmod.x"}
CRAFTED = {  # a sweep file from someone else: (sampler option, hydra.sweeper node, the one line)
    "sampler": (
        None,
        {"sampler": {"_target_": "evilmod.x"}},
        r"sampler\._target_: sampler 'evilmod\.x' is not allowed",
    ),
    "sampler_walk": (
        None,
        {"sampler": {"_target_": "optuna.samplers.os.system"}},
        r"sampler\._target_: sampler 'optuna\.samplers\.os\.system' is not allowed",
    ),
    "independent_sampler": (
        "cmaes",
        {"sampler": {"independent_sampler": EVIL}},
        r"sampler\.independent_sampler\._target_: sampler 'evilmod\.x'",
    ),
    "x0": ("cmaes", {"sampler": {"x0": EVIL}}, r"sampler\.x0\._target_: not allowed here"),
    "constraints_func": (
        "nsgaii",
        {"sampler": {"constraints_func": EVIL}},
        r"sampler\.constraints_func: must be a single value",
    ),
    "storage_sqlite": (None, {"storage": "sqlite:///optuna.db"}, r"storage: must be null: it opens a store"),
    "storage_redis": (None, {"storage": "redis://localhost:6379"}, r"storage: must be null"),
    "storage_target": (None, {"storage": EVIL}, r"storage: must be null"),
    "custom_search_space": (
        None,
        {"custom_search_space": "evilmod.x"},
        r"custom_search_space: must be null: it names a function the sweeper calls",
    ),
    "params_hydra": (
        None,
        {"params": {"hydra.job_logging.root.level": "choice(INFO,DEBUG)"}},
        r"params\.hydra\.job_logging\.root\.level: sweeping Hydra's configuration is not allowed",
    ),
    "params_hydra_group": (
        None,
        {"params": {"hydra/job_logging": "choice(default,disabled)"}},
        r"params\.hydra/job_logging: sweeping Hydra's configuration is not allowed",
    ),
    "search_space_target": (None, {"search_space": {"x": EVIL}}, r"search_space\.x\._target_: not allowed here"),
    "search_space_field": (
        None,
        {"search_space": {"optim.lr": {"type": "float", "low": 0, "high": 1, "cmd": "x"}}},
        r"search_space\.optim\.lr\.cmd: unknown field",
    ),
    "direction": (None, {"direction": "sideways"}, r"direction: must be minimize or maximize"),
    "study_name": (None, {"study_name": "a\nb"}, r"study_name: control characters"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_optuna_sweeper_is_refused(tmp_path, case):
    sampler, node, pattern = CRAFTED[case]
    defaults = [{"override /hydra/sweeper": "optuna"}]
    if sampler:
        defaults.append({"override /hydra/sweeper/sampler": sampler})
    (tmp_path / "hparams_search").mkdir()
    text = OmegaConf.to_yaml({"defaults": defaults, "hydra": {"sweeper": node}})
    (tmp_path / "hparams_search" / "crafted.yaml").write_text("# @package _global_\n" + text)
    source = Source(extra_dir=str(tmp_path))
    cfg = compose(["hparams_search=crafted"], source, with_hydra=True)
    with pytest.raises(ConfigError, match="^hydra\\.sweeper\\." + pattern) as info:
        cli.check_composed(cfg, source, ["hparams_search=crafted"], multirun=True)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_the_optuna_fields_that_are_data_pass():
    node = {
        "_target_": security.OPTUNA_SWEEPER,
        "sampler": {"_target_": "optuna.samplers.CmaEsSampler", "seed": 0, "x0": {"optim.lr": 1e-3}},
        "direction": "minimize",
        "storage": None,
        "n_trials": 4,
        "search_space": {"optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        "params": {"optim.weight_decay": "choice(0,1e-4)"},
    }
    security._check_sweeper(node, security.Trust())
    node["sampler"]["_args_"] = [1]  # positional arguments of a sampler: never data the framework passes
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.sampler\._args_: not allowed in a sampler$"):
        security._check_sweeper(node, security.Trust())


def test_trust_does_not_widen_the_optuna_fields():
    node = {"_target_": security.OPTUNA_SWEEPER, "storage": "sqlite:///x.db"}
    trust = security.Trust(hydra_targets=(security.OPTUNA_SWEEPER,))
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.storage: must be null"):
        security._check_sweeper(node, trust)


# -- a search through the CLI -----------------------------------------------------------------------
def test_an_optuna_search_runs_two_trials_and_minimises_the_objective(tmp_path):
    """The documented search (conf/hparams_search/optuna_lr.yaml), two trials, through the real CLI."""
    sweep = tmp_path / "sweep"
    over = [a for a in small(tmp_path) if not a.startswith("hydra.run")]
    over += [
        "hparams_search=optuna_lr",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweeper.n_trials=2",
        "trainer.max_steps=3",
        "trainer.val_batches=1",
        "trainer.figures=false",
    ]
    proc = run_cli(over, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = []
    for job in ("0", "1"):
        lr = OmegaConf.load(sweep / job / ".hydra" / "config.yaml").optim.lr
        trials.append((rows(sweep / job, "val")[-1]["loss"], lr))
    assert not (sweep / "2").exists()
    result = OmegaConf.load(sweep / "optimization_results.yaml")
    best_loss, best_lr = min(trials)
    assert result.best_value == pytest.approx(best_loss) and result.best_params["optim.lr"] == best_lr
