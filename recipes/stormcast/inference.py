"""Roll a trained StormCast out autoregressively: a zarr forecast store plus PNG frames.

    python -m recipes.stormcast.inference --diffusion outputs/diff_run --data-root data/hrrr \\
        --start 2021-06-01T00 --hours 12 --members 4 --out forecast.zarr

Each hour the regression stage maps [state, ERA5 background, invariants] to its mean
forecast, and the diffusion stage samples the residual (EDM Heun sampler) for every
member; the members then continue from their own states. Either stage may be given
alone: regression only (one deterministic member), or diffusion only for a model trained
without the regression stage (StormScope-style conditions). Models are exported weights
(``python -m framework.export``), checkpoint directories, run directories or PhysicsNeMo
``.mdlus`` files. A .mdlus names no channels: they are those of the other stage when it
records them, else those of ``--data-config`` (Hydra overrides composed as ``python -m
framework`` composes them, e.g. ``--data-config recipe=stormcast``: its ``data`` node's
channel lists and input conventions).

The store holds ``forecast`` (member, time, channel, y, x) and, where the data has the
hours, ``truth`` (time, channel, y, x), both in physical units, with ``time`` (hours
since 1970-01-01 UTC) and the channel names in the attributes. It is written under
``<out>.partial`` and renamed when complete. Bad input ends with one line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from framework.errors import ConfigError, DataError, FrameworkError

_EPOCH = dt.datetime(1970, 1, 1)


def parse_time(text: str) -> int:
    """Hours since 1970-01-01 UTC from ``YYYY-MM-DDTHH`` (or an ISO time on the hour)."""
    try:
        t = dt.datetime.fromisoformat(text if len(text) > 13 else text + ":00")
    except ValueError:
        raise ConfigError(f"--start: {text!r} is not a time like 2021-06-01T00") from None
    if t.minute or t.second:
        raise ConfigError(f"--start: {text!r} is not on the hour")
    return int((t.replace(tzinfo=None) - _EPOCH).total_seconds() // 3600)


def format_time(hours: int) -> str:
    return (_EPOCH + dt.timedelta(hours=int(hours))).strftime("%Y-%m-%dT%H")


class Forecaster:
    """One autoregressive hour for a batch of members, in normalized units."""

    def __init__(self, regression, diffusion, device, *, precision="fp32", seed=0, sampler=None, data=None):
        """``data``: channel lists and input conventions for a .mdlus stage (``data_config``)."""
        from recipes.weather import weights

        self.device, self.seed = device, seed
        self.reg = self.reg_info = self.diff = self.diff_info = None
        self.conditions, self.reg_residual = [], False
        if diffusion is not None:
            data = _stage_data(data, diffusion, regression, "--diffusion")
            self.diff, self.diff_info = weights.load(diffusion, device, data=data)
            _check_known(self.diff_info, data, "--diffusion")
            task = self.diff_info.task
            self.conditions, self.residual = list(task["conditions"]), bool(task.get("residual"))
            from recipes.weather.config import SamplerConfig

            self.sampler = SamplerConfig(**{**task["sampler"], **(sampler or {})})
            needs_reg = self.residual or "regression" in self.conditions
            if needs_reg and regression is None:
                regression = task.get("regression")
                if not regression:
                    raise ConfigError("--regression: the diffusion model needs its regression stage")
            if not needs_reg:
                regression = None
        if regression is not None:
            data = data or (weights.recorded_data(self.diff_info) if self.diff_info is not None else None)
            data = _stage_data(data, regression, None, "--regression")
            self.reg, self.reg_info = weights.load(regression, device, data=data)
            _check_known(self.reg_info, data, "--regression")
            if self.reg_info.task.get("name") != "stormcast_regression":
                raise ConfigError(f"--regression: {regression} holds a {self.reg_info.task.get('name')!r} model")
            self.reg_residual = bool(self.reg_info.task.get("residual"))
        if self.reg is None and self.diff is None:
            raise ConfigError("give --diffusion, --regression or both")
        if self.reg is not None and self.diff is not None:
            a, b = self.reg_info, self.diff_info
            if a.channels != b.channels or a.grid != b.grid:
                raise ConfigError(
                    f"--regression {a.path} and --diffusion {b.path} were trained on different channels or grids"
                )
        self.info = self.diff_info or self.reg_info
        self.autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        )
        # As in training: no TF32 (torch's default lets cuDNN run fp32 convolutions in TF32).
        from framework.config.schema import PrecisionConfig
        from framework.distributed import precision as precision_mod

        precision_mod.build(PrecisionConfig(name=precision), device).apply_backend_flags()

    @torch.no_grad()
    def step(self, state, background, invariants, lead: int) -> torch.Tensor:
        from framework.domain import draws
        from recipes.weather import edm
        from recipes.weather.diffusion import condition_inputs

        with self.autocast:
            reg, cond = condition_inputs(self.reg, self.reg_residual, self.conditions, state, background, invariants)
            if self.diff is None:
                return reg
            keys = [(self.seed, lead, m) for m in range(state.shape[0])]
            noise = lambda k: draws.field_normal(k, state.shape[1:], device=state.device)  # noqa: E731
            sample = edm.heun_sample(
                lambda x, s: self.diff(x, s, cond),
                noise(keys),
                noise=lambda i: noise([(*k, i) for k in keys]),
                **self.sampler.kwargs(),
            ).float()
        return reg + sample if self.residual else sample


def _stage_data(data, path, other, flag: str) -> dict | None:
    """The data config a stage at ``path`` is read with: ``data`` if given, else (for a .mdlus,
    which names no channels) the channels recorded by the ``other`` stage; a ConfigError when a
    .mdlus has neither."""
    from recipes.weather import weights
    from recipes.weather.mdlus import is_mdlus

    if data is not None or not is_mdlus(path):
        return data
    if other is not None and not is_mdlus(other):
        data = weights.recorded_data(weights.describe(other))
    if data is None:
        raise ConfigError(
            f"{flag}: {path} is a PhysicsNeMo .mdlus, which names no channels; name them with "
            "--data-config (e.g. --data-config recipe=stormcast)"
        )
    return data


def _check_known(info, data, flag: str) -> None:
    """A .mdlus stage whose channel counts do not fit ``data``: one line with the numbers."""
    if data is not None and info.config.get("format") == "physicsnemo":
        from recipes.weather import weights

        weights.check_channels(info, data, flag, grid=False)


def data_config(overrides: list[str]) -> dict:
    """``--data-config``: the ``data`` node of the config ``python -m framework <overrides>`` would
    compose: channel lists and input conventions, checked; one ConfigError line on anything else."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from framework.cli import compose
    from recipes.weather.layout import naming_of

    cfg = compose(list(overrides))
    out = {}
    keys = naming_of(OmegaConf.select(cfg, "data") or {}).channel_keys  # StormCast's or StormScope's
    for key, ok, want in (
        *((k, lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v), "a list of names") for k in keys),
        ("background_time", lambda v: v in ("input", "target"), "input or target"),
        ("invariant_norm", lambda v: v in ("zscore", "none"), "zscore or none"),
        ("dt", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive int"),
    ):
        try:
            value = OmegaConf.select(cfg, f"data.{key}", throw_on_missing=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"--data-config: data.{key}: {str(e).splitlines()[0]}") from None
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if not ok(value):
            raise ConfigError(f"--data-config: data.{key} must be {want} (got {value!r})")
        out[key] = value
    return out


