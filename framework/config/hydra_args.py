"""Hydra's command line, parsed the way ``@hydra.main`` parses it, without Hydra's private modules.

``hydra._internal.utils.get_args_parser`` is not public API; this is the same set of flags
(Hydra 1.3), with the same destinations, so :func:`framework.cli.precheck` reads exactly
what Hydra is about to read. ``tests/framework/config/test_hydra_args.py`` compares the two
parsers flag by flag, so a Hydra upgrade that adds or renames a flag fails a test instead of
being misread.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
CFG_CHOICES = ("job", "hydra", "all")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, description="Hydra", prog="python -m framework")
    p.add_argument("--help", "-h", action="store_true", help="Application's help")
    p.add_argument("--hydra-help", action="store_true", help="Hydra's help")
    p.add_argument("--version", action="store_true", help="Show Hydra's version and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--cfg", "-c", choices=CFG_CHOICES, help="Show config instead of running")
    p.add_argument("--resolve", action="store_true", help="Resolve interpolations before printing")
    p.add_argument("--package", "-p", help="Config package to show")
    p.add_argument("--run", "-r", action="store_true", help="Run a job")
    p.add_argument("--multirun", "-m", action="store_true", help="Run multiple jobs")
    p.add_argument("--shell-completion", "-sc", action="store_true", help="Shell completion")
    p.add_argument("--config-path", "-cp", help="Overrides the config_path of hydra.main()")
    p.add_argument("--config-name", "-cn", help="Overrides the config_name of hydra.main()")
    p.add_argument("--config-dir", "-cd", help="Adds a config dir to the search path")
    p.add_argument("--experimental-rerun", help="Rerun a job from a previous config pickle")
    p.add_argument(
        "--info", "-i", const="all", nargs="?", action="store", choices=INFO_CHOICES, help="Print Hydra information"
    )
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like Hydra; a usage error exits 2 with argparse's usage line, as Hydra's would."""
    return parser().parse_args(list(argv))
