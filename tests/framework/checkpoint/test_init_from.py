"""``checkpoint.init_from`` in the engine: the name/shape check, the default reader of our own
formats (Task.init_weights), the manager's resume plan and the record kept in checkpoints."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from framework.checkpoint import init_from
from framework.config.schema import CheckpointConfig
from framework.errors import ConfigError, DataError
from framework.task import Task
from tests.framework.checkpoint.test_manager import make_trainer, manager, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def net(seed=0, hidden=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def test_apply_copies_exactly_the_weights():
    src, dst = net(0), net(1)
    assert init_from.apply(dst, src.state_dict(), "src.pt") == 4
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda sd: sd.pop("2.bias"), "src.pt does not fit the model: it lacks 2.bias$"),
        (
            lambda sd: sd.update(extra=torch.zeros(1)),
            "src.pt does not fit the model: it holds extra, which this model does not have$",
        ),
        (
            lambda sd: sd.update({"0.weight": torch.zeros(9, 4)}),
            r"src.pt does not fit the model: 0.weight is float32\[9, 4\] there, float32\[8, 4\] here$",
        ),
        (
            lambda sd: sd["2.weight"].view(-1)[1].fill_(float("nan")),
            r"src.pt does not fit the model: 2.weight holds non-finite values \(NaN or Inf\)$",
        ),
        (
            lambda sd: sd["0.bias"].fill_(float("-inf")),
            r"src.pt does not fit the model: 0.bias holds non-finite values \(NaN or Inf\)$",
        ),
    ],
    ids=["missing", "unexpected", "shape", "nan", "inf"],
)
def test_apply_refuses_other_names_shapes_or_non_finite_weights_in_one_line_and_copies_nothing(edit, message):
    sd, dst = {k: v.clone() for k, v in net(0).state_dict().items()}, net(1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    edit(sd)
    with pytest.raises(ConfigError, match=rf"^checkpoint.init_from: {message}") as e:
        init_from.apply(dst, sd, "src.pt")
    assert "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


class _Plain(Task):
    """Only what Task requires; init_weights is the engine's default."""

    export_spec = train_dataset = val_dataset = build_model = loss = val_step = val_summary = None


def test_default_init_weights_reads_an_exported_weights_file(tmp_path):
    src = net(0)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    task = _Plain(None, None, torch.device("cpu"))
    dst = net(1)
    record = task.init_weights(dst, tmp_path / "w.pt")
    assert record == {"path": str(tmp_path / "w.pt"), "format": "weights file", "tensors": 4}
    assert torch.equal(dst[0].weight, src[0].weight)
    torch.save(net(0, hidden=16).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(ConfigError, match=r"wide.pt does not fit the model: 0.weight is float32\[16, 4\] there"):
        task.init_weights(dst, tmp_path / "wide.pt")


def test_default_init_weights_never_unpickles_code(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"0.weight": Evil()}, protocol=2))
    with pytest.raises(DataError, match="evil.pt: weights cannot be read: it holds a pickled Python object"):
        _Plain(None, None, torch.device("cpu")).init_weights(net(), tmp_path / "evil.pt")
    assert not marker.exists()


def test_default_init_weights_reads_a_run_dir_and_its_latest_checkpoint(tmp_path):
    t = make_trainer()
    train(t, 2)
    m = manager(tmp_path / "run")
    m.save(t, {})
    dst = make_trainer(seed=3).model
    record = _Plain(None, None, torch.device("cpu")).init_weights(dst, tmp_path / "run")
    assert record["checkpoint"] == str(tmp_path / "run" / "checkpoints" / "step_00000002") and record["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(t.model.state_dict().values(), dst.state_dict().values()))


def test_plan_resume_is_the_answer_resume_path_gives_once(tmp_path, monkeypatch):
    t = make_trainer()
    m = manager(tmp_path)
    assert m.plan_resume() is None and m.resume_path() is None  # nothing to resume: a fresh start
    train(t, 1)
    m.save(t, {})
    m = manager(tmp_path)
    checked = []
    original = m._verify
    monkeypatch.setattr(m, "_verify", lambda path, **kw: checked.append(path) or original(path, **kw))
    planned = m.plan_resume()
    assert planned.name == "step_00000001" and len(checked) == 1
    assert m.resume_path() == planned and len(checked) == 1  # not verified twice
    assert m.resume_path() == planned and len(checked) == 2  # asked again: looked up again


def test_checkpoints_keep_the_init_from_record_across_a_resume(tmp_path):
    record = {"path": "/w/start.mdlus", "format": "physicsnemo", "tensors": 4}
    t = make_trainer()
    t.init_from = record
    train(t, 1)
    m = manager(tmp_path)
    first = m.save(t, {})
    assert json.loads((first / "meta.json").read_text())["init_from"] == record
    resumed = make_trainer(seed=1)
    resumed.init_from = None  # what the runtime sets when it resumes
    m = manager(tmp_path)
    m.load(m.resume_path(), resumed)
    assert resumed.init_from == record
    train(resumed, 1)
    assert json.loads((m.save(resumed, {}) / "meta.json").read_text())["init_from"] == record


def test_an_empty_init_from_is_refused():
    with pytest.raises(ValueError, match="init_from: is empty"):
        CheckpointConfig(init_from=" ")
