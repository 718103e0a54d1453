"""The forecast store: one zarr store that many ranks and jobs write, region by region.

Layout (zarr format 3, consolidated metadata, read with ``xarray.open_zarr``)::

    forecast    (member, init, lead, channel, y, x)  float32, physical units
                chunks (1, 1, 1, all channels, row_chunk, all columns)
    truth       (init, lead, channel, y, x)          float32, the stores' own fields
    completed   (init, member)                       uint8, 1 once the member's region is written
    member      (member,)     int
    init        (init,)       hours since 1970-01-01 (CF: decoded as datetime64)
    lead        (lead,)       hours (forecast_period)
    valid_time  (init, lead)  hours since 1970-01-01
    channel     (channel,)    names, so ``.sel(channel="t2m")`` works; ``channel_units`` beside it
    y, x        (y,), (x,)    grid indices; ``latitude``/``longitude`` (y, x) where the data has them

A writer owns whole chunks: one member, one init, one lead, a band of rows that is a multiple
of ``row_chunk`` (the domain split is made in multiples of it), so no two ranks ever write one
chunk. ``completed`` has one chunk per element, written after the member's data (and, for the
rank holding member 0, the truth): a resumed job skips what is marked.

The store is built under ``<out>.partial`` (its skeleton made in a private directory and
renamed into place, so concurrent jobs agree on one) and renamed to ``<out>`` when every
member of every init is marked: a reader never sees a half-written ``<out>``. Its
``identity`` attribute (models, seed, members, inits, leads, channels, grid, sampler) must
match for a job to join or resume it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from framework import untrusted
from framework.errors import ConfigError, DataError

FORMAT = 1
HOURS_SINCE = "hours since 1970-01-01 00:00:00"
_EPOCH = dt.datetime(1970, 1, 1)
DIMS = ("member", "init", "lead", "channel", "y", "x")

# CF units of the channel families of recipes/weather (by name prefix, as the data sets name them).
_UNITS = (
    ("refc", "dBZ"),
    ("abi", "K"),
    ("u", "m s-1"),
    ("v", "m s-1"),
    ("t", "K"),
    ("msl", "Pa"),
    ("sp", "Pa"),
    ("p", "Pa"),
    ("z", "m2 s-2"),
    ("q", "kg kg-1"),
)


def channel_units(name: str) -> str:
    """CF units of channel ``name`` (``"1"``, dimensionless, when the name is of no known family)."""
    n = name.lower()
    return next((u for prefix, u in _UNITS if n.startswith(prefix)), "1")


def iso(hours: int) -> str:
    return (_EPOCH + dt.timedelta(hours=int(hours))).strftime("%Y-%m-%dT%H")


@dataclass(frozen=True)
class StoreSpec:
    """What the store holds; ``identity`` plus the shape decide whether a job may join a store."""

    members: int
    inits: tuple[int, ...]  # hours since 1970-01-01
    leads: int
    dt: int  # hours per lead step
    channels: tuple[str, ...]
    grid: tuple[int, int]
    row_chunk: int
    identity: dict = field(default_factory=dict)  # models, seed, sampler...: JSON values
    attrs: dict = field(default_factory=dict)  # descriptive only (titles, paths shown)

    def key(self) -> dict:
        """Everything that decides the store's contents, as JSON values."""
        d = asdict(self)
        d.pop("attrs")
        d["inits"] = [iso(t) for t in self.inits]
        d["channels"] = list(self.channels)
        d["grid"] = list(self.grid)
        d["format"] = FORMAT
        return json.loads(json.dumps(d))


def _first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            found = _first_difference(x, y, f"{prefix}{k}.")
            if found:
                return found
        elif x != y:
            return f"{prefix}{k} (store: {x!r}, this run: {y!r})"
    return None


def _array(group, name, shape, chunks, dtype, dims, attrs=None, fill=None, compressed=True):
    kw = {} if compressed else {"compressors": None}
    return group.create_array(
        name,
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        fill_value=fill,
        dimension_names=dims,
        attributes=attrs or {},
        **kw,
    )


def _consolidate(path: Path) -> None:
    import zarr

    with warnings.catch_warnings():  # zarr 3 notes consolidated metadata is not in the v3 spec yet
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))


