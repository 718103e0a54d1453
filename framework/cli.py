"""Command line: validate the config, set up the process, build the components, train.

Every expected failure (bad config, bad data) ends with one line on stderr and an exit
code (2 for config, 3 for data); nothing else is printed, no traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from framework.config import resolvers  # noqa: F401  (registers ${launch_time:})
from framework.errors import ConfigError, FrameworkError

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def fail(e: FrameworkError) -> None:
    print(f"{getattr(e, 'prefix', 'error')}: {one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(e.exit_code)


def one_line(e: Exception) -> str:
    """The error's own message, also when a DataLoader worker re-raised it with its traceback."""
    text = str(e).strip()
    if "Original Traceback" in text:  # "...\nframework.errors.DataError: <message>"
        last = [ln for ln in text.splitlines() if ln.strip()][-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text.splitlines()[0] if text else type(e).__name__


# -- before Hydra: compose once ourselves so composition errors also get one line + exit 2 ---
_SKIP_FLAGS = ("--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc",
               "--config-dir", "-cd", "--config-path", "-cp", "--experimental-rerun")


def precheck(argv: list[str]) -> None:
    """Compose and validate the job Hydra is about to run; exit 2 with one line on any error."""
    if any(a.split("=")[0] in _SKIP_FLAGS for a in argv):
        return
    from hydra._internal.utils import get_args_parser  # Hydra's own parser: same flags, same meaning

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        raise  # argparse already printed its one-line usage error (exit 2)
    overrides = [o for o in args.overrides if not o.lstrip("~+").startswith("hydra")]
    try:
        overrides = _first_of_sweeps(overrides) if args.multirun else overrides
        cfg = compose(overrides, config_name=args.config_name or "config")
        from framework.config.validate import validate

        validate(cfg)
    except FrameworkError as e:
        fail(e)


def _first_of_sweeps(overrides: list[str]) -> list[str]:
    """A multirun validates its first combination here; each job validates itself too."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for text, o in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if o.is_sweep_override():
            value = next(iter(o.sweep_string_iterator()))
            text = f"{o.get_key_element()}={value}"
        out.append(text)
    return out


def compose(overrides: list[str], config_name: str = "config"):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="framework"):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_hydra_message(e)) from None


def _hydra_message(e: Exception) -> str:
    lines = [ln.rstrip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0]
    if text.startswith("Could not override") and "+" in str(e):
        text += " (unknown key; prefix with + to add a new one)"
    if "Available options" in str(e):  # list the choices, not Hydra's search path
        i = next(i for i, ln in enumerate(lines) if ln.startswith("Available options"))
        opts = [ln.strip() for ln in lines[i + 1:] if ln.startswith("\t") and "provider=" not in ln]
        text += "; available: " + ", ".join(opts)
    elif len(lines) > 1 and lines[0].startswith(("Ambiguous", "no viable", "mismatched", "extraneous")):
        text = f"bad override syntax: {text}"
    return text


# -- the job -------------------------------------------------------------------------------
def main(cfg) -> dict:
    """Run one job from a composed config (called by @hydra.main, also from submitit)."""
    try:
        from framework.config.validate import validate

        run = validate(cfg)
        from framework.runtime import run_job

        return run_job(run, run_dir=_run_dir())
    except FrameworkError as e:
        fail(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(os.getcwd())
