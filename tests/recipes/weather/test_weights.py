"""An exported weights file's .json (recipes/weather/weights.py ``describe``) is another's file: a
malformed one is one DataError line naming the .json and the field, never a traceback later."""

from __future__ import annotations

import copy
import json

import pytest

from framework.errors import DataError
from recipes.weather import weights

CHANNELS = {"hrrr_channels": ["u10m", "v10m", "t2m"], "era5_channels": ["u850"], "invariants": ["lsm"]}
SONG = dict(model_channels=8, channel_mult=[1, 2], channel_mult_emb=4, num_blocks=1, attn_resolutions=[])
SIDECAR = {  # as python -m framework.export writes it for a regression run
    "name": "songunet",
    "model": {"name": "songunet", **SONG, "dropout": 0.0, "embedding_type": "zero", "additive_pos_embed": False},
    "in_channels": 8,
    "out_channels": 3,
    "img_resolution": [16, 16],
    "kwargs": {**SONG, "img_resolution": [16, 16], "in_channels": 8, "out_channels": 3},
    "task": {"name": "stormcast_regression", "residual": False},
    "channels": CHANNELS,
    "data": {"background_time": "input", "invariant_norm": "zscore", "dt": 1},
    "seed": 0,
    "weights": "reg.pt",
}


def export(tmp_path, sidecar) -> tuple:
    pt, side = tmp_path / "reg.pt", tmp_path / "reg.json"
    pt.write_bytes(b"")  # describe reads no weights
    side.write_text(json.dumps(sidecar))
    return pt, side


def edited(**fields):
    """SIDECAR with ``fields`` set (None: removed); ``task__edm`` sets ``task["edm"]``."""
    out = copy.deepcopy(SIDECAR)
    for name, value in fields.items():
        *parents, key = name.split("__")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(key)
        else:
            node[key] = value
    return out


def test_the_exports_sidecar_describes_the_model(tmp_path):
    pt, _ = export(tmp_path, SIDECAR)
    info = weights.describe(pt)
    assert (info.name, info.grid, info.channels) == ("songunet", [16, 16], CHANNELS)
    assert info.task["name"] == "stormcast_regression" and info.config["in_channels"] == 8
    weights.check_channels(info, {**CHANNELS, "grid": [16, 16]}, "task.regression")


MALFORMED = [  # (the .json, what its one line says after "<the .json>: ")
    ([1, 2], "unreadable model config (its top level is a JSON list, not an object)"),
    (edited(name=None), "its model config has no 'name'"),
    (edited(name=["songunet"]), "its model config's 'name' must be a string"),
    (edited(model=[1]), "its model config's 'model' must be an object"),
    (edited(img_resolution=5), "its model config's 'img_resolution' must be [rows, cols] of positive ints (got 5)"),
    (edited(img_resolution=[16, "16"]), "'img_resolution' must be [rows, cols] of positive ints"),
    (edited(channels="abc"), "its model config's 'channels' must be an object of channel lists (got 'abc')"),
    (edited(channels={"hrrr_channels": "u10m"}), "'channels' must be an object of channel lists"),
    (edited(in_channels="8"), "its model config's 'in_channels' must be a positive int (got '8')"),
    (edited(out_channels=None), "its model config has no 'out_channels'"),
    (edited(task__edm={"sigma_data": "x"}), "its model config's 'task.edm.sigma_data' must be a non-empty list"),
    (edited(task__conditions="state"), "its model config's 'task.conditions' must be a list of strings"),
    (edited(data=[1]), "its model config's 'data' must be an object or null"),
]


@pytest.mark.parametrize("sidecar,expect", MALFORMED, ids=[m[1][:48] for m in MALFORMED])
def test_a_malformed_sidecar_is_one_line_naming_the_json_and_the_field(tmp_path, sidecar, expect):
    pt, side = export(tmp_path, sidecar)
    with pytest.raises(DataError) as e:
        weights.describe(pt)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{side}: ") and expect in msg, msg


def test_weights_holding_nan_or_inf_are_refused_in_one_line(tmp_path):
    """A model whose weights hold NaN or Inf would only show itself in its forecasts: refused at load."""
    import torch

    pt, _ = export(tmp_path, SIDECAR)
    sd = weights.build(weights.describe(pt)).state_dict()
    torch.save(sd, pt)
    model, _ = weights.load(pt)  # as written, it loads
    key = next(k for k, v in sd.items() if v.is_floating_point() and v.numel() > 1)
    sd[key].view(-1)[1] = float("nan")
    torch.save(sd, pt)
    with pytest.raises(DataError, match=rf"^{pt}: weight {key} holds non-finite values \(NaN or Inf\)$"):
        weights.load(pt)
