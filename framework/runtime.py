"""Build every component of a validated run through the registries, then train.

Order (fixed, as in torchtitan's parallelize step): seed -> data -> which checkpoint to
resume from -> model (``checkpoint.init_from`` on a fresh start) on device -> domain splitter
-> sharding policy -> optimizer/schedule -> trainer.
"""

from __future__ import annotations

import logging
import math
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from framework import registry
from framework.checkpoint.manager import CheckpointManager
from framework.data.sampler import micro_batch
from framework.distributed import collectives
from framework.distributed import env as dist_env
from framework.distributed import mesh as mesh_mod
from framework.distributed import precision as precision_mod
from framework.errors import ConfigError, DistributedError
from framework.logging import Sink
from framework.logging.console import ConsoleSink
from framework.logging.jsonl import JsonlSink
from framework.task import Task
from framework.train import compile as compile_mod
from framework.train import optim as optim_mod
from framework.train import schedule as schedule_mod

log = logging.getLogger("framework")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    else:
        torch.use_deterministic_algorithms(False)


class JobResult(float):
    """What a training job returns: the run's ``objective`` as a float, and its summary by key.

    Hydra's sweepers read the job's return value as a number (Optuna calls ``float()`` on it,
    Nevergrad computes with it, Ax takes a float but reads a dict as named metrics), so the
    value itself is the objective: NaN when the run logged no such value (a resumed run with
    no step left to train). The summary stays readable as before: ``result["steps"]``,
    ``"final_loss"``, ``"val"`` (the last validation row), ``"run_dir"``, ``"resumed_from"``,
    ``"objective"`` (its name)."""

    summary: dict

    def __new__(cls, value: float, summary: dict) -> JobResult:
        self = super().__new__(cls, value)
        self.summary = dict(summary)
        return self

    def __reduce__(self):  # pickled back from a submitit job
        return (type(self), (float(self), self.summary))

    def __getitem__(self, key: str):
        return self.summary[key]

    def __contains__(self, key: object) -> bool:
        return key in self.summary

    def get(self, key: str, default=None):
        return self.summary.get(key, default)

    def keys(self):
        return self.summary.keys()

    def items(self):
        return self.summary.items()


def objective_value(name: str, final_loss: float | None, val: dict) -> float:
    """``objective`` (validated: ``train/loss`` or ``val/<key>``) read from the run's end."""
    from framework.config.schema import OBJECTIVE_TRAIN

    value = final_loss if name == OBJECTIVE_TRAIN else val.get(name[len("val/") :])
    return math.nan if value is None else float(value)


def run_job(run, run_dir: Path) -> JobResult:
    """Train; returns the run's objective as a float that also holds its summary (JobResult)."""
    registry.load_providers()
    env = dist_env.detect()
    if run.parallel.name == "auto":  # the layout the plan picks for these ranks and this memory
        from framework.plan import apply_auto

        run = apply_auto(run, env.world_size, env.is_main)
    degrees = mesh_mod.resolve(run.parallel, env.world_size)  # config error before any group
    micro_batch(run.data.batch_size, degrees.dp, run.trainer.grad_accum)  # even micro-batches on every rank
    _check_layout(run, degrees)
    device = dist_env.pick_device(run.device, env)
    with dist_env.process_group(env, device, run.parallel.timeout_s):
        try:
            return _run(run, run_dir, env, degrees, device)
        except (torch.distributed.DistError, RuntimeError) as e:
            if env.distributed and is_comm_failure(e):
                raise DistributedError(_dist_message(e, env, run.parallel.timeout_s)) from None
            raise


_COMM_MARKERS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "gloo", "nccl", "c10d")


def is_comm_failure(e: BaseException) -> bool:
    """Gloo reports timeouts and dead peers as plain RuntimeErrors; recognise them by text."""
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e).lower()
    return any(m in text for m in _COMM_MARKERS)


def _check_layout(run, degrees) -> None:
    if run.sharding.name == "none" and degrees.world > 1:
        raise ConfigError(
            f"sharding=none on {degrees.world} ranks would train {degrees.world} unsynchronised "
            "replicas; use parallel=ddp, fsdp2, hsdp, fsdp2_domain or domain"
        )
    if degrees.domain > 1 and run.splitter.name == "off":
        raise ConfigError(
            f"parallel.domain={degrees.domain} needs splitter=rows (or parallel=fsdp2_domain / parallel=domain)"
        )
    if run.trainer.compile_cudagraphs and run.trainer.compile is not False:
        obstacle = compile_mod.cudagraph_obstacle(*_cudagraph_layout(run, degrees))
        if obstacle:
            raise ConfigError(f"trainer.compile_cudagraphs=true cannot apply: {obstacle}; set it to null or false")
    if degrees.domain > 1:
        from framework.domain.splitter import model_plan

        model_plan(run.model.name, degrees.domain)  # a model without a split plan: one line, before any group


