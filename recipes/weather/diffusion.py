"""The StormCast diffusion task: EDM on the residual of a frozen regression stage.

Training: target = state(t+dt) - regression([state, background, invariants]) (or the
state itself with residual=false); the EDM denoiser sees the noisy target stacked with
the configured conditions. Validation: an ensemble drawn with the Heun sampler, scored
by CRPS, ensemble-mean RMSE and spread/skill, with fields and power spectra as figures.

Every random draw (sigma per sample, noise per pixel) is keyed by (seed, step, sample,
global position), so data-parallel and domain-parallel layouts train on the same draws.
"""

from __future__ import annotations

import torch

from framework import registry
from framework.domain import draws
from framework.errors import ConfigError, DataError
from recipes.weather import edm, layout, metrics
from recipes.weather.task import RegressionTask

# Purposes of keyed draws, so no two streams share a key.
_SIGMA, _NOISE, _VAL = 1, 2, 3


def condition_channels(data, conditions, regression_out: int | None = None) -> int:
    sizes = {k: len(v) for k, v in layout.channel_lists(data).items()}  # state, background, invariants
    sizes["regression"] = regression_out if regression_out is not None else sizes["state"]
    return sum(sizes[c] for c in conditions)


def condition_inputs(regression, regression_residual: bool, conditions, state, background, invariants):
    """(regression forecast or None, stacked diffusion conditions or None) for one batch.

    ``regression``: the frozen first stage (or None); ``regression_residual``: it predicts the
    change from ``state``. ``conditions`` names the parts to stack, in order. Shared by training
    and the inference rollout, so both condition the diffusion model alike.
    """
    reg = None
    if regression is not None:
        out = regression(torch.cat([state, background, invariants], dim=1)).float()
        reg = state.float() + out if regression_residual else out
    parts = {"state": state, "background": background, "invariants": invariants, "regression": reg}
    cond = torch.cat([parts[c].float() for c in conditions], dim=1) if conditions else None
    return reg, cond


