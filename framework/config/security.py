"""The one gate a config passes before anything it names can run: ``_target_``s and Hydra's own nodes.

Trust model (docs/security.md): the code and the user's own primary config file are
trusted; command-line overrides, other config files (``--config-dir`` groups, experiment
files, sweep parameters), checkpoints, exports and data stores are not. Nothing read from
them may run code. Everything here raises :class:`~framework.errors.ConfigError` (one line,
exit code 2) and runs before Hydra instantiates a callback, a launcher or a sweeper,
configures logging or sets an environment variable (``framework.cli.precheck``), and again
in the job (``framework.cli.main``) before any component is built.

What is checked:

* every ``_target_`` in the job config, unresolved (a plain string under an allowed prefix,
  never an interpolation) and resolved (a ``_target_`` produced by ``oc.decode`` counts
  too), and it must resolve to a class or function *defined* under an allowed prefix
  (``framework.cli.os.system`` is ``posix.system``: refused);
* Hydra's security-relevant nodes (:data:`CRITICAL`): ``hydra.callbacks`` (refused unless
  trusted), ``hydra.launcher`` (Hydra's basic launcher or hydra-submitit-launcher; shell
  and environment fields equal to the framework's presets), ``hydra.sweeper`` (Hydra's basic
  sweeper, or hydra-optuna-sweeper with data-only fields: :data:`OPTUNA_SAMPLERS`, no storage,
  no custom search space), ``hydra.job.env_set`` (refused unless trusted), ``hydra.job_logging`` /
  ``hydra.hydra_logging`` (standard ``logging`` classes and ``ext://sys.stdout|stderr``
  only), ``hydra.searchpath`` (``file://`` from the command line); interpolations in these
  nodes may only name Hydra's own run-time values (:data:`SAFE_REFS`);
* overrides before composition: ``hydra.searchpath`` entries other than ``file://`` (a
  ``pkg://`` entry imports a module while composing), ``hydra.overrides.*`` and
  ``hydra.runtime.*`` (Hydra's own bookkeeping), and ``trust`` (only the primary config file
  grants trust).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.errors import ConfigError, first_line

# Hydra's own launchers/sweeper, and the launcher plugin the cluster presets select.
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
LAUNCHER_PREFIXES = ("hydra_plugins.hydra_submitit_launcher.",)

# hydra-optuna-sweeper, allowed with the fields below only (conf/hparams_search/). Hydra builds
# the sweeper node with instantiate(), recursively: any `_target_` inside it is called.
OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
# sampler._target_ (and a CMA-ES sampler's independent_sampler): Optuna's own samplers, whose
# arguments are numbers and names
OPTUNA_SAMPLERS = frozenset(
    f"optuna.samplers.{name}"
    for name in ("TPESampler", "RandomSampler", "CmaEsSampler", "NSGAIISampler", "MOTPESampler", "GridSampler")
)
OPTUNA_SCALARS = frozenset({"study_name", "n_trials", "n_jobs", "max_failure_rate"})
# fields that name code or a store to open: only null. custom_search_space is a function the
# sweeper calls; storage is a database URL (SQLAlchemy loads dialect plugins; a redis:// store
# holds pickled trials, unpickled on load) or a node Hydra instantiates.
OPTUNA_NULL = ("storage", "custom_search_space")
OPTUNA_DISTRIBUTION = frozenset({"type", "choices", "low", "high", "log", "step"})  # search_space.<name>.*

# Hydra nodes whose content runs code or shapes a process; see the module docstring.
CRITICAL = ("callbacks", "launcher", "sweeper", "job.env_set", "job_logging", "hydra_logging", "searchpath")

# Interpolations allowed inside CRITICAL nodes: Hydra's run-time values, fixed for a job.
SAFE_REFS = frozenset(
    {
        "hydra.runtime.output_dir",
        "hydra.runtime.cwd",
        "hydra.job.name",
        "hydra.job.id",
        "hydra.job.num",
        "hydra.sweep.dir",
        "hydra.launcher.cpus_per_task",
        "hydra.launcher.tasks_per_node",
        "hydra.launcher.gpus_per_node",
        "hydra.launcher.nodes",
        "hydra.launcher.mem_gb",
        "hydra.launcher.timeout_min",
    }
)
SAFE_REF_RESOLVERS = ("now:", "launch_time:")

# hydra-submitit-launcher fields that only become quoted sbatch flags or numbers.
SAFE_LAUNCHER_FIELDS = frozenset(
    {
        "submitit_folder",
        "timeout_min",
        "cpus_per_task",
        "gpus_per_node",
        "tasks_per_node",
        "mem_gb",
        "nodes",
        "name",
        "stderr_to_stdout",
        "partition",
        "qos",
        "comment",
        "constraint",
        "exclude",
        "gres",
        "cpus_per_gpu",
        "gpus_per_task",
        "mem_per_gpu",
        "mem_per_cpu",
        "account",
        "signal_delay_s",
        "max_num_timeout",
        "array_parallelism",
    }
)
# sbatch options (additional_parameters keys) that neither run a program, change the
# environment or the working directory, nor redirect files.
SAFE_SBATCH = frozenset(
    {
        "exclusive",
        "hint",
        "time_min",
        "mail_type",
        "mail_user",
        "reservation",
        "account",
        "constraint",
        "gres",
        "gpus",
        "gpus_per_node",
        "gpus_per_task",
        "gpus_per_socket",
        "gpu_bind",
        "gpu_freq",
        "cpus_per_gpu",
        "cpus_per_task",
        "cpu_freq",
        "mem",
        "mem_per_cpu",
        "mem_per_gpu",
        "mem_bind",
        "nodelist",
        "exclude",
        "dependency",
        "begin",
        "deadline",
        "requeue",
        "no_requeue",
        "priority",
        "nice",
        "licenses",
        "switches",
        "wckey",
        "comment",
        "distribution",
        "ntasks",
        "ntasks_per_node",
        "ntasks_per_socket",
        "ntasks_per_core",
        "tmp",
        "signal",
        "core_spec",
        "thread_spec",
        "sockets_per_node",
        "cores_per_socket",
        "threads_per_core",
        "overcommit",
        "oversubscribe",
        "contiguous",
        "partition",
        "qos",
        "time",
        "mincpus",
        "job_name",
        "kill_on_invalid_dep",
        "spread_job",
        "use_min_nodes",
        "network",
        "profile",
        "acctg_freq",
        "nodes",
        "clusters",
        "cluster_constraint",
        "extra_node_info",
        "hold",
        "delay_boot",
    }
)
# srun options (srun_args, as --name or --name=value) with the same property.
SAFE_SRUN = frozenset(
    {
        "cpu_bind",
        "mem_bind",
        "distribution",
        "hint",
        "mpi",
        "gpu_bind",
        "gpus_per_task",
        "cpus_per_task",
        "cpus_per_gpu",
        "ntasks_per_node",
        "kill_on_bad_exit",
        "label",
        "overlap",
        "exact",
        "exclusive",
        "network",
        "cpu_freq",
        "gpu_freq",
        "accel_bind",
        "threads_per_core",
        "wait",
        "unbuffered",
        "overcommit",
        "gres_flags",
        "mem",
        "mem_per_cpu",
        "mem_per_gpu",
        "verbose",
        "quiet",
    }
)
# Classes logging's dictConfig may build from hydra.job_logging / hydra.hydra_logging.
LOGGING_CLASSES = frozenset(
    {
        "logging.StreamHandler",
        "logging.FileHandler",
        "logging.NullHandler",
        "logging.Formatter",
        "logging.Filter",
        "logging.handlers.RotatingFileHandler",
        "logging.handlers.TimedRotatingFileHandler",
        "logging.handlers.WatchedFileHandler",
        "logging.handlers.MemoryHandler",
        "colorlog.ColoredFormatter",
    }
)
LOGGING_EXT = frozenset({"ext://sys.stdout", "ext://sys.stderr"})

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_REF = re.compile(r"\$\{([^${}]*)\}")


# -- trust ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trust:
    """What the user's primary config file allows beyond the defaults (its top-level ``trust:``).

    Entries ending in ``.`` are prefixes, others exact dotted names (``env_set`` and
    ``launcher_fields`` are plain names).
    """

    targets: tuple[str, ...] = ()  # more _target_ prefixes for the job config
    hydra_targets: tuple[str, ...] = ()  # hydra.callbacks / hydra.launcher / hydra.sweeper targets
    launcher_fields: tuple[str, ...] = ()  # hydra.launcher fields taken as they are (setup, srun_args, ...)
    env_set: tuple[str, ...] = ()  # hydra.job.env_set keys
    logging: tuple[str, ...] = ()  # more classes / ext:// names for Hydra's logging configs
    source: str | None = None  # the file it came from

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "source")

    def as_dict(self) -> dict:
        return {k: list(getattr(self, k)) for k in self.keys()}


def trust_from_file(path: str | Path | None) -> Trust:
    """The ``trust:`` node of the primary config file, read as written (no interpolation)."""
    if path is None:
        return Trust()
    try:
        raw = OmegaConf.load(str(path))
    except (OSError, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"cannot read the primary config {path}: {first_line(e)}") from None
    if not isinstance(raw, DictConfig) or "trust" not in raw:
        return Trust(source=str(path))
    return _trust_node(OmegaConf.to_container(raw._get_node("trust"), resolve=False), str(path))


def _trust_node(node: Any, source: str) -> Trust:
    if node is None:
        return Trust(source=source)
    if not isinstance(node, dict):
        raise ConfigError(f"trust: must be a mapping of {', '.join(Trust.keys())} (in {source})")
    values = {}
    for key, value in node.items():
        if key not in Trust.keys():
            raise ConfigError(f"trust.{key}: unknown key; valid: {', '.join(Trust.keys())} (in {source})")
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"trust.{key}: must be a list of names (in {source})")
        if any("${" in v for v in value):
            raise ConfigError(f"trust.{key}: interpolations are not allowed in trust (in {source})")
        values[key] = tuple(value)
    return Trust(source=source, **values)


def check_trust_node(cfg: DictConfig, trust: Trust) -> None:
    """The composed ``trust`` node must be the primary file's, untouched by overrides or other files."""
    composed = OmegaConf.to_container(cfg._get_node("trust"), resolve=False) if "trust" in cfg else None
    got = _trust_node(composed, "the composed config") if composed is not None else Trust()
    if got.as_dict() == trust.as_dict():
        return
    where = trust.source or "the primary config file"
    raise ConfigError(
        f"trust: may only be set in the primary config file ({where}); command-line overrides, "
        "sweeps and other config files cannot grant trust"
    )


