"""Loading a checkpoint never executes code: crafted DCP metadata, crafted torch files, paths
outside the checkpoint; errors are one line and never advise ``weights_only=False``."""

from __future__ import annotations

import json
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch

from framework.checkpoint.dcp import DcpBackend, read_metadata
from framework.checkpoint.manager import CheckpointManager
from framework.checkpoint.torch_save import TorchSaveBackend
from framework.config.schema import CheckpointConfig
from framework.distributed.env import DistEnv
from framework.errors import DataError
from tests.conftest import REPO, run_module
from tests.framework.checkpoint.craft import evil_torch_file, plant_bytes_entry, point_outside, settle_manifest
from tests.framework.checkpoint.test_manager import make_trainer, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saved(tmp_path, backend="dcp", config=None):
    impl = {"dcp": DcpBackend, "torch_save": TorchSaveBackend}[backend]()
    m = CheckpointManager(CheckpointConfig(name=backend), impl, tmp_path / "run", DistEnv())
    t = make_trainer()
    train(t, 1)
    return m, t, m.save(t, config if config is not None else {"seed": 0})


CONFIG = {
    "seed": 0,
    "task": {"name": "stormcast_regression"},
    "model": {"name": "songunet"},
    "data": {"hrrr_channels": ["u10m"], "era5_channels": [], "invariants": [], "grid": [16, 16]},
}


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    assert "weights_only" not in text and "Re-running" not in text, text
    return text


@pytest.mark.parametrize("manifest", ["reforge", "drop"])
def test_bytes_entry_in_dcp_metadata_is_refused_before_anything_is_read(tmp_path, manifest):
    """DCP reads a BytesStorageMetadata entry with torch.load(weights_only=False): a crafted
    checkpoint would run code on resume. It is refused by name, the payload never unpickled,
    whether the manifest was forged to match (an attacker) or is absent (an older version)."""
    m, _, path = saved(tmp_path)
    marker = tmp_path / "PWNED"
    fqn = plant_bytes_entry(path, marker, manifest=manifest)
    with pytest.raises(DataError) as info:
        m.load(path, make_trainer(seed=1))
    text = one_line(info.value)
    assert f"is refused: entry {fqn} of .metadata is a pickled Python object (BytesStorageMetadata)" in text
    assert not marker.exists()
    # the entry of a part that is not loaded is refused too: no bytes entries at all
    m.cfg.exclude = ["model"]
    with pytest.raises(DataError, match="BytesStorageMetadata"):
        m.load(path, make_trainer(seed=1))
    assert not marker.exists()


