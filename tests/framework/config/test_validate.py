"""Bad configs end with one line naming the key (ConfigError, exit code 2)."""

import pytest

from framework.config.validate import validate
from framework.errors import ConfigError

CASES = [
    (["trainer.max_steps=0"], r"^trainer\.max_steps: must be > 0"),
    (["trainer.max_steps=abc"], r"^trainer\.max_steps: .*could not be converted to Integer"),
    (["data.batch_size=0"], r"^data\.batch_size: must be > 0"),
    (["optim.lr=-1"], r"^optim\.lr: must be >= 0"),
    (["checkpoint.keep=0"], r"^checkpoint\.keep: must be > 0"),
    (["checkpoint.every=-5"], r"^checkpoint\.every: must be >= 0"),
    (["trainer.grad_accum=0"], r"^trainer\.grad_accum: must be > 0"),
    (["trainer.compile_memory_budget=0"], r"^trainer\.compile_memory_budget: must be in \(0, 1\], got 0"),
    (["seed=x"], r"^seed: "),
    (["device=tpu"], r"^device: must be one of"),
    (["sharding.reshard_after_forward=sometimes"], r"^sharding\.reshard_after_forward: must be one of"),
    (["schedule.min_lr_ratio=2"], r"^schedule\.min_lr_ratio: must be in \[0, 1\]"),
    (["optim.betas=[0.9]"], r"^optim\.betas: must be two numbers"),
    (["+trainer.foo=1"], r"^trainer\.foo: Key 'foo' not in 'TrainerConfig'"),
    (["+foo=1"], r"^foo: unknown top-level key"),
    (["model.embedding_type=fourier"], r"^model\.embedding_type: must be one of"),
    (["data.grid=[31,32]"], r"^data\.grid: rows=31 is not divisible by 2"),
    (["data.grid=[32]", "data.root=x"], r"^data\.grid: must be \[rows, cols\]"),
    (["data.hrrr_channels=[t2m,t2m]"], r"^data\.hrrr_channels: lists \['t2m'\] more than once"),
    (["data=hrrr_era5"], r"^data\.root: missing value"),
    (["data=hrrr_era5", "data.root=/no/such/dir"], r"^data\.root: directory does not exist: /no/such/dir"),
    (["checkpoint.resume=/no/such/ckpt"], r"^checkpoint\.resume: path does not exist"),
    (["checkpoint.exclude=[weights]"], r"^checkpoint\.exclude: unknown part"),
    (["parallel.domain=0"], r"^parallel\.domain: must be > 0 or -1"),
    (["parallel.dp_shard=-1", "parallel.domain=-1"], r"^parallel\.domain: only one of"),
    (["recipe=stormcast_diffusion", "data.root=."], r"^task.regression: residual=true needs the regression stage"),
]


@pytest.mark.parametrize("overrides,pattern", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_config_names_the_key(compose, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        validate(compose(overrides))
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    "target", ["os.system", "subprocess.run", "builtins.eval", "torch.load", "torch.optim_evil.X", "${oc.env:HOME}"]
)
def test_target_outside_allowed_prefixes_is_refused(compose, target):
    with pytest.raises(ConfigError, match=r"^optim\._target_: target .* is not allowed"):
        validate(compose([f"optim._target_={target}"]))


def test_target_nested_anywhere_is_refused(compose):
    with pytest.raises(ConfigError, match=r"^model\.act\._target_: target 'os\.system' is not allowed"):
        validate(compose(["+model.act._target_=os.system"]))


def test_target_check_runs_before_import(compose, monkeypatch):
    import importlib

    calls = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda n, *a: calls.append(n) or real(n, *a))
    with pytest.raises(ConfigError, match=r"target 'evilpkg_never_imported\.Opt' is not allowed"):
        validate(compose(["optim._target_=evilpkg_never_imported.Opt"]))
    assert "evilpkg_never_imported" not in calls


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (["model=nope"], r"Could not find 'model/nope'; available: .*songunet_tiny"),
        (["trainer.foo=1"], r"Could not override 'trainer\.foo'.*prefix with \+"),
        (["trainer.max_steps=[1"], r"^bad override syntax"),
    ],
)
def test_composition_errors_are_config_errors(compose, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        compose(overrides)


def test_relative_paths_are_saved_absolute_and_words_stay_words(compose, tmp_path, monkeypatch):
    """What a run saves (checkpoints, exports) names its data, weights and checkpoints from anywhere."""
    monkeypatch.chdir(tmp_path)
    run = validate(compose(["data.root=stores/a", "checkpoint.init_from=weights/r.pt"]))
    assert run.data.root == str(tmp_path / "stores" / "a") == run.raw.data.root
    assert run.checkpoint.init_from == str(tmp_path / "weights" / "r.pt") == run.raw.checkpoint.init_from
    assert run.checkpoint.resume == "latest" == run.raw.checkpoint.resume  # a word, not a path
    (tmp_path / "ck").mkdir()
    assert validate(compose(["checkpoint.resume=ck"])).checkpoint.resume == str(tmp_path / "ck")
    assert validate(compose(["data.root=/abs/x"])).data.root == "/abs/x"
    # task.regression (the diffusion stage's, read back by inference) is such a path too
    from dataclasses import fields

    from recipes.weather.config import DiffusionTaskConfig

    assert next(f for f in fields(DiffusionTaskConfig) if f.name == "regression").metadata["path"]