def primary_config_file(config_sources: Iterable[Any], config_name: str) -> Path | None:
    """The file Hydra loaded as the primary config: the first file source holding ``<name>.yaml``."""
    for src in config_sources:
        schema = src.get("schema") if isinstance(src, dict) else getattr(src, "schema", None)
        path = src.get("path") if isinstance(src, dict) else getattr(src, "path", None)
        if schema != "file" or not path:
            continue
        candidate = Path(path) / f"{config_name}.yaml"
        if candidate.is_file():
            return candidate.resolve()
    return None


# -- targets ---------------------------------------------------------------------------------------
def plugin_prefixes() -> tuple[str, ...]:
    """Top-level packages of the installed recipe plugins (module ``acme.plugin.registry`` -> ``acme.``)."""
    from framework import registry

    out = []
    for module in registry.plugin_modules():
        parts = module.split(".")
        top = parts[0]
        # never widen to a shared namespace (a plugin living under torch. or the standard library)
        if top in ("torch", "framework") or top in sys.stdlib_module_names:
            prefix = ".".join(parts[:-1] or parts) + "."
        else:
            prefix = top + "."
        if prefix not in out:
            out.append(prefix)
    return tuple(out)


def target_prefixes(trust: Trust | None = None) -> tuple[str, ...]:
    base = ("framework.", *plugin_prefixes(), "torch.optim.")
    extra = tuple(t for t in (trust.targets if trust else ()) if t not in base)
    return base + extra


