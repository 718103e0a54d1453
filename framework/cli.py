"""Command line: check the config, set up the process, build the components, train.

Every expected failure (bad or refused config, unusable run dir, bad data) ends with one
line on stderr and an exit code (framework.errors); nothing else is printed, no traceback.

Two gates (docs/security.md):

* :func:`precheck`, before Hydra acts on anything: composes what Hydra is about to run
  (all of it, the ``hydra`` node included; under ``--multirun`` every option of a swept
  config group too), refuses what could run code (``_target_``\\s outside the allowed
  packages, Hydra callbacks, launchers, sweepers, logging classes, environment variables,
  search-path entries, trust granted anywhere but the primary config file), validates, and
  checks the run dir (usable, not locked by a live run); a run dir that records a run is rerun
  with its recorded overrides and the command line's on top (:mod:`framework.rerun`);
* :func:`main`, the job (called by Hydra, also in a submitit job whose config came from a
  file): the same checks on the job's config and Hydra node, the I/O checks, the run-dir
  lock, the run dir's override history (main rank), then :func:`framework.runtime.run_job`.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

from framework.config import resolvers
from framework.config.compose import CONF_DIR, Source, hydra_message  # noqa: F401  (CONF_DIR: tests, tools)
from framework.errors import EXIT_INTERRUPTED, ConfigError, FrameworkError, Terminated, first_line

if TYPE_CHECKING:
    from framework.runtime import JobResult

MAX_SWEEP_VARIANTS = 256  # compositions a --multirun's check makes at most: its first job, then one per group option


def fail(e: FrameworkError) -> NoReturn:
    print(f"{getattr(e, 'prefix', 'error')}: {one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(e.exit_code)


def one_line(e: Exception) -> str:
    """The error's own message, also when a DataLoader worker re-raised it with its traceback."""
    text = str(e).strip()
    if "Original Traceback" in text:  # "...\nframework.errors.DataError: <message>"
        last = [ln for ln in text.splitlines() if ln.strip()][-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text.splitlines()[0] if text else type(e).__name__


def compose(overrides: list[str], config_name: str = "config"):
    """The job config of ``conf/`` with ``overrides`` (no ``hydra`` node); errors are ConfigErrors."""
    from framework.config.compose import compose as _compose

    return _compose(overrides, Source(config_name=config_name))


# -- before Hydra ----------------------------------------------------------------------------------
_RERUN = None  # precheck's framework.rerun.Rerun, for main in the same process (the history, the log)
_PASSED: list[str] | None = None  # the command line's overrides, as precheck read them


def precheck(argv: list[str]) -> None:
    """Check what Hydra is about to run; exit 2 with one line on any error (before Hydra acts).

    A run dir that records a run (``framework.rerun``) is rerun with its recorded overrides and
    the command line's on top: when ``argv`` is this process's command line, it is rewritten so
    that ``@hydra.main``, which parses ``sys.argv`` next, runs exactly what was checked here."""
    global _RERUN, _PASSED
    from framework.config import hydra_args

    args = hydra_args.parse(argv)  # a usage error: argparse's line, exit 2 (as Hydra's own parser)
    if args.version or args.shell_completion:
        return  # nothing of the config is acted on
    rerun = None
    try:
        resolvers.restrict()
        if args.experimental_rerun is not None:
            raise ConfigError(
                "--experimental-rerun loads a pickle, which can run code, and is not supported; run "
                "again with hydra.run.dir=<run dir>: its overrides are reused"
            )
        from framework.config import security

        security.check_config_path(args.config_path)
        security.check_overrides(args.overrides)
        source = Source.from_args(args)
        passed = list(args.overrides)
        only_prints = args.help or args.hydra_help or args.info
        if not (args.multirun or only_prints):
            rerun = _plan_rerun(passed, _explicit_run_dir(passed))
        out = _check_all(args, source, rerun.overrides if rerun else passed)
        if rerun is None and out is not None and not only_prints:  # a run dir set by a config file
            rerun = _plan_rerun(passed, out)
            if rerun is not None:
                _check_all(args, source, rerun.overrides)
        if args.multirun and not only_prints:
            from framework.distributed.launcher import guard_submitit

            guard_submitit()  # submitit's failures: one line in this process
    except FrameworkError as e:
        fail(ConfigError(rerun.blame(one_line(e))) if rerun is not None and isinstance(e, ConfigError) else e)
    except Exception as e:  # noqa: BLE001  (Hydra's or OmegaConf's own errors: one line too)
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        message = hydra_message(e)
        fail(ConfigError(rerun.blame(message) if rerun is not None else message))
    finally:
        _clear_hydra_config()
    _PASSED, _RERUN = list(args.overrides), rerun
    if rerun is not None and rerun.overrides != list(args.overrides) and list(argv) == sys.argv[1:]:
        rest = list(argv)
        for o in args.overrides:
            rest.remove(o)
        # overrides first: an option with an optional value (--info) must not take one
        sys.argv[1:] = [*rerun.overrides, *rest]


def _explicit_run_dir(passed: list[str]) -> Path | None:
    from framework.rerun import explicit_run_dir

    return explicit_run_dir(passed)


def _plan_rerun(passed: list[str], run_dir: Path | None):
    from framework.rerun import plan
    from framework.rundir import launch_id

    return plan(passed, run_dir, launch_id())


def _check_all(args, source: Source, overrides: list[str]) -> Path | None:
    """Compose and check every config the launch runs; the run dir of a single run (else None)."""
    runs = not (args.help or args.hydra_help or args.info)  # these only print (their logging setup is checked)
    out = None
    for i, (cfg, passed) in enumerate(_compose_variants(source, overrides, args.multirun)):
        multirun = args.multirun or str(cfg.hydra.mode).endswith("MULTIRUN")
        trust, job = check_composed(cfg, source, passed, multirun=multirun)
        if i == 0 and not multirun:
            out = Path(cfg.hydra.runtime.output_dir)
        if not runs:
            continue
        from framework.config.validate import validate

        run = validate(job, trust)
        if run.mode == "plan" and not multirun and not args.cfg:  # the whole job: no run dir, no Hydra
            print_plan(run)
            sys.exit(0)
        if i == 0 and not args.cfg and _launch_rank() == 0:  # --cfg only prints
            _precheck_dirs(cfg, run, multirun)
    return out


def check_composed(cfg, source: Source, passed: list[str], *, multirun: bool):
    """Security checks of a composed config (``hydra`` node included); returns (trust, job config)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write

    from framework.config import security

    h = cfg.hydra
    primary = security.primary_config_file(h.runtime.config_sources, source.config_name)
    trust = security.trust_from_file(primary)
    security.check_trust_node(cfg, trust)
    _check_recorded_overrides(h, passed)

    with read_write(cfg.hydra), open_dict(cfg.hydra):  # what Hydra fills in when the job starts
        if multirun:
            cfg.hydra.job.num = 0
            cfg.hydra.job.id = "precheck"
    HydraConfig.instance().set_config(cfg)
    try:
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        out = OmegaConf.select(cfg, key)
        if multirun:
            out = os.path.join(str(out), str(OmegaConf.select(cfg, "hydra.sweep.subdir")))
    except Exception as e:  # noqa: BLE001  (an OmegaConf error naming the key)
        raise ConfigError(f"{key}: {first_line(e)}") from None
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = os.path.abspath(str(out))
    HydraConfig.instance().set_config(cfg)

    job_targets = security.target_prefixes(trust)
    security.check_hydra(
        cfg.hydra,
        trust,
        presets=security.Presets.load(CONF_DIR),
        job_targets=job_targets,
        primary_searchpath=_primary_searchpath(primary),
    )
    job = copy.deepcopy(cfg)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return trust, job


def _check_recorded_overrides(h, passed: list[str]) -> None:
    """``hydra.overrides`` must be exactly what was passed: a sweep recomposes its jobs from it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(passed)
    want_hydra = [o.input_line for o in parsed if o.is_hydra_override()]
    want_task = [o.input_line for o in parsed if not o.is_hydra_override()]
    from omegaconf import OmegaConf

    # as Hydra reads them back: unresolved; a mapping (Hydra's OverridesConf)
    recorded = cast(dict, OmegaConf.to_container(h.overrides, resolve=False))
    if recorded.get("hydra") != want_hydra or recorded.get("task") != want_task:
        raise ConfigError(
            "hydra.overrides: set by a config file; it is Hydra's record of the command line and cannot be set"
        )


def _primary_searchpath(primary: Path | None) -> list[str]:
    if primary is None:
        return []
    from omegaconf import DictConfig, OmegaConf

    raw = OmegaConf.load(str(primary))
    sp = OmegaConf.select(raw, "hydra.searchpath", default=None) if isinstance(raw, DictConfig) else None
    if sp is None:
        return []
    entries = OmegaConf.to_container(sp, resolve=False)
    assert isinstance(entries, list)  # Hydra's schema: composing this file refused any other type
    return [str(x) for x in entries]


def _compose_variants(source: Source, overrides: list[str], multirun: bool):
    """The configs a launch composes: one for a run; for a sweep its first job and, for every swept
    config group (command line or ``hydra.sweeper.params``), one per option (the others at their
    first value). Yields (config with its hydra node, the overrides passed)."""
    from framework.config.compose import compose as _compose

    def run(ov):
        return _compose(ov, source, with_hydra=True), ov

    first = _firsts(overrides, source) if multirun else overrides
    cfg, passed = run(first)
    if not (multirun or str(cfg.hydra.mode).endswith("MULTIRUN")):
        yield cfg, passed
        return
    from omegaconf import OmegaConf

    params = (  # the basic sweeper's params: a mapping
        cast(dict, OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=False))
        if cfg.hydra.sweeper.get("params")
        else {}
    )
    sweep = [f"{k}={v}" for k, v in (params or {}).items()] + list(overrides)
    if params:
        first = _firsts(sweep, source)
        cfg, passed = run(first)
    yield cfg, passed
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # Every option, however many: a job's hydra node (its logging, its environment) is set up by
    # Hydra before the job's own check runs, so an option left out here would act unchecked.
    variants: dict[tuple[str, ...], None] = {}  # in order, each once (a repeated option counts once)
    for i, o in enumerate(OverridesParser.create().parse_overrides(sweep)):
        if not o.is_sweep_override() or not _is_group(o.key_or_group, source):
            continue
        for value in _sweep_values(o, source):
            variant = list(first)
            variant[i] = f"{o.get_key_element()}={value}"
            if variant[i] != first[i]:  # else composed already
                variants[tuple(variant)] = None
    if 1 + len(variants) > MAX_SWEEP_VARIANTS:
        raise ConfigError(
            f"--multirun: checking this sweep's config group options takes {1 + len(variants)} "
            f"compositions, more than {MAX_SWEEP_VARIANTS}; split it into smaller sweeps"
        )
    for composition in variants:
        yield run(list(composition))