def _build(path: Path, spec: StoreSpec, coords: dict[str, np.ndarray]) -> None:
    """The skeleton: every array and coordinate, no forecast data (chunks are written by the ranks)."""
    import zarr

    m, n_init, n_lead, c = spec.members, len(spec.inits), spec.leads, len(spec.channels)
    h, w = spec.grid
    aux = " ".join(["valid_time", *(k for k in ("latitude", "longitude") if k in coords)])
    attrs = {
        "title": "ensemble forecast",
        "Conventions": "CF-1.10",
        "identity": spec.key(),
        **spec.attrs,
    }
    g = zarr.create_group(str(path), zarr_format=3, attributes=attrs)
    common = {"coordinates": aux}
    _array(
        g,
        "forecast",
        (m, n_init, n_lead, c, h, w),
        (1, 1, 1, c, spec.row_chunk, w),
        "float32",
        DIMS,
        {**common, "long_name": "forecast, per channel in its channel_units"},
        fill=float("nan"),
    )
    _array(
        g,
        "truth",
        (n_init, n_lead, c, h, w),
        (1, 1, c, spec.row_chunk, w),
        "float32",
        DIMS[1:],
        {**common, "long_name": "verifying state from the data stores"},
        fill=float("nan"),
    )
    _array(
        g,
        "completed",
        (n_init, m),
        (1, 1),
        "uint8",
        ("init", "member"),
        {"long_name": "1 once the member's forecast (member 0: and the truth) is written"},
        fill=0,
        compressed=False,
    )
    time_attrs = {"units": HOURS_SINCE, "calendar": "proleptic_gregorian"}
    values = {
        "member": (np.arange(m, dtype=np.int64), ("member",), {"long_name": "ensemble member"}),
        "init": (
            np.asarray(spec.inits, dtype=np.int64),
            ("init",),
            {**time_attrs, "standard_name": "forecast_reference_time"},
        ),
        "lead": (
            np.arange(1, n_lead + 1, dtype=np.int64) * spec.dt,
            ("lead",),
            {"units": "hours", "standard_name": "forecast_period", "long_name": "lead time"},
        ),
        "valid_time": (
            np.asarray(spec.inits, dtype=np.int64)[:, None] + np.arange(1, n_lead + 1, dtype=np.int64) * spec.dt,
            ("init", "lead"),
            {**time_attrs, "standard_name": "time", "long_name": "valid time"},
        ),
        "channel": (np.asarray(spec.channels, dtype=str), ("channel",), {"long_name": "channel name"}),
        "channel_units": (
            np.asarray([channel_units(n) for n in spec.channels], dtype=str),
            ("channel",),
            {"long_name": "CF units of each channel"},
        ),
        "y": (np.arange(h, dtype=np.int64), ("y",), {"long_name": "grid row"}),
        "x": (np.arange(w, dtype=np.int64), ("x",), {"long_name": "grid column"}),
    }
    for name, units in (("latitude", "degrees_north"), ("longitude", "degrees_east")):
        if name in coords:
            values[name] = (np.asarray(coords[name], dtype=np.float64), ("y", "x"), {"units": units})
    for name, (data, dims, a) in values.items():
        arr = _array(g, name, data.shape, data.shape, data.dtype if data.dtype.kind != "U" else str, dims, a)
        arr[...] = data
    _consolidate(path)


# The arrays a job writes, their shapes from the spec and dtypes as _build makes them: a store
# joined by identity alone (another job's, or a damaged one) must have them exactly.
_SHAPES = {
    "forecast": (lambda s: (s.members, len(s.inits), s.leads, len(s.channels), *s.grid), "float32"),
    "truth": (lambda s: (len(s.inits), s.leads, len(s.channels), *s.grid), "float32"),
    "completed": (lambda s: (len(s.inits), s.members), "uint8"),
}


def _expected_array(group, path: Path, name: str, spec: StoreSpec):
    shape_of, dtype = _SHAPES[name]
    try:
        arr = group[name]
    except KeyError:
        raise DataError(f"{path}: holds no array '{name}'; remove it or add infer.overwrite=true") from None
    want = tuple(shape_of(spec))
    if tuple(getattr(arr, "shape", ())) != want or str(getattr(arr, "dtype", "")) != dtype:
        got = f"{getattr(arr, 'shape', None)} {getattr(arr, 'dtype', type(arr).__name__)}"
        raise DataError(
            f"{path}: array '{name}' is {got}, not {want} {dtype} as this forecast writes it; "
            "remove it or add infer.overwrite=true"
        )
    return arr


