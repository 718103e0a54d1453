"""Rerunning a run dir (framework/rerun.py): the command line over the recorded overrides, the
record read as untrusted input, the append-only history. Through the CLI: tests/framework/test_cli.py."""

import json
import sys

import pytest

from framework import cli, rerun
from framework.errors import ConfigError


def test_new_values_replace_recorded_ones_in_place():
    m = rerun.merge(["a=1", "b.c=2", "model=x"], ["b.c=5", "d=4"])
    assert m.effective == ["a=1", "b.c=5", "model=x", "d=4"]
    assert m.reused == ["a=1", "model=x"] and m.replaced == [("b.c=2", "b.c=5")] and m.dropped == []


def test_the_last_of_several_new_values_wins():
    m = rerun.merge(["a=1"], ["a=5", "a=6"])
    assert m.effective == ["a=6"] and m.replaced == [("a=1", "a=6")]


def test_a_plain_value_over_an_added_key_keeps_the_plus():
    """The key exists only because the recorded +key added it: a plain key=v would be refused."""
    assert rerun.merge(["+x=1", "++y=2"], ["x=3", "y=4"]).effective == ["+x=3", "++y=4"]
    assert rerun.merge(["+x=1"], ["+x=3"]).effective == ["+x=3"]


def test_deletions():
    m = rerun.merge(["a=1", "+b=2", "c=3"], ["~a", "~b", "~z"])
    assert m.effective == ["c=3", "~z"]  # ~z recorded nothing: Hydra deletes z itself
    assert m.dropped == ["a=1", "+b=2"]
    # a recorded deletion is undone by a new value for that key
    assert rerun.merge(["~a"], ["a=7"]).effective == ["a=7"]


def test_a_group_and_its_keys_are_separate_keys():
    m = rerun.merge(["model=dit_tiny", "model.depth=2", "+foo@pkg=1"], ["model.depth=4", "foo@pkg=2"])
    assert m.effective == ["model=dit_tiny", "model.depth=4", "+foo@pkg=2"]


def test_checkpoint_resume_is_never_carried_over():
    """A run started from another run's checkpoint resumes its own latest when rerun."""
    m = rerun.merge(["checkpoint.resume=/other/run/checkpoints/step_00000003", "a=1"], [])
    assert m.effective == ["a=1"] and m.not_reused == ["checkpoint.resume=/other/run/checkpoints/step_00000003"]


def _history(run_dir, *entries):
    path = run_dir / rerun.HISTORY
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def start(i, effective, launch=None):
    return {"event": "start", "id": str(i), "effective": effective, "launch": launch}


def test_the_record_is_the_last_accepted_invocation(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / rerun.HYDRA_OVERRIDES).write_text("- from=yaml\n")
    _history(
        tmp_path,
        start(1, ["a=1"]),
        {"event": "end", "id": "1", "exit": 0},
        start(2, ["a=2"]),  # killed: no end, it ran
        start(3, ["model=other"]),
        {"event": "end", "id": "3", "exit": 2},  # refused (its config never trained)
        start(4, ["a=4"], launch="torchrun:xyz"),  # this very launch's main rank, written meanwhile
    )
    record = rerun.read_record(tmp_path, launch="torchrun:xyz")
    assert record.overrides == ["a=2"] and record.source == tmp_path / rerun.HISTORY
    assert rerun.read_record(tmp_path).overrides == ["a=4"]


def test_without_a_history_the_record_is_hydras_overrides_yaml(tmp_path):
    assert rerun.read_record(tmp_path) is None
    (tmp_path / ".hydra").mkdir()
    (tmp_path / rerun.HYDRA_OVERRIDES).write_text("- a=1\n- +b=2\n")
    assert rerun.read_record(tmp_path).overrides == ["a=1", "+b=2"]
    (tmp_path / rerun.HYDRA_OVERRIDES).write_text("")
    assert rerun.read_record(tmp_path).overrides == []


def test_appends_survive_a_torn_line(tmp_path):
    path = tmp_path / rerun.HISTORY
    rerun.append(path, start(1, ["a=1"]))
    with open(path, "a") as f:
        f.write('{"event": "start", "id": "2", "effe')  # a crash mid-write
    rerun.append(path, {"event": "end", "id": "1", "exit": 0})
    rerun.append(path, start(3, ["a=3"]))
    assert [e["id"] for e in rerun.history_entries(path)] == ["1", "1", "3"]
    assert rerun.read_record(tmp_path).overrides == ["a=3"]


def test_history_start_and_end(tmp_path):
    h = rerun.History(tmp_path)
    h.start(passed=["hydra.run.dir=x", "a=2"], effective=["a=2"], reused=None, resumes_from={"step": 3})
    h.end(0, 9)
    h.end(1)  # once only
    first, last = rerun.history_entries(tmp_path / rerun.HISTORY)
    assert first["event"] == "start" and first["passed"] == ["hydra.run.dir=x", "a=2"] and first["time"]
    assert first["resumes_from"] == {"step": 3}
    assert last == {**last, "event": "end", "id": first["id"], "exit": 0, "step": 9}