def _dataset(root, info, start: int, hours: int):
    from recipes.weather import layout
    from recipes.weather.dataset import HrrrEra5Dataset

    first, last = (_EPOCH + dt.timedelta(hours=start)).year, (_EPOCH + dt.timedelta(hours=start + hours)).year
    from recipes.weather.task import data_conventions

    ch, conv = layout.channel_lists(info.channels), data_conventions(info.config)
    ds = HrrrEra5Dataset(
        root,
        list(range(first, last + 1)),
        ch["state"],
        ch["background"],
        ch["invariants"],
        naming=layout.naming_of(info.channels),  # the stores of the recipe the model was trained for
        dt=int(conv["dt"]),
        grid=list(info.grid),
        background_time=conv["background_time"],
        invariant_norm=conv["invariant_norm"],
    )
    if list(ds.grid) != list(info.grid):
        raise ConfigError(f"--data-root: stores hold grid {list(ds.grid)} but the model was trained on {info.grid}")
    return ds


def _samples(ds, start: int, hours: int) -> list[int]:
    """Sample index of each hour start .. start+hours-1 (its truth is an hour on; its background at
    the input or the target time, as the model was trained)."""
    by_time = {ds.sample_times(i)[0]: i for i in range(len(ds))}
    out = []
    for k in range(hours):
        t = start + k
        if t not in by_time:
            raise DataError(
                f"--data-root: no sample (state, background, next state) for {format_time(t)}; "
                f"the rollout needs hours {format_time(start)} .. {format_time(start + hours)}"
            )
        out.append(by_time[t])
    return out