class ForecastStore:
    """The ``<out>.partial`` store of one forecast, opened for region writes."""

    def __init__(self, out: Path, spec: StoreSpec):
        import zarr

        self.out, self.spec = Path(out), spec
        self.path = partial_path(self.out)
        self.group = zarr.open_group(str(self.path), mode="r+")
        self.forecast, self.truth, self.completed = (_expected_array(self.group, self.path, k, spec) for k in _SHAPES)

    # -- the skeleton, once per store --------------------------------------------------------------
    @staticmethod
    def prepare(out: Path, spec: StoreSpec, coords: dict, *, overwrite: bool) -> str:
        """Make sure ``<out>.partial`` exists with this spec (created, joined or resumed), or say that
        ``<out>`` already holds exactly this forecast: ``"created"``, ``"joined"`` or ``"complete"``.
        Called by one rank of each job; jobs racing to create it agree on one skeleton."""
        out = Path(out)
        part = partial_path(out)
        if out.exists():
            if not overwrite:
                found = read_identity(out)
                diff = _first_difference(found or {}, spec.key()) if found is not None else "its attributes"
                if diff is None:
                    return "complete"
                raise ConfigError(
                    f"infer.out: {out} exists and holds another forecast ({diff}); add infer.overwrite=true "
                    "to replace it, or choose another infer.out"
                )
            shutil.rmtree(out, ignore_errors=True)
        if part.exists():
            found = read_identity(part)
            diff = _first_difference(found or {}, spec.key()) if found is not None else "unreadable"
            if diff is None:
                return "joined"
            if not overwrite:
                raise ConfigError(
                    f"infer.out: {part} was started by another forecast ({diff}); remove it, add "
                    "infer.overwrite=true, or choose another infer.out"
                )
            shutil.rmtree(part, ignore_errors=True)
        part.parent.mkdir(parents=True, exist_ok=True)
        tmp = part.parent / f".{part.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            _build(tmp, spec, coords)
            os.rename(tmp, part)  # atomic; fails if another job's skeleton got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not part.exists():
                raise
            return ForecastStore.prepare(out, spec, coords, overwrite=False)
        return "created"

    # -- regions ------------------------------------------------------------------------------------
    def done(self) -> np.ndarray:
        """(init, member) bool: the members already written."""
        return np.asarray(self.completed[...], dtype=bool)

    def write(self, members: list[int], init: int, lead: int, rows: slice, fields: np.ndarray) -> None:
        """``fields`` (len(members), C, rows, W) of consecutive ``members`` at lead index ``lead``."""
        m0 = members[0]
        if members != list(range(m0, m0 + len(members))):
            raise ValueError(f"members must be consecutive: {members}")
        self.forecast[m0 : m0 + len(members), init, lead, :, rows, :] = fields

    def write_truth(self, init: int, lead: int, rows: slice, fields: np.ndarray) -> None:
        self.truth[init, lead, :, rows, :] = fields

    def mark(self, init: int, members: list[int]) -> None:
        """Members of ``init`` complete: called after every band of their data is written."""
        for m in members:
            self.completed[init, m] = 1

    def commit(self) -> bool:
        """Rename ``<out>.partial`` to ``<out>`` (consolidating again first: scores may have added
        arrays). False when another job committed it first."""
        _consolidate(self.path)
        try:
            os.rename(self.path, self.out)
        except FileNotFoundError:
            return False
        return True


def partial_path(out: Path) -> Path:
    return Path(str(out) + ".partial")


def read_identity(path: Path) -> dict | None:
    """The ``identity`` attribute of a store (JSON only: nothing read runs code), or None."""
    meta = Path(path) / "zarr.json"
    try:  # a regular file of bounded size, any JSON at any depth
        attrs = untrusted.mapping(untrusted.read_json(meta), str(meta)).get("attributes") or {}
    except (OSError, ValueError):
        return None
    ident = attrs.get("identity") if isinstance(attrs, dict) else None
    return ident if isinstance(ident, dict) else None


def open_complete(out: Path):
    """The committed store, read-only (for scores, frames and tests)."""
    import zarr

    if not Path(out).is_dir():
        raise DataError(f"{out}: no forecast store")
    return zarr.open_group(str(out), mode="r")
