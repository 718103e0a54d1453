"""Config options and registry entries map one to one (by each node's ``name``)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework import registry
from framework.cli import CONF_DIR
from framework.errors import ConfigError

GROUP_TO_REGISTRY = {
    "model": registry.models,
    "data": registry.datasets,
    "sharding": registry.sharding,
    "splitter": registry.splitters,
    "precision": registry.precision,
    "checkpoint": registry.checkpoint,
    "logger": registry.loggers,
    "schedule": registry.schedules,
}


def _names(group: str, key: str = "name") -> set[str]:
    out = set()
    for f in (Path(CONF_DIR) / group).glob("*.yaml"):
        node = OmegaConf.load(f)
        if group == "recipe":
            node = node.get("task", {})
            if key not in node:  # a variant of another preset (stormcast_fast: defaults [stormcast])
                continue
        out.add(str(OmegaConf.select(node, key)))
    return out


@pytest.mark.parametrize("group", sorted(GROUP_TO_REGISTRY))
def test_options_and_entries_match(group):
    registry.load_providers()
    reg = GROUP_TO_REGISTRY[group]
    assert _names(group) == set(reg.names())


@pytest.mark.parametrize("path", sorted((Path(CONF_DIR) / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_model_file_lists_every_knob_of_its_schema(path):
    """Every field of a model's schema is in each of its files, so that a documented knob
    (``model.recompute_norm_levels=[1]`` on the diffusion preset, say) overrides without ``+``."""
    import dataclasses

    registry.load_providers()
    node = OmegaConf.load(path)
    fields = {f.name for f in dataclasses.fields(registry.models.entry(node.name).schema)}
    assert set(node) == fields, f"missing {sorted(fields - set(node))}, unknown {sorted(set(node) - fields)}"


def test_recipes_map_to_tasks():
    registry.load_providers()
    assert _names("recipe") == set(registry.tasks.names())


def test_trainer_entry_is_the_configured_one():
    registry.load_providers()
    assert registry.trainers.names() == [OmegaConf.load(Path(CONF_DIR) / "config.yaml").trainer.name]


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown precision policy 'fp8'; valid: bf16, fp16, fp32, tf32$"):
        registry.precision.entry("fp8")


def test_a_model_unknown_for_want_of_any_plugin_says_how_to_get_them(monkeypatch):
    # a checkout on PYTHONPATH that was never pip-installed has no entry points: "valid: (none)"
    # alone would not say why
    registry.load_providers()  # (once loaded, for good: not while no plugin is found)
    monkeypatch.setattr(registry, "plugin_modules", lambda: [])
    with pytest.raises(
        ConfigError,
        match=r"unknown model 'nope'; .*no recipe plugin is installed: `pip install -e \.`"
        r".* FRAMEWORK_RECIPES=pkg\.registry",
    ):
        registry.models.entry("nope")
    with pytest.raises(ConfigError, match=r"unknown precision policy 'fp8'; valid: bf16, fp16, fp32, tf32$"):
        registry.precision.entry("fp8")  # the engine's own: nothing to install


def test_duplicate_registration_is_refused():
    r = registry.Registry("thing")
    r.add("a")
    with pytest.raises(ValueError, match="registered twice"):
        r.add("a")