def _firsts(overrides: list[str], source: Source) -> list[str]:
    """Each sweep override at its first value (a --multirun's first job)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(hydra_message(e)) from None
    out = []
    for text, o in zip(overrides, parsed):
        if o.is_sweep_override():
            values = _sweep_values(o, source)
            text = f"{o.get_key_element()}={values[0]}" if values else text
        out.append(text)
    return out


def _sweep_values(o, source: Source) -> list[str]:
    from hydra.core.override_parser.types import Glob

    value = o.value()
    if isinstance(value, Glob):
        return value.filter(_group_options(o.key_or_group, source))
    return list(o.sweep_string_iterator())


def _group_dirs(group: str, source: Source) -> list[Path]:
    group = group.split("@")[0].replace(".", "/")
    return [Path(d) / group for d in (source.config_dir, source.extra_dir) if d and (Path(d) / group).is_dir()]


def _is_group(key: str, source: Source) -> bool:
    return bool(_group_dirs(key, source))


def _group_options(key: str, source: Source) -> list[str]:
    return sorted({p.stem for d in _group_dirs(key, source) for p in d.glob("*.yaml")})


def _precheck_dirs(cfg, run, multirun: bool) -> None:
    """The run dir (or sweep dir) can be written and no live run holds it: before Hydra writes there."""
    from omegaconf import OmegaConf

    from framework import rundir

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if not str(OmegaConf.select(cfg, key) or "").strip():  # Hydra would take the working directory
        raise ConfigError(f"{key}: empty (an unset variable?); name the directory the run writes to")
    if multirun:
        rundir.creatable_dir(OmegaConf.select(cfg, "hydra.sweep.dir"), "hydra.sweep.dir")
        return
    run_dir = Path(cfg.hydra.runtime.output_dir)
    rundir.preflight(run_dir, checkpoints=run.checkpoint.name != "none", resume=run.checkpoint.resume)
    rundir.refuse_if_locked(run_dir)


def _launch_rank() -> int:
    from framework.rundir import launch_rank

    return launch_rank()


def _clear_hydra_config() -> None:
    try:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None  # Hydra sets its own when the job starts
    except Exception:  # noqa: BLE001, S110  (nothing was set)
        pass


# -- the job -------------------------------------------------------------------------------------
def main(cfg) -> dict | JobResult:
    """Run one job from a composed config (called by @hydra.main, also from submitit)."""
    lock = history = None
    code, steps = 1, None  # what the history's end entry says
    try:
        resolvers.restrict()
        trust = job_gate(cfg)
        from framework.config.validate import validate

        run = validate(cfg, trust)
        if run.mode == "plan":  # a job of a --multirun (a single run printed it in precheck)
            return {"plan": print_plan(run)}
        run_dir = _run_dir()
        lock = prepare_run_dir(run, run_dir)
        if lock is not None:  # the main rank
            history = _start_history(run, run_dir)
        from framework.runtime import run_job

        result = run_job(run, run_dir=run_dir)
        code, steps = 0, result.get("steps")
        return result
    except Terminated as e:
        _abort(f"{e.prefix}: {e}", e.exit_code, history, lock)
    except FrameworkError as e:
        code = e.exit_code
        _fail_job(e)
    except KeyboardInterrupt:
        _abort("interrupted", EXIT_INTERRUPTED, history, lock)
    finally:
        if history is not None:
            history.end(code, steps)
        if lock is not None:
            lock.release()


def _abort(line: str, code: int, history, lock) -> NoReturn:
    """End at once after an abort (Ctrl-C, SIGTERM before training): the line is the message, and
    the process ends before interpreter shutdown runs what the abort cut short (zarr's event
    loop, a coroutine never awaited, a worker's pipe), whose complaints would print after it.
    The history and the lock go first."""
    if history is not None:
        history.end(code)
    if lock is not None:
        lock.release()
    logging.shutdown()
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _fail_job(e: FrameworkError) -> NoReturn:
    """:func:`fail`; in a job submitit started, the line is also handed back to the launching
    process (a job that exits leaves submitit no result, and its launcher waits on)."""
    from framework.distributed import launcher

    if launcher.in_submitit_job() and e.exit_code != launcher.EXIT_STOPPED:  # a stop is requeued
        print(f"{getattr(e, 'prefix', 'error')}: {one_line(e)}", file=sys.stderr, flush=True)
        raise launcher.job_failed(one_line(e), e.exit_code) from None
    fail(e)


def _start_history(run, run_dir: Path):
    """Log what a rerun reused and append this invocation to the run dir's history (main rank)."""
    from framework import rerun as rerun_mod
    from framework.errors import RunDirError

    log = logging.getLogger("framework")
    effective = _task_overrides()
    rerun = _RERUN if _RERUN is not None and Path(_RERUN.run_dir) == Path(os.path.abspath(run_dir)) else None
    if rerun is not None:
        for line in rerun.log_lines():
            log.info(line)
    history = rerun_mod.History(run_dir)
    resumes = rerun_mod.resume_point(run.checkpoint.resume, run_dir) if run.checkpoint.name != "none" else None
    try:
        history.start(
            passed=_PASSED if _PASSED is not None else effective,
            effective=effective,
            reused=rerun.record if rerun is not None and rerun.merge is not None else None,
            resumes_from=resumes,
        )
    except OSError as e:
        raise RunDirError(f"hydra.run.dir: cannot write {history.path}: {e.strerror or e}") from None
    return history


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [str(o) for o in HydraConfig.get().overrides.task]


def print_plan(run) -> list[str]:
    """``mode=plan``: what each rank would hold, read and compute (framework/plan.py), on stdout."""
    from framework import registry
    from framework.plan import report

    registry.load_providers()
    lines = report(run)
    if _launch_rank() == 0:
        print("\n".join(lines), flush=True)
    return lines


def job_gate(cfg):
    """The job's own security check (its config may have come from a file); returns the Trust."""
    from hydra.core.hydra_config import HydraConfig

    from framework.config import security

    if not HydraConfig.initialized():  # called outside Hydra: no Hydra node to check
        trust = security.Trust()
        security.check_trust_node(cfg, trust)
        return trust
    h = HydraConfig.get()
    primary = security.primary_config_file(h.runtime.config_sources, h.job.config_name or "config")
    trust = security.trust_from_file(primary)
    security.check_trust_node(cfg, trust)
    security.check_hydra(
        h,
        trust,
        presets=security.Presets.load(CONF_DIR),
        job_targets=security.target_prefixes(trust),
        primary_searchpath=_primary_searchpath(primary),
    )
    return trust


def prepare_run_dir(run, run_dir: Path):
    """I/O checks on every rank; the main rank takes the run-dir lock (returned; release it at exit)."""
    from framework import rundir

    rundir.preflight(run_dir, checkpoints=run.checkpoint.name != "none", resume=run.checkpoint.resume)
    if rundir.launch_rank() == 0:
        return rundir.RunLock(run_dir).acquire()
    rundir.refuse_if_locked(run_dir)
    return None


def _run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(os.getcwd())
