"""Loading a checkpoint never executes code: crafted DCP metadata, crafted torch files, paths
outside the checkpoint; errors are one line and never advise ``weights_only=False``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import pickle
import re
import subprocess
import sys
import threading

import pytest
import torch

from framework.checkpoint import manifest as manifest_mod
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
    with pytest.raises(DataError, match=rf"is corrupt: {name} cannot be read \(.*{name} nests its JSON too deeply\)$"):
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


# -- a manifest's chunk count, special files, contents that verify but do not fit ---------------
def _set_manifest(path, **edits) -> None:
    """Edit manifest.json as an attacker could (it is not a signature)."""
    man = json.loads((path / "manifest.json").read_text())
    man.update({k: v for k, v in edits.items() if k != "files"})
    man["files"] = {**edits.get("files", {}), **man["files"], **edits.get("files", {})}  # edited ones first
    (path / "manifest.json").write_text(json.dumps(man))


@contextlib.contextmanager
def _memory_capped(extra: int = 1 << 30):
    """Address space capped at what the process maps now plus ``extra``: an allocation the code
    must never make fails at once (MemoryError) instead of filling the machine."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    kb = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (kb * 1024 + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize(
    "chunk,size,error",
    [(1, 10**12, r"has no valid chunk_bytes \(at least 4096\)"), (4096, 10**18, "has a malformed entry for state.pt")],
    ids=["chunk-of-one-byte", "size-of-an-exabyte"],
)
def test_a_manifest_declaring_countless_chunks_is_refused_without_listing_them(tmp_path, chunk, size, error):
    """The schema check compared the chunk list with a list of every (offset, length) the size
    makes: a 1 kB manifest declaring 10**12 one-byte chunks was a MemoryError traceback (or all
    the machine's memory). The count is computed; chunk_bytes has a floor."""
    m, _, path = saved(tmp_path, "torch_save")
    _set_manifest(path, chunk_bytes=chunk, files={"state.pt": {"size": size, "chunks": []}})
    with _memory_capped(), pytest.raises(DataError) as info:
        m.load(path, make_trainer(seed=1))
    assert re.search(rf"checkpoint {re.escape(str(path))} is corrupt: manifest.json {error}$", one_line(info.value))


def _special(path, kind: str) -> None:
    """Replace the file ``path`` by a named pipe (an open blocks until a writer comes) or a link to
    /dev/zero (a read never ends)."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@contextlib.contextmanager
def _released(fifo, after: float = 20.0):
    """Yields a list that is non-empty if, ``after`` seconds on, the block is still running: then
    ``fifo`` is opened and closed for writing until the block ends, so that a reader blocked on it
    (a hang: the thread pool that hashes files cannot be interrupted) gets an end of file and the
    test fails instead of hanging."""
    done, waited = threading.Event(), []

    def release() -> None:
        if done.wait(after):
            return
        waited.append(after)
        while not done.wait(0.1):
            with contextlib.suppress(OSError):  # ENXIO: no reader at the moment
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield waited
    finally:
        done.set()
        thread.join()


@pytest.mark.timeout(120)  # before: these hung for ever (or read /dev/zero until memory ran out)
@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("name", ["meta.json", "manifest.json"])
def test_a_pipe_or_device_as_a_json_file_is_a_corrupt_checkpoint_not_a_hang(tmp_path, name, kind):
    """Named on resume (the locator reads both files) and loaded (verification reads them again)."""
    m, _, path = saved(tmp_path)
    _special(path / name, kind)
    m.cfg.resume = str(path)
    with _released(path / name) as waited:
        for attempt in (m.resume_path, lambda: m.load(path, make_trainer(seed=1))):
            with pytest.raises(DataError) as info:
                attempt()
            text = one_line(info.value)
            assert text == f"checkpoint {path} is corrupt: {name} cannot be read ({path / name} is not a regular file)"
    assert not waited, "the reader waited on the pipe"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "backend,name,how", [("dcp", ".metadata", "drop"), ("torch_save", "state.pt", "forge")], ids=["dcp", "torch"]
)
def test_a_pipe_as_a_checkpoint_data_file_is_refused_not_waited_on(tmp_path, backend, name, how):
    """With a manifest forged to list the pipe's size (0), the hashing opened it; without one (an
    older checkpoint), the loader did."""
    m, _, path = saved(tmp_path, backend)
    _special(path / name, "fifo")
    if how == "drop":
        (path / "manifest.json").unlink()
    else:
        _set_manifest(path, files={name: {"size": 0, "chunks": [hashlib.blake2b(digest_size=32).hexdigest()]}})
    with _released(path / name) as waited, pytest.raises(DataError) as info:
        m.load(path, make_trainer(seed=1))
    assert not waited, "the loader waited on the pipe"
    assert one_line(info.value).endswith("is not a regular file)" if how == "drop" else f"{name} is not a regular file")


@pytest.mark.timeout(120)
def test_resume_latest_and_export_pass_a_checkpoint_whose_manifest_is_a_pipe(tmp_path, caplog):
    """The CLI's first look at a run dir (rerun.resume_point, before training) and export hung on a
    named pipe as the newest checkpoint's manifest; now it is skipped like a corrupt manifest, and
    refused in one line when named."""
    from framework import rerun

    m, t, older = saved(tmp_path, "torch_save", config=CONFIG)
    train(t, 1)
    newest = m.save(t, CONFIG)
    _special(newest / "manifest.json", "fifo")
    run = tmp_path / "run"
    with _released(newest / "manifest.json") as waited:
        point = rerun.resume_point("latest", run)
        with caplog.at_level(logging.WARNING, logger="framework"):
            assert m.resume_path() == older
    assert not waited, "the locator waited on the pipe"
    assert point == {"step": 1, "checkpoint": str(older)}
    assert f"checkpoint {newest} is corrupt: manifest.json cannot be read" in caplog.text
    proc = run_module("framework.export", [str(run), str(tmp_path / "out.pt")], REPO, timeout=90)
    assert proc.returncode == 0 and "of step 1" in proc.stdout, proc.stderr
    proc = run_module("framework.export", [str(newest), str(tmp_path / "out.pt")], REPO, timeout=90)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: checkpoint {newest} is corrupt: manifest.json cannot be read "
        f"({newest / 'manifest.json'} is not a regular file)"
    ]


def _first_param(s: dict) -> str:
    return next(iter(s["model"] if "model" in s else s["param_groups"][0]["params"]))


def _optimizer(s: dict) -> dict:
    """The optimizer state of state.pt, or extra.pt's param groups (DCP) as {"param_groups"}."""
    return s["optimizer"] if "optimizer" in s else s