def _cudagraph_layout(run, degrees) -> tuple[str, int, bool]:
    """What decides whether the compiled blocks can replay as CUDA graphs: the sharding the run
    applies (fsdp2 on one rank is none), the domain degree, and activation checkpointing (a model
    node's ``checkpoint_level``, the UNet recipes' knob)."""
    from framework.plan import effective

    return effective(run.sharding.name, degrees), degrees.domain, getattr(run.model, "checkpoint_level", 0) > 0


def _dist_message(e: Exception, env, timeout_s: float) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "timed out" in first.lower() or "timeout" in first.lower():
        return (
            f"rank {env.rank}: a collective timed out after {timeout_s:g} s (parallel.timeout_s); "
            f"a peer rank is dead or hung: {first}"
        )
    return f"rank {env.rank}: a peer rank failed: {first}"


def _step_flops(run, degrees, env, device, task) -> float | None:
    """One sample's training FLOPs for tflops and MFU: stated by the model, else on a GPU from a
    step traced on fake tensors (framework/plan.py). The trainer's fallback, counting its first
    real step under FlopCounterMode, would run that step eagerly (87 GiB for the regression
    preset on an H200 against 37 GiB compiled) and delay the compile by a step. On CPU that
    costs nothing, while the trace costs seconds: None, and the trainer counts (the same number)."""
    stated = task.flops_per_sample()
    if stated or device.type != "cuda":
        return stated
    from framework.plan import step_flops

    try:
        flops, source = step_flops(run, degrees)
    except Exception as e:  # noqa: BLE001  (an op fake tensors cannot run: the trainer counts instead)
        text = str(e).strip()
        flops, source = None, f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__
    if env.is_main:
        if flops is None:
            log.info("FLOPs not traced (%s): counted on the first step, which runs eager", source)
        else:
            log.info("FLOPs: %.4g TFLOP per sample, forward + backward (%s)", flops / 1e12, source)
    return flops


def _run(run, run_dir: Path, env, degrees, device) -> JobResult:
    if not env.is_main:  # one voice in the shared log; our warnings and errors still from all
        log.setLevel(logging.WARNING)
        # Library warnings (FSDP2's "returned a view tensor", deprecations) come from code every
        # rank runs alike: rank 0 prints them once for the job.
        warnings.simplefilter("ignore")
    topology = mesh_mod.build(degrees, device.type)
    seed_everything(run.seed, run.deterministic)
    precision = precision_mod.build(run.precision, device)
    precision.apply_backend_flags()

    task_cls = registry.tasks.entry(run.task.name).builder
    domain = _domain_group(run, topology, task_cls)
    task = task_cls(run, env, device, barrier=collectives.barrier, domain=domain)
    if not isinstance(task, Task):
        raise ConfigError(f"task '{run.task.name}' ({type(task).__name__}) is not a framework.task.Task")
    task.train_dataset()  # fail on bad data before building anything large
    task.val_dataset()
    backend = registry.checkpoint.build(run.checkpoint.name, run.checkpoint)
    checkpoint = (
        CheckpointManager(run.checkpoint, backend, run_dir, env, barrier=collectives.barrier)
        if backend is not None
        else None
    )
    resume = checkpoint.plan_resume() if checkpoint is not None else None  # verified by every rank
    model = task.build_model()
    init_from = _init_from(run, task, model, resume)
    model = model.to(device)
    model = registry.splitters.build(
        run.splitter.name,
        model,
        run.splitter,
        topology=topology,
        domain=domain,
        plan=registry.models.entry(run.model.name).split_plan,
        model_name=run.model.name,
    )
    from framework.train import precompile
    from framework.train.compile import compile_model, compile_wanted

    compiled, jobs = None, []
    if compile_wanted(run.trainer.compile, device.type):  # per block class, before sharding, as torchtitan orders it
        compiled = compile_model(
            model,
            units=list(run.sharding.units),
            device_type=device.type,
            deterministic=run.deterministic,
            cache_dir=compile_mod.user_cache_dir(),
            memory_budget=run.trainer.compile_memory_budget,
            cudagraphs=compile_mod.cudagraphs_wanted(
                run.trainer.compile_cudagraphs, device.type, *_cudagraph_layout(run, degrees)
            ),
        )
        micro = run.data.batch_size // degrees.dp // run.trainer.grad_accum
        jobs = precompile.plan_jobs(run.trainer.compile_workers, compiled, model, task, micro, precision, device)
    sharded = registry.sharding.build(
        run.sharding.name, model, run.sharding, topology=topology, precision=precision, device=device
    )
    model = sharded.model
    precision.sharded_cast = sharded.mixed_precision
    if jobs:  # the blocks' graphs built side by side, before the first step (each rank a share)
        precompile.run_jobs(
            jobs,
            run.trainer.compile_workers,
            compiled,
            precision,
            sharded.mixed_precision,
            device,
            env,
            timeout_s=0.8 * run.parallel.timeout_s,  # the barrier below must not time out first
        )
    if compiled is not None and compiled.enabled:
        collectives.barrier()  # every rank, with or without a share: none waits on a rank that skipped

    optimizer = optim_mod.build(run.optim, model.parameters())
    scheduler = schedule_mod.build(run.schedule, optimizer, run.trainer.max_steps)

    sinks: list[Sink] = []
    if env.is_main:
        sinks = [
            JsonlSink(run_dir / "metrics.jsonl"),
            ConsoleSink(run.trainer.max_steps, 0, enabled=run.trainer.progress),
        ]
        extra = registry.loggers.build(run.logger.name, run.logger, run=run, run_dir=run_dir)
        if extra is not None:
            sinks.append(extra)
        _report(run, env, device, topology, sharded)

    trainer_cls = registry.trainers.entry(run.trainer.name).builder
    trainer = trainer_cls(
        cfg=run.trainer,
        run=run,
        env=env,
        device=device,
        task=task,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        checkpoint=checkpoint,
        sinks=sinks,
        run_dir=run_dir,
        dp_rank=topology.dp_rank,
        dp_size=topology.dp_size,
        flops_per_sample=_step_flops(run, degrees, env, device, task),
    )
    trainer.init_from = init_from  # a resumed run takes the record of its checkpoint instead
    try:
        summary = trainer.fit()
    finally:
        for s in sinks:
            s.close()
    objective = objective_value(run.objective, summary.final_loss, summary.val)
    if env.is_main:
        for line in summary.lines(task):
            log.info(line)
    return JobResult(
        objective,
        {
            "steps": summary.steps,
            "final_loss": summary.final_loss,
            "val": summary.val,
            "run_dir": summary.run_dir,
            "resumed_from": summary.resumed_from,
            "objective": run.objective,
        },
    )