def matches(name: str, allowed: Iterable[str]) -> bool:
    for a in allowed:
        if a.endswith("."):
            if name.startswith(a):
                return True
        elif name == a:
            return True
    return False


def _module_ok(module_name: str, allowed: Iterable[str]) -> bool:
    """A module may be walked through if it lies under an allowed prefix or is a parent of one."""
    for a in allowed:
        stem = a if a.endswith(".") else a.rsplit(".", 1)[0] + "."
        if (module_name + ".").startswith(stem) or stem.startswith(module_name + "."):
            return True
    return False


def _defined_under(obj: Any, allowed: Iterable[str], name: str) -> bool:
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return False
    for a in allowed:
        if a.endswith("."):
            if (module + ".").startswith(a):
                return True
        elif name == a and module.split(".")[0] == a.split(".")[0]:
            return True
    return False


def locate(name: str, allowed: tuple[str, ...], key: str) -> Any:
    """Find ``name`` as Hydra's ``_locate`` does, importing only modules under ``allowed``.

    The object must be a class or function defined under an allowed prefix, reached only
    through allowed modules and classes: ``framework.cli.os.system`` (``os`` imported by
    framework.cli) is refused.
    """
    parts = name.split(".")
    if any(not p.isidentifier() or (p.startswith("__") and p.endswith("__")) for p in parts):
        raise ConfigError(f"{key}: target '{name}' is not a dotted name of a class or function")
    refuse = f"{key}: target '{name}' is not allowed; it resolves outside " + ", ".join(allowed)
    if not _module_ok(parts[0], allowed):
        raise ConfigError(refuse)
    try:
        obj = importlib.import_module(parts[0])
        for i in range(1, len(parts)):
            try:
                obj = getattr(obj, parts[i])
            except AttributeError:
                if not inspect.ismodule(obj):
                    raise
                mod = ".".join(parts[: i + 1])
                if not _module_ok(mod, allowed):
                    raise ConfigError(refuse) from None
                obj = importlib.import_module(mod)
            last = i == len(parts) - 1
            if inspect.ismodule(obj):
                if not _module_ok(obj.__name__, allowed):
                    raise ConfigError(refuse)
            elif not last and not inspect.isclass(obj):
                raise ConfigError(refuse)
    except ConfigError:
        raise
    except Exception as e:  # ImportError, AttributeError, or the module's own error
        raise ConfigError(f"{key}: target '{name}' cannot be found ({first_line(e)})") from None
    if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not _defined_under(obj, allowed, name):
        raise ConfigError(refuse)
    return obj


