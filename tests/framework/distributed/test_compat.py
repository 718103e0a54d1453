"""The adapters over torch's private APIs (framework.compat), on the installed torch.

Checked on torch 2.11, 2.12, 2.13 and 2.14 (CPU, gloo): ``framework.compat.TORCH_CHECKED``.
CI runs this file on 2.13 (the main suite) and on 2.11 and 2.14 (.ci/run, torch smoke); a new
torch minor fails ``test_the_installed_torch_is_a_minor_we_checked`` until someone runs
this file on it and adds it to TORCH_CHECKED (and to pyproject's range).
"""

from __future__ import annotations

import datetime
import tomllib
import types

import pytest
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.version import Version

from framework import compat
from tests.conftest import REPO
from tests.multiproc import spawn
from tests.zygote import held_store

pytestmark = pytest.mark.timeout(300)


def _claimed_torch() -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == "torch")


def test_the_installed_torch_is_a_minor_we_checked():
    minor = compat.torch_minor()
    assert minor in compat.TORCH_CHECKED, (
        f"torch {minor} is not among the minors the adapters of framework/compat.py were checked on "
        f"({', '.join(compat.TORCH_CHECKED)}): run tests/framework/distributed/test_compat.py on it, then add it"
    )


def test_every_minor_pyproject_claims_was_checked():
    spec = _claimed_torch().specifier
    checked = {Version(m) for m in compat.TORCH_CHECKED}
    claimed = {Version(f"2.{m}") for m in range(0, 30) if spec.contains(f"2.{m}.0")}
    assert claimed, spec
    assert claimed <= checked, (
        f"pyproject claims torch {spec} but the adapters were never run on {sorted(map(str, claimed - checked))}"
    )


def test_private_apis_the_adapters_prefer_exist_on_this_torch():
    """Where they are gone, the public fallbacks take over (tested below): this says when."""
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(getattr(DeviceMesh, "_flatten", None)), "DeviceMesh._flatten is gone: flatten_mesh falls back"


def test_the_functional_collectives_compiled_domain_layouts_use_exist_on_this_torch():
    """framework/domain/comm.py's traced halo exchange, sums and gathers (no fallback: without
    them a compiled domain layout cannot trace its collectives)."""
    from framework import compat

    fc = compat.funcol()
    for name in ("all_to_all_single", "all_reduce", "all_gather_tensor"):
        assert callable(getattr(fc, name, None)), f"torch.distributed._functional_collectives.{name} is gone"


def test_timeout_of_the_group_process_group_made(monkeypatch):
    """In this process: one gloo rank, the timeout we gave, read back two ways."""
    from framework.distributed import env as env_mod

    one_rank = types.SimpleNamespace(rank=0, world_size=1, distributed=True)
    assert not dist.is_initialized()
    with held_store(1) as store:
        for name, value in store.items():
            monkeypatch.setenv(name, value)
        with env_mod.process_group(one_rank, types.SimpleNamespace(type="cpu"), timeout_s=77):
            assert env_mod.collective_timeout() == datetime.timedelta(seconds=77)
            assert compat.group_timeout() == datetime.timedelta(seconds=77)  # torch's private field, read back
    assert not dist.is_initialized()
    assert compat.group_timeout() is None
    assert env_mod.collective_timeout() == dist.default_pg_timeout


def _ranks(mesh) -> list[int]:
    return sorted(dist.get_process_group_ranks(mesh.get_group()))


def _views(rank, world):
    import torch

    from framework.distributed import env as env_mod
    from framework.distributed.mesh import Degrees, build

    # a group made by someone else (tests.multiproc, timeout_s=100): read from its options
    assert compat.group_timeout() == datetime.timedelta(seconds=100)
    assert env_mod.collective_timeout() == datetime.timedelta(seconds=100)

    # rank = (replicate * shard + shard_index) * domain + domain_index, row-major
    topo = build(Degrees(2, 1, 2), "cpu")
    expected = {"dp": [rank % 2, rank % 2 + 2], "fsdp": [rank // 2 * 2, rank // 2 * 2 + 1], "hsdp": list(range(world))}
    for name, ranks in expected.items():
        view = topo.view(name)
        if name == "hsdp":
            assert view.mesh.flatten().tolist() == ranks
            continue
        assert view.mesh_dim_names == (name,) and view.mesh.tolist() == ranks and _ranks(view) == ranks, name
        t = torch.ones(1)
        dist.all_reduce(t, group=view.get_group())  # the group works
        assert t.item() == len(ranks)

    # the public fallback gives the same ranks (a new root mesh per view)
    mesh = topo.mesh
    for dims, name in ((("dp_replicate", "dp_shard"), "dp"), (("dp_shard", "domain"), "fsdp")):
        view = compat._flatten_public(mesh, dims, name)
        assert view.mesh.tolist() == expected[name] and _ranks(view) == expected[name], name
    with pytest.raises(ValueError, match="not adjacent"):
        compat._flatten_public(mesh, ("dp_replicate", "domain"), "x")


def test_flattened_views_have_the_right_ranks_on_four_gloo_ranks():
    spawn(_views, 4, timeout_s=100)
