"""Through the real CLI under torchrun (gloo): every layout logs the losses of parallel=none."""

import pytest

from scripts.loss_compare import compare
from tests.conftest import layout_reference, run_cli, run_layout

pytestmark = pytest.mark.timeout(600)

EXTRA = ["data.grid=[16,16]", "data.hours_per_year=48", "data.batch_size=4", "model.model_channels=8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return layout_reference(tmp_path_factory, "parity", EXTRA)


@pytest.mark.parametrize(
    "layout,nproc",
    [
        (["parallel=ddp"], 2),
        (["parallel=fsdp2"], 2),
        (["parallel=hsdp"], 4),
        (["parallel=fsdp2", "trainer.grad_accum=2", "sharding.reshard_after_forward=never"], 2),
    ],
)
def test_layout_logs_the_losses_of_one_process(reference, layout, nproc):
    tmp, extra, ref = reference
    losses = run_layout(layout, nproc, tmp / "_".join(layout).replace("=", "-"), 5, extra)
    assert len(losses) == 5
    assert compare(ref, losses) <= 1e-5, (ref, losses)


def test_loss_compare_script_reports_and_exits_zero(reference, capsys):
    from scripts import loss_compare

    tmp, extra, _ = reference

    def launch(overrides, nproc):  # the script's runs, forked as the other tests' (tests/zygote.py)
        return run_cli(overrides, tmp, env={"OMP_NUM_THREADS": "1"}, nproc=nproc)

    argv = ["--b", "parallel=fsdp2", "--nproc-b", "2", "--steps", "3", "--", *extra]
    assert loss_compare.main(argv, run=launch) == 0
    out = capsys.readouterr().out
    assert "max relative difference" in out and "within rtol" in out


def test_start_up_report_and_sharded_parameter_bytes(reference):
    tmp, extra, _ = reference
    run_layout(["parallel=fsdp2"], 2, tmp / "report", 1, extra)
    log = (tmp / "report" / "framework.log").read_text()
    assert "mesh: dp_replicate=1 x dp_shard=2 x domain=1 (parallel=fsdp2, sharding=fsdp2" in log
    assert "FSDP2 units" in log and "block0 (reshard=True)" in log and "<root> (reshard=False)" in log
    run_layout(["parallel=none"], 1, tmp / "report1", 1, extra)
    mb = [
        float(f.read_text().split("M; ")[1].split(" MB")[0])
        for f in (tmp / "report" / "framework.log", tmp / "report1" / "framework.log")
    ]
    assert mb[0] == pytest.approx(mb[1] / 2, rel=0.1)  # each of 2 ranks holds about half (dim-0 padding)


def test_unsynchronised_replicas_are_refused(tmp_path):
    proc = run_cli(["parallel=none", f"hydra.run.dir={tmp_path}"], tmp_path, nproc=2)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and errors
    assert all("sharding=none on 2 ranks would train 2 unsynchronised replicas" in ln for ln in errors)


def test_degrees_that_do_not_match_the_world_exit_2(tmp_path):
    proc = run_cli(
        ["parallel=fsdp2", "parallel.domain=3", "splitter=off", f"hydra.run.dir={tmp_path}"], tmp_path, nproc=2
    )
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    # One line per rank that got that far: torchrun stops the peers of the first rank to exit.
    assert 1 <= len(errors) <= 2 and all("cannot fill 2 ranks" in ln for ln in errors), proc.stderr
    assert "framework/" not in proc.stderr  # no traceback of ours
