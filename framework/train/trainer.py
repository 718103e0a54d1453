"""The training loop: one readable loop, top to bottom.

Everything it touches is built elsewhere (framework.runtime): the task (framework.task.Task)
owns data, model, loss and scores; the precision policy owns autocast and the GradScaler;
the checkpoint manager owns files. Splitting and sharding have already been applied to
``model``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from framework import registry
from framework.config.schema import OBJECTIVE_TRAIN, TrainerConfig
from framework.data.loader import eval_loader, train_loader
from framework.data.sampler import GlobalBatchSampler
from framework.distributed import collectives
from framework.errors import ConfigError, FrameworkError
from framework.train import metrics, preemption

log = logging.getLogger("framework")

# the share of a log window's time spent waiting for batches above which the log says the data
# loader does not keep up
DATA_WAIT_WARN = 0.1


class NonFiniteLoss(FrameworkError):
    """A step's loss or gradient norm was NaN or inf: the run stops, the last good checkpoint stays."""

    exit_code = 4


@dataclass
class Summary:
    steps: int
    final_loss: float | None
    val: dict = field(default_factory=dict)
    run_dir: str = ""
    resumed_from: str | None = None

    def lines(self, task) -> list[str]:
        out = [
            f"done: {self.steps} steps, final train loss {self.final_loss:.4g}"
            if self.final_loss is not None
            else f"done: {self.steps} steps"
        ]
        if self.val:
            out += task.summary_lines(self.val)
        out.append(f"run dir: {self.run_dir}")
        return out


