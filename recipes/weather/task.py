"""The StormCast regression task: [state_t, ERA5 background, invariants] -> state_t+dt.

The trainer calls ``loss`` and ``val_step``; everything weather-specific lives here. The tasks
read the state and background channel lists under the keys of their data config
(``recipes.weather.layout.Naming``: StormCast's ``hrrr_channels`` / ``era5_channels``,
StormScope's ``state_channels`` / ``background_channels``) and record them under those keys.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from framework import registry
from framework.errors import ConfigError, DataError
from framework.task import Task
from recipes.weather import layout

# Input conventions a trained model depends on, with the values of exports that predate them.
DATA_CONVENTIONS = {"background_time": "target", "invariant_norm": "zscore", "dt": 1}


def data_conventions(spec: dict) -> dict:
    """The input conventions an export spec records (legacy defaults where it records none)."""
    return {**DATA_CONVENTIONS, **(spec.get("data") or {})}


def check_init_from(run, path):
    """The weights ``checkpoint.init_from`` names, described (``recipes.weather.weights``) and checked
    against ``run``: a model of another task, other channels (a .mdlus: other channel counts) or
    another ``task.edm.sigma_data`` is a ConfigError line; the grid is left to the shapes."""
    from framework.checkpoint.init_from import WHAT
    from recipes.weather import weights

    try:
        info = weights.describe(path, data=run.data)
    except DataError as e:
        raise ConfigError(f"{WHAT}: {e}") from None
    trained = info.task.get("name")
    if trained != run.task.name:
        raise ConfigError(f"{WHAT}: {path} holds a {trained!r} model; this run trains {run.task.name!r}")
    weights.check_channels(info, run.data, WHAT, grid=False)
    edm = getattr(run.task, "edm", None)
    sigma = (info.task.get("edm") or {}).get("sigma_data")
    if edm is not None and sigma is not None and list(sigma) != list(edm.sigma_data):
        raise ConfigError(
            f"{WHAT}: {path} was trained with task.edm.sigma_data={list(sigma)} but this run has {list(edm.sigma_data)}"
        )
    return info


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in float32, the prediction first made plain contiguous (NCHW) where the
    target is (else left as it is): a channels-last prediction (compiled models on CUDA) against an
    NCHW target sends the loss's
    kernels down TensorIterator's strided path (its backward took 1.75 ms per StormCast step on an
    H200, where its bytes take about 0.4 ms at the chip's bandwidth; docs/benchmarks.md, run 11)."""
    target = target.float()
    fmt = torch.contiguous_format if target.is_contiguous() else torch.preserve_format
    return F.mse_loss(pred.to(torch.float32, memory_format=fmt), target)