def _init_from(run, task, model, resume: Path | None) -> dict | None:
    """``checkpoint.init_from``: the task loads those weights into the fresh ``model`` (before it
    is split or sharded). Not on resume: the checkpoint's weights win, and it is said once."""
    value = run.checkpoint.init_from
    if not value:
        return None
    if resume is not None:
        from framework.checkpoint.backend import read_meta

        started = (read_meta(resume).get("init_from") or {}).get("path")
        log.info(
            "checkpoint.init_from=%s not applied: resuming from %s, whose weights win%s",
            value,
            resume,
            f" (this run started from {started})" if started else "",
        )
        return None
    path = Path(value)
    if not path.exists():
        raise ConfigError(f"checkpoint.init_from: {path} does not exist")
    record = dict(task.init_weights(model, path) or {})
    record.setdefault("path", str(path))
    log.info(
        "checkpoint.init_from: the model starts from %s (%s tensors%s)",
        path,
        record.get("tensors", "?"),
        f", {record['format']}" if record.get("format") else "",
    )
    return record


def _domain_group(run, topology, task_cls):
    """Rows of each domain rank at full resolution, multiples the task asks for."""
    from framework.domain.comm import DomainGroup, split_extents

    size = topology.degrees.domain
    if size == 1:
        return None
    rows, multiple = task_cls.domain_rows(run)
    extents = split_extents(rows, size, multiple)
    return DomainGroup(topology.group("domain"), extents)


def _report(run, env, device, topology, sharded) -> None:
    params = list(sharded.model.parameters())
    n = sum(p.numel() for p in params)  # DTensor numel is the global size
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    nbytes = sum(p.numel() * p.element_size() for p in local)
    log.info(
        "recipe=%s model=%s precision=%s device=%s world=%d",
        run.recipe,
        run.model.name,
        run.precision.name,
        device,
        env.world_size,
    )
    log.info(
        "mesh: %s (parallel=%s, sharding=%s, splitter=%s)",
        topology.describe(),
        run.parallel.name,
        sharded.kind,
        run.splitter.name,
    )
    if sharded.units:
        log.info("FSDP2 units (%d): %s", len(sharded.units), ", ".join(sharded.units))
    if run.tags:
        log.info("tags: %s", ", ".join(run.tags))
    log.info("parameters: %.3f M; %.3f MB of parameters on this rank", n / 1e6, nbytes / 2**20)