class DiffusionTask(RegressionTask):
    def __init__(self, run, env, device, barrier=lambda: None, domain=None):
        super().__init__(run, env, device, barrier=barrier, domain=domain)
        self._regression, self._regression_residual = None, False
        self._figure_fields, self._figure_index = None, None  # the first validation sample's, drawn
        self._flops = None  # stated by the net (build_model), when it can

    # config checks, before any heavy work -------------------------------------------------
    @staticmethod
    def check_config(run) -> None:
        RegressionTask.check_config(run)
        cfg, data = run.task, run.data
        channels, (state_key, background_key) = layout.channel_lists(data), layout.naming_of(data).keys
        if getattr(run.model, "embedding_type", "positional") != "positional":
            raise ConfigError(
                f"model.embedding_type={run.model.embedding_type!r}: a diffusion model must see its "
                "noise level; use model.embedding_type=positional"
            )
        n, n_state = len(cfg.edm.sigma_data), len(channels["state"])
        if n not in (1, n_state):
            raise ConfigError(f"task.edm.sigma_data: {n} values for {n_state} channels (give one, or one per channel)")
        unknown = [c for c in cfg.plot_channels if c not in channels["state"]]
        if unknown:
            raise ConfigError(f"task.plot_channels: {unknown[0]!r} is not in data.{state_key}")
        if "background" in cfg.conditions and not channels["background"]:
            raise ConfigError(f"task.conditions: 'background' needs data.{background_key}")
        if cfg.needs_regression:
            from recipes.weather import weights

            try:
                info = weights.describe(cfg.regression, data=data)  # data: the names a .mdlus lacks
            except DataError as e:
                raise ConfigError(f"task.regression: {e}") from None
            if info.task.get("name") != "stormcast_regression":
                raise ConfigError(
                    f"task.regression: {cfg.regression} holds a {info.task.get('name')!r} model, "
                    "not a stormcast_regression one"
                )
            weights.check_channels(info, data, "task.regression")
            from recipes.weather.task import data_conventions

            for key, trained in data_conventions(info.config).items():
                if getattr(data, key, trained) != trained:
                    raise ConfigError(
                        f"task.regression: {cfg.regression} was trained with data.{key}={trained} but "
                        f"this run has data.{key}={getattr(data, key)}"
                    )

    # model ---------------------------------------------------------------------------------
    @staticmethod
    def model_io(data: dict, task: dict) -> tuple[int, int]:
        """(in, out) channels of the denoising net: noisy latent plus the conditions."""
        out = len(layout.channel_lists(data)["state"])
        return out + condition_channels(data, task["conditions"]), out

    @staticmethod
    def wrap_net(net, task: dict):
        return edm.EDMPrecond(net, sigma_data=list(task["edm"]["sigma_data"]))

    def build_model(self) -> torch.nn.Module:
        in_ch, out_ch = self._plain_io()
        net = registry.models.build(
            self.model_cfg.name,
            self.model_cfg,
            in_channels=in_ch,
            out_channels=out_ch,
            img_resolution=tuple(self.data_cfg.grid),
        )
        known = getattr(net, "flops_per_sample", None)  # a net whose FLOPs FlopCounterMode cannot see
        self._flops = known() if known is not None else None
        return self.wrap_net(net, {"edm": {"sigma_data": list(self.cfg.edm.sigma_data)}})

    def summary_lines(self, val_row: dict) -> list[str]:
        """A diffusion stage is judged as an ensemble (CRPS, spread/skill), its mean against the
        regression stage it corrects and persistence: no "beats persistence" verdict."""
        if "crps" not in val_row:
            return []
        against = [f"persistence {val_row['rmse_persistence']:.4g}"]
        if "rmse_regression" in val_row:
            against.insert(0, f"the regression stage {val_row['rmse_regression']:.4g}")
        return [
            f"validation ensemble: CRPS {val_row['crps']:.4g}, spread/skill {val_row['spread_skill']:.3g} "
            "(1: calibrated; below 1: overconfident)",
            f"ensemble-mean RMSE {val_row['rmse']:.4g} vs {' and '.join(against)}; one member "
            f"{val_row['rmse_member']:.4g} (normalized units)",
        ]

    def flops_per_sample(self) -> float | None:
        """Model FLOPs of one training sample when the net states them (the DiT), else None."""
        return self._flops

    def regression(self):
        """The frozen regression stage, on this device, split over the domain like the model."""
        if self._regression is None:
            from recipes.weather import weights

            model, info = weights.load(self.cfg.regression, self.device, data=self.data_cfg)
            for p in model.parameters():
                p.requires_grad_(False)
            if self.domain is not None:
                from framework.domain.splitter import model_plan, split

                model = split(model, self.domain, model_plan(info.name, self.domain.size))
            self._regression, self._regression_residual = model, bool(info.task.get("residual", False))
        return self._regression

    # batches ---------------------------------------------------------------------------------
    def _inputs(self, batch):
        """(target, conditions, base): what the diffusion learns, what it sees, what it adds to."""
        with torch.no_grad():
            reg, cond = condition_inputs(
                self.regression() if self.cfg.needs_regression else None,
                self._regression_residual,
                self.cfg.conditions,
                batch["state"],
                batch["background"],
                batch["invariants"],
            )
        target = batch["target"].float()
        base = reg if self.cfg.residual else None
        return (target - base if base is not None else target), cond, base

    def _keys(self, batch, purpose: int, *tail: int) -> list[tuple[int, ...]]:
        """One key per sample: (seed, purpose, sample index, *tail); the same on every layout."""
        return [(self.run.seed, purpose, int(i), *tail) for i in batch["index"].tolist()]

    def _field_noise(self, keys, like: torch.Tensor) -> torch.Tensor:
        offset = self.rows.start if self.rows is not None else 0
        return draws.field_normal(
            keys,
            like.shape[1:],
            row_offset=offset,
            full_rows=self.data_cfg.grid[0],
            dim=1,
            device=like.device,
            dtype=like.dtype,
        )

    def _sigma(self, keys, device) -> torch.Tensor:
        e = self.cfg.edm
        sig = edm.sigma_from_uniform(
            draws.uniform(keys, device),
            draws.normal(keys, device),
            distribution=e.sigma_distribution,
            p_mean=e.p_mean,
            p_std=e.p_std,
            sigma_min=e.sigma_min,
            sigma_max=e.sigma_max,
        )
        return sig.float()

    # steps -------------------------------------------------------------------------------
    def loss(self, model, batch) -> torch.Tensor:
        target, cond, _ = self._inputs(batch)
        step = int(batch.get("step", 0))
        sigma = self._sigma(self._keys(batch, _SIGMA, step), target.device)
        noise = self._field_noise(self._keys(batch, _NOISE, step), target)
        return (
            edm.edm_loss(model, target, sigma, noise, cond, sigma_data=self.cfg.edm.sigma_data).mean()
            * self.loss_weight
        )

    def _sample(self, model, cond, keys, like) -> torch.Tensor:
        s = self.cfg.sampler
        latents = self._field_noise(keys, like)
        churn = lambda i: self._field_noise([(*k, i) for k in keys], like)  # noqa: E731
        return edm.heun_sample(lambda x, sigma: model(x, sigma, cond), latents, noise=churn, **s.kwargs()).float()

    @torch.no_grad()
    def val_step(self, model, batch) -> dict[str, torch.Tensor]:
        target, cond, base = self._inputs(batch)
        truth = batch["target"].float()
        # A fixed-sigma validation loss: comparable from one validation to the next.
        sigma = self._sigma(self._keys(batch, _VAL, 0), target.device)
        noise = self._field_noise(self._keys(batch, _VAL, 1), target)
        loss = edm.edm_loss(model, target, sigma, noise, cond, sigma_data=self.cfg.edm.sigma_data).mean((1, 2, 3))
        members = []
        for m in range(self.cfg.val_members):
            sample = self._sample(model, cond, self._keys(batch, _VAL, 2, m), target)
            members.append(sample + base if base is not None else sample)
        ens = torch.stack(members)  # (N, B, C, h, W)
        sums = metrics.ensemble_sums(ens, truth)
        sums["se_persistence"] = ((batch["state"].float() - truth) ** 2).sum((0, 2, 3)).double()
        if base is not None:
            sums["se_regression"] = ((base - truth) ** 2).sum((0, 2, 3)).double()
        # Pixel-share weighting, as in training, so the summed loss is the global mean.
        sums["loss_sum"] = (loss * self.loss_weight).sum().double()
        sums["samples"] = torch.tensor(float(len(loss)), dtype=torch.float64, device=loss.device)
        if self._figure_fields is None:
            self._figure_fields = {"truth": truth[0], "member 0": ens[0, 0], "ensemble mean": ens[:, 0].mean(0)}
            if base is not None:
                self._figure_fields["regression"] = base[0]
            self._figure_fields["persistence"] = batch["state"][0].float()
            self._figure_index = int(batch["index"][0])
        return sums

    def val_summary(self, sums: dict[str, torch.Tensor]) -> dict:
        stds = torch.as_tensor(self.val_dataset().state_stds, dtype=torch.float64)
        loss = float(sums["loss_sum"] / sums["samples"])  # domain ranks: D x samples, D x weighted losses
        row = {
            "loss": loss,
            **metrics.ensemble_summary(sums, self.channels["state"], stds, self.cfg.val_members),
        }
        return row

    def val_figures(self, out_dir, step: int) -> dict:
        if self._figure_fields is None:
            return {}
        fields, self._figure_fields = self._figure_fields, None
        names = self.channels["state"]
        chans = [names.index(c) for c in (self.cfg.plot_channels or names[:1])]
        fields = {k: v[chans] for k, v in fields.items()}
        return self.draw_fields(out_dir, step, fields, chans, "member 0", index=self._figure_index)
