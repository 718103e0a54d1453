"""Domain (spatial) parallelism: halo exchange, the domain splitter and its plans.

Splitter options: ``off`` (nothing split) and ``rows`` (every activation split along its
rows over the domain axis, with halo exchange; the model's split plan says how each layer
does it). ``shard_tensor`` is the deprecated name of ``rows``.
"""

import warnings

from framework import registry
from framework.config.schema import SplitterConfig

# Deprecated splitter names -> the option they stand for (kept for one release).
DEPRECATED_SPLITTERS = {"shard_tensor": "rows"}
_warned: set[str] = set()


@registry.splitters.register("off", SplitterConfig)
def no_split(model, cfg, **_):
    return model


@registry.splitters.register("rows", SplitterConfig)
def split_rows(model, cfg, *, domain=None, plan=None, model_name=None, **_):
    """Split activations along rows over the domain axis, by the model's split ``plan``
    (see framework.domain.splitter). ConfigError (one line) if a model without a plan is to
    be split over more than one rank."""
    if domain is None or domain.size == 1:
        return model
    from framework.domain.splitter import require_plan, split

    return split(model, domain, require_plan(plan, model_name, domain.size))


@registry.splitters.register("shard_tensor", SplitterConfig)
def shard_tensor_split(model, cfg, **kwargs):
    """Deprecated name of ``rows``: warns once, then does exactly what ``rows`` does."""
    warn_deprecated("shard_tensor")
    return split_rows(model, cfg, **kwargs)


def warn_deprecated(name: str) -> None:
    """A FutureWarning, once per process (from global rank 0 only), for a deprecated splitter name."""
    if name in _warned:
        return
    _warned.add(name)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(
        f"splitter={name} is deprecated and will be removed in the next release; use "
        f"splitter={DEPRECATED_SPLITTERS[name]} (same behaviour)",
        FutureWarning,
        stacklevel=4,
    )