class ForecastStore:
    """The zarr store, written under ``<out>.partial`` and renamed when complete."""

    def __init__(
        self, out: Path, *, members: int, hours: int, channels: list[str], grid, times, meta: dict, overwrite: bool
    ):
        import zarr

        self.out, self.tmp = Path(out), Path(str(out) + ".partial")
        if self.out.exists() and not overwrite:
            raise ConfigError(f"--out: {self.out} exists (add --overwrite to replace it)")
        shutil.rmtree(self.tmp, ignore_errors=True)
        h, w = grid
        attrs = {
            "channels": list(channels),
            "time_units": "hours since 1970-01-01 00:00:00 UTC",
            "times": [format_time(t) for t in times],
            **meta,
        }
        self.group = zarr.create_group(str(self.tmp), attributes=attrs)
        common = dict(dtype="float32", compressors=None, fill_value=float("nan"))
        self.forecast = self.group.create_array(
            "forecast",
            shape=(members, hours, len(channels), h, w),
            chunks=(1, 1, 1, h, w),
            dimension_names=("member", "time", "channel", "y", "x"),
            **common,
        )
        self.truth = self.group.create_array(
            "truth",
            shape=(hours, len(channels), h, w),
            chunks=(1, 1, h, w),
            dimension_names=("time", "channel", "y", "x"),
            **common,
        )
        tarr = self.group.create_array(
            "time",
            shape=(hours,),
            dtype="int64",
            chunks=(hours,),
            compressors=None,
            fill_value=0,
            dimension_names=("time",),
            attributes={"units": attrs["time_units"]},
        )
        tarr[...] = np.asarray(times, dtype=np.int64)

    def close(self) -> None:
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)


