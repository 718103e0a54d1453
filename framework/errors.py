"""Errors the CLI turns into one readable line and an exit code."""


class FrameworkError(Exception):
    exit_code = 1


class ConfigError(FrameworkError):
    """A configuration problem: exit code 2, before any heavy work."""

    exit_code = 2


class DataError(FrameworkError):
    """Input data that cannot be used (missing file, channel, NaN...): exit code 3."""

    exit_code = 3


class DistributedError(FrameworkError):
    """A peer rank failed or a collective timed out: exit code 5, never a hang."""

    exit_code = 5
