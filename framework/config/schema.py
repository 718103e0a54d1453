"""Dataclass schemas of the engine's config nodes, stored in Hydra's ConfigStore.

Range checks live in ``__post_init__`` and raise :class:`Invalid` naming the key; the
validator prefixes the group and turns it into one readable line (exit code 2).
Recipe-specific schemas (models, datasets, tasks) live beside their recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from framework.config.resume import MAY


class Invalid(ValueError):
    def __init__(self, key: str, msg: str):
        super().__init__(f"{key}: {msg}")
        self.key, self.msg = key, msg


def path_field(default: Any = None, *, tokens: tuple[str, ...] = ()) -> Any:
    """A field holding a file system path: validation makes a relative one absolute (against the
    working directory the run starts in), so what the run saves (checkpoints, exports, the
    config a later stage or inference reads) still names it from anywhere. ``tokens``: values
    that are words, not paths (``checkpoint.resume=latest``)."""
    return field(default=default, metadata={"path": True, "tokens": tokens})


def positive(obj, *keys):
    for k in keys:
        v = getattr(obj, k)
        if v is None or v <= 0:
            raise Invalid(k, f"must be > 0 (got {v})")


def non_negative(obj, *keys):
    for k in keys:
        v = getattr(obj, k)
        if v is None or v < 0:
            raise Invalid(k, f"must be >= 0 (got {v})")


def one_of(obj, key, choices):
    v = getattr(obj, key)
    if v not in choices:
        raise Invalid(key, f"must be one of {', '.join(map(str, choices))} (got {v!r})")


@dataclass
class TrainerConfig:
    name: str = "default"
    max_steps: int = 100
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    log_every: int = 10
    val_every: int = 100  # 0: validate only at the end
    val_batches: int = 4  # validation batches per evaluation; 0: the whole split
    progress: bool = True
    figures: bool = True  # the task's validation figures (fields, spectra) at each validation
    compile: bool | None = False  # null: auto, compiled on CUDA and eager on CPU (the GPU presets)
    # processes per rank that compile the blocks before the first step (framework/train/precompile.py);
    # null: one per 2 CPU cores of the rank, at most 8 (none below 4 cores); 0: off (the first
    # step compiles them one by one)
    compile_workers: int | None = None
    # the share of the compiled blocks' activations AOTAutograd may keep for backward (its
    # activation_memory_budget); below 1 it recomputes cheap pointwise work in backward instead
    compile_memory_budget: float = 1.0
    # the compiled blocks replayed as CUDA graphs (inductor's cudagraph trees): one launch per
    # graph instead of one per kernel; null: on for CUDA under sharding none; true: also under
    # ddp; true under FSDP2, a domain split or activation checkpointing is a config error
    compile_cudagraphs: bool | None = False
    stop_before_end_min: float = 0.0  # SLURM: checkpoint and stop this long before the time limit
    # Debugging (conf/debug/): > 0 trains on the first N global batches over and over, so a
    # model that cannot drive its loss down on them has a bug; 0: off.
    overfit_batches: int = 0
    detect_anomaly: bool = False  # torch.autograd anomaly detection: names the forward op of a NaN gradient (slow)
    # > 0: a torch.profiler trace of this many steps, after one skipped step (the first: FLOP
    # counting, compilation) and one warm-up, written under <run dir>/profile/; 0: off.
    profile_steps: int = 0

    def __post_init__(self):
        positive(self, "max_steps", "grad_accum", "log_every")
        non_negative(
            self, "grad_clip", "val_every", "val_batches", "stop_before_end_min", "overfit_batches", "profile_steps"
        )
        if self.compile_workers is not None:
            non_negative(self, "compile_workers")
        if not 0.0 < self.compile_memory_budget <= 1.0:
            raise Invalid("compile_memory_budget", f"must be in (0, 1], got {self.compile_memory_budget}")
        if self.profile_steps and self.max_steps < self.profile_steps + 2:
            raise Invalid(
                "profile_steps",
                f"{self.profile_steps} traced steps need trainer.max_steps >= {self.profile_steps + 2} "
                f"(one step skipped, one warm-up; got max_steps={self.max_steps})",
            )


@dataclass
class ParallelConfig:
    """Mesh degrees; ``dp_shard=-1`` takes the ranks the other axes leave."""

    name: str = "none"
    dp_replicate: int = 1
    dp_shard: int = -1
    domain: int = 1
    timeout_s: float = 600.0  # collective timeout: a dead rank cannot hang the rest

    def __post_init__(self):
        positive(self, "dp_replicate", "timeout_s")
        for key in ("dp_shard", "domain"):
            v = getattr(self, key)
            if v == 0 or v < -1:
                raise Invalid(key, f"must be > 0 or -1 for 'the remaining ranks' (got {v})")
        if self.dp_shard == -1 and self.domain == -1:
            raise Invalid("domain", "only one of dp_shard and domain may be -1")


@dataclass
class ShardingConfig:
    name: str = "none"
    reshard_after_forward: str = "default"  # default | always | never
    cpu_offload: bool = False
    forward_prefetch: bool = False
    units: list[str] = field(default_factory=list)  # FSDP unit classes; []: repeated blocks

    def __post_init__(self):
        one_of(self, "reshard_after_forward", ("default", "always", "never"))


@dataclass
class SplitterConfig:
    name: str = "off"


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    init_scale: float = 65536.0  # GradScaler, fp16 only

    def __post_init__(self):
        positive(self, "init_scale")


@dataclass
class CheckpointConfig:
    name: str = "torch_save"
    every: int = 100  # steps between checkpoints; 0: only at the end
    keep: int = 3  # newest complete checkpoints kept
    resume: str = path_field("latest", tokens=("latest", "none"))  # latest | none | <path to a checkpoint>
    exclude: list[str] = field(default_factory=list)  # parts not loaded, e.g. [optimizer]
    save_final: bool = True
    io_threads: int = 1  # dcp / dcp_async: writer threads per rank
    # A fresh run starts from these weights (fine-tuning): a run, checkpoints or step directory,
    # an exported weights file, or what the task reads besides (Task.init_weights). Not applied
    # when the run resumes: the checkpoint wins.
    init_from: str | None = path_field()

    def __post_init__(self):
        non_negative(self, "every")
        positive(self, "keep", "io_threads")
        if self.init_from is not None and not str(self.init_from).strip():
            raise Invalid("init_from", "is empty (null: start from the model's initialisation)")
        parts = ("model", "optimizer", "schedule", "scaler", "rng", "data")
        bad = [p for p in self.exclude if p not in parts]
        if bad:
            raise Invalid("exclude", f"unknown part(s) {bad}; valid: {', '.join(parts)}")


@dataclass
class LoggerConfig:
    name: str = "console"
    project: str = "framework"
    entity: str | None = None
    mode: str = "offline"  # wandb: offline | online | disabled
    group: str | None = None
    images: bool = True


@dataclass
class OptimConfig:
    """A torch.optim optimizer built from ``_target_`` (only torch.optim.* is allowed)."""

    _target_: str = "torch.optim.Adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: bool | None = None

    def __post_init__(self):
        non_negative(self, "lr", "weight_decay")
        positive(self, "eps")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise Invalid("betas", f"must be two numbers in [0, 1) (got {list(self.betas)})")


@dataclass
class ScheduleConfig:
    name: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of optim.lr

    def __post_init__(self):
        non_negative(self, "warmup_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise Invalid("min_lr_ratio", f"must be in [0, 1] (got {self.min_lr_ratio})")


@dataclass
class ClusterConfig:
    name: str = "local"


@dataclass
class PlanConfig:
    """The machine ``mode=plan`` plans for, and the budget ``parallel=auto`` fits in (docs/plan.md)."""

    world_size: int | None = None  # null: the ranks at hand (torchrun, SLURM; else 1)
    gpus_per_node: int | None = None  # null: the launcher's local world size, else the GPUs here, else all
    gpu_memory_gib: float | None = None  # null: the GPU's own memory; on CPU, no limit
    headroom: float = 0.1  # share of the memory left free (CUDA context, allocator fragmentation)

    def __post_init__(self):
        for key in ("world_size", "gpus_per_node", "gpu_memory_gib"):
            if getattr(self, key) is not None:
                positive(self, key)
        if not 0 <= self.headroom < 1:
            raise Invalid("headroom", f"must be in [0, 1) (got {self.headroom})")


@dataclass
class PathsConfig:
    """Where a site keeps its data and writes its runs (``paths=<site>``): ``data.root`` of the
    synthetic presets and ``hydra.run.dir`` / ``hydra.sweep.dir`` interpolate these."""

    data_dir: str = path_field("data")  # data stores (the synthetic ones are written here)
    output_dir: str = path_field("outputs")  # run dirs of single runs: <output_dir>/<recipe>/<date>/<time>
    multirun_dir: str = path_field("multirun")  # sweeps: <multirun_dir>/<recipe>/<date>/<time>/<job>

    RESUME_RULES = (("*", MAY, None),)  # where things are kept, not what the run learns

    def __post_init__(self):
        for key in ("data_dir", "output_dir", "multirun_dir"):
            if not str(getattr(self, key)).strip():
                raise Invalid(key, "is empty")


OBJECTIVE_TRAIN = "train/loss"  # the final train loss; every other objective names a key of the last val row


@dataclass
class TopConfig:
    """Top-level keys outside any group."""

    recipe: str = MISSING
    seed: int = 0
    deterministic: bool = False
    device: str = "auto"  # auto | cpu | cuda
    mode: str = "train"  # train | plan: print the plan (framework/plan.py) instead of training
    tags: list[str] = field(default_factory=list)  # saved with the config, sent to wandb as the run's tags
    # What the job returns to a Hydra sweeper (Optuna, Ax, Nevergrad): val/<key> of the last
    # validation row (val/loss, val/rmse, val/rmse/t2m, ...) or train/loss.
    objective: str = "val/loss"

    RESUME_RULES = (("tags", MAY, None), ("objective", MAY, None))  # labels, not what the run learns

    def __post_init__(self):
        one_of(self, "device", ("auto", "cpu", "cuda"))
        one_of(self, "mode", ("train", "plan"))
        for i, tag in enumerate(self.tags):
            # wandb refuses tags longer than 64 characters
            if not isinstance(tag, str) or not tag.strip() or len(tag) > 64 or not tag.isprintable():
                raise Invalid(f"tags[{i}]", f"must be a printable name of 1 to 64 characters (got {tag!r})")
        if len(set(self.tags)) != len(self.tags):
            raise Invalid("tags", f"has duplicates: {list(self.tags)}")
        if self.objective != OBJECTIVE_TRAIN and not (self.objective.startswith("val/") and len(self.objective) > 4):
            raise Invalid(
                "objective",
                f"must be val/<key of the validation row> (val/loss, ...) or {OBJECTIVE_TRAIN} "
                f"(got {self.objective!r})",
            )


def _store():
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, node in {
        "trainer": TrainerConfig,
        "parallel": ParallelConfig,
        "sharding": ShardingConfig,
        "splitter": SplitterConfig,
        "precision": PrecisionConfig,
        "checkpoint": CheckpointConfig,
        "logger": LoggerConfig,
        "optim": OptimConfig,
        "schedule": ScheduleConfig,
        "cluster": ClusterConfig,
        "plan": PlanConfig,
        "paths": PathsConfig,
    }.items():
        cs.store(group=f"schema/{group}", name="base", node=node)


_store()

# Fixed-schema groups: the schema does not depend on the option's name.
FIXED: dict[str, Any] = {
    "trainer": TrainerConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "cluster": ClusterConfig,
    "plan": PlanConfig,
    "paths": PathsConfig,
}
