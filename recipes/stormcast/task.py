"""The StormCast regression task: [state_t, ERA5 background, invariants] -> state_t+dt.

The trainer calls ``loss`` and ``val_step``; everything weather-specific lives here.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from framework import registry
from framework.errors import ConfigError, DataError


class RowBand(torch.utils.data.Dataset):
    """A dataset's samples restricted to one band of rows (read from zarr, not sliced after)."""

    def __init__(self, dataset, rows: slice):
        self.dataset, self.rows = dataset, rows

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset.read(i, rows=self.rows)

    def __getattr__(self, name):  # stats, channel names, grid: those of the whole dataset
        if name in ("dataset", "rows"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class RegressionTask:
    def __init__(self, run, env, device: torch.device, barrier=lambda: None, domain=None):
        self.run, self.env, self.device, self.barrier = run, env, device, barrier
        self.data_cfg, self.model_cfg, self.cfg = run.data, run.model, run.task
        self._train = self._val = None
        self._figure = None
        # Domain parallel: this rank reads and computes only its band of rows, and its
        # loss is weighted by its share of the pixels (times the group size, since the
        # gradient reduction averages over the domain ranks too).
        self.domain = domain
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
                raise ConfigError(f"data.grid: {axis}={n} is not divisible by {factor}, the "
                                  f"{run.model.downsample_reason}")

    # data --------------------------------------------------------------------------------
    def _dataset(self, years):
        from recipes.stormcast.dataset import HrrrEra5Dataset

        d = self.data_cfg
        if d.name == "synthetic":
            self._ensure_synthetic()
        ds = HrrrEra5Dataset(d.root, list(years), list(d.hrrr_channels), list(d.era5_channels),
                             list(d.invariants), dt=d.dt)
        if tuple(ds.grid) != tuple(d.grid):
            raise ConfigError(f"data.grid: config says {list(d.grid)} but the stores under {d.root} "
                              f"hold {list(ds.grid)}")
        return ds if self.rows is None else RowBand(ds, self.rows)

    def _ensure_synthetic(self):
        from recipes.stormcast.synthetic import write_synthetic

        d = self.data_cfg
        if self.env.is_main:  # idempotent: returns at once when the stores are there
            try:
                write_synthetic(d.root, height=d.grid[0], width=d.grid[1], hrrr_channels=list(d.hrrr_channels),
                                era5_channels=list(d.era5_channels), invariants=list(d.invariants),
                                years=sorted(set(d.train_years) | set(d.val_years)),
                                hours_per_year=d.hours_per_year, seed=d.generator_seed)
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
    @property
    def in_channels(self) -> int:
        d = self.data_cfg
        return len(d.hrrr_channels) + len(d.era5_channels) + len(d.invariants)

    def build_model(self) -> torch.nn.Module:
        d = self.data_cfg
        return registry.models.build(self.model_cfg.name, self.model_cfg, in_channels=self.in_channels,
                                     out_channels=len(d.hrrr_channels), img_resolution=tuple(d.grid))

    # steps -------------------------------------------------------------------------------
    def _predict(self, model, batch):
        x = torch.cat([batch["state"], batch["background"], batch["invariants"]], dim=1)
        out = model(x)
        return batch["state"] + out if self.cfg.residual else out

    def loss(self, model, batch) -> torch.Tensor:
        pred = self._predict(model, batch)
        return F.mse_loss(pred.float(), batch["target"].float()) * self.loss_weight

    @torch.no_grad()
    def val_step(self, model, batch) -> dict[str, torch.Tensor]:
        """Per-channel sums of squared error (model and persistence), normalized units."""
        pred = self._predict(model, batch).float()
        target = batch["target"].float()
        if self._figure is None:  # the first validation sample of this rank, for the figure
            self._figure = (target[0, 0].detach(), pred[0, 0].detach())
        dims = (0, 2, 3)
        return {
            "se_model": ((pred - target) ** 2).sum(dims).double(),
            "se_persistence": ((batch["state"].float() - target) ** 2).sum(dims).double(),
            "count": torch.tensor(float(target.numel() // target.shape[1]), dtype=torch.float64,
                                  device=target.device),
        }

    def val_figures(self, out_dir, step: int) -> dict:
        """Truth / prediction / error of the first channel of the first validation sample."""
        if self._figure is None:
            return {}
        (truth, pred), self._figure = self._figure, None
        return self.draw_fields(out_dir, step, {"truth": truth[None], "prediction": pred[None]}, [0], "prediction")

    def draw_fields(self, out_dir, step: int, fields: dict, channels: list[int], shown: str) -> dict:
        """Field and spectrum figures of ``fields`` ({label: (len(channels), rows, W)}, normalised),
        one pair per HRRR channel index in ``channels``; the field figure shows ``fields[shown]``
        against ``fields["truth"]``.

        Domain ranks hold bands of rows: the fields are gathered (ShardTensor) before the
        global rank 0 draws them. Returns {name: png path} on that rank, else {}.
        """
        from pathlib import Path

        if self.domain is not None:
            from framework.domain.shard_tensor import ShardTensor

            fields = {k: ShardTensor.from_local(v[None], self.domain.group).full_tensor()[0] for k, v in fields.items()}
        if not self.env.is_main:
            return {}
        from recipes.stormcast.plots import field_figure, spectra_figure

        ds, names = self.val_dataset(), self.data_cfg.hrrr_channels
        out, title = {}, f"{self.run.recipe}, step {step}: first validation sample"
        for j, c in enumerate(channels):
            name, mean, std = names[c], float(ds.hrrr_means[c]), float(ds.hrrr_stds[c])
            phys = {k: v[j].cpu().double().numpy() * std + mean for k, v in fields.items()}  # physical units
            out[f"fields/{name}"] = str(field_figure(Path(out_dir) / f"val_{step:08d}_{name}.png", name,
                                                     phys["truth"], phys[shown], title))
            out[f"spectra/{name}"] = str(spectra_figure(Path(out_dir) / f"spectrum_{step:08d}_{name}.png", name,
                                                        phys, title))
        return out

    def val_summary(self, sums: dict[str, torch.Tensor]) -> dict:
        mse = (sums["se_model"] / sums["count"]).cpu()
        mse_p = (sums["se_persistence"] / sums["count"]).cpu()
        stds = torch.as_tensor(self.val_dataset().hrrr_stds, dtype=torch.float64)
        row = {"loss": float(mse.mean()), "rmse": float(mse.sqrt().mean()),
               "rmse_persistence": float(mse_p.sqrt().mean())}
        for i, name in enumerate(self.data_cfg.hrrr_channels):  # physical units
            row[f"rmse/{name}"] = float(mse[i].sqrt() * stds[i])
            row[f"rmse_persistence/{name}"] = float(mse_p[i].sqrt() * stds[i])
        return row
