"""Every shipped option composes and validates."""

from pathlib import Path

import pytest

from framework.cli import CONF_DIR
from framework.config.validate import validate
from framework.errors import ConfigError

GROUPS = sorted(p.name for p in Path(CONF_DIR).iterdir() if p.is_dir())
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((Path(CONF_DIR) / g).glob("*.yaml"))]

# Diffusion recipes name their regression stage: given an export made from the matching
# regression recipe (its config is what the start-up check reads).
REGRESSION_OF = {
    "stormcast_diffusion": "stormcast",
    "stormcast_diffusion_fast": "stormcast_fast",
    "tiny_diffusion": "tiny",
}


def regression_export(compose, tmp_path, recipe: str) -> Path:
    import json

    from omegaconf import OmegaConf

    from framework.export import model_config

    cfg = compose([f"recipe={recipe}", f"data.root={tmp_path}"])
    side = model_config(OmegaConf.to_container(cfg, resolve=True))
    out = tmp_path / f"{recipe}_regression.pt"
    out.with_suffix(".json").write_text(json.dumps(side))
    out.write_bytes(b"")
    return out


def test_groups_of_the_design_exist():
    for g in (
        "recipe",
        "model",
        "data",
        "parallel",
        "sharding",
        "splitter",
        "precision",
        "checkpoint",
        "logger",
        "optim",
        "schedule",
        "cluster",
    ):
        assert g in GROUPS


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes(compose, tmp_path, group, option):
    overrides = [f"{group}={option}"]
    if (
        group == "data"
        and option != "synthetic"
        or group == "recipe"
        and option.startswith(("stormcast", "stormscope"))
    ):
        overrides.append(f"data.root={tmp_path}")  # must exist
    if group == "model" and option.startswith("songunet_stormcast"):
        overrides.append("data.grid=[64,64]")  # 4 down-samplings
    if group == "model" and option == "dit":
        overrides.append("data.grid=[64,64]")  # patch 4
    if group == "recipe" and option in REGRESSION_OF:
        overrides.append(f"task.regression={regression_export(compose, tmp_path, REGRESSION_OF[option])}")
    run = validate(compose(overrides))  # raises (a ConfigError naming the problem) if it does not validate
    if group == "recipe":
        assert run.recipe == option


def test_default_is_tiny_recipe(compose):
    run = validate(compose([]))
    assert run.recipe == "tiny"
    assert run.model.name == "songunet" and run.data.name == "synthetic"
    assert run.parallel.name == "none" and run.precision.name == "fp32"
    assert run.checkpoint.name == "torch_save" and run.logger.name == "console"


def test_stormcast_recipe_is_paper_size(compose, tmp_path):
    run = validate(compose(["recipe=stormcast", f"data.root={tmp_path}"]))
    assert list(run.data.grid) == [512, 640]
    assert len(run.data.hrrr_channels) == 99 and len(run.data.era5_channels) == 26
    assert len(run.data.invariants) == 2
    assert list(run.model.channel_mult) == [1, 2, 2, 2, 2] and run.model.model_channels == 128


def test_stormcast_diffusion_recipe_is_paper_size(compose, tmp_path):
    """The paper's diffusion net: 99 + 99 + 99 + 2 channels in, 99 out, ~121 M parameters."""
    from recipes.weather.diffusion import DiffusionTask

    reg = regression_export(compose, tmp_path, "stormcast")
    run = validate(compose(["recipe=stormcast_diffusion", f"data.root={tmp_path}", f"task.regression={reg}"]))
    assert list(run.task.conditions) == ["state", "regression", "invariants"] and run.task.residual
    assert run.model.embedding_type == "positional" and run.model.additive_pos_embed
    task = DiffusionTask(run, env=None, device="cpu")
    import torch

    with torch.device("meta"):
        model = task.build_model()
    assert model.net.in_channels == 299 and model.net.out_channels == 99
    n = sum(p.numel() for p in model.parameters())
    assert 118e6 < n < 124e6, n


def test_stormscope_recipe_is_the_preset(compose, tmp_path):
    """StormScope's DiT: 16 x 768, 16 heads, patch 4, kernel 31; ~188 M parameters at 512x640."""
    import torch

    from recipes.weather.diffusion import DiffusionTask

    run = validate(compose(["recipe=stormscope", f"data.root={tmp_path}"]))
    m = run.model
    assert (m.depth, m.hidden_size, m.num_heads, m.patch_size, m.attn_kernel) == (16, 768, 16, 4, 31)
    assert list(run.task.conditions) == ["state", "background", "invariants"] and not run.task.residual
    with torch.device("meta"):
        model = DiffusionTask(run, env=None, device="cpu").build_model()
    n = sum(p.numel() for p in model.parameters())
    assert 185e6 < n < 191e6, n


def test_command_line_beats_recipe(compose):
    run = validate(compose(["trainer.max_steps=7", "model.model_channels=4"]))
    assert run.trainer.max_steps == 7 and run.model.model_channels == 4


def test_parallel_preset_picks_sharding_and_splitter(compose):
    cfg = compose(["parallel=fsdp2_domain"])
    assert cfg.sharding.name == "fsdp2" and cfg.splitter.name == "rows"
    assert cfg.parallel.domain == 2
    cfg = compose(["parallel=fsdp2_domain", "sharding.reshard_after_forward=never", "parallel.domain=4"])
    assert cfg.sharding.reshard_after_forward == "never" and cfg.parallel.domain == 4


def test_job_name_is_framework(compose):
    from hydra import compose as hc
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hc("config", return_hydra_config=True)
    assert cfg.hydra.job.name == "framework"


@pytest.mark.parametrize(
    "override,hint",
    [
        ("trainer.max_step=5", "; did you mean 'trainer.max_steps'?"),
        ("optim.lrr=1", "; did you mean 'optim.lr'?"),
        ("seeed=1", "; did you mean 'seed'?"),
        ("trainer.zzz=5", None),  # nothing close: no guess
    ],
)
def test_an_unknown_key_gets_the_near_name(compose, override, hint):
    with pytest.raises(ConfigError) as err:
        compose([override, "data.grid=[16,16]"])
    line = str(err.value)
    assert "\n" not in line and f"Could not override '{override.split('=')[0]}'" in line
    assert line.endswith(hint) if hint else "did you mean" not in line


def test_an_unknown_option_of_a_group_gets_the_near_name(compose):
    with pytest.raises(ConfigError, match=r"did you mean songunet_tiny\?; available: dit, "):
        compose(["model=songunet_tin"])
