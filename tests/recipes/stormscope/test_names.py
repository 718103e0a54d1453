"""StormScope's data under its own names: state/ and background/ stores, state_channels and
background_channels keys; StormCast's names (and weights recorded under them) are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from framework.config.validate import validate
from framework.errors import ConfigError
from framework.export import model_config
from recipes.stormscope.config import StormScopeDataConfig
from recipes.weather import layout, synthetic
from recipes.weather.dataset import HrrrEra5Dataset
from tests.conftest import run_cli
from tests.framework.test_cli import assert_one_line_error

STATE, BACKGROUND, INV = ["abi08", "abi13", "refc"], ["u850", "t850"], ["lsm", "orog"]
SMALL = ["--height", "8", "--width", "12", "--years", "2020", "2021", "--hours-per-year", "6"]


def test_stores_named_for_stormscope_hold_what_stormcasts_would(tmp_path, capsys):
    """The writer (its CLI) and the dataset under StormScope's names: state/, background/, its
    stats and manifest keys; the samples are those of a StormCast store of the same channels."""
    scope = tmp_path / "scope"
    args = ["--root", str(scope), *SMALL, "--state-channels", *STATE, "--background-channels", *BACKGROUND]
    assert synthetic.main(args) == 0
    out = capsys.readouterr().out
    assert str(scope / "state" / "2020.zarr") in out and "background channels: u850 t850" in out
    assert sorted(p.name for p in scope.iterdir()) == [
        "background",
        "invariants.zarr",
        "state",
        "stats",
        "synthetic.json",
    ]
    assert layout.year_store(scope, "background", 2021).is_dir()
    assert (scope / "stats" / "state_means.npy").is_file() and (scope / "stats" / "background_stds.npy").is_file()
    manifest = json.loads((scope / "synthetic.json").read_text())
    assert manifest["state_channels"] == STATE and "hrrr_channels" not in manifest
    assert synthetic.main([*args[:2], *SMALL, "--hrrr-channels", "t2m", "--state-channels", "refc"]) == 2
    assert "not both" in capsys.readouterr().err

    cfg = StormScopeDataConfig(
        root=str(scope),
        grid=[8, 12],
        train_years=[2020, 2021],
        val_years=[2021],
        state_channels=STATE,
        background_channels=BACKGROUND,
        invariants=INV,
    )
    ds = HrrrEra5Dataset.from_config(cfg, [2020, 2021])
    assert ds.layout == layout.NATIVE and ds.channel_names == {
        "state": STATE,
        "background": BACKGROUND,
        "invariants": INV,
    }
    cast = HrrrEra5Dataset(
        synthetic.write_synthetic(
            tmp_path / "cast",
            height=8,
            width=12,
            years=(2020, 2021),
            hours_per_year=6,
            hrrr_channels=STATE,
            era5_channels=BACKGROUND,
        ),
        [2020, 2021],
        STATE,
        BACKGROUND,
        INV,
    )
    assert len(ds) == len(cast) and np.array_equal(ds.state_stds, cast.hrrr_stds)
    for a, b in zip(ds[len(ds) - 1].values(), cast[len(cast) - 1].values()):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    with pytest.raises(ConfigError, match="physicsnemo layout is StormCast's"):
        HrrrEra5Dataset.from_config(cfg, [2020], layout="physicsnemo")


def export_of(compose, tmp_path, name: str, overrides: list[str]):
    """An export's .json (and an empty .pt) of the run ``overrides`` configure: enough for the
    start-up checks, which read no weights."""
    cfg = compose([*overrides, f"data.root={tmp_path}"])
    out = tmp_path / f"{name}.pt"
    out.with_suffix(".json").write_text(json.dumps(model_config(OmegaConf.to_container(cfg, resolve=True))))
    out.write_bytes(b"")
    return out


@pytest.mark.parametrize("case", ["stormcast_key", "stormcast_weights"])
def test_stormcast_names_in_a_stormscope_config_are_one_line(compose, tmp_path, case):
    if case == "stormcast_key":
        args, pattern = ["+data.hrrr_channels=[abi08]"], r"^error: data\.hrrr_channels: Key 'hrrr_channels' not in"
    else:  # a StormScope model recorded under StormCast's keys (trained on data=synthetic before)
        old = export_of(compose, tmp_path, "old", ["recipe=tiny_stormscope", "data=synthetic"])
        args = [f"checkpoint.init_from={old}"]
        pattern = (
            r"^error: checkpoint\.init_from: .*old\.pt is a StormCast model \(channels in hrrr_channels, "
            r"era5_channels\) but this is a StormScope data config \(state_channels, background_channels\)$"
        )
    proc = run_cli(["recipe=tiny_stormscope", *args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert_one_line_error(proc, 2, pattern)
    assert not (tmp_path / "run").exists()


def test_the_other_way_round_is_refused_too(compose, tmp_path):
    """StormCast data under the StormScope task, and a model recorded under StormScope's keys as
    the weights of a StormCast run: one ConfigError line each (exit code 2)."""
    with pytest.raises(ConfigError, match=r"^data: data=synthetic is a StormCast data config .* use data=stormscope"):
        validate(compose(["recipe=tiny_stormscope", "data=synthetic", f"data.root={tmp_path}"]))
    scope = export_of(compose, tmp_path, "scope", ["recipe=tiny", "data=stormscope_synthetic"])
    with pytest.raises(ConfigError, match=r"scope\.pt is a StormScope model .* but this is a StormCast data") as e:
        validate(compose(["recipe=tiny", f"data.root={tmp_path}", f"checkpoint.init_from={scope}"]))
    assert "\n" not in str(e.value) and e.value.exit_code == 2