RESTORE_EDITS = {
    "step-str": (lambda s: s["data"].update(step="abc"), r"its data step 'abc' is not a step"),
    "step-missing": (lambda s: s.update(data={}), r"its data state holds no step"),
    "step-negative": (lambda s: s["data"].update(step=-5), r"its data step -5 is not a step"),
    "step-other": (lambda s: s["data"].update(step=10**12), r"it holds step 1000000000000, its meta.json says 1"),
    "groups-str": (lambda s: _optimizer(s).update(param_groups="abc"), r"param_groups is a str, not a list"),
    "groups-empty": (lambda s: _optimizer(s).update(param_groups=[]), r"has 0 param groups, this optimizer 1"),
    "group-params": (
        lambda s: _optimizer(s)["param_groups"][0].update(params=["nope"]),
        r"param group 0 does not name this model's parameters",
    ),
    "group-no-lr": (lambda s: _optimizer(s)["param_groups"][0].pop("lr"), r"param group 0 has no learning rate"),
    "group-betas": (
        lambda s: _optimizer(s)["param_groups"][0].update(betas="ab"),
        r"param group 0's betas is str, expected \(number, number\)",
    ),
}
TORCH_SAVE_EDITS = {
    "optimizer-garbage": (
        lambda s: s.update(optimizer={"state": 5, "param_groups": "x"}),
        r"the optimizer state is not a dict with a 'state' dict",
    ),
    "moment-shape": (
        lambda s: s["optimizer"]["state"][_first_param(s)].update(exp_avg=torch.zeros(2)),
        r"the optimizer state of 0.weight: exp_avg is a tensor of shape \[2\], expected of shape \[8, 4\]",
    ),
    "moment-missing": (
        lambda s: s["optimizer"]["state"][_first_param(s)].pop("exp_avg_sq"),
        r"the optimizer state of 0.weight lacks exp_avg_sq$",
    ),
    "state-other-param": (
        lambda s: s["optimizer"]["state"].update(nope={}),
        r"the optimizer state has state for 'nope', which this optimizer does not hold",
    ),
    "model-shape": (
        lambda s: s["model"].update({_first_param(s): torch.zeros(3, 3)}),
        r"cannot be loaded into this model: 0.weight is float32\[3, 3\] in the checkpoint, float32\[8, 4\] here",
    ),
    "model-dtype": (
        lambda s: s["model"].update({_first_param(s): torch.zeros(8, 4, dtype=torch.float64)}),
        r"0.weight is float64\[8, 4\] in the checkpoint, float32\[8, 4\] here",
    ),
}
EDITS = [(b, k) for b in ("dcp", "torch_save") for k in RESTORE_EDITS] + [("torch_save", k) for k in TORCH_SAVE_EDITS]


@pytest.mark.parametrize("backend,edit", EDITS, ids=[f"{b}-{k}" for b, k in EDITS])
def test_state_that_verifies_but_does_not_fit_is_one_line_and_the_checkpoint_stays(tmp_path, backend, edit):
    """A checkpoint whose manifest was re-forged over wrong contents: a step that is no step, an
    optimizer state torch cannot load (or loads, to fail at the first training step), a model
    tensor of another shape. Each was a traceback (exit 1) on resume, some only after training
    had started; now one DataError before anything is restored, and the checkpoint untouched."""
    change, error = {**RESTORE_EDITS, **TORCH_SAVE_EDITS}[edit]
    m, _, path = saved(tmp_path, backend)
    _edit_small_state(path, backend, change)
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    b = make_trainer(seed=1)
    with pytest.raises(DataError) as info:
        m.load(path, b)
    text = one_line(info.value)
    assert str(path) in text and re.search(error, text), text
    assert b.step == 0  # nothing restored
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    man = manifest_mod.read(path)
    assert man is not None
    manifest_mod.verify(path, man, json.loads((path / "meta.json").read_text()), full=True)  # still verifies


def test_a_restore_failure_the_checks_do_not_foresee_is_one_line_naming_the_checkpoint(tmp_path):
    """Whatever else torch refuses while restoring (here a GradScaler state without its growth
    factor: a KeyError) is one DataError naming the checkpoint, not a traceback."""
    m = CheckpointManager(CheckpointConfig(name="torch_save"), TorchSaveBackend(), tmp_path / "run", DistEnv())
    t = make_trainer(scaler=True)
    train(t, 1)
    path = m.save(t, {"seed": 0})
    _edit_small_state(path, "torch_save", lambda s: s.update(scaler={"scale": 1.0}))
    with pytest.raises(DataError) as info:
        m.load(path, make_trainer(seed=1, scaler=True))
    assert one_line(info.value) == f"checkpoint {path} cannot be restored into this run: 'growth_factor'"
