"""framework.config.resume: what a resumed run may change, and the one line when it may not."""

import copy

import pytest

from framework.config.resume import MAY, MUST_NOT, check_resume, diff, rule_for
from framework.errors import ConfigError


@pytest.fixture(scope="module")
def saved():
    from omegaconf import OmegaConf

    from framework.cli import compose
    from framework.config.validate import validate

    return OmegaConf.to_container(validate(compose([])).raw)


def _with(cfg, **changes):
    out = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        node = out
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


def test_identical_configs_have_no_changes(saved):
    assert check_resume(saved, copy.deepcopy(saved)) == []


@pytest.mark.parametrize(
    "change",
    [
        {"optim__lr": 1e-4},
        {"optim__weight_decay": 0.1},
        {"optim__betas": [0.8, 0.99]},
        {"schedule__warmup_steps": 5},
        {"schedule__name": "constant"},
        {"trainer__max_steps": 10_000},
        {"trainer__log_every": 1},
        {"trainer__val_every": 7},
        {"trainer__val_batches": 0},
        {"trainer__progress": False},
        {"trainer__grad_accum": 2},
        {"checkpoint__every": 5},
        {"checkpoint__keep": 9},
        {"logger__name": "wandb"},
        {"logger__project": "x"},
        {"data__num_workers": 4},
        {"data__pin_memory": False},
        {"data__root": "/elsewhere/same/data"},
        {"parallel__name": "fsdp2"},
        {"parallel__dp_shard": 4},
        {"sharding__name": "fsdp2"},
        {"splitter__name": "shard_tensor"},
        {"precision__name": "bf16"},
        {"device": "cuda"},
        {"cluster__name": "x"},
    ],
)
def test_allowed_changes_are_returned(saved, change):
    changes = check_resume(saved, _with(saved, **change))
    assert len(changes) == 1 and changes[0].verdict == MAY and changes[0].kind == "changed"
    assert changes[0].key == next(iter(change)).replace("__", ".")


@pytest.mark.parametrize(
    "change,key",
    [
        ({"model__model_channels": 64}, "model.model_channels"),
        ({"model__name": "dit"}, "model.name"),
        ({"data__grid": [64, 64]}, "data.grid"),
        ({"data__hrrr_channels": ["v10m", "u10m", "t2m", "msl"]}, "data.hrrr_channels"),  # the order counts
        ({"data__era5_channels": ["u850", "v850"]}, "data.era5_channels"),
        ({"data__invariants": ["lsm"]}, "data.invariants"),
        ({"data__dt": 2}, "data.dt"),
        ({"task__name": "stormcast_diffusion"}, "task.name"),
        ({"recipe": "stormcast"}, "recipe"),
        ({"optim___target_": "torch.optim.AdamW"}, "optim._target_"),
        ({"data__batch_size": 16}, "data.batch_size"),
        ({"seed": 3}, "seed"),
        ({"trainer__name": "other"}, "trainer.name"),
    ],
)
def test_refused_change_names_key_old_and_new(saved, change, key):
    new = _with(saved, **change)
    with pytest.raises(ConfigError) as info:
        check_resume(saved, new)
    msg = str(info.value)
    assert msg.startswith(f"{key}: cannot change when resuming"), msg
    old_value = diff(saved, new)[0].old
    assert f"checkpoint: {old_value!r}" in msg or f"checkpoint: {old_value}" in msg
    assert "\n" not in msg and info.value.exit_code == 2


@pytest.mark.parametrize(
    "change,part",
    [
        ({"optim___target_": "torch.optim.AdamW"}, "optimizer"),
        ({"data__batch_size": 16}, "data"),
        ({"seed": 3}, "data"),
        ({"model__model_channels": 64}, "model"),
        ({"data__grid": [64, 64]}, "model"),
    ],
)
def test_excluded_part_frees_its_keys(saved, change, part):
    with pytest.raises(ConfigError, match=f"unless checkpoint.exclude has {part}"):
        check_resume(saved, _with(saved, **change))
    (c,) = check_resume(saved, _with(saved, **change), exclude=[part])
    assert c.verdict == MAY


def test_several_refusals_are_counted_in_one_line(saved):
    new = _with(saved, model__model_channels=64, data__grid=[64, 64], task__name="x", optim__lr=0.1)
    with pytest.raises(ConfigError, match=r"^data\.grid: .*\(\+2 more: model\.model_channels, task\.name\)$"):
        check_resume(saved, new)


def test_keys_on_one_side_only_are_reported_not_refused(saved):
    new = copy.deepcopy(saved)
    new["model"]["new_flag"] = True
    del new["data"]["generator_seed"]
    kinds = {c.key: c.kind for c in check_resume(saved, new)}
    assert kinds == {"model.new_flag": "added", "data.generator_seed": "removed"}


def test_numbers_compare_by_value_but_bools_do_not_equal_ints():
    assert diff({"optim": {"lr": 1e-3}}, {"optim": {"lr": 0.001}}) == []
    assert diff({"trainer": {"max_steps": 10}}, {"trainer": {"max_steps": 10.0}}) == []
    assert len(diff({"trainer": {"progress": True}}, {"trainer": {"progress": 1}})) == 1


def test_unknown_keys_must_not_change():
    assert rule_for("something.new")[0] == MUST_NOT
    assert rule_for("data.some_new_normalisation")[0] == MUST_NOT


def test_a_recipe_adds_rules_for_its_own_keys(saved):
    """The engine knows no recipe keys: a recipe's data schema may declare which of its keys may change."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from framework.config.resume import schema_rules

    new = _with(saved, data__val_years=[2022])
    with pytest.raises(ConfigError, match=r"^data\.val_years: cannot change"):
        check_resume(saved, new)

    @dataclass
    class DataSchema:
        RESUME_RULES = (("val_years", MAY, None), ("train_years", MUST_NOT, "data"))

    rules = schema_rules(SimpleNamespace(nodes={"data": DataSchema(), "model": object()}))
    assert rules == (("data.val_years", MAY, None), ("data.train_years", MUST_NOT, "data"))
    (c,) = check_resume(saved, new, rules=rules)
    assert c.key == "data.val_years" and c.verdict == MAY
    with pytest.raises(ConfigError, match=r"^data\.train_years: .*unless checkpoint\.exclude has data"):
        check_resume(saved, _with(saved, data__train_years=[2019]), rules=rules)
