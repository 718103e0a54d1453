"""Build every component of a validated run through the registries, then train.

Order (fixed, as in torchtitan's parallelize step): seed -> model on device -> domain
splitter -> sharding policy -> optimizer/schedule -> checkpoint -> trainer.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

from framework import registry
from framework.checkpoint.manager import CheckpointManager
from framework.distributed import collectives, env as dist_env, precision as precision_mod
from framework.logging.console import ConsoleSink
from framework.logging.jsonl import JsonlSink
from framework.train import optim as optim_mod, schedule as schedule_mod

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


def run_job(run, run_dir: Path) -> dict:
    registry.load_providers()
    env = dist_env.detect()
    device = dist_env.pick_device(run.device, env)
    seed_everything(run.seed, run.deterministic)
    precision = precision_mod.build(run.precision, device)
    precision.apply_backend_flags()

    task = registry.tasks.build(run.task.name, run, env, device, barrier=collectives.barrier)
    task.train_dataset()  # fail on bad data before building anything large
    task.val_dataset()
    model = task.build_model().to(device)
    model = registry.splitters.build(run.splitter.name, model, run.splitter)
    model = registry.sharding.build(run.sharding.name, model, run.sharding, precision=precision)
    if run.trainer.compile:
        model = torch.compile(model)

    optimizer = optim_mod.build(run.optim, model.parameters())
    scheduler = schedule_mod.build(run.schedule, optimizer, run.trainer.max_steps)
    backend = registry.checkpoint.build(run.checkpoint.name, run.checkpoint)
    checkpoint = (CheckpointManager(run.checkpoint, backend, run_dir, env, barrier=collectives.barrier)
                  if backend is not None else None)

    sinks = []
    if env.is_main:
        sinks = [JsonlSink(run_dir / "metrics.jsonl"),
                 ConsoleSink(run.trainer.max_steps, 0, enabled=run.trainer.progress)]
        extra = registry.loggers.build(run.logger.name, run.logger, run=run, run_dir=run_dir)
        if extra is not None:
            sinks.append(extra)
        _report(run, env, device, model)

    trainer_cls = registry.trainers.entry(run.trainer.name).builder
    trainer = trainer_cls(cfg=run.trainer, run=run, env=env, device=device, task=task, model=model,
                          optimizer=optimizer, scheduler=scheduler, precision=precision,
                          checkpoint=checkpoint, sinks=sinks, run_dir=run_dir)
    try:
        summary = trainer.fit()
    finally:
        for s in sinks:
            s.close()
    if env.is_main:
        for line in summary.lines():
            log.info(line)
    return {"steps": summary.steps, "final_loss": summary.final_loss, "val": summary.val,
            "run_dir": summary.run_dir, "resumed_from": summary.resumed_from}


def _report(run, env, device, model) -> None:
    n = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info("recipe=%s model=%s parallel=%s precision=%s device=%s world=%d",
             run.recipe, run.model.name, run.parallel.name, run.precision.name, device, env.world_size)
    log.info("parameters: %.3f M (%.1f MB per rank)", n / 1e6, nbytes / 2**20)