class Trainer:
    def __init__(
        self,
        *,
        cfg: TrainerConfig,
        run,
        env,
        device,
        task,
        model,
        optimizer,
        scheduler,
        precision,
        checkpoint,
        sinks,
        run_dir: Path,
        dp_rank=0,
        dp_size=1,
        flops_per_sample: float | None = None,
    ):
        self.cfg, self.run, self.env, self.device = cfg, run, env, device
        self.task, self.model, self.optimizer, self.scheduler = task, model, optimizer, scheduler
        self.precision, self.checkpoint, self.sinks = precision, checkpoint, sinks
        self.run_dir = Path(run_dir)
        # Metrics reduce over every rank: data-parallel ranks hold other samples, domain
        # ranks other pixels of the same ones (their losses are weighted to sum right).
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.step = 0
        self._warned_data_wait = False
        self.run_id = uuid.uuid4().hex[:12]
        self.init_from: dict | None = None  # what checkpoint.init_from loaded (recorded in checkpoints)
        # one sample's training FLOPs, for tflops and MFU; None: counted on the first step
        self.flops_per_sample = flops_per_sample
        self.skipped_steps = 0
        # First step whose loss or gradient norm was not finite (-1: none), kept on the device
        # and read only where the loop syncs anyway (log steps, saves, the end): no per-step sync.
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)

    # -- plumbing ---------------------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        nb = self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=nb) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _log(self, row: dict) -> None:
        if self.env.is_main:
            for sink in self.sinks:
                sink.log(row)

    def _micro_batches(self, batch: dict) -> list[dict]:
        n = self.cfg.grad_accum
        size = next(v for v in batch.values() if torch.is_tensor(v)).shape[0] // n
        return [
            {k: v[i * size : (i + 1) * size] if torch.is_tensor(v) and v.dim() else v for k, v in batch.items()}
            for i in range(n)
        ]

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        scaler = self.precision.scaler
        total = torch.zeros((), device=self.device)
        micros = self._micro_batches(batch)
        for i, micro in enumerate(micros):
            # DDP: all-reduce once, on the last micro-batch. FSDP2 reduce-scatters every
            # micro-batch: gradients stay sharded (memory) at the cost of more traffic.
            no_sync = getattr(self.model, "no_sync", None)
            ctx = no_sync() if no_sync is not None and i < len(micros) - 1 else contextlib.nullcontext()
            with ctx:
                with self.precision.autocast(self.device):
                    loss = self.task.loss(self.model, micro)
                scaled = loss / self.cfg.grad_accum
                (scaler.scale(scaled) if scaler else scaled).backward()
            total += loss.detach()
        if scaler:
            scaler.unscale_(self.optimizer)  # clip the true gradients
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        # One global norm: over DTensor shards, torch reduces across every mesh dim.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if scaler is None:  # (a GradScaler skips non-finite steps itself and counts them)
            # The norm is global (reduced over every rank), so every rank flags the same step.
            bad = ~(torch.isfinite(grad_norm) & torch.isfinite(total))
            self._first_bad = torch.where(bad & (self._first_bad < 0), self.step + 1, self._first_bad)
        if self.checkpoint is not None:  # an async save must finish reading before params change
            self.checkpoint.before_optimizer_step()
        if scaler:
            scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            self.skipped_steps += int(scaler.get_scale() < scale)  # inf/NaN grads: step skipped
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total / self.cfg.grad_accum, grad_norm

    # -- validation ----------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        data = self.run.data
        loader = eval_loader(
            self.task.val_dataset(),
            batch_size=data.batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            max_batches=self.cfg.val_batches,
            num_workers=data.num_workers,
            pin_memory=data.pin_memory,
            device=self.device,
        )
        self.model.eval()
        sums: dict[str, torch.Tensor] = {}
        for batch in loader:
            with self.precision.autocast(self.device):
                part = self.task.val_step(self.model, self._to_device(batch))
            for k, v in part.items():
                sums[k] = sums[k] + v if k in sums else v
        self.model.train()
        for v in sums.values():
            collectives.all_reduce_sum(v)
        row = {"step": self.step, "split": "val", **self.task.val_summary(sums)}
        self._check_objective(row)
        self._log(row)
        # Off, the task keeps its first sample for a figure never drawn: a few small tensors.
        images = self.task.val_figures(self.run_dir / "plots", self.step) if self.cfg.figures else {}
        for sink in self.sinks if images else ():
            if hasattr(sink, "log_images"):
                sink.log_images(self.step, images)
        return row

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> Summary:
        resumed = None
        if self.checkpoint is not None:
            path = self.checkpoint.resume_path()
            if path is not None:
                changes = self._check_resume(path)
                self.checkpoint.load(path, self)
                resumed = str(path)
                log.info("resumed from %s at step %d", path, self.step)
                self._follow_schedule(changes)
        self._start = self.step
        if self.step > self.cfg.max_steps:
            raise ConfigError(
                f"trainer.max_steps={self.cfg.max_steps} is below the step of the checkpoint resumed "
                f"({self.step}); set trainer.max_steps above {self.step} to train on"
            )
        if self.step == self.cfg.max_steps and resumed:
            log.info("already at trainer.max_steps=%d (resumed from %s): nothing to train", self.step, resumed)
        for sink in self.sinks:  # sinks that need the (restored) run id start now
            if hasattr(sink, "start"):
                sink.start(self)
        data = self.run.data
        overfit = self.cfg.overfit_batches
        if overfit and self.env.is_main:
            log.info("trainer.overfit_batches=%d: training on the first %d global batch(es) only", overfit, overfit)
        sampler = (functools.partial(FirstBatches, repeat=overfit) if overfit else GlobalBatchSampler)(
            len(self.task.train_dataset()),
            data.batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=self.run.seed,
            start_step=self.step,
        )
        batches = iter(
            train_loader(
                self.task.train_dataset(),
                sampler,
                num_workers=data.num_workers,
                pin_memory=data.pin_memory,
                device=self.device,
            )
        )
        console = next((s for s in self.sinks if hasattr(s, "advance")), None)
        stop = preemption.StopRequest(self.cfg.stop_before_end_min)
        stop.install()
        profiler = self._profiler()
        try:
            with torch.autograd.detect_anomaly() if self.cfg.detect_anomaly else contextlib.nullcontext():
                return self._loop(batches, console, stop, resumed, profiler)
        finally:
            if profiler is not None:
                profiler.stop()  # a run cut short still writes what was traced
            stop.uninstall()

    def _loop(self, batches, console, stop, resumed, profiler=None) -> Summary:
        self.model.train()
        last_loss, val_row = None, {}
        watch = metrics.Stopwatch(self.device)
        window_start, t_run = self.step, time.perf_counter()
        while self.step < self.cfg.max_steps:
            with watch.waiting():  # the loader alone: a copy to the GPU may wait for the GPU's queue
                batch = next(batches)
            batch = self._to_device(batch)
            batch["step"] = self.step  # tasks key their random draws by it (equal on every layout)
            if self.flops_per_sample is None:  # not traced at start-up (CPU): count this step
                stated = self.task.flops_per_sample()
                if stated:  # the model states its FLOPs (FlopCounterMode cannot see all kernels)
                    self.flops_per_sample = stated
                    loss, grad_norm = self.train_step(batch)
                else:
                    (loss, grad_norm), flops = metrics.count_flops(lambda: self.train_step(batch))
                    self.flops_per_sample = flops * self.env.world_size / self.run.data.batch_size  # all ranks
            else:
                loss, grad_norm = self.train_step(batch)
            self.step += 1
            if profiler is not None:
                profiler.step()
            last = self.step == self.cfg.max_steps

            saving = self.checkpoint is not None and self.checkpoint.due(self.step, last)
            if self.step % self.cfg.log_every == 0 or last or saving:
                self._check_finite()  # never log on, validate or checkpoint a diverged model
            if self.step % self.cfg.log_every == 0 or last:
                loss = collectives.all_reduce_mean(loss.detach().clone())
                last_loss = float(loss)
                dt = watch.lap()
                row = self._train_row(last_loss, grad_norm, dt, self.step - window_start, t_run)
                row["data_wait"] = watch.waited / dt if dt > 0 else 0.0
                self._log(row)
                self._warn_data_wait(row["data_wait"], window_start)
                window_start = self.step
                if console is not None:
                    console.advance(self.step, last_loss, None)
            if (self.cfg.val_every and self.step % self.cfg.val_every == 0) or last:
                val_row = self.validate()
                watch.lap()  # validation time is not training throughput
            if saving:
                self.checkpoint.save(self, _plain(self.run.raw), finite=True)
                watch.lap()
            if not last and stop.agreed():
                self._stop_early(stop)
        if self.checkpoint is not None:
            self.checkpoint.finish()  # a run that ends waits for its last save
        return Summary(self.step, last_loss, val_row, str(self.run_dir), resumed)

    def _check_objective(self, row: dict) -> None:
        """``objective=val/<key>`` must name a key of the validation row: checked at the first
        validation (every rank alike), not at the end of a long run."""
        name = getattr(self.run, "objective", OBJECTIVE_TRAIN)
        if name == OBJECTIVE_TRAIN or name[len("val/") :] in row:
            return
        keys = ", ".join(f"val/{k}" for k in row if k not in ("step", "split"))
        raise ConfigError(f"objective: {name!r} is not in the validation row (available: {keys}, {OBJECTIVE_TRAIN})")

    def _profiler(self):
        """``trainer.profile_steps=N``: torch.profiler over N steps after one skipped (the first
        step counts FLOPs or compiles) and one warm-up; each rank writes a chrome trace and a
        table of its slowest ops under <run dir>/profile/."""
        n = self.cfg.profile_steps
        if not n:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule

        out = self.run_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        cuda = self.device.type == "cuda"
        rank = self.env.rank

        def written(prof) -> None:
            trace = out / f"trace_rank{rank}.json"
            prof.export_chrome_trace(str(trace))
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            (out / f"ops_rank{rank}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
            log.info(
                "profile: steps %d-%d traced to %s (ops_rank%d.txt: the slowest ops)",
                self.step - n + 1,
                self.step,
                trace,
                rank,
            )

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(
            activities=activities, schedule=schedule(wait=1, warmup=1, active=n, repeat=1), on_trace_ready=written
        )
        prof.start()
        return prof

    def _check_resume(self, path: Path) -> list:
        """Say which settings differ from the checkpoint's run (returned); refuse those that may not
        change (framework.config.resume: the model, the task, the data a model was trained on)."""
        from framework.checkpoint.backend import read_meta
        from framework.config.resume import check_resume, schema_rules
        from framework.config.schema import TopConfig

        saved = read_meta(path).get("config") or {}
        rules = (*schema_rules(self.run), *TopConfig.RESUME_RULES)  # the top-level keys' own (tags, objective)
        changes = check_resume(saved, _plain(self.run.raw), exclude=tuple(self.run.checkpoint.exclude), rules=rules)
        for change in changes:
            log.info("resume: %s", change.line())
        return changes

    def _follow_schedule(self, changes: list) -> None:
        """The rule for a schedule changed on resume (``trainer.max_steps`` or ``schedule.*``, among
        ``_check_resume``'s changes): the config's schedule applies from the restored step on, as
        if the run had been configured so from the start (a longer run re-stretches the cosine),
        and the jump is said once."""
        if "schedule" in self.run.checkpoint.exclude or not hasattr(self.scheduler, "lr_lambdas"):
            return
        what = [
            f"{c.key} {c.old} -> {c.new}"
            for c in changes
            if c.key == "trainer.max_steps" or c.key.startswith("schedule.")
        ]
        if not what:
            return
        groups = self.optimizer.param_groups
        old = [g["lr"] for g in groups]
        for g, base, factor in zip(groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            g["lr"] = base * factor(self.step)
        self.scheduler._last_lr = [g["lr"] for g in groups]
        log.info(
            "resume: the schedule follows the config (%s): learning rate at step %d %.4g -> %.4g, "
            "then as the new schedule gives it",
            ", ".join(what),
            self.step,
            old[0],
            groups[0]["lr"],
        )

    def _check_finite(self) -> None:
        """Stop (exit 4) if any step since the last check had a NaN/inf loss or gradient norm.

        Policy: stop rather than skip. Checked before every log, validation and save, so a
        diverged model is never checkpointed and the newest checkpoint is the last good one;
        a run stops at most ``log_every`` steps after the bad step.
        """
        flag = self._first_bad.clone()
        if collectives.active():  # every rank stops together (the norm is global; the loss is not)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        first = int(flag)  # one sync, where the loop syncs anyway
        if first < 0:
            return
        saved = self.checkpoint.latest() if self.checkpoint is not None else None
        kept = f"newest checkpoint kept: {saved.name}" if saved is not None else "no checkpoint was written"
        raise NonFiniteLoss(
            f"the loss or gradient norm became NaN/inf at step {first} (optim.lr="
            f"{self.optimizer.defaults.get('lr')}); stopped without saving; {kept}"
        )

    def _stop_early(self, stop) -> None:
        saved = "no checkpoint (checkpoint=none)"
        self._check_finite()
        if self.checkpoint is not None:
            if self.checkpoint.latest() is None or self.checkpoint.latest().name != f"step_{self.step:08d}":
                self.checkpoint.save(self, _plain(self.run.raw), finite=True)
            self.checkpoint.finish()
            saved = f"checkpoint step_{self.step:08d} saved"
        log.info("stopping at step %d on %s; %s", self.step, stop.reason(), saved)
        stop.hand_over()  # submitit requeues here (rank 0) and exits
        raise preemption.Stopped(
            f"stopped at step {self.step} on {stop.reason()}: {saved}; run again with the same run dir to resume"
        )

    def _warn_data_wait(self, share: float, since: int) -> None:
        """Once per run on a GPU, which idles meanwhile: the steps since ``since`` waited on their
        data for over a tenth of their time (the first window, with its compile and the workers'
        start, is not judged). On CPU the loader and the step share the cores: the row says it.
        Rank 0's wait, as its row: another rank's slow loader shows there as a longer step."""
        quiet = self._warned_data_wait or self.device.type == "cpu" or not self.env.is_main
        if quiet or share <= DATA_WAIT_WARN or since == self._start:
            return
        self._warned_data_wait = True
        log.warning(
            "steps %d-%d waited for their data %.0f%% of the time: the data loader does not keep up "
            "(data.num_workers=%d: raise it; docs/data.md, Read speed)",
            since + 1,
            self.step,
            100 * share,
            self.run.data.num_workers,
        )

    def _train_row(self, loss: float, grad_norm, dt: float, steps: int, t_run: float) -> dict:
        sps = self.run.data.batch_size * steps / dt if dt > 0 else 0.0
        row = {
            "step": self.step,
            "split": "train",
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "samples_per_s": sps,
            "mem_gb": metrics.peak_memory_gb(self.device),
        }
        reserved = metrics.reserved_memory_gb(self.device)
        if reserved is not None:
            row["mem_reserved_gb"] = reserved
        if self.flops_per_sample:
            tflops = self.flops_per_sample * sps / 1e12
            row["tflops"] = tflops
            peak = metrics.peak_tflops(self.device, self.precision.name)
            if peak:
                row["mfu"] = tflops / (peak * self.env.world_size)
        if self.precision.scaler is not None:
            row["skipped_steps"] = self.skipped_steps
        done = self.step - self._start
        row["eta_s"] = (time.perf_counter() - t_run) / done * (self.cfg.max_steps - self.step)
        return row


class FirstBatches(GlobalBatchSampler):
    """``trainer.overfit_batches=N``: the global batches of steps 0..N-1, over and over."""

    def __init__(self, *args, repeat: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.repeat = repeat

    def global_batch_indices(self, step: int) -> list[int]:
        return super().global_batch_indices(step % self.repeat)


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


registry.trainers.add("default", TrainerConfig, Trainer)