def _refuse_target(key: str, value: Any, allowed: tuple[str, ...]) -> ConfigError:
    return ConfigError(f"{key}: target '{value}' is not allowed; targets must start with " + ", ".join(allowed))


def check_target(key: str, value: Any, allowed: tuple[str, ...], *, resolve: bool = True) -> None:
    if not isinstance(value, str) or not matches(value, allowed):
        raise _refuse_target(key, value, allowed)
    if resolve:
        locate(value, allowed, key)


def check_targets_unresolved(node: Any, allowed: tuple[str, ...] | None, path: str = "") -> None:
    """Every ``_target_`` of the composed tree, before anything is resolved or imported.

    A ``_target_`` must be a plain string: an interpolation is refused here, whatever it would
    give. ``allowed=None`` checks only that.
    """
    if isinstance(node, DictConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return
        for key in node.keys():
            sub = f"{path}.{key!s}" if path else str(key)  # !s: a key may be any DictKeyType
            child = node._get_node(key)
            if key == "_target_":
                raw = child._value() if child is not None else None
                if child is not None and child._is_interpolation():
                    raise ConfigError(
                        f"{sub}: target '{raw}' is not allowed; a _target_ must be a plain string, not an interpolation"
                    )
                if allowed is not None:
                    check_target(sub, raw, allowed, resolve=False)
                continue
            check_targets_unresolved(child, allowed, sub)
    elif isinstance(node, ListConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return
        for i in range(len(node)):
            check_targets_unresolved(node._get_node(i), allowed, f"{path}[{i}]")


def check_targets_resolved(node: Any, allowed: tuple[str, ...], path: str = "", *, skip: Iterable[str] = ()) -> None:
    """Every ``_target_`` of a resolved plain container, also those an interpolation produced."""
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            if sub in skip:
                continue
            if key == "_target_":
                check_target(sub, value, allowed)
            else:
                check_targets_resolved(value, allowed, sub, skip=skip)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_targets_resolved(value, allowed, f"{path}[{i}]", skip=skip)


# -- overrides, before composition -------------------------------------------------------------
def check_overrides(overrides: list[str]) -> None:
    """Refuse, before Hydra composes anything, the overrides that act during composition."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # composition reports the syntax error in one line
    for o in parsed:
        key = o.get_key_element().lstrip("~+")
        key = key.split("@")[0]
        if o.is_sweep_override() and o.is_hydra_override():
            raise ConfigError(f"{o.input_line}: sweeping over Hydra's configuration is not supported")
        if key == "trust" or key.startswith("trust."):
            raise ConfigError(
                f"{o.input_line}: trust can only be granted in the primary config file, not on the command line"
            )
        if key.startswith(("hydra.overrides", "hydra.runtime")) or key in ("hydra.job.config_name",):
            raise ConfigError(f"{o.input_line}: {key} is Hydra's own bookkeeping and cannot be overridden")
        if key == "hydra.searchpath" or key.startswith("hydra.searchpath."):
            value = o.value() if not o.is_delete() else []
            entries = value if isinstance(value, list) else [value]
            for entry in entries:
                if not isinstance(entry, str) or not entry.startswith("file://"):
                    raise ConfigError(
                        f"hydra.searchpath: '{entry}' is not allowed on the command line: only "
                        "file:// directories (a pkg:// entry imports a Python module while composing)"
                    )


def check_config_path(config_path: str | None) -> None:
    if config_path and config_path.startswith("pkg://"):
        raise ConfigError(
            f"--config-path: '{config_path}' is not allowed: use a directory (a pkg:// path imports a Python module)"
        )


# -- the Hydra node ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Presets:
    """What the framework's own configs (``conf/config.yaml``, ``conf/cluster/*.yaml``) put in
    ``hydra.launcher``, ``hydra.job.env_set`` and ``hydra.callbacks``, read as written: a value
    equal to one of them is the framework's own and allowed."""

    launcher: dict  # field -> allowed raw values
    env_set: dict  # key -> allowed raw values
    callbacks: dict  # name -> allowed raw values

    @classmethod
    def load(cls, conf_dir: str | Path) -> Presets:
        found: dict[str, dict[str, list]] = {"launcher": {}, "job.env_set": {}, "callbacks": {}}
        for path in [Path(conf_dir, "config.yaml"), *sorted(Path(conf_dir, "cluster").glob("*.yaml"))]:
            try:
                raw = OmegaConf.load(str(path))
            except (OSError, OmegaConfBaseException, ValueError):  # a broken preset fails where it is used
                continue
            for sub, allowed in found.items():
                node = OmegaConf.select(raw, f"hydra.{sub}") if isinstance(raw, DictConfig) else None
                if isinstance(node, DictConfig):
                    for k, v in cast(dict, OmegaConf.to_container(node, resolve=False)).items():
                        allowed.setdefault(str(k), []).append(v)
        return cls(found["launcher"], found["job.env_set"], found["callbacks"])


def check_hydra(
    h: DictConfig,
    trust: Trust,
    *,
    presets: Presets,
    job_targets: tuple[str, ...],
    primary_searchpath: Iterable[str] = (),
) -> None:
    """Check Hydra's node (``cfg.hydra`` or ``HydraConfig.get()``) before Hydra acts on it."""
    check_targets_unresolved(h, None, "hydra")  # no interpolated _target_ anywhere
    for sub in CRITICAL:
        node = _raw_node(h, sub)
        if node is not None:
            _check_refs(node, f"hydra.{sub}", trust)
    resolved = {sub: _resolve(h, sub) for sub in CRITICAL}

    _check_callbacks(resolved["callbacks"], h, trust, presets, job_targets)
    _check_launcher(resolved["launcher"], h, trust, presets, job_targets)
    _check_sweeper(resolved["sweeper"], trust)
    _check_env_set(resolved["job.env_set"], h, trust, presets)
    for sub in ("job_logging", "hydra_logging"):
        _check_logging(resolved[sub], f"hydra.{sub}", trust)
    for entry in resolved["searchpath"] or []:
        if not (isinstance(entry, str) and entry.startswith("file://")) and entry not in primary_searchpath:
            raise ConfigError(
                f"hydra.searchpath: '{entry}' is not allowed; only file:// directories, or what the "
                "primary config file lists"
            )
    _check_output_subdir(h)
    # any other _target_ under hydra.* is held to the job's prefixes
    rest = _resolve_all_but(h, ("callbacks", "launcher", "sweeper"))
    check_targets_resolved(rest, job_targets, "hydra")


def _check_output_subdir(h: DictConfig) -> None:
    """Hydra writes config.yaml, hydra.yaml and overrides.yaml into the run dir joined with
    ``hydra.output_subdir``: an absolute path or ``..`` would overwrite those names anywhere (the
    user's own ``conf/config.yaml`` among them)."""
    sub = _resolve(h, "output_subdir")
    if sub is None:
        return
    parts = PurePosixPath(str(sub)).parts
    if parts[:1] == ("/",) or ".." in parts or _CONTROL.search(str(sub)):
        raise ConfigError(
            f"hydra.output_subdir: {str(sub)!r} is not allowed: Hydra writes config.yaml, hydra.yaml and "
            "overrides.yaml there, so it must be a folder inside the run directory (a relative path without '..')"
        )


def _raw_node(h: DictConfig, dotted: str) -> Any:
    node: Any = h
    for part in dotted.split("."):
        if (
            not isinstance(node, DictConfig)
            or node._is_none()
            or node._is_missing()
            or node._is_interpolation()
            or part not in node
        ):
            return node if node is not h and isinstance(node, DictConfig) and node._is_interpolation() else None
        node = node._get_node(part)
    return node


def _exempt(path: str, trust: Trust) -> bool:
    parts = re.split(r"[.\[]", path)
    if parts[:2] == ["hydra", "launcher"] and len(parts) > 2 and parts[2] in trust.launcher_fields:
        return True
    return parts[:3] == ["hydra", "job", "env_set"] and len(parts) > 3 and parts[3] in trust.env_set


def _check_refs(node: Any, path: str, trust: Trust) -> None:
    """Interpolations in a critical node may only name Hydra's run-time values (SAFE_REFS)."""
    if _exempt(path, trust):
        return
    if isinstance(node, (DictConfig, ListConfig)) and not node._is_interpolation():
        if node._is_none() or node._is_missing():
            return
        if isinstance(node, DictConfig):
            for k in node.keys():
                _check_refs(node._get_node(k), f"{path}.{k!s}", trust)
        else:
            for i in range(len(node)):
                _check_refs(node._get_node(i), f"{path}[{i}]", trust)
        return
    raw = node._value() if hasattr(node, "_value") else node
    if not isinstance(raw, str) or "${" not in raw:
        return
    if path.rsplit(".", 1)[-1] in ("class", "()", "_target_"):
        raise ConfigError(f"{path}: '{raw}' must be a plain string here, not an interpolation")
    rest = raw
    while True:
        found = _REF.search(rest)
        if not found:
            break
        inner = found.group(1).strip()
        ok = (
            inner in SAFE_REFS
            or (inner.startswith("hydra:") and "hydra." + inner[6:] in SAFE_REFS)
            or (inner.startswith(SAFE_REF_RESOLVERS) and "${" not in inner)
        )
        if not ok:
            raise ConfigError(
                f"{path}: interpolation '${{{inner}}}' is not allowed in {'.'.join(path.split('.')[:2])} "
                "(only Hydra's run-time values such as ${hydra.runtime.output_dir}); write the value"
            )
        rest = rest[: found.start()] + "x" + rest[found.end() :]
    if "${" in rest:
        raise ConfigError(f"{path}: '{raw}' is not an interpolation allowed here")


def _resolve(h: DictConfig, sub: str) -> Any:
    try:
        node = OmegaConf.select(h, sub, throw_on_missing=True)
        if isinstance(node, (DictConfig, ListConfig)):
            return OmegaConf.to_container(node, resolve=True)
        return node
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or f"hydra.{sub}"
        raise ConfigError(f"{key}: {first_line(e)}") from None


def _resolve_all_but(h: DictConfig, skip: tuple[str, ...]) -> dict:
    out = {}
    for key in h.keys():
        if key in skip or key in ("help", "hydra_help", "overrides", "runtime"):
            continue
        node = h._get_node(key)
        assert node is not None  # key is one of h's keys
        try:
            out[key] = (
                OmegaConf.to_container(node, resolve=True)
                if isinstance(node, (DictConfig, ListConfig))
                else node._value()
            )
        except OmegaConfBaseException:
            out[key] = (
                OmegaConf.to_container(node, resolve=False)
                if isinstance(node, (DictConfig, ListConfig))
                else node._value()
            )
    return out


def _check_callbacks(
    callbacks: Any, h: DictConfig, trust: Trust, presets: Presets, job_targets: tuple[str, ...]
) -> None:
    if not callbacks:
        return
    if not isinstance(callbacks, dict):
        raise ConfigError("hydra.callbacks: must be a mapping of callbacks")
    raw = cast(dict, OmegaConf.to_container(h.callbacks, resolve=False))  # h.callbacks resolved to a dict: a DictConfig
    for name, cb in callbacks.items():
        if raw.get(name) in presets.callbacks.get(str(name), []):
            continue  # the framework's own
        target = cb.get("_target_") if isinstance(cb, dict) else None
        if target is None or not matches(str(target), trust.hydra_targets):
            raise ConfigError(
                f"hydra.callbacks.{name}: Hydra callbacks run code and are not allowed (target "
                f"'{target}'); list the callback class in trust.hydra_targets of your primary config"
            )
        locate(target, trust.hydra_targets, f"hydra.callbacks.{name}._target_")
        for k, v in cb.items():
            if k != "_target_":
                check_targets_resolved(v, job_targets + trust.hydra_targets, f"hydra.callbacks.{name}.{k}")


def _scalar_ok(key: str, value: Any) -> None:
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{key}: must be a single value")
    if isinstance(value, str) and _CONTROL.search(value):
        raise ConfigError(f"{key}: control characters (newlines) are not allowed: {value!r}")


def _check_launcher(launcher: Any, h: DictConfig, trust: Trust, presets: Presets, job_targets: tuple[str, ...]) -> None:
    if not launcher:
        return
    target = launcher.get("_target_")
    key = "hydra.launcher._target_"
    if target == BASIC_LAUNCHER:
        pass
    elif isinstance(target, str) and matches(target, LAUNCHER_PREFIXES):
        locate(target, LAUNCHER_PREFIXES, key)
    elif isinstance(target, str) and matches(target, trust.hydra_targets):
        locate(target, trust.hydra_targets, key)
    else:
        raise ConfigError(
            f"{key}: launcher '{target}' is not allowed; only Hydra's basic launcher, "
            "hydra_plugins.hydra_submitit_launcher.* or one listed in trust.hydra_targets"
        )
    raw = cast(dict, OmegaConf.to_container(h.launcher, resolve=False))  # resolved to a mapping: a DictConfig
    for field, value in launcher.items():
        path = f"hydra.launcher.{field}"
        if field == "_target_" or field in trust.launcher_fields:
            continue
        if field in SAFE_LAUNCHER_FIELDS:
            _scalar_ok(path, value)
        elif field == "additional_parameters" and isinstance(value, dict):
            preset_pairs = [
                (k, v) for d in presets.launcher.get(field, []) if isinstance(d, dict) for k, v in d.items()
            ]
            raw_params = raw.get(field)
            if not isinstance(raw_params, dict):
                raw_params = {}
            for k, v in value.items():
                name = str(k).replace("-", "_")
                if (k, raw_params.get(k)) not in preset_pairs and name not in SAFE_SBATCH:
                    raise ConfigError(
                        f"{path}.{k}: sbatch option --{name.replace('_', '-')} is not allowed from a "
                        "config or the command line (it can run a program, change the environment "
                        "or files); put it in a conf/cluster preset or list additional_parameters in "
                        "trust.launcher_fields"
                    )
                _scalar_ok(f"{path}.{k}", v)
        elif field == "srun_args" and (value is None or isinstance(value, list)):
            preset_args = [a for lst in presets.launcher.get(field, []) if isinstance(lst, list) for a in lst]
            raw_args = raw.get(field)
            if not isinstance(raw_args, list):
                raw_args = []
            for i, arg in enumerate(value or []):
                _scalar_ok(f"{path}[{i}]", arg)
                option = str(arg)[2:].split("=", 1)[0].replace("-", "_") if str(arg).startswith("--") else None
                if (raw_args[i] if i < len(raw_args) else arg) not in preset_args and option not in SAFE_SRUN:
                    raise ConfigError(
                        f"{path}[{i}]: srun option '{arg}' is not allowed (only options such as "
                        "--cpu-bind=...; one that runs a program or sets the environment needs "
                        "srun_args in trust.launcher_fields)"
                    )
        else:
            allowed = [None, [], {}, *presets.launcher.get(field, [])]
            if raw.get(field) not in allowed:
                raise ConfigError(
                    f"{path}: may only take the value of a framework cluster preset (conf/cluster) "
                    f"unless '{field}' is listed in trust.launcher_fields of your primary config "
                    f"(it runs as shell code or sets how the job starts)"
                )
    check_targets_resolved({k: v for k, v in launcher.items() if k != "_target_"}, job_targets, "hydra.launcher")


def _check_sweeper(sweeper: Any, trust: Trust) -> None:
    target = sweeper.get("_target_") if isinstance(sweeper, dict) else None
    if target is None or target == BASIC_SWEEPER:
        return
    if target == OPTUNA_SWEEPER:  # its fields are checked even where trust lists it
        _check_optuna(sweeper)
        return
    if not matches(target, trust.hydra_targets):
        raise ConfigError(
            f"hydra.sweeper._target_: sweeper '{target}' is not allowed; only Hydra's basic "
            f"sweeper ({BASIC_SWEEPER}), the Optuna sweeper ({OPTUNA_SWEEPER}) or one listed in "
            "trust.hydra_targets of the primary config"
        )
    locate(target, trust.hydra_targets, "hydra.sweeper._target_")


def _check_optuna(sweeper: dict) -> None:
    """hydra-optuna-sweeper's node: its known fields, with values that are data (see OPTUNA_*)."""
    for field, value in sweeper.items():
        path = f"hydra.sweeper.{field}"
        if field == "_target_":
            continue
        if field == "sampler":
            _check_optuna_sampler(value, path)
        elif field == "direction":
            names = [getattr(v, "name", v) for v in (value if isinstance(value, list) else [value])]
            if not names or any(n not in ("minimize", "maximize") for n in names):
                raise ConfigError(f"{path}: must be minimize or maximize, or a list of them (got {value!r})")
        elif field in OPTUNA_NULL:
            if value is not None:
                what = "names a function the sweeper calls" if field == "custom_search_space" else "opens a store"
                raise ConfigError(
                    f"{path}: must be null: it {what}, which can run code (the framework keeps the study "
                    "in memory; docs/security.md)"
                )
        elif field in OPTUNA_SCALARS:
            _scalar_ok(path, value)
        elif field == "params":
            for key, v in _mapping(value, path).items():
                _not_hydra(f"{path}.{key}", str(key))
                _scalar_ok(f"{path}.{key}", v)
        elif field == "search_space":  # deprecated by the plugin; {name: {type, low, high, ...}}
            for key, dist in _mapping(value, path).items():
                _not_hydra(f"{path}.{key}", str(key))
                for k, v in _mapping(dist, f"{path}.{key}").items():
                    if k not in OPTUNA_DISTRIBUTION:
                        raise ConfigError(
                            f"{path}.{key}.{k}: unknown field (valid: {', '.join(sorted(OPTUNA_DISTRIBUTION))})"
                        )
                    for i, item in enumerate(v if k == "choices" and isinstance(v, list) else [v]):
                        _scalar_ok(f"{path}.{key}.{k}" + (f"[{i}]" if k == "choices" else ""), item)
        else:
            raise ConfigError(f"{path}: not a field the framework allows in the Optuna sweeper")


def _check_optuna_sampler(sampler: Any, path: str) -> None:
    if not isinstance(sampler, dict) or sampler.get("_target_") not in OPTUNA_SAMPLERS:
        target = sampler.get("_target_") if isinstance(sampler, dict) else sampler
        raise ConfigError(
            f"{path}._target_: sampler '{target}' is not allowed; only " + ", ".join(sorted(OPTUNA_SAMPLERS))
        )
    for k, v in sampler.items():
        sub = f"{path}.{k}"
        if k == "_target_":
            continue
        if k == "independent_sampler" and v is not None:
            _check_optuna_sampler(v, sub)
        elif k == "x0" and v is not None:  # CMA-ES's start point: {param: value}
            for name, x in _mapping(v, sub).items():
                if str(name).startswith("_"):
                    raise ConfigError(f"{sub}.{name}: not a parameter name")
                _scalar_ok(f"{sub}.{name}", x)
        elif k.startswith("_") and k != "_partial_":
            raise ConfigError(f"{sub}: not allowed in a sampler")
        else:  # numbers, flags and names; an object (a callable, trials) would come as a node to build
            _scalar_ok(sub, v)


def _mapping(value: Any, path: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must be a mapping")
    if "_target_" in value:
        raise ConfigError(f"{path}._target_: not allowed here (Hydra would build it when it builds the sweeper)")
    return value


def _not_hydra(path: str, key: str) -> None:
    """Swept keys are the job's: a hydra key would set up the job (its logging, its environment)
    before the job's own check runs."""
    if key.lstrip("+~").split("/")[0].split(".")[0] == "hydra":
        raise ConfigError(f"{path}: sweeping Hydra's configuration is not allowed")


def _check_env_set(env_set: Any, h: DictConfig, trust: Trust, presets: Presets) -> None:
    if not env_set:
        return
    copied = set(OmegaConf.select(h, "job.env_copy", default=[]) or [])
    raw = cast(dict, OmegaConf.to_container(h.job.env_set, resolve=False))  # a mapping (Hydra's schema): a DictConfig
    for k in env_set:
        if k in trust.env_set or k in copied or raw.get(k) in presets.env_set.get(str(k), []):
            continue
        raise ConfigError(
            f"hydra.job.env_set.{k}: setting environment variables from a config or the command line is "
            f"not allowed ({k} could make the job run another program); list {k} in trust.env_set of "
            "your primary config"
        )


def _check_log_file(handler: dict, path: str, trust: Trust) -> None:
    """A file handler's file, from a config: a ``.log`` file, appended to. Its path and its
    formatter's text are the config's to choose, so any other name (``site-packages/x.pth``,
    ``~/.bashrc``) would be a file the config writes for something else to run, and ``mode: w``
    would wipe another run's log."""
    cls = handler.get("class", handler.get("()"))
    if isinstance(cls, str) and matches(cls, trust.logging):
        return  # a trusted class takes its arguments as given
    name = handler["filename"]
    if not isinstance(name, str) or _CONTROL.search(name) or not name.endswith(".log"):
        raise ConfigError(
            f"{path}.filename: {name!r} is not allowed: a logging handler from a config may only write "
            "a file ending in .log (list the handler class in trust.logging of your primary config "
            "to write another)"
        )
    if handler.get("mode", "a") != "a":
        raise ConfigError(f"{path}.mode: {handler['mode']!r} is not allowed: a log file is only appended to ('a')")


def _check_logging(node: Any, path: str, trust: Trust) -> None:
    if isinstance(node, dict):
        if "." in node:
            raise ConfigError(
                f"{path}.'.': setting a logging object's attributes is not allowed (its file, its stream); "
                "give them as the class's arguments"
            )
        if "filename" in node:  # a file handler (whatever its class: another file may set it)
            _check_log_file(node, path, trust)
        for k, v in node.items():
            sub = f"{path}.{k}"
            if k in ("class", "()"):
                if not isinstance(v, str) or not (v in LOGGING_CLASSES or matches(v, trust.logging)):
                    raise ConfigError(
                        f"{sub}: logging class '{v}' is not allowed (only the standard logging "
                        "handlers and formatters, or one listed in trust.logging of your primary config)"
                    )
            else:
                _check_logging(v, sub, trust)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_logging(v, f"{path}[{i}]", trust)
    elif isinstance(node, str) and node.strip().startswith("ext://"):
        value = node.strip()
        if value not in LOGGING_EXT and not matches(value[len("ext://") :], trust.logging):
            raise ConfigError(
                f"{path}: '{value}' is not allowed (ext:// imports a module; only ext://sys.stdout "
                "and ext://sys.stderr)"
            )