def rollout(args) -> Path:
    from tqdm import tqdm

    from recipes.weather.layout import channel_lists

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    sampler = {"num_steps": args.steps} if args.steps else None
    data = data_config(args.data_config) if args.data_config else None
    fc = Forecaster(
        args.regression, args.diffusion, device, precision=args.precision, seed=args.seed, sampler=sampler, data=data
    )
    members = args.members
    if fc.diff is None and members != 1:
        raise ConfigError(f"--members {members}: a regression-only rollout is deterministic; give --diffusion")
    info = fc.info
    names = channel_lists(info.channels)["state"]
    plot = args.plot_channels if args.plot_channels is not None else names[:1]
    bad = [c for c in plot if c not in names]
    if bad:
        raise ConfigError(f"--plot-channels: {bad[0]!r} is not one of the model's channels {names}")
    start = parse_time(args.start)
    ds = _dataset(args.data_root, info, start, args.hours)
    idx = _samples(ds, start, args.hours)
    times = [start + k + 1 for k in range(args.hours)]
    mean = torch.as_tensor(ds.state_means, dtype=torch.float32)[:, None, None]
    std = torch.as_tensor(ds.state_stds, dtype=torch.float32)[:, None, None]
    meta = {
        "start": format_time(start),
        "members": members,
        "regression": str(fc.reg_info.path) if fc.reg else None,
        "diffusion": str(fc.diff_info.path) if fc.diff else None,
        "seed": args.seed,
    }
    store = ForecastStore(
        args.out,
        members=members,
        hours=args.hours,
        channels=names,
        grid=info.grid,
        times=times,
        meta=meta,
        overwrite=args.overwrite,
    )
    frames = Path(args.frames) if args.frames else Path(str(args.out) + ".frames")
    first = ds.read(idx[0])
    # persistence: the initial state, the forecast every lead must beat
    initial = (first["state"] * std + mean).numpy()
    state = first["state"][None].to(device).repeat(members, 1, 1, 1)
    invariants = first["invariants"][None].to(device).repeat(members, 1, 1, 1)
    bar = tqdm(range(args.hours), desc="rollout", unit="h", disable=not args.progress)
    for k in bar:
        sample = ds.read(idx[k])
        background = sample["background"][None].to(device).repeat(members, 1, 1, 1)
        state = fc.step(state, background, invariants, lead=k + 1)
        phys = (state.cpu() * std + mean).numpy()
        truth = (sample["target"] * std + mean).numpy()
        store.forecast[:, k] = phys
        store.truth[k] = truth
        for c in plot:
            _frame(frames, c, names.index(c), times[k], k + 1, truth, phys, initial)
        bar.set_postfix(valid=format_time(times[k]))
    store.close()
    return Path(args.out)


def _frame(frames: Path, name: str, c: int, time: int, lead: int, truth, phys, initial) -> None:
    from recipes.weather import plots

    title = f"{name}, member 0 of {phys.shape[0]}: {plots.valid_label(time, lead)}"
    plots.field_figure(
        frames / f"{name}_{lead:03d}.png",
        name,
        truth[c],
        phys[0, c],
        title,
        persistence=initial[c],
        units=plots.channel_units(name),
        shown="member 0",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.stormcast.inference", description=__doc__.split("\n")[0])
    ap.add_argument("--diffusion", type=Path, help="the diffusion model: exported .pt, checkpoint, run dir or .mdlus")
    ap.add_argument(
        "--regression",
        type=Path,
        help="the regression model: exported .pt, checkpoint, run dir or .mdlus (default: the one the "
        "diffusion model was trained on)",
    )
    ap.add_argument(
        "--data-root",
        required=True,
        help="the zarr stores (initial state, background): HRRR/ERA5, or StormScope's state/background",
    )
    ap.add_argument(
        "--data-config",
        nargs="+",
        metavar="OVERRIDE",
        help="for a .mdlus model (which names no channels): Hydra overrides, as for python -m framework "
        "(e.g. recipe=stormcast, or data=hrrr_era5 data.invariants=[lsm,orog]), whose data node "
        "names the channels and input conventions",
    )
    ap.add_argument("--start", required=True, help="initial time, e.g. 2021-06-01T00")
    ap.add_argument("--hours", type=int, default=6, help="hours to roll out (default 6)")
    ap.add_argument("--members", type=int, default=1, help="ensemble members (diffusion only; default 1)")
    ap.add_argument("--out", type=Path, required=True, help="the zarr store to write")
    ap.add_argument("--frames", help="folder of PNG frames (default: <out>.frames)")
    ap.add_argument("--plot-channels", nargs="*", help="channels drawn as frames (default: the first)")
    ap.add_argument("--steps", type=int, help="sampler steps (default: the training config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    for key in ("hours", "members", "steps"):
        value = getattr(args, key)
        if value is not None and value < 1:
            print(f"error: --{key} must be >= 1 (got {value})", file=sys.stderr)
            return 2
    try:
        out = rollout(args)
    except FrameworkError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return e.exit_code
    print(f"wrote {out} ({args.members} member(s) x {args.hours} h)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
