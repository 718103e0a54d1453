"""Ensemble forecasts at scale: one Hydra app, the launchers of training, one zarr store.

    python -m recipes.weather.forecast infer.diffusion=runs/diff infer.data_root=/data \\
        'infer.starts=[2021-06-01T00]' infer.hours=12 infer.members=8 infer.out=forecast.zarr
    torchrun --nproc-per-node=4 -m recipes.weather.forecast parallel=domain parallel.domain=2 ...
    python -m recipes.weather.forecast --multirun cluster=slurm_local infer.shards=2 infer.shard=0,1 ...

The config is ``conf/infer.yaml`` with training's ``parallel``, ``precision`` and ``cluster``
groups, and it passes training's security gate (``framework.cli.check_composed`` before
Hydra acts, ``framework.cli.job_gate`` in the job). Work is (start time, block of
``member_batch`` members): start times are split over sweep jobs (``infer.shard`` of
``infer.shards``), the blocks over the data-parallel ranks, and each block's rows over the
``parallel.domain`` ranks (the model's split plan, as in training). Every rank writes its own
chunks of the store (``recipes.weather.forecast_store``); a block is marked complete after
its data, so a requeued or rerun job skips it. Draws are keyed by (seed, start time, member,
lead, global position): the forecast does not depend on the layout. The job that completes
the store scores it (``recipes.weather.forecast_scores``) and renames it into place.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from framework.config.schema import Invalid, non_negative, positive
from framework.errors import ConfigError, DataError, FrameworkError

log = logging.getLogger("framework")
writes = logging.getLogger("framework.forecast.writes")  # at INFO on every rank (others log warnings only)
writes.setLevel(logging.INFO)

CONFIG_NAME = "infer"
SAMPLER_DTYPES = ("float64", "float32")
PRECISIONS = ("fp32", "bf16")  # bf16: autocast; nothing here switches TF32 on, so tf32 is refused
_EPOCH = dt.datetime(1970, 1, 1)


def parse_start(text: str, key: str = "infer.starts") -> int:
    """Hours since 1970-01-01 from ``YYYY-MM-DDTHH`` (or an ISO time on the hour)."""
    text = str(text)
    try:
        t = dt.datetime.fromisoformat(text if len(text) > 13 else text + ":00")
    except ValueError:
        raise Invalid(key.split(".")[-1], f"{text!r} is not a time like 2021-06-01T00") from None
    if t.minute or t.second:
        raise Invalid(key.split(".")[-1], f"{text!r} is not on the hour")
    return int((t.replace(tzinfo=None) - _EPOCH).total_seconds() // 3600)


@dataclass
class InferConfig:
    """The ``infer`` node of ``conf/infer.yaml`` (its comments say what each key does)."""

    data_root: str = MISSING
    starts: list[str] = MISSING
    out: str = MISSING
    diffusion: str | None = None
    regression: str | None = None
    data_config: list[str] = field(default_factory=list)
    start_count: int = 1
    start_every: int = 24
    hours: int = 6
    members: int = 1
    overwrite: bool = False
    member_batch: int = 8
    row_chunk: int | None = None
    steps: int | None = None
    sampler_dtype: str = "float32"  # as fast as float64 on an H200, less memory: docs/inference.md
    shard: int = 0
    shards: int = 1
    scores: bool = True
    fair_crps: bool = True
    plot_channels: list[str] | None = None
    frames: bool = True
    progress: bool = True

    def __post_init__(self):
        positive(self, "start_count", "start_every", "hours", "members", "member_batch", "shards")
        non_negative(self, "shard")
        for key in ("steps", "row_chunk"):
            if getattr(self, key) is not None:
                positive(self, key)
        if self.shard >= self.shards:
            raise Invalid("shard", f"must be below infer.shards={self.shards} (got {self.shard})")
        if self.sampler_dtype not in SAMPLER_DTYPES:
            raise Invalid("sampler_dtype", f"must be one of {', '.join(SAMPLER_DTYPES)} (got {self.sampler_dtype!r})")
        if not self.diffusion and not self.regression:
            raise Invalid("diffusion", "give infer.diffusion, infer.regression or both")
        if not self.starts:
            raise Invalid("starts", "give at least one start time, e.g. 'infer.starts=[2021-06-01T00]'")
        times = self.init_hours()
        if len(set(times)) != len(times):
            raise Invalid("starts", "start times repeat (check infer.starts, start_count, start_every)")
        for key in ("diffusion", "regression", "data_root", "out"):
            value = getattr(self, key)
            if value:  # relative to where the job starts; the store records them absolute
                setattr(self, key, os.path.abspath(value))

    def init_hours(self) -> list[int]:
        """Every start time of the store, in hours since 1970-01-01 (sorted)."""
        first = [parse_start(s) for s in self.starts]
        return sorted(t + k * self.start_every for t in first for k in range(self.start_count))


@dataclass
class InferRun:
    seed: int
    device: str
    infer: InferConfig
    parallel: Any  # framework.config.schema.ParallelConfig
    precision: str
    cluster: str


TOP_KEYS = ("seed", "device", "infer", "parallel", "sharding", "splitter", "precision", "cluster")


def validate(cfg, trust=None) -> InferRun:
    """The typed inference config; one ConfigError line (exit 2) on anything wrong."""
    from omegaconf import OmegaConf

    from framework.config.schema import ClusterConfig, ParallelConfig
    from framework.config.validate import _typed, check_targets

    check_targets(cfg, trust)  # unresolved and resolved, as training's validation
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    plain.pop("hydra", None)
    plain.pop("trust", None)  # checked against the primary config file by job_gate / check_composed
    unknown = [str(k) for k in plain if k not in TOP_KEYS]
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key; valid keys: {', '.join(sorted(TOP_KEYS))}")
    for key in TOP_KEYS:
        if key not in plain:
            raise ConfigError(f"{key}: missing (conf/infer.yaml sets it)")
    infer = _typed("infer", InferConfig, OmegaConf.create(plain["infer"]))
    parallel = _typed("parallel", ParallelConfig, OmegaConf.create(plain["parallel"]))
    cluster = _typed("cluster", ClusterConfig, OmegaConf.create(plain["cluster"]))
    precision = str((plain["precision"] or {}).get("name"))
    if precision not in PRECISIONS:
        raise ConfigError(f"precision: {precision!r} is not used for inference; use one of {', '.join(PRECISIONS)}")
    device = str(plain["device"])
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device: must be one of auto, cpu, cuda (got {device!r})")
    seed = plain["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed: must be an integer (got {seed!r})")
    for key in ("diffusion", "regression"):
        value = getattr(infer, key)
        if value and not Path(value).exists():
            raise ConfigError(f"infer.{key}: {value} does not exist")
    from framework import rundir

    rundir.readable_dir(infer.data_root, "infer.data_root")
    rundir.creatable_dir(Path(infer.out).parent, "infer.out")
    return InferRun(seed, device, infer, parallel, precision, cluster.name)


# -- the command line: the training gate, then Hydra ----------------------------------------------
def _with_config_name(argv: list[str]) -> list[str]:
    """``argv`` with ``--config-name infer`` unless it names a primary config (its own, which
    should list ``infer`` in its defaults)."""
    named = any(a in ("--config-name", "-cn") or a.startswith(("--config-name=", "-cn=")) for a in argv)
    return argv if named else ["--config-name", CONFIG_NAME, *argv]


def precheck(argv: list[str]) -> None:
    """What ``framework.cli.precheck`` does for training, with this app's validation: compose what
    Hydra is about to run (every option of a swept group too), refuse what could run code, validate;
    exit 2 with one line on anything wrong, before Hydra acts on the config."""
    from framework import cli
    from framework.config import hydra_args, resolvers, security
    from framework.config.compose import Source, hydra_message

    args = hydra_args.parse(argv)
    if args.version or args.shell_completion:
        return
    try:
        resolvers.restrict()
        if args.experimental_rerun is not None:
            raise ConfigError("--experimental-rerun loads a pickle, which can run code, and is not supported")
        security.check_config_path(args.config_path)
        security.check_overrides(args.overrides)
        source = Source.from_args(args)
        for cfg, passed in cli._compose_variants(source, list(args.overrides), args.multirun):
            multirun = args.multirun or str(cfg.hydra.mode).endswith("MULTIRUN")
            trust, job = cli.check_composed(cfg, source, passed, multirun=multirun)
            if not (args.help or args.hydra_help or args.info):
                validate(job, trust)
    except FrameworkError as e:
        cli.fail(e)
    except Exception as e:  # noqa: BLE001  (Hydra's or OmegaConf's own errors: one line too)
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        cli.fail(ConfigError(hydra_message(e)))
    finally:
        cli._clear_hydra_config()


def job(cfg) -> dict:
    """One job (called by Hydra, also in a submitit job): the gate again, then the forecast."""
    from framework import cli
    from framework.config import resolvers

    try:
        resolvers.restrict()
        trust = cli.job_gate(cfg)
        run = validate(cfg, trust)
        return launch(run)
    except FrameworkError as e:
        cli.fail(e)


def launch(run: InferRun) -> dict:
    import torch

    from framework import registry
    from framework.distributed import env as dist_env
    from framework.distributed import mesh as mesh_mod
    from framework.errors import DistributedError
    from framework.runtime import _dist_message, is_comm_failure

    registry.load_providers()
    env = dist_env.detect()
    degrees = mesh_mod.resolve(run.parallel, env.world_size)
    device = dist_env.pick_device(run.device, env)
    if not env.is_main:
        log.setLevel(logging.WARNING)
    with dist_env.process_group(env, device, run.parallel.timeout_s):
        try:
            return Forecast(run, env, degrees, device).run()
        except (torch.distributed.DistError, RuntimeError) as e:
            if env.distributed and is_comm_failure(e):
                raise DistributedError(_dist_message(e, env, run.parallel.timeout_s)) from None
            raise


# -- the forecast ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One piece of work: a block of consecutive members of one start time (index into inits)."""

    init: int
    members: tuple[int, ...]