class RowBand(torch.utils.data.Dataset):
    """A dataset's samples restricted to one band of rows (read from zarr, not sliced after)."""

    def __init__(self, dataset, rows: slice):
        self.dataset, self.rows = dataset, rows

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset.read(i, rows=self.rows)

    def __getitems__(self, indices):  # DataLoader's batched fetch: one read per store
        return self.dataset.read_many(indices, rows=self.rows)

    def __getattr__(self, name):  # stats, channel names, grid: those of the whole dataset
        if name in ("dataset", "rows"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class RegressionTask(Task):
    def __init__(self, run, env, device: torch.device, barrier=lambda: None, domain=None):
        super().__init__(run, env, device, barrier=barrier, domain=domain)
        self.data_cfg, self.model_cfg, self.cfg = run.data, run.model, run.task
        self.channels = layout.channel_lists(run.data)  # {"state", "background", "invariants"}: names
        self._train = self._val = None
        self._figure = None
        # Domain parallel: this rank reads and computes only its band of rows, and its
        # loss is weighted by its share of the pixels (times the group size, since the
        # gradient reduction averages over the domain ranks too).
        self.rows = None
        self.loss_weight = 1.0
        if domain is not None:
            start = sum(domain.extents[: domain.rank])
            self.rows = slice(start, start + domain.extents[domain.rank])
            self.loss_weight = domain.size * domain.extents[domain.rank] / sum(domain.extents)

    # config checks, before any heavy work -------------------------------------------------
    @staticmethod
    def check_config(run) -> None:
        factor = run.model.downsample_factor  # the UNet's total down-sampling, the DiT's patch
        rows, cols = run.data.grid
        for axis, n in (("rows", rows), ("cols", cols)):
            if n % factor:
                raise ConfigError(
                    f"data.grid: {axis}={n} is not divisible by {factor}, the {run.model.downsample_reason}"
                )
        init_from = getattr(run.checkpoint, "init_from", None)
        if init_from and Path(init_from).exists():  # a missing path is refused only where it would be used
            check_init_from(run, init_from)

    @classmethod
    def domain_rows(cls, run) -> tuple[int, int]:
        """Bands of grid rows, multiples of the model's down-sampling (UNet levels, DiT patches)."""
        return run.data.grid[0], run.model.downsample_factor

    @staticmethod
    def model_io(data: dict, task: dict) -> tuple[int, int]:
        """(in, out) channels of the net: [state, background, invariants] -> state."""
        channels = layout.channel_lists(data)
        n = len(channels["state"])
        return n + len(channels["background"]) + len(channels["invariants"]), n

    @classmethod
    def export_spec(cls, config: dict) -> dict:
        """The model config of a run: its ``model`` node, in/out channels and grid, the builder's
        ``kwargs``, and the task node and channel names (under the data config's keys), so a consumer
        (the diffusion stage, inference) checks it is fed the data the model was trained on."""
        if (
            not isinstance(config, dict)
            or not isinstance(config.get("model"), dict)
            or not isinstance(config.get("data"), dict)
            or not isinstance(config.get("task"), dict)
        ):
            raise DataError("checkpoint meta.json has no run config with 'model', 'data' and 'task' nodes")
        model, data = dict(config["model"]), config["data"]
        try:
            in_channels, out_channels = cls.model_io(data, config["task"])
            grid = [int(g) for g in data["grid"]]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"checkpoint meta.json: data config lacks channels or grid ({e})") from None
        kwargs = {k: v for k, v in model.items() if k != "name"}
        kwargs.update(img_resolution=grid, in_channels=in_channels, out_channels=out_channels)
        channels = {k: list(data.get(k) or []) for k in layout.naming_of(data).channel_keys}
        # How the inputs were made; exports written before these keys existed were trained with
        # the background at the target time and z-scored invariants (see data_conventions).
        conventions = {k: data.get(k, v) for k, v in DATA_CONVENTIONS.items()}
        return {
            "name": model.get("name"),
            "model": model,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "img_resolution": grid,
            "kwargs": kwargs,
            "task": config["task"],
            "channels": channels,
            "data": conventions,
            "seed": config.get("seed"),
        }

    @classmethod
    def export_writers(cls) -> dict:
        """``python -m framework.export --format physicsnemo``: a PhysicsNeMo .mdlus."""
        from recipes.weather.mdlus import write_mdlus

        return {"physicsnemo": write_mdlus}

    # data --------------------------------------------------------------------------------
    def _dataset(self, years):
        from recipes.weather.config import SyntheticStores
        from recipes.weather.dataset import HrrrEra5Dataset

        d = self.data_cfg
        if isinstance(d, SyntheticStores):
            self._ensure_synthetic()
        ds = HrrrEra5Dataset.from_config(d, years)
        if tuple(ds.grid) != tuple(d.grid):
            raise ConfigError(
                f"data.grid: config says {list(d.grid)} but the stores under {d.root} hold {list(ds.grid)}"
            )
        return ds if self.rows is None else RowBand(ds, self.rows)

    def _ensure_synthetic(self):
        from recipes.weather.synthetic import write_synthetic

        d = self.data_cfg
        if self.env.is_main:  # idempotent: returns at once when the stores are there
            try:
                write_synthetic(
                    d.root,
                    height=d.grid[0],
                    width=d.grid[1],
                    **{k: list(getattr(d, k)) for k in layout.naming_of(d).channel_keys},  # its keys are the writer's
                    years=sorted(set(d.train_years) | set(d.val_years)),
                    hours_per_year=d.hours_per_year,
                    seed=d.generator_seed,
                    layout=d.write_layout,
                )
            except (FileExistsError, ValueError) as e:
                raise DataError(f"data.root {d.root}: {str(e).splitlines()[0]}") from None
        self.barrier()

    def train_dataset(self):
        if self._train is None:
            self._train = self._dataset(self.data_cfg.train_years)
        return self._train

    def val_dataset(self):
        if self._val is None:
            self._val = self._dataset(self.data_cfg.val_years)
        return self._val

    # model -------------------------------------------------------------------------------
    def _plain_io(self) -> tuple[int, int]:
        return self.model_io(self.data_cfg, {"conditions": list(getattr(self.cfg, "conditions", []))})

    def build_model(self) -> torch.nn.Module:
        in_ch, out_ch = self._plain_io()
        return registry.models.build(
            self.model_cfg.name,
            self.model_cfg,
            in_channels=in_ch,
            out_channels=out_ch,
            img_resolution=tuple(self.data_cfg.grid),
        )

    def example_batch(self, batch_size: int, empty) -> dict:
        """What ``read`` gives for this rank's rows, batched, without reading (framework.plan)."""
        d = self.data_cfg
        rows = d.grid[0] if self.rows is None else self.rows.stop - self.rows.start
        field = lambda names: empty((batch_size, len(names), rows, d.grid[1]))  # noqa: E731
        ch = self.channels
        return {
            "state": field(ch["state"]),
            "target": field(ch["state"]),
            "background": field(ch["background"]),
            "invariants": field(ch["invariants"]),
            "index": torch.arange(batch_size),  # read as numbers (diffusion keys its draws by them)
        }

    def init_weights(self, model, path) -> dict:
        """``checkpoint.init_from``: our formats (the engine's default) or a PhysicsNeMo .mdlus, whose
        channel names are this run's (a .mdlus records none; their counts must fit)."""
        from framework.checkpoint.init_from import apply
        from recipes.weather import weights

        info = check_init_from(self.run, path)
        if info.config.get("format") != "physicsnemo":
            return super().init_weights(model, path)
        n = apply(model, weights._weights(info, model.state_dict()), path)
        return {"path": str(path), "format": "physicsnemo", "tensors": n}

    # steps -------------------------------------------------------------------------------
    def _predict(self, model, batch):
        x = torch.cat([batch["state"], batch["background"], batch["invariants"]], dim=1)
        out = model(x)
        return batch["state"] + out if self.cfg.residual else out

    def loss(self, model, batch) -> torch.Tensor:
        pred = self._predict(model, batch)
        return mse_loss(pred, batch["target"]) * self.loss_weight

    @torch.no_grad()
    def val_step(self, model, batch) -> dict[str, torch.Tensor]:
        """Per-channel sums of squared error (model and persistence), normalized units."""
        pred = self._predict(model, batch).float()
        target = batch["target"].float()
        if self._figure is None:  # the first validation sample of this rank, for the figure
            self._figure = {
                "truth": target[0, :1].detach(),
                "prediction": pred[0, :1].detach(),
                "persistence": batch["state"][0, :1].float().detach(),
                "index": int(batch["index"][0]),
            }
        dims = (0, 2, 3)
        return {
            "se_model": ((pred - target) ** 2).sum(dims).double(),
            "se_persistence": ((batch["state"].float() - target) ** 2).sum(dims).double(),
            "count": torch.tensor(float(target.numel() // target.shape[1]), dtype=torch.float64, device=target.device),
        }

    def val_figures(self, out_dir, step: int) -> dict:
        """Truth / prediction / persistence and their errors of the first channel of the first
        validation sample, and their spectra."""
        if self._figure is None:
            return {}
        fields, self._figure = self._figure, None
        index = fields.pop("index")
        return self.draw_fields(out_dir, step, fields, [0], "prediction", index=index)

    def draw_fields(self, out_dir, step: int, fields: dict, channels: list[int], shown: str, index=None) -> dict:
        """Field and spectrum figures of ``fields`` ({label: (len(channels), rows, W)}, normalised),
        one pair per state (HRRR) channel index in ``channels``; the field figure shows ``fields[shown]``
        and, when given, ``fields["persistence"]`` (the state the forecast starts from, left out of the
        spectra) against ``fields["truth"]``. ``index``: the validation sample, whose valid time and
        lead go in the titles.

        Domain ranks hold bands of rows: the fields are gathered (comm.gather_rows) before the
        global rank 0 draws them. Returns {name: png path} on that rank, else {}.
        """
        if self.domain is not None:
            from framework.domain.comm import gather_rows

            fields = {k: gather_rows(v, self.domain, dim=1) for k, v in fields.items()}
        if not self.env.is_main:
            return {}
        from recipes.weather import plots

        ds, names = self.val_dataset(), self.channels["state"]
        title = f"{self.run.recipe}, step {step}: first validation sample"
        if index is not None:
            state_hour, valid_hour = ds.sample_times(index)
            title += f", {plots.valid_label(valid_hour, valid_hour - state_hour)}"
        spacing = plots.grid_spacing_km(self.data_cfg.root, layout.naming_of(self.data_cfg))
        out = {}
        for j, c in enumerate(channels):
            name, mean, std = names[c], float(ds.state_means[c]), float(ds.state_stds[c])
            phys = {k: v[j].cpu().double().numpy() * std + mean for k, v in fields.items()}  # physical units
            units = plots.channel_units(name)
            out[f"fields/{name}"] = str(
                plots.field_figure(
                    Path(out_dir) / f"val_{step:08d}_{name}.png",
                    name,
                    phys["truth"],
                    phys[shown],
                    title,
                    persistence=phys.get("persistence"),
                    units=units,
                    shown=shown,
                )
            )
            spectra = {k: v for k, v in phys.items() if k != "persistence"}
            out[f"spectra/{name}"] = str(
                plots.spectra_figure(
                    Path(out_dir) / f"spectrum_{step:08d}_{name}.png",
                    name,
                    spectra,
                    title,
                    units=units,
                    spacing_km=spacing,
                )
            )
        return out

    def val_summary(self, sums: dict[str, torch.Tensor]) -> dict:
        mse = (sums["se_model"] / sums["count"]).cpu()
        mse_p = (sums["se_persistence"] / sums["count"]).cpu()
        stds = torch.as_tensor(self.val_dataset().state_stds, dtype=torch.float64)
        row = {
            "loss": float(mse.mean()),
            "rmse": float(mse.sqrt().mean()),
            "rmse_persistence": float(mse_p.sqrt().mean()),
        }
        for i, name in enumerate(self.channels["state"]):  # physical units
            row[f"rmse/{name}"] = float(mse[i].sqrt() * stds[i])
            row[f"rmse_persistence/{name}"] = float(mse_p[i].sqrt() * stds[i])
        return row

    def summary_lines(self, val_row: dict) -> list[str]:
        if "rmse" not in val_row:
            return []
        r, p = val_row["rmse"], val_row["rmse_persistence"]
        verdict = "beats" if r < p else "does NOT beat"
        return [f"validation RMSE {r:.4g} vs persistence {p:.4g} (normalized units): model {verdict} persistence"]