def test_export_of_a_crafted_dcp_checkpoint_fails_in_one_line(tmp_path, capsys):
    from framework import export

    m, _, path = saved(tmp_path, config=CONFIG)
    marker = tmp_path / "PWNED"
    fqn = plant_bytes_entry(path, marker)
    out = tmp_path / "out.pt"
    assert export.main([str(path), str(out)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"entry {fqn} of .metadata" in err[0], err
    # before: 129 of 130 tensors exported and exit 0; now nothing is written
    assert not out.exists() and not out.with_suffix(".json").exists() and not marker.exists()
    proc = run_module("framework.export", [str(path), str(out)], REPO)  # as a user runs it
    assert proc.returncode == 3 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "BytesStorageMetadata" in proc.stderr and not marker.exists()


@pytest.mark.parametrize(
    "backend,name",
    [("torch_save", "state.pt"), ("torch_save", "rng/rank_0.pt"), ("dcp", "extra.pt"), ("dcp", "rng/rank_0.pt")],
)
def test_torch_files_holding_objects_are_refused_without_torchs_advice(tmp_path, backend, name):
    m, _, path = saved(tmp_path, backend)
    marker = tmp_path / "PWNED"
    (path / name).write_bytes(evil_torch_file(marker))
    settle_manifest(path, "reforge")
    with pytest.raises(DataError) as info:
        m.load(path, make_trainer(seed=1))
    text = one_line(info.value)
    assert f"{name} cannot be read: it holds a pickled Python object" in text and "refused" in text, text
    assert not marker.exists()


def test_export_of_a_crafted_torch_save_checkpoint_fails_in_one_line(tmp_path, capsys):
    from framework import export

    _, _, path = saved(tmp_path, "torch_save", config=CONFIG)
    marker = tmp_path / "PWNED"
    (path / "state.pt").write_bytes(evil_torch_file(marker))
    settle_manifest(path, "reforge")
    assert export.main([str(path), str(tmp_path / "out.pt")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state.pt cannot be read: it holds a pickled Python object" in err[0], err
    assert "weights_only" not in err[0] and not marker.exists()


def test_dcp_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    m, _, path = saved(tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 4096)
    point_outside(path, "../../../secret.bin")
    with pytest.raises(
        DataError,
        match=r"is refused: .metadata points .* at '../../../secret.bin', which is not a "
        r"data file inside the checkpoint",
    ):
        m.load(path, make_trainer(seed=1))


def test_dcp_metadata_of_another_model_is_refused_by_name_shape_and_dtype(tmp_path):
    m, _, path = saved(tmp_path)
    other = make_trainer()
    other.model[2] = torch.nn.Linear(8, 3)
    other.optimizer = torch.optim.Adam(other.model.parameters())
    other.scheduler = torch.optim.lr_scheduler.LambdaLR(other.optimizer, lambda s: 1.0)
    with pytest.raises(
        DataError,
        match=r"cannot be loaded into this model: model.2.weight is float32\[2, 8\] in the "
        r"checkpoint, float32\[3, 8\] here",
    ):
        m.load(path, other)
    other = make_trainer()
    other.model.append(torch.nn.Linear(2, 2))
    other.optimizer = torch.optim.Adam(other.model.parameters())
    other.scheduler = torch.optim.lr_scheduler.LambdaLR(other.optimizer, lambda s: 1.0)
    with pytest.raises(DataError, match=r"cannot be loaded into this model: it lacks model.3.bias \(and 1 more\)"):
        m.load(path, other)
    half = make_trainer()
    half.model = half.model.to(torch.float64)
    half.optimizer = torch.optim.Adam(half.model.parameters())
    half.scheduler = torch.optim.lr_scheduler.LambdaLR(half.optimizer, lambda s: 1.0)
    with pytest.raises(DataError, match=r"model.0.weight is float32\[8, 4\] in the checkpoint, float64\[8, 4\] here"):
        m.load(path, half)


def test_only_tensors_go_through_dcp(tmp_path):
    """A non-tensor value in the optimizer state goes to extra.pt, not through DCP (which
    would pickle it); it comes back on load."""
    t = make_trainer()
    train(t, 1)
    first = next(iter(t.optimizer.state.values()))
    first["note"] = 3  # a plain value among the tensors
    m = CheckpointManager(CheckpointConfig(name="dcp"), DcpBackend(), tmp_path, DistEnv())
    path = m.save(t, {})
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = read_metadata(path).state_dict_metadata
    assert entries and all(isinstance(md, TensorStorageMetadata) for md in entries.values())
    extra = torch.load(path / "extra.pt", weights_only=True)
    assert extra["plain"] == [(("optimizer", "state", "0.weight", "note"), 3)]
    b = make_trainer(seed=1)
    m.load(path, b)
    assert next(iter(b.optimizer.state.values()))["note"] == 3
    assert torch.equal(b.model[0].weight, t.model[0].weight)


def test_metadata_with_code_is_refused_by_the_unpickler(tmp_path):
    m, _, path = saved(tmp_path)
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    settle_manifest(path, "reforge")
    with pytest.raises(
        DataError,
        match=r".metadata cannot be read: '(builtins|io).open' is not allowed in checkpoint metadata",
    ):
        m.load(path, make_trainer(seed=1))
    assert not marker.exists()
    assert json.loads((path / "manifest.json").read_text())["files"][".metadata"]  # the forged manifest matched


def _binunicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def test_metadata_that_patches_an_allowed_class_is_refused(tmp_path):
    """Naming only allowed globals is not enough: pickle's BUILD would set attributes on the
    class itself (here: every PosixPath.is_file made truthy for the whole process)."""
    m, _, path = saved(tmp_path)
    legit = (path / ".metadata").read_bytes()
    patch = (
        b"cpathlib\nPosixPath\n"  # the class, not an instance
        + b"N}"
        + _binunicode("is_file")
        + b"cpathlib\nPath\ns\x86b0"  # BUILD (None, {"is_file": Path}), then POP
    )
    (path / ".metadata").write_bytes(legit[:2] + patch + legit[2:])
    settle_manifest(path, "reforge")
    with pytest.raises(DataError, match=r"cannot be read: setting the state of pathlib.PosixPath is not allowed"):
        m.load(path, make_trainer(seed=1))
    assert not pathlib.PosixPath(tmp_path / "absent").is_file()


def test_metadata_naming_a_torch_submodule_imports_nothing(tmp_path):
    """A name under ``torch`` is looked up among the dtypes, never with getattr (torch imports
    a lazy submodule the moment it is asked for one)."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch\nonnx\n.")
    code = (
        "import sys; from framework.checkpoint.dcp import read_metadata\n"
        "try: read_metadata(sys.argv[1])\nexcept Exception as e: print(e)\n"
        "print('torch.onnx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-2:] == [
        f"checkpoint file {tmp_path / '.metadata'} cannot be read: 'torch.onnx' is not allowed in checkpoint metadata",
        "False",
    ], out


@pytest.mark.parametrize("backend", ["torch_save", "dcp"])
def test_export_weights_checks_the_expected_model_before_reading(tmp_path, backend):
    """What weights.load does: the model is built first, its state dict is what the checkpoint
    must hold (names, dtypes, shapes)."""
    from framework.checkpoint.backend import for_checkpoint

    _, t, path = saved(tmp_path, backend)
    reader = for_checkpoint(path)
    weights = reader.export_weights(path, t.model.state_dict())
    assert all(type(v) is torch.Tensor and v.is_contiguous() for v in weights.values())
    assert all(torch.equal(weights[k], v) for k, v in t.model.state_dict().items())
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with pytest.raises(
        DataError,
        match=r"cannot be loaded into this model: (model\.)?2.weight is float32\[2, 8\] in "
        r"the checkpoint, float32\[3, 8\] here",
    ):
        reader.export_weights(path, other.state_dict())


def test_tensor_data_that_is_a_pickle_is_refused_without_torchs_advice(tmp_path, capsys):
    from framework import export
    from tests.framework.checkpoint.craft import plant_pickle_as_tensor

    m, _, path = saved(tmp_path, config=CONFIG)
    marker = tmp_path / "PWNED"
    plant_pickle_as_tensor(path, marker)
    with pytest.raises(DataError) as info:
        m.load(path, make_trainer(seed=1))
    assert "it holds a pickled Python object" in one_line(info.value)
    assert export.main([str(path), str(tmp_path / "out.pt")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "it holds a pickled Python object" in err[0] and "weights_only" not in err[0], err
    assert not marker.exists()


def _edit_small_state(path, backend: str, edit) -> None:
    """Change the plain (non-tensor) part of a checkpoint as an attacker could, manifest re-forged."""
    name = {"dcp": "extra.pt", "torch_save": "state.pt"}[backend]
    state = torch.load(path / name, weights_only=True)
    edit(state)
    torch.save(state, path / name)
    settle_manifest(path, "reforge")


@pytest.mark.parametrize("backend", ["dcp", "torch_save"])
@pytest.mark.parametrize(
    "edit,error",
    [
        (lambda s: s["schedule"].update(optimizer=3), r"the LR schedule's state sets 'optimizer', which is not state"),
        (lambda s: s["schedule"].update(last_epoch="1"), r"the LR schedule's last_epoch is a str, expected a int"),
        (lambda s: s["schedule"].update(lr_lambdas=[{"__code__": 1}]), r"lr_lambdas set fields this run.s factors"),
        (lambda s: s["meta"].update(run_id="../../other"), r"run id '../../other' is not a run id"),
    ],
    ids=["schedule-attribute", "schedule-type", "factor-state", "run-id"],
)
def test_plain_state_that_would_patch_the_trainer_is_refused(tmp_path, backend, edit, error):
    """LambdaLR.load_state_dict copies what it is given onto the scheduler (and factor state onto
    the factor): a checkpoint's schedule may only hold the scheduler's own state."""
    m, t, path = saved(tmp_path, backend)
    _edit_small_state(path, backend, edit)
    b = make_trainer(seed=1)
    with pytest.raises(DataError, match=error):
        m.load(path, b)
    assert b.scheduler.optimizer is b.optimizer and b.scheduler.last_epoch == 0 and b.run_id != "../../other"


def test_a_schedule_field_only_an_older_torch_had_is_dropped(tmp_path):
    m, t, path = saved(tmp_path)
    _edit_small_state(path, "dcp", lambda s: s["schedule"].update(verbose=False))
    b = make_trainer(seed=1)
    m.load(path, b)
    assert b.scheduler.last_epoch == t.scheduler.last_epoch and not hasattr(b.scheduler, "verbose")


def test_a_plain_value_at_a_huge_list_index_is_refused(tmp_path):
    """DCP's set_element pads a list up to the index: a 1 kB extra.pt could ask for 10**9 slots."""
    m, _, path = saved(tmp_path)
    _edit_small_state(path, "dcp", lambda s: s.setdefault("plain", []).append((("optimizer", "state", "x", 10**9), 1)))
    with pytest.raises(DataError, match=r"extra.pt cannot be read: malformed 'plain' entry"):
        m.load(path, make_trainer(seed=1))


@pytest.mark.parametrize("name", ["meta.json", "manifest.json"])
def test_json_nested_too_deep_is_a_corrupt_checkpoint_not_a_traceback(tmp_path, name):
    m, _, path = saved(tmp_path)
    (path / name).write_text("[" * 100_000)
    with pytest.raises(DataError, match=rf"is corrupt: {name} cannot be read \(maximum recursion depth"):
        m.load(path, make_trainer(seed=1))


def test_a_tensor_shape_larger_than_the_data_files_is_refused_before_allocation(tmp_path):
    """Export allocates what .metadata declares: a crafted shape must not become a huge empty()."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from framework.checkpoint.dcp import load_model_weights

    _, _, path = saved(tmp_path)
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, in a test
    fqn, entry = next((k, v) for k, v in md.state_dict_metadata.items() if k.startswith("model.") and len(v.size) == 2)
    md.state_dict_metadata[fqn] = TensorStorageMetadata(entry.properties, torch.Size([2**20, 2**20]), entry.chunks)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    settle_manifest(path, "reforge")
    with pytest.raises(DataError, match=r"corrupt: .metadata declares \d+ bytes of tensors, its data files hold \d+$"):
        load_model_weights(path)