def units(inits: list[int], shard: int, shards: int, members: int, batch: int) -> list[Unit]:
    """Every unit of this job's start times (those with index % shards == shard), in order. Blocks
    are fixed by ``batch`` alone, so every layout runs the same forward batches."""
    return [
        Unit(i, tuple(range(m, min(m + batch, members))))
        for i in range(shard, len(inits), shards)
        for m in range(0, members, batch)
    ]


def rank_share(pending: list[Unit], dp_rank: int, dp: int) -> list[Unit]:
    return pending[dp_rank::dp]


class Forecast:
    def __init__(self, run: InferRun, env, degrees, device):
        self.conf, self.cfg, self.env, self.degrees, self.device = run, run.infer, env, degrees, device

    # collectives over every rank of the job (no-ops in one process)
    def _broadcast(self, tensor):
        from framework.distributed import collectives

        if collectives.active():
            import torch.distributed as dist

            dist.broadcast(tensor, src=0)
        return tensor

    def _setup(self) -> None:
        import torch

        from framework.distributed import mesh as mesh_mod
        from recipes.stormcast.inference import Forecaster, data_config
        from recipes.weather import layout
        from recipes.weather.task import data_conventions

        cfg = self.cfg
        self.topology = mesh_mod.build(self.degrees, self.device.type)
        sampler = {"num_steps": cfg.steps} if cfg.steps else None
        try:
            data = data_config(list(cfg.data_config)) if cfg.data_config else None
            self.fc = fc = Forecaster(
                cfg.regression,
                cfg.diffusion,
                self.device,
                precision="bf16" if self.conf.precision == "bf16" else "fp32",
                seed=self.conf.seed,
                sampler=sampler,
                data=data,
            )
        except ConfigError as e:  # its messages name the old CLI's flags: name this app's keys
            text = str(e)
            for flag in ("diffusion", "regression", "data-config"):
                text = text.replace(f"--{flag}", f"infer.{flag.replace('-', '_')}")
            raise ConfigError(text) from None
        if fc.diff is None and cfg.members != 1:
            raise ConfigError(
                f"infer.members={cfg.members}: a regression-only rollout is deterministic; give infer.diffusion"
            )
        self.info = fc.info
        self.names = layout.channel_lists(fc.info.channels)["state"]
        plot = cfg.plot_channels if cfg.plot_channels is not None else self.names[:1]
        bad = [c for c in plot if c not in self.names]
        if bad:
            raise ConfigError(f"infer.plot_channels: {bad[0]!r} is not one of the model's channels {self.names}")
        self.plot = list(plot)
        self.dt = int(data_conventions(fc.info.config)["dt"])
        self.inits = cfg.init_hours()
        self.grid = tuple(int(g) for g in fc.info.grid)
        self._split()
        from recipes.stormcast.inference import _dataset

        last = self.inits[-1] + cfg.hours * self.dt
        self.ds = _dataset(cfg.data_root, fc.info, self.inits[0], last - self.inits[0])
        by_time = {self.ds.sample_times(i)[0]: i for i in range(len(self.ds))}
        self.samples: dict[int, list[int]] = {}
        for i in range(self.conf.infer.shard, len(self.inits), cfg.shards):
            hours = [self.inits[i] + k * self.dt for k in range(cfg.hours)]
            missing = [h for h in hours if h not in by_time]
            if missing:
                from recipes.weather.forecast_store import iso

                raise DataError(
                    f"infer.data_root: no sample (state, background, next state) for {iso(missing[0])}; the "
                    f"forecast from {iso(self.inits[i])} needs {iso(hours[0])} .. {iso(hours[-1] + self.dt)}"
                )
            self.samples[i] = [by_time[h] for h in hours]
        self.mean = torch.as_tensor(self.ds.state_means, dtype=torch.float32)[:, None, None]
        self.std = torch.as_tensor(self.ds.state_stds, dtype=torch.float32)[:, None, None]

    def _split(self) -> None:
        """Rows of this rank (bands in multiples of the store's row chunk, which is a multiple of the
        model's down-sampling), and the networks split over the domain group as in training."""
        from framework import registry
        from framework.domain.comm import DomainGroup, split_extents
        from framework.domain.splitter import model_plan, split

        info, cfg = self.info, self.cfg
        factor = 1
        for stage in (self.fc.reg_info, self.fc.diff_info):
            if stage is not None:
                schema = registry.models.entry(stage.name).schema(**stage.model)
                factor = math.lcm(factor, int(getattr(schema, "downsample_factor", 1)))
        self.row_chunk = cfg.row_chunk or factor
        if self.row_chunk % factor:
            raise ConfigError(
                f"infer.row_chunk={self.row_chunk}: must be a multiple of {factor}, the model's down-sampling "
                "(a domain band is whole chunks)"
            )
        size = self.degrees.domain
        rows = info.grid[0]
        if rows % self.row_chunk:
            raise ConfigError(f"infer.row_chunk={self.row_chunk}: the grid's {rows} rows are not a multiple of it")
        extents = split_extents(rows, size, self.row_chunk)
        rank = self.topology.domain_rank
        start = sum(extents[:rank])
        self.rows = slice(start, start + extents[rank])
        self.domain = None
        if size > 1:
            self.domain = DomainGroup(self.topology.group("domain"), extents)
            for attr, stage in (("reg", self.fc.reg_info), ("diff", self.fc.diff_info)):
                model = getattr(self.fc, attr)
                if model is not None:
                    setattr(self.fc, attr, split(model, self.domain, model_plan(stage.name, size)))

    def _spec(self):
        from recipes.weather.forecast_store import StoreSpec
        from recipes.weather.layout import channel_lists

        fc, cfg = self.fc, self.cfg
        sampler = dataclasses.asdict(fc.sampler) if fc.diff is not None else None
        if sampler is not None:
            sampler["s_max"] = str(sampler["s_max"])  # inf is not JSON
            sampler["dtype"] = cfg.sampler_dtype
        identity = {
            "regression": str(fc.reg_info.path.resolve()) if fc.reg is not None else None,
            "diffusion": str(fc.diff_info.path.resolve()) if fc.diff is not None else None,
            "data_root": cfg.data_root,
            "seed": self.conf.seed,
            "member_batch": cfg.member_batch,
            "precision": self.conf.precision,
            "sampler": sampler,
        }
        chans = channel_lists(fc.info.channels)
        attrs = {
            "background_channels": list(chans["background"]),
            "invariants": list(chans["invariants"]),
            "draws": "keyed by (seed, start time, member, lead, global position): the same for every layout",
        }
        shape = (cfg.members, tuple(self.inits), cfg.hours, self.dt, tuple(self.names), self.grid, self.row_chunk)
        return StoreSpec(*shape, identity=identity, attrs=attrs)  # members, inits, leads, dt, channels, grid, chunk

    def _coords(self) -> dict:
        """latitude/longitude (y, x) when the state stores hold them (PhysicsNeMo's layout)."""
        import zarr

        from recipes.weather.dataset import checked_array
        from recipes.weather.layout import PN_LAT, PN_LON

        h, w = self.grid
        out = {}
        paths = getattr(self.ds, "_paths", {}) or {}  # the dataset's year stores, by source
        first = next(iter(paths.get(getattr(self.ds, "_state", None)) or []), None)
        if first is None:
            return out
        try:
            g = zarr.open_group(str(first), mode="r")
            for key, name in ((PN_LAT, "latitude"), (PN_LON, "longitude")):
                if key in g and g[key].ndim == 2:
                    out[name] = checked_array(g, Path(first), key, 2)[:h, :w]  # its chunks and grid bounded first
        except (DataError, OSError, ValueError, KeyError, TypeError):  # optional: a store without usable ones has none
            return {}
        return out

    def run(self) -> dict:
        import torch

        from framework.distributed import collectives
        from recipes.weather.forecast_store import ForecastStore, iso

        self._setup()
        cfg, env = self.cfg, self.env
        spec = self._spec()
        status = torch.zeros(1, dtype=torch.int64)
        states = ("created", "joined", "complete")
        if env.is_main:
            state = ForecastStore.prepare(Path(cfg.out), spec, self._coords(), overwrite=cfg.overwrite)
            status[0] = states.index(state)
            log.info("store %s: %s", cfg.out if state == "complete" else f"{cfg.out}.partial", state)
        state = states[int(self._broadcast(status)[0])]
        if state == "complete":
            log.info("%s already holds this forecast: nothing to do", cfg.out)
            return {"out": cfg.out, "written": 0, "complete": True}
        collectives.barrier()  # the skeleton exists before anyone opens it
        self.store = ForecastStore(Path(cfg.out), spec)

        todo = units(self.inits, cfg.shard, cfg.shards, cfg.members, cfg.member_batch)
        done = torch.zeros(len(self.inits), cfg.members, dtype=torch.uint8)
        if env.is_main:  # one reading, shared: ranks that read it at different times could disagree
            done[:] = torch.from_numpy(self.store.done().astype("uint8"))
        done = self._broadcast(done).bool()
        pending = [u for u in todo if not all(done[u.init, m] for m in u.members)]
        if len(pending) < len(todo):
            log.info(
                "resuming: %d of %d blocks of this job already written, skipped", len(todo) - len(pending), len(todo)
            )
        dp, dp_rank = self.degrees.dp, self.topology.dp_rank
        mine = rank_share(pending, dp_rank, dp)
        rounds = math.ceil(len(pending) / dp) if pending else 0
        log.info(
            "%d start time(s) x %d member(s) x %d lead(s); this job: %d block(s) of <= %d member(s) over "
            "dp=%d x domain=%d ranks",
            len(self.inits),
            cfg.members,
            cfg.hours,
            len(pending),
            cfg.member_batch,
            dp,
            self.degrees.domain,
        )
        from framework.train import preemption

        stop = preemption.StopRequest()
        stop.install()
        from tqdm import tqdm

        bar = tqdm(total=rounds, desc="forecast", unit="block", disable=not (cfg.progress and env.is_main))
        written = 0
        try:
            for r in range(rounds):  # every rank the same number of rounds: the stop check is a collective
                unit = mine[r] if r < len(mine) else None
                if unit is not None:
                    self._forecast(unit)
                    self._mark(unit)
                    written += 1
                    if self.topology.domain_rank == 0:  # every writer's record, not rank 0's alone
                        first, last = unit.members[0], unit.members[-1]
                        writes.info("rank %d wrote %s members %d-%d", env.rank, iso(self.inits[unit.init]), first, last)
                bar.update(1)
                if r + 1 < rounds and stop.agreed():
                    log.info(
                        "stopping on %s after %d of %d rounds; the written members are kept",
                        stop.reason(),
                        r + 1,
                        rounds,
                    )
                    stop.hand_over()  # submitit requeues here (rank 0) and exits
                    raise preemption.Stopped(
                        f"stopped on {stop.reason()}: run the same command again to write the rest of {cfg.out}"
                    )
        finally:
            bar.close()
            stop.uninstall()
        return self._finish(written)

    def _forecast(self, unit: Unit) -> None:
        import torch

        cfg, n = self.cfg, len(unit.members)
        t0 = self.inits[unit.init]
        idx = self.samples[unit.init]
        first = self.ds.read(idx[0], rows=self.rows)
        state = first["state"][None].to(self.device).repeat(n, 1, 1, 1)
        invariants = first["invariants"][None].to(self.device).repeat(n, 1, 1, 1)
        dtype = getattr(torch, cfg.sampler_dtype)
        for k in range(cfg.hours):
            sample = first if k == 0 else self.ds.read(idx[k], rows=self.rows)
            background = sample["background"][None].to(self.device).repeat(n, 1, 1, 1)
            keys = [(self.conf.seed, t0, m, k + 1) for m in unit.members]
            state = step(self.fc, state, background, invariants, keys, self.rows, self.grid[0], dtype)
            phys = (state.cpu() * self.std + self.mean).numpy()
            self.store.write(list(unit.members), unit.init, k, self.rows, phys)
            if unit.members[0] == 0:
                self.store.write_truth(unit.init, k, self.rows, (sample["target"] * self.std + self.mean).numpy())

    def _mark(self, unit: Unit) -> None:
        """After every domain rank has written its band: the block is complete."""
        if self.domain is not None:
            import torch.distributed as dist

            dist.barrier(group=self.domain.group)
        if self.topology.domain_rank == 0:
            self.store.mark(unit.init, list(unit.members))

    def _finish(self, written: int) -> dict:
        """Every rank of this job is done; if every job is, the one that gets here first scores
        the store and renames it into place (the others find it taken or gone)."""
        import torch

        from framework import rundir
        from framework.distributed import collectives
        from framework.errors import RunDirError
        from recipes.weather.forecast_store import partial_path

        collectives.barrier()
        cfg, env = self.cfg, self.env
        flag = torch.zeros(1, dtype=torch.int64)
        lock = None
        if env.is_main:
            left = int((~self.store.done()).sum())
            if left:
                log.info("%d member(s) of other jobs' start times still to write; the last job commits", left)
            else:
                claim = Path(str(cfg.out) + ".commit")
                claim.mkdir(parents=True, exist_ok=True)
                try:
                    lock = rundir.RunLock(claim).acquire()
                    flag[0] = 1 if partial_path(Path(cfg.out)).exists() else 0
                except RunDirError:
                    log.info("another job is committing %s", cfg.out)
        try:
            if int(self._broadcast(flag)[0]):
                self._score_and_commit()
        finally:
            if lock is not None:
                lock.release()
                import shutil

                shutil.rmtree(Path(str(cfg.out) + ".commit"), ignore_errors=True)
        complete = Path(cfg.out).exists()
        if env.is_main and complete:
            log.info(
                "wrote %s (%d member(s) x %d start time(s) x %d lead(s))",
                cfg.out,
                cfg.members,
                len(self.inits),
                cfg.hours,
            )
        return {"out": cfg.out, "written": written, "complete": complete}

    def _score_and_commit(self) -> None:
        from framework.distributed import collectives

        cfg = self.cfg
        if cfg.scores:
            from recipes.weather import forecast_scores

            summary = forecast_scores.score(self.store.group, self.env, fair=cfg.fair_crps, spectra=self.plot)
            if self.env.is_main:
                forecast_scores.write(self.store.group, summary, Path(cfg.out))
        if self.env.is_main and cfg.frames:
            from recipes.weather.forecast_scores import frames

            frames(self.store.group, Path(str(cfg.out) + ".report"), self.plot)
        collectives.barrier()
        if self.env.is_main:
            self.store.commit()


