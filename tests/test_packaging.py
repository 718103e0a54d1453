"""Packaging: the wheel is complete and runs on its own; every import is declared with bounds.

The wheel test builds a wheel from a copy of the source tree (no stale build/ leaks in),
installs it without -e into a fresh venv that reuses this interpreter's site-packages for
the dependencies (a path in a .pth file: no network, no editable finder of the checkout),
and runs the main job from a directory where the checkout is not importable.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SOURCES = ("framework", "recipes")  # what the wheel holds as code; conf/ ships as framework_conf


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    for name in (*SOURCES, "conf"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            str(src),
            "-w",
            str(tmp / "dist"),
        ]
    )
    (whl,) = (tmp / "dist").glob("framework-*.whl")
    return whl


def test_the_wheel_holds_every_module_and_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        p.relative_to(REPO).as_posix()
        for s in SOURCES
        for p in (REPO / s).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    expected |= {"framework_conf/" + p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml")}
    missing = sorted(expected - names)
    assert not missing, (
        "missing from the wheel (a new package? add it to [tool.setuptools] packages in "
        "pyproject.toml): " + ", ".join(missing[:20])
    )
    assert not any(n.startswith(("tests/", "conf/", "benchmarks/", "scripts/")) for n in names)


def _dependency_dirs() -> list[str]:
    """This interpreter's site-packages (torch, hydra, ...), never the checkout."""
    dirs = [*site.getsitepackages(), site.getusersitepackages() if site.ENABLE_USER_SITE else ""]
    return [d for d in dict.fromkeys(dirs) if d and Path(d).is_dir() and Path(d).resolve() != REPO]


@pytest.mark.slow  # ~30 s: build, venv, install, one 2-step run (CI runs it: no -m filter)
def test_the_installed_wheel_runs_the_main_job_from_anywhere(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)])
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # plain paths in a .pth: importable, but their own .pth files (an editable finder) are not run
    (purelib / "_framework_test_deps.pth").write_text("\n".join(_dependency_dirs()) + "\n")

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "FRAMEWORK_RECIPES")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    probe = (
        "import json, sys, importlib; from framework import compat, registry; "
        "mods = registry.plugin_modules(); "
        "print(json.dumps({'framework': compat.__file__, 'conf': compat.CONF_DIR, "
        "'installed_conf': str(compat.installed_conf_dir()), 'path': sys.path, "
        "'plugins': {m: importlib.import_module(m).__file__ for m in mods}}))"
    )
    found = json.loads(_run([str(py), "-c", probe], cwd=cwd, env=env).stdout.splitlines()[-1])
    assert str(REPO) not in found["path"], found["path"]
    assert Path(found["framework"]).is_relative_to(purelib)
    assert found["conf"] == found["installed_conf"] == str(purelib / "framework_conf")
    assert {"recipes.stormcast.registry", "recipes.stormscope.registry"} <= set(found["plugins"])
    assert all(Path(f).is_relative_to(purelib) for f in found["plugins"].values()), found["plugins"]

    run = tmp_path / "run"
    args = {
        "hydra.run.dir": run,
        "data.root": tmp_path / "data",
        "data.grid": "[16,16]",
        "data.hours_per_year": 48,
        "data.batch_size": 4,
        "model.model_channels": 8,
        "trainer.max_steps": 2,
        "trainer.log_every": 1,
        "trainer.val_every": 2,
        "trainer.val_batches": 1,
        "trainer.progress": "false",
        "checkpoint.every": 2,
        "schedule.warmup_steps": 1,
    }
    r = subprocess.run(
        [str(py), "-m", "framework", *(f"{k}={v}" for k, v in args.items())],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    hint = ""
    if "site-packages/conf" in r.stderr or "Primary config directory not found" in r.stderr:
        hint = (
            "\nthe engine looks for site-packages/conf: CONF_DIR must come from framework.compat "
            "(framework/config/compose.py) and @hydra.main must get config_path=cli.CONF_DIR "
            "(framework/__main__.py)\n"
        )
    assert r.returncode == 0, hint + r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["split"] == "train"] == [1, 2]
    # Hydra composed the configs of the wheel
    assert str(purelib / "framework_conf") in (run / ".hydra" / "hydra.yaml").read_text()


def test_an_editable_install_maps_framework_conf_onto_the_checkout():
    from framework import compat

    if not _editable_install_of_this_checkout():
        pytest.skip("framework is not installed editable from this checkout")
    assert compat.installed_conf_dir() == REPO / "conf", "stale editable install: pip install --no-deps -e ."
    assert compat.conf_dir() == REPO / "conf"


def _editable_install_of_this_checkout() -> bool:
    from importlib.metadata import distributions

    for dist in distributions(name="framework"):  # the checkout's own framework.egg-info has no direct_url
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable") and direct["url"] == REPO.as_uri():
            return True
    return False


# -- every import declared -------------------------------------------------------------------
def _third_party_imports() -> dict[str, list[str]]:
    """Top-level names imported anywhere in framework/ and recipes/ -> where (file:line)."""
    found: dict[str, list[str]] = {}
    for s in SOURCES:
        for path in sorted((REPO / s).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in (*SOURCES, "__future__"):
                        found.setdefault(top, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_third_party_import_is_declared_with_lower_and_upper_bounds():
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    declared = {canonicalize_name(r.name): r for r in reqs}
    dists = packages_distributions()
    problems = []
    for top, where in sorted(_third_party_imports().items()):
        names = [canonicalize_name(d) for d in dists.get(top, [])]
        if not names:
            problems.append(f"{top}: no installed distribution provides it ({where[0]})")
        elif not any(n in declared for n in names):
            problems.append(f"{top}: imported ({where[0]}) but {names[0]} is not in pyproject's dependencies")
    assert not problems, "\n".join(problems)
    for name, r in declared.items():
        ops = {s.operator for s in r.specifier}
        assert ops & {">=", ">", "==", "~="} and ops & {"<", "<=", "==", "~="}, f"{name}: needs both bounds: {r}"
