"""Recipes are plugins: the engine knows no weather, and a new recipe needs no engine change.

The toy recipe (tests/toy_recipe) is found through a real ``framework.recipes`` entry
point: a ``.dist-info`` folder on PYTHONPATH, as pip writes for an installed package.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import REPO, run_cli, run_module

# Words of the weather recipes that must never appear in the engine's code.
WEATHER_WORDS = re.compile(
    r"hrrr|era5|rmse_persistence|persistence|stormcast|stormscope|songunet|edm\b|"
    r"sigma_data|invariants|recipes\.",
    re.IGNORECASE,
)


def test_framework_contains_no_weather_words():
    hits = []
    for path in sorted((REPO / "framework").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if WEATHER_WORDS.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "the engine names recipe concepts:\n" + "\n".join(hits)


def test_recipes_are_found_through_entry_points():
    from framework import registry

    registry.load_providers()
    assert {"recipes.stormcast.registry", "recipes.stormscope.registry"} <= set(registry.plugin_modules())
    assert {"stormcast_regression", "stormcast_diffusion", "stormscope"} <= set(registry.tasks.names())


def _install_toy(site: Path) -> None:
    """What pip writes for a package declaring a framework.recipes entry point."""
    info = site / "toy_recipe-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-recipe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[framework.recipes]\ntoy = tests.toy_recipe.registry\n")


def test_a_toy_recipe_trains_resumes_and_exports_without_engine_changes(tmp_path):
    site = tmp_path / "site"
    _install_toy(site)
    conf = REPO / "tests" / "toy_recipe" / "conf"
    base = [
        "--config-dir",
        str(conf),
        "recipe=toy",
        f"hydra.run.dir={tmp_path / 'run'}",
        "trainer.progress=false",
        "checkpoint.every=10",
    ]
    r = run_cli([*base, "trainer.max_steps=10"], cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "toy validation MSE" in r.stderr + r.stdout
    r = run_cli([*base, "trainer.max_steps=20"], cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr + r.stdout
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [row["loss"] for row in rows if row["split"] == "val"]
    assert len(val) == 2 and val[-1] < val[0]  # it learns

    # the engine's export asks the toy task for its export spec
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000020"
    import os

    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env_path]))
    try:
        e = run_module("framework.export", [str(ckpt), str(tmp_path / "toy.pt")], cwd=tmp_path)
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_path
    assert e.returncode == 0, e.stderr[-2000:]
    spec = json.loads((tmp_path / "toy.json").read_text())
    assert spec["name"] == "toy_cnn" and spec["kwargs"] == {"channels": 8}


def test_a_broken_plugin_is_one_config_error_line(tmp_path):
    site = tmp_path / "site"
    info = site / "broken-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[framework.recipes]\nbroken = no_such_module.registry\n")
    r = run_cli(["trainer.max_steps=1"], cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert r.returncode == 2
    assert (
        r.stderr.strip().splitlines()[-1]
        == "error: recipe plugin 'no_such_module.registry' cannot be imported: No module named 'no_such_module'"
    )