def step(fc, state, background, invariants, keys, rows: slice, full_rows: int, dtype):
    """One lead step of a block of members on this rank's ``rows`` (normalized units): the
    regression mean plus a diffusion sample whose draws are keyed by ``keys`` and global position."""
    import torch

    from framework.domain import draws
    from recipes.weather import edm
    from recipes.weather.diffusion import condition_inputs

    with torch.no_grad(), fc.autocast:
        reg, cond = condition_inputs(fc.reg, fc.reg_residual, fc.conditions, state, background, invariants)
        if fc.diff is None:
            return reg
        shape = state.shape[1:]
        noise = lambda ks: draws.field_normal(  # noqa: E731
            ks, shape, row_offset=rows.start, full_rows=full_rows, dim=1, device=state.device
        )
        sample = edm.heun_sample(
            lambda x, s: fc.diff(x, s, cond),
            noise(keys),
            noise=lambda i: noise([(*k, i) for k in keys]),
            dtype=dtype,
            **fc.sampler.kwargs(),
        ).float()
    return reg + sample if fc.residual else sample


def main() -> None:
    import hydra

    from framework import cli
    from framework.distributed.launcher import die_with_launcher

    die_with_launcher()
    argv = _with_config_name(sys.argv[1:])
    try:
        precheck(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.argv[1:] = argv
    # the job by its module's name, not __main__'s: submitit pickles it by reference
    from recipes.weather import forecast

    hydra.main(version_base="1.3", config_path=cli.CONF_DIR, config_name=CONFIG_NAME)(forecast.job)()


if __name__ == "__main__":
    main()
