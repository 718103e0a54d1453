"""The real CLI, as a user runs it: the main job, resume, exit codes and one-line errors."""

import json
import shutil

import numpy as np
import pytest

from framework.logging.jsonl import read
from tests.conftest import run_cli, tiny_overrides


def assert_one_line_error(proc, code, pattern):
    assert proc.returncode == code, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    import re

    assert re.search(pattern, err[0]), err[0]


@pytest.mark.slow
def test_default_main_job_learns_and_beats_persistence(tmp_path):
    """`python -m framework` with no overrides but where to write (about two minutes)."""
    # a new interpreter, as the README's command (not forked from tests/zygote.py)
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", f"data.root={tmp_path / 'data'}"], cwd=tmp_path, real=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    train, val = read(run / "metrics.jsonl", "train"), read(run / "metrics.jsonl", "val")
    assert train[-1]["step"] == 200
    assert train[-1]["loss"] < train[0]["loss"] / 5  # the loss falls clearly
    assert val[-1]["rmse"] < 0.8 * val[-1]["rmse_persistence"]  # and beats persistence
    for key in ("step", "split", "loss", "lr", "grad_norm", "samples_per_s", "mem_gb", "data_wait"):
        assert key in train[0]
    assert all(0.0 <= row["data_wait"] <= 1.0 for row in train)  # a share of each window's time
    assert "mem_reserved_gb" not in train[0]  # the GPU allocator's figure: no such thing on CPU
    assert (run / "checkpoints" / "step_00000200" / "meta.json").is_file()
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "framework.log").is_file()
    log = (run / "framework.log").read_text()
    assert "model beats persistence" in log and f"run dir: {run}" in log


def test_short_run_writes_the_run_directory(tmp_path):
    proc = run_cli(tiny_overrides(tmp_path, tmp_path / "data"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    rows = read(run / "metrics.jsonl")
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if r["split"] == "val"] == [3, 6]
    val = rows[-1]
    assert {"rmse/t2m", "rmse_persistence/t2m", "rmse", "rmse_persistence"} <= set(val)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    log = (run / "framework.log").read_text()
    for step in (3, 6):  # every save is logged, with where it went
        assert f"checkpoint step_{step:08d} saved (torch_save, " in log and str(run / "checkpoints") in log


def test_resumed_run_logs_the_losses_of_an_unbroken_one(tmp_path):
    data = tmp_path / "data"
    a = tmp_path / "a"
    over = tiny_overrides(a, data, deterministic="true", **{"hydra.run.dir": str(a)})
    assert run_cli(over, cwd=tmp_path).returncode == 0
    unbroken = read(a / "metrics.jsonl", "train")

    # Simulate a crash after the step-3 checkpoint that had logged steps 4-6 (and tore a line),
    # then rerun in place: the rows past step 3 are dropped, not logged twice.
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_00000006")
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "split": "tr')
    over = tiny_overrides(b, data, deterministic="true", **{"hydra.run.dir": str(b)})
    proc = run_cli(over, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (b / "framework.log").read_text()
    assert "resumed from" in log and "metrics.jsonl: dropped 4 rows past step 3, where this run resumes" in log
    lines = (b / "metrics.jsonl").read_text().splitlines()
    assert lines.count('{"step": 7, "split": "tr') == 1  # what cannot be parsed is kept, never lost
    resumed = [json.loads(ln) for ln in lines if ln.endswith("}")]
    assert [(r["step"], r["split"]) for r in resumed] == [(s, "train") for s in (1, 2, 3)] + [(3, "val")] + [
        (s, "train") for s in (4, 5, 6)
    ] + [(6, "val")]
    resumed = [r for r in resumed if r["split"] == "train"]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in unbroken], rtol=1e-6)
    assert [r["lr"] for r in resumed] == [r["lr"] for r in unbroken]