@pytest.mark.parametrize(
    "name,text,pattern",
    [
        ("overrides.yaml", "a: 1\n", r"overrides\.yaml: not a list of override strings \(got dict\); refused$"),
        ("overrides.yaml", "- a=1\n- [b]\n", r"not a list of override strings \(got a list with a non-string item\)"),
        ("overrides.yaml", '!!python/object/apply:os.system ["true"]\n', r"overrides\.yaml: not valid YAML"),
        ("overrides.yaml", "- +hydra.callbacks.x._target_=os.system\n", r"never Hydra's settings; refused$"),
        ("overrides.yaml", "- hydra/launcher=submitit_slurm\n", r"never Hydra's settings; refused$"),
        ("overrides.yaml", "- +trust.targets=[os]\n", r"overrides\.yaml: \+trust\.targets=\[os\]: trust can only"),
        ("overrides.yaml", "- 'a=[1'\n", r"overrides\.yaml: bad override syntax"),
        ("override_history.jsonl", '["a=1"]\n', r"line 1: not an entry of an override history; refused$"),
        ("override_history.jsonl", '{"event": "start", "effective": "a=1"}\n', r"line 1: effective: not a list"),
    ],
)
def test_a_crafted_record_is_refused_in_one_line(tmp_path, name, text, pattern):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / name).write_text(text)
    with pytest.raises(ConfigError, match=pattern) as e:
        rerun.plan(["trainer.max_steps=2"], tmp_path)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path / ".hydra" / name))


def test_a_damaged_record_is_one_line_or_a_skipped_line_never_a_traceback_or_a_wait(tmp_path):
    """History lines nested past parsing are skipped like torn ones; an overrides.yaml nested too
    deeply is refused, and a named pipe in its place is no record (a read would wait forever)."""
    import os

    hydra = tmp_path / ".hydra"
    hydra.mkdir()
    deep = "[" * 100_000 + "]" * 100_000
    (hydra / "override_history.jsonl").write_text(deep + "\n" + json.dumps(start(1, ["a=1"])) + "\n")
    assert rerun.plan(["b=2"], tmp_path).overrides == ["a=1", "b=2"]
    (hydra / "override_history.jsonl").unlink()
    (hydra / "overrides.yaml").write_text(deep)
    with pytest.raises(ConfigError, match=r"overrides\.yaml: nests too deeply"):
        rerun.plan([], tmp_path)
    (hydra / "overrides.yaml").unlink()
    os.mkfifo(hydra / "overrides.yaml")  # no record, and no wait for a writer
    assert rerun.plan(["b=2"], tmp_path) is None


def test_a_record_too_large_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(rerun, "MAX_BYTES", 10)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / rerun.HYDRA_OVERRIDES).write_text("- a=1\n- b=2\n")
    with pytest.raises(ConfigError, match=r"more than a record of overrides can be"):
        rerun.plan([], tmp_path)


def test_checkpoint_resume_none_starts_over_with_the_command_line(tmp_path):
    _history(tmp_path, start(1, ["a=1"]))
    fresh = rerun.plan(["hydra.run.dir=x", "checkpoint.resume=none", "b=2"], tmp_path)
    assert fresh.overrides == ["hydra.run.dir=x", "checkpoint.resume=none", "b=2"]
    again = rerun.plan(["hydra.run.dir=x", "b=2"], tmp_path)
    assert again.overrides == ["hydra.run.dir=x", "a=1", "b=2"]


def test_the_explicit_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rerun.explicit_run_dir(["a=1", "hydra.run.dir=r"]) == tmp_path / "r"
    assert rerun.explicit_run_dir(["hydra.run.dir=out/${now:%H}"]) is None  # composed instead
    assert rerun.explicit_run_dir(["a=1"]) is None


def test_precheck_hands_hydra_the_effective_overrides(tmp_path, monkeypatch):
    """@hydra.main parses sys.argv after precheck: it must run what precheck checked."""
    run = tmp_path / "run"
    _history(run, start(1, ["model.model_channels=8", "trainer.max_steps=6"]))
    argv = [f"hydra.run.dir={run}", "trainer.max_steps=9", "--cfg", "job"]
    monkeypatch.setattr(sys, "argv", ["framework", *argv])
    monkeypatch.setattr(cli, "_RERUN", None)  # restored after the test: precheck sets both
    monkeypatch.setattr(cli, "_PASSED", None)
    cli.precheck(argv)
    assert sys.argv[1:] == [f"hydra.run.dir={run}", "model.model_channels=8", "trainer.max_steps=9", "--cfg", "job"]
    assert cli._RERUN is not None and cli._RERUN.merge.replaced == [("trainer.max_steps=6", "trainer.max_steps=9")]
