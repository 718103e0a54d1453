"""The injections that ran code before the one gate, through the real CLI: each would write a marker file;
now each ends with one line and exit 2 before anything is written (no marker, no run dir, no data).

Every one of these forms wrote its marker with the CLI before framework.cli.precheck checked the whole
config, hydra.* included (verified against the previous cli.py).
"""

import pickle
import re
import textwrap

import pytest

from tests.conftest import MarkerPayload, run_cli, tiny_overrides

EVILMOD = """\
import pathlib
pathlib.Path({marker!r}).write_text("imported")
def x(*a, **k):
    pathlib.Path({marker!r}).write_text("called")
"""


def _setup(tmp_path, case, marker):
    """Files a case needs (an importable module in the working dir, a --config-dir, a pickle, a fake squeue)."""
    (tmp_path / "evilmod.py").write_text(EVILMOD.format(marker=str(marker)))
    cd = tmp_path / "cd"
    (cd / "experiment").mkdir(parents=True)
    (cd / "experiment" / "evil.yaml").write_text(
        textwrap.dedent("""\
        # @package _global_
        optim: '${oc.decode:"{_target_: evilmod.x, lr: 0.001}"}'
        """)
    )
    (cd / "cluster").mkdir()
    (cd / "cluster" / "evil.yaml").write_text(
        textwrap.dedent(f"""\
        # @package _global_
        cluster: {{name: local}}
        hydra:
          job_logging:
            handlers:
              x: {{class: zipfile.ZipFile, file: {marker}, mode: w}}
        """)
    )
    (tmp_path / "config.pickle").write_bytes(pickle.dumps(MarkerPayload(marker)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text(f"#!/bin/sh\ntouch {marker}\necho 2099-01-01T00:00:00\n")
    squeue.chmod(0o755)
    return cd, bin_dir


CASES = {
    # Hydra instantiated a callback from the command line
    "callback": (
        [
            "+hydra.callbacks.x._target_=pathlib.Path.write_text",
            "+hydra.callbacks.x.self._target_=pathlib.Path",
            "+hydra.callbacks.x.self._args_=[{marker}]",
            "+hydra.callbacks.x.data=pwned",
        ],
        r"^error: hydra\.callbacks\.x: Hydra callbacks run code and are not allowed",
    ),
    # under --multirun Hydra instantiated the launcher node recursively
    "launcher": (
        [
            "--multirun",
            "+hydra.launcher.x._target_=pathlib.Path.write_text",
            "+hydra.launcher.x.self._target_=pathlib.Path",
            "+hydra.launcher.x.self._args_=[{marker}]",
            "+hydra.launcher.x.data=pwned",
            "hydra.sweep.dir={tmp}/sweep",
        ],
        r"^error: hydra\.launcher\.x: may only take the value of a framework cluster preset",
    ),
    # hydra.job.env_set.PATH made the SLURM time-limit check run a planted squeue
    "env_set": (
        ["trainer.stop_before_end_min=1", "+hydra.job.env_set.PATH={bin}:/usr/bin:/bin"],
        r"^error: hydra\.job\.env_set\.PATH: setting environment variables",
    ),
    # logging.config built a handler of any class with config-given arguments
    "job_logging": (
        [
            "+hydra.job_logging.handlers.x.class=zipfile.ZipFile",
            "+hydra.job_logging.handlers.x.file={marker}",
            "+hydra.job_logging.handlers.x.mode=w",
        ],
        r"^error: hydra\.job_logging\.handlers\.x\.class: logging class 'zipfile\.ZipFile' is not allowed",
    ),
    # a file handler's name and text came from the config: a .pth file runs in every later interpreter
    "log_file": (
        ["+hydra.job_logging.handlers.x.class=logging.FileHandler", "+hydra.job_logging.handlers.x.filename={marker}"],
        r"^error: hydra\.job_logging\.handlers\.x\.filename: '.*marker' is not allowed",
    ),
    # Hydra wrote config.yaml, hydra.yaml and overrides.yaml wherever this said (the user's conf/ too)
    "output_subdir": (["hydra.output_subdir={marker}"], r"^error: hydra\.output_subdir: '.*marker' is not allowed"),
    # a pkg:// search-path entry imported a module of the working directory while composing
    "searchpath": (["hydra.searchpath=[pkg://evilmod]"], r"^error: hydra\.searchpath: 'pkg://evilmod' is not allowed"),
    # a _target_ inside an interpolation in a --config-dir file passed the unresolved check
    "oc_decode": (
        ["--config-dir", "{cd}", "experiment=evil"],
        r"^error: optim\._target_: target 'evilmod\.x' is not allowed",
    ),
    # --help configures Hydra's logging from hydra.hydra_logging
    "help": (
        [
            "--help",
            "+hydra.hydra_logging.handlers.x.class=zipfile.ZipFile",
            "+hydra.hydra_logging.handlers.x.file={marker}",
            "+hydra.hydra_logging.handlers.x.mode=w",
        ],
        r"^error: hydra\.hydra_logging\.handlers\.x\.class",
    ),
    # the second option of a swept group configures the second job's logging
    "sweep_group": (
        ["--multirun", "--config-dir", "{cd}", "cluster=local,evil", "hydra.sweep.dir={tmp}/sweep"],
        r"^error: hydra\.job_logging\.handlers\.x\.class: logging class 'zipfile\.ZipFile'",
    ),
    # options past the check's cap (64 then, repeats counted) configured their jobs' logging unchecked
    "sweep_past_cap": (
        [
            "--multirun",
            "--config-dir",
            "{cd}",
            "optim=adam" + ",adamw" * 64,
            "cluster=local,evil",
            "hydra.sweep.dir={tmp}/sweep",
        ],
        r"^error: hydra\.job_logging\.handlers\.x\.class: logging class 'zipfile\.ZipFile'",
    ),
    # Hydra builds the Optuna sweeper's node with instantiate(): a sampler, a storage or a custom
    # search space from the command line or a sweep file imported and called evilmod
    "optuna_sampler": (
        ["hparams_search=optuna_lr", "hydra.sweeper.sampler._target_=evilmod.x", "hydra.sweep.dir={tmp}/sweep"],
        r"^error: hydra\.sweeper\.sampler\._target_: sampler 'evilmod\.x' is not allowed; only optuna\.samplers\.",
    ),
    "optuna_storage": (
        ["hparams_search=optuna_lr", "hydra.sweeper.storage={{_target_:evilmod.x}}", "hydra.sweep.dir={tmp}/sweep"],
        r"^error: hydra\.sweeper\.storage: must be null",
    ),
    "optuna_search_space": (
        ["hparams_search=optuna_lr", "hydra.sweeper.custom_search_space=evilmod.x", "hydra.sweep.dir={tmp}/sweep"],
        r"^error: hydra\.sweeper\.custom_search_space: must be null",
    ),
    # --experimental-rerun unpickles a file
    "rerun": (["--experimental-rerun", "{tmp}/config.pickle"], r"^error: --experimental-rerun loads a pickle"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_injection_is_refused_before_anything_runs(tmp_path, case):
    marker = tmp_path / "marker"
    cd, bin_dir = _setup(tmp_path, case, marker)
    args, pattern = CASES[case]
    args = [a.format(marker=marker, tmp=tmp_path, cd=cd, bin=bin_dir) for a in args]
    overrides = tiny_overrides(tmp_path, tmp_path / "data", checkpoint="none", **{"trainer.max_steps": 2})
    proc = run_cli([*args, *overrides], cwd=tmp_path, env={"SLURM_JOB_ID": "12345"} if case == "env_set" else None)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and re.search(pattern, err[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not marker.exists(), marker.read_text()
    for written in ("run", "sweep", "data"):
        assert not (tmp_path / written).exists(), written


def test_submitits_folder_must_be_private(tmp_path):
    """A sweep file may choose hydra.launcher.submitit_folder; submitit's pickles there are loaded
    by the jobs and the launching process, so a folder others can write is refused."""
    from framework.distributed.launcher import shared_folder

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o1777)  # like /tmp: anyone may add entries, not rename others'
    assert shared_folder(f"{shared}/mine/%j") is None
    assert (shared / "mine").stat().st_mode & 0o777 == 0o700  # created for this user alone
    (shared / "open").mkdir()
    (shared / "open").chmod(0o777)  # planted by another user, or left open
    assert "can be written by other users" in shared_folder(f"{shared}/open/%j")
    shared.chmod(0o777)  # no sticky bit: another user could rename mine/ and put their own in its place
    assert "can be written by anyone" in shared_folder(f"{shared}/mine/%j")
    shared.chmod(0o1777)
    (shared / "link").symlink_to(shared / "open")
    assert "/open can be written by other users" in shared_folder(f"{shared}/link/%j")


def test_a_sweep_into_a_shared_submitit_folder_is_refused_before_submitting(tmp_path):
    shared = tmp_path / "scratch"
    shared.mkdir()
    shared.chmod(0o777)
    overrides = tiny_overrides(tmp_path, tmp_path / "data", checkpoint="none", **{"trainer.max_steps": 2})
    proc = run_cli(
        [
            "--multirun",
            "hydra/launcher=submitit_local",
            f"hydra.launcher.submitit_folder={shared}/%j",
            f"hydra.sweep.dir={tmp_path}/sweep",
            *[o for o in overrides if not o.startswith("hydra.run.dir=")],
        ],
        cwd=tmp_path,
    )
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert re.match(
        rf"^error: hydra\.launcher\.submitit_folder: {re.escape(str(shared))} can be written by other users", err[0]
    ), err[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not list(shared.iterdir())  # no job pickle was written