def test_a_longer_run_on_resume_follows_the_schedule_of_the_new_length(tmp_path):
    """The documented rule: the config's schedule applies from the restored step on, as if the
    run had been configured with the new trainer.max_steps from the start; the jump is logged."""
    data = tmp_path / "data"

    def run(name, steps):
        over = tiny_overrides(
            tmp_path / name, data, **{"hydra.run.dir": str(tmp_path / name), "trainer.max_steps": steps}
        )
        proc = run_cli(over, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {r["step"]: r["lr"] for r in read(tmp_path / name / "metrics.jsonl", "train")}

    fresh = run("fresh", 8)
    run("grown", 4)
    grown = run("grown", 8)  # resumed at step 4 with twice the length
    assert [grown[s] for s in range(5, 9)] == pytest.approx([fresh[s] for s in range(5, 9)], rel=1e-9)
    assert (
        "resume: the schedule follows the config (trainer.max_steps 4 -> 8): learning rate at step 4"
        in (tmp_path / "grown" / "framework.log").read_text()
    )


def test_a_rerun_with_only_the_new_override_continues_the_run(tmp_path):
    """hydra.run.dir=RUN trainer.max_steps=9: the recorded overrides are reused (the tiny model,
    grid and data of the first invocation; without them the resume would be refused), the new
    one applies; the history holds every invocation; a rerun refused on resume is not reused."""
    from framework import rerun

    run = tmp_path / "run"
    first = tiny_overrides(tmp_path, tmp_path / "data", deterministic="true")
    assert run_cli(first, cwd=tmp_path).returncode == 0
    proc = run_cli([f"hydra.run.dir={run}", "trainer.max_steps=9"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "framework.log").read_text()
    recorded = [o for o in first if not o.startswith("hydra.")]
    assert f"rerun of {run}: {len(recorded) - 1} override(s) reused from {run / rerun.HISTORY}: " in log
    assert "rerun: new overrides applied: trainer.max_steps=9 (was trainer.max_steps=6)" in log
    assert f"resumed from {run / 'checkpoints' / 'step_00000006'} at step 6" in log
    assert [r["step"] for r in read(run / "metrics.jsonl", "train")] == list(range(1, 10))
    effective = [o if o != "trainer.max_steps=6" else "trainer.max_steps=9" for o in recorded]
    assert (run / ".hydra" / "overrides.yaml").read_text().splitlines() == [f"- {o}" for o in effective]

    entries = rerun.history_entries(run / rerun.HISTORY)
    starts = [e for e in entries if e["event"] == "start"]
    assert [e["passed"] for e in starts] == [first, [f"hydra.run.dir={run}", "trainer.max_steps=9"]]
    assert [e["effective"] for e in starts] == [recorded, effective]
    assert [e["resumes_from"] for e in starts] == [
        None,
        {"step": 6, "checkpoint": str(run / "checkpoints" / "step_00000006")},
    ]
    assert [(e["exit"], e["step"]) for e in entries if e["event"] == "end"] == [(0, 6), (0, 9)]

    # A change a resume refuses: one line, exit 2, recorded as refused, and never the base of a rerun.
    proc = run_cli([f"hydra.run.dir={run}", "model.model_channels=4", "trainer.max_steps=10"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: model.model_channels: cannot change when resuming (checkpoint: 8, now: 4)"
    ), proc.stderr[-2000:]
    assert rerun.history_entries(run / rerun.HISTORY)[-1]["exit"] == 2
    assert rerun.read_record(run).overrides == effective


@pytest.mark.parametrize(
    "file,text,pattern",
    [
        (
            "overrides.yaml",
            "trainer: {max_steps: 3}\n",
            r"overrides\.yaml: not a list of override strings \(got dict\)",
        ),
        (
            "overrides.yaml",
            "- trainer.max_steps=3\n- +hydra.callbacks.x._target_=os.system\n",
            r"overrides\.yaml: \+hydra\.callbacks\.x\._target_=os\.system: a run dir records only the job's",
        ),
        (
            "override_history.jsonl",
            '{"event": "start", "id": "1", "effective": ["optim._target_=os.system"]}\n',
            r"^error: optim\._target_: target 'os\.system' is not allowed.*\(an override reused from .*"
            r"override_history\.jsonl; drop it with ~optim\._target_\)$",
        ),
    ],
)
def test_a_crafted_record_in_the_run_dir_is_refused_in_one_line(tmp_path, file, text, pattern):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / file).write_text(text)
    proc = run_cli([f"hydra.run.dir={run}", "trainer.max_steps=2"], cwd=tmp_path)
    assert_one_line_error(proc, 2, pattern)
    assert sorted(p.name for p in run.iterdir()) == [".hydra"]  # refused before anything was written
    assert (run / ".hydra" / file).read_text() == text


@pytest.mark.parametrize("precision", ["bf16", "tf32", "fp16"])
def test_precisions_train(tmp_path, precision):
    over = tiny_overrides(
        tmp_path, tmp_path / "data", precision=precision, **{"trainer.max_steps": 3, "checkpoint": "none"}
    )
    proc = run_cli(over, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read(tmp_path / "run" / "metrics.jsonl", "train")
    assert all(np.isfinite(r["loss"]) for r in rows)
    if precision == "fp16":
        assert "skipped_steps" in rows[-1]


def test_grad_accumulation_matches_the_full_batch(tmp_path):
    """Accumulating 2 micro-batches of 2 gives the step of one batch of 4 (deterministic)."""
    losses = {}
    for accum in (1, 2):
        d = tmp_path / f"acc{accum}"
        over = tiny_overrides(
            d,
            tmp_path / "data",
            deterministic="true",
            checkpoint="none",
            **{"trainer.grad_accum": accum, "trainer.max_steps": 3},
        )
        assert run_cli(over, cwd=tmp_path).returncode == 0
        losses[accum] = [r["loss"] for r in read(d / "run" / "metrics.jsonl", "train")]
    np.testing.assert_allclose(losses[1], losses[2], rtol=1e-5)


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["trainer.max_steps=0"], r"^error: trainer\.max_steps: must be > 0"),
        (["model=nope"], r"^error: .*Could not find 'model/nope'; available:"),
        (["optim._target_=os.system"], r"^error: optim\._target_: target 'os\.system' is not allowed"),
        (["recipe=stormscope"], r"^error: data\.root: missing value"),
        (["recipe=tiny_stormscope", "model.attn_kernel=4"], r"^error: model\.attn_kernel: must be odd \(got 4\)"),
        (
            ["recipe=tiny_stormscope", "data.grid=[33,32]"],
            r"^error: data\.grid: rows=33 is not divisible by 2, the patch size",
        ),
        (["data.grid=[33,32]"], r"^error: data\.grid: rows=33 is not divisible by 2"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path, args, pattern):
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert_one_line_error(proc, 2, pattern)
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.mark.parametrize("args", [["hydra.run.dir="], ["--multirun", "hydra.sweep.dir= ", "optim.lr=1e-3,2e-3"]])
def test_an_empty_run_dir_is_refused_not_the_working_directory(tmp_path, args):
    """hydra.run.dir=$UNSET would make Hydra write the run into the working directory."""
    proc = run_cli(args, cwd=tmp_path)
    key = "sweep" if "--multirun" in args else "run"
    assert_one_line_error(proc, 2, rf"^error: hydra\.{key}\.dir: empty \(an unset variable\?\); name the directory")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("accum", [3, 5])  # 3: two samples a step went untrained; 5: empty micro-batches, NaN
def test_micro_batches_that_do_not_split_the_batch_are_one_line_and_exit_2(tmp_path, accum):
    over = tiny_overrides(tmp_path, tmp_path / "data", **{"trainer.max_steps": 2, "checkpoint": "none"})
    proc = run_cli([*over, "data.batch_size=4", f"trainer.grad_accum={accum}"], cwd=tmp_path)
    assert_one_line_error(
        proc, 2, rf"^error: trainer\.grad_accum={accum}: the 4 samples per rank do not split into {accum} equal"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before a step


def test_bad_data_is_one_line_and_exit_3(tmp_path):
    from recipes.weather.synthetic import write_synthetic

    root = write_synthetic(tmp_path / "store", height=16, width=16, years=(2020, 2021), hours_per_year=24)
    args = [
        f"hydra.run.dir={tmp_path / 'run'}",
        "data=hrrr_era5",
        f"data.root={root}",
        "data.grid=[16,16]",
        "data.train_years=[2020]",
        "data.val_years=[2021]",
        "data.hrrr_channels=[t2m,refc]",
        "data.era5_channels=[u850]",
        "model=songunet_tiny",
    ]
    proc = run_cli(args, cwd=tmp_path)
    assert_one_line_error(proc, 3, r"^error: .*2020\.zarr: channel 'refc' not in variable 'data'")
    proc = run_cli(
        [*args[:-2], "data.hrrr_channels=[t2m]", "data.era5_channels=[u850]", "data.train_years=[2019]"], cwd=tmp_path
    )
    assert_one_line_error(proc, 3, r"^error: .*2019\.zarr")


def test_runs_from_any_working_directory(tmp_path):
    elsewhere = tmp_path / "some" / "where"
    elsewhere.mkdir(parents=True)
    over = tiny_overrides(tmp_path, tmp_path / "data", **{"trainer.max_steps": 1, "checkpoint": "none"})
    proc = run_cli(over, cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]


class _BadSample(__import__("torch").utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        from framework.errors import DataError

        raise DataError("/x/hrrr/2020.zarr: NaN in variable 'data' channel 't2m' at time index 3")


def test_data_error_from_a_loader_worker_is_still_one_line():
    import torch

    from framework.cli import one_line
    from framework.errors import DataError

    with pytest.raises(DataError) as info:
        next(iter(torch.utils.data.DataLoader(_BadSample(), num_workers=1)))
    assert "Traceback" in str(info.value)  # what the worker hands back...
    assert one_line(info.value) == "/x/hrrr/2020.zarr: NaN in variable 'data' channel 't2m' at time index 3"
