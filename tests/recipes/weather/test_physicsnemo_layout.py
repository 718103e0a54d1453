"""Reading PhysicsNeMo's StormCast data layout: a hand-written store read by HrrrEra5Dataset and
checked against values computed here, the synthetic writer's reference layout, identity with the
native layout (samples and training losses), and the guarded missing-samples file."""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from framework.errors import ConfigError, DataError
from recipes.weather import physicsnemo_layout as pn
from recipes.weather.dataset import HrrrEra5Dataset
from recipes.weather.synthetic import write_synthetic
from tests.conftest import MarkerPayload

# ------------------------------------------------------------------ a hand-written reference store

HS, WS = 6, 7  # the HRRR stores' grid
REGION = (4, 6)  # the training region [0:4, 0:6]
HRRR_STORE = ["t2m", "u10m", "refc", "msl"]
ERA5_STORE = ["u850", "t850", "z500"]
INV_STORE = ["lsm", "orog", "soil"]
HRRR_SEL, ERA5_SEL, INV_SEL = ["msl", "u10m", "refc"], ["z500", "u850"], ["orog", "lsm"]
LAT1D = np.arange(46.0, 29.5, -1.0)  # descending, as ERA5
LON1D = np.arange(255.0, 280.5, 1.0)  # 0..360, regional
H_MEANS, H_STDS = np.array([280.0, 1.0, 10.0, 101325.0]), np.array([10.0, 5.0, 8.0, 1000.0])
E_MEANS, E_STDS = np.array([2.0, 270.0, 55000.0]), np.array([6.0, 12.0, 1500.0])
MISSING = [dt.datetime(2021, 12, 31, 19), dt.datetime(2022, 1, 1, 1)]


def hours(start: str, n: int) -> np.ndarray:
    first = int(np.datetime64(start, "h").astype(np.int64))
    return np.arange(first, first + n, dtype=np.int64)


# state hours stored per year: 2018 straddles the HRRR v3 start (Aug 1 01:00), 2021 ends on
# Dec 31 23:00 so its last pair crosses into 2022, 2022 straddles the Dec 15 00:00 end rule
TIMES = {
    2018: hours("2018-07-31T22", 6),
    2021: hours("2021-12-31T16", 8),
    2022: np.concatenate([hours("2022-01-01T00", 3), hours("2022-12-14T22", 5)]),
}
LAT2D = 37.0 + 0.3 * np.arange(HS)[:, None] + 0.1 * np.arange(WS)[None, :]
LON2D = -100.0 + 0.35 * np.arange(WS)[None, :] - 0.1 * np.arange(HS)[:, None]  # -180..180, as HRRR


def _v2(group, name, values, dims, attrs=None, chunks=None):
    values = np.asarray(values)
    kw = dict(
        shape=values.shape, chunks=chunks or values.shape, attributes={"_ARRAY_DIMENSIONS": list(dims), **(attrs or {})}
    )
    if values.dtype == object:
        arr = group.create_array(name, dtype=str, **kw)
    else:
        arr = group.create_array(name, dtype=values.dtype, compressors=None, **kw)
    arr[...] = values


def _time(group, year, h, era5):
    """Encode the time coordinate a different way per store, as xarray might have."""
    if era5:
        _v2(group, "time", h, ["time"], {"units": "hours since 1970-01-01T00:00:00Z", "calendar": "standard"})
    elif year == 2018:
        ref = int(np.datetime64("2018-01-01T00", "h").astype(np.int64))
        _v2(
            group,
            "time",
            h - ref,
            ["time"],
            {"units": "hours since 2018-01-01 00:00:00", "calendar": "proleptic_gregorian"},
        )
    elif year == 2021:
        ref = int(np.datetime64("2021-01-01T00", "h").astype(np.int64))
        _v2(group, "time", (h - ref) / 24.0, ["time"], {"units": "days since 2021-01-01"})
    else:
        _v2(group, "time", h.astype("datetime64[h]").astype("datetime64[ns]"), ["time"])


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The store on disk and the arrays it holds: {'root', 'hrrr': {year: data}, 'era5': {...}, 'inv'}."""
    root = tmp_path_factory.mktemp("pn") / "data"
    rng = np.random.default_rng(7)
    out = {"root": root, "hrrr": {}, "era5": {}}
    sub = {2018: "train", 2021: "train/more", 2022: "valid"}  # recursive discovery
    for year, h in TIMES.items():
        hrrr = H_MEANS[:, None, None] + H_STDS[:, None, None] * rng.standard_normal((len(h), 4, HS, WS))
        era5 = E_MEANS[:, None, None] + E_STDS[:, None, None] * rng.standard_normal((len(h), 3, len(LAT1D), len(LON1D)))
        hrrr, era5 = hrrr.astype(np.float32), era5.astype(np.float32)
        out["hrrr"][year], out["era5"][year] = hrrr, era5
        g = zarr.create_group(str(root / "hrrr_v3" / sub[year] / f"{year}.zarr"), zarr_format=2)
        _v2(g, "HRRR", hrrr, ["time", "channel", "y", "x"], chunks=(1, 1, 2, WS))
        _time(g, year, h, era5=False)
        _v2(g, "channel", np.array(HRRR_STORE), ["channel"])
        _v2(g, "latitude", LAT2D, ["y", "x"])
        _v2(g, "longitude", LON2D, ["y", "x"])
        zarr.consolidate_metadata(g.store)
        g = zarr.create_group(str(root / "era5" / sub[year] / f"{year}.zarr"), zarr_format=2)
        _v2(g, "data", era5, ["time", "channel", "latitude", "longitude"], chunks=(1, 1, len(LAT1D), len(LON1D)))
        _time(g, year, h, era5=True)
        _v2(g, "channel", np.array(ERA5_STORE, dtype=object), ["channel"])
        _v2(g, "latitude", LAT1D, ["latitude"])
        _v2(g, "longitude", LON1D, ["longitude"])
        zarr.consolidate_metadata(g.store)
    inv = rng.uniform(0, 500, size=(3, HS, WS)).astype(np.float32)
    out["inv"] = inv
    g = zarr.create_group(str(root / "hrrr_v3" / "invariants.zarr"), zarr_format=2)
    _v2(g, "HRRR_invariants", inv, ["channel", "y", "x"])
    _v2(g, "channel", np.array(INV_STORE), ["channel"])
    zarr.consolidate_metadata(g.store)
    for folder, means, stds in (
        (root / "hrrr_v3" / "stats_v3_2019_2021", H_MEANS, H_STDS),
        (root / "era5" / "stats", E_MEANS, E_STDS),
    ):
        folder.mkdir(parents=True)
        np.save(folder / "means.npy", means)
        np.save(folder / "stds.npy", stds)
    np.save(root / "missing_samples_hrrr_v3.npy", np.array(MISSING, dtype=object), allow_pickle=True)
    return out


def make(root, years, **kw) -> HrrrEra5Dataset:
    kw.setdefault("grid", REGION)
    return HrrrEra5Dataset(root, years, HRRR_SEL, ERA5_SEL, INV_SEL, **kw)


def iso(h: int) -> str:
    return str(np.datetime64(int(h), "h"))


def bilinear(field: np.ndarray, lat: float, lon: float) -> np.ndarray:
    """ERA5 field (C, lat, lon) at one point, straight from the definition (lat descending)."""
    lon = lon % 360.0
    i = next(k for k in range(len(LAT1D) - 1) if LAT1D[k] >= lat >= LAT1D[k + 1])
    j = next(k for k in range(len(LON1D) - 1) if LON1D[k] <= lon <= LON1D[k + 1])
    fy = (LAT1D[i] - lat) / (LAT1D[i] - LAT1D[i + 1])
    fx = (lon - LON1D[j]) / (LON1D[j + 1] - LON1D[j])
    f = field.astype(np.float64)
    return (
        (1 - fy) * (1 - fx) * f[:, i, j]
        + (1 - fy) * fx * f[:, i, j + 1]
        + fy * (1 - fx) * f[:, i + 1, j]
        + fy * fx * f[:, i + 1, j + 1]
    )


def expected_sample(ref, state_hour: int, dt_: int, background_hour: int, invariant_norm="zscore") -> dict:
    h, w = REGION
    hsel = [HRRR_STORE.index(c) for c in HRRR_SEL]
    esel = [ERA5_STORE.index(c) for c in ERA5_SEL]

    def at(source, hour):
        for year, hs in TIMES.items():
            k = np.flatnonzero(hs == hour)
            if len(k):
                return ref[source][year][int(k[0])]
        raise KeyError(iso(hour))

    def norm_h(x):
        return (x[hsel, :h, :w] - H_MEANS[hsel, None, None]) / H_STDS[hsel, None, None]

    era5 = at("era5", background_hour)
    bg = np.array([[bilinear(era5, LAT2D[y, x], LON2D[y, x]) for x in range(w)] for y in range(h)]).transpose(2, 0, 1)
    inv = ref["inv"][[INV_STORE.index(c) for c in INV_SEL], :h, :w].astype(np.float64)
    if invariant_norm == "zscore":
        inv = (inv - inv.mean(axis=(1, 2), keepdims=True)) / inv.std(axis=(1, 2), keepdims=True)
    return {
        "state": norm_h(at("hrrr", state_hour)),
        "target": norm_h(at("hrrr", state_hour + dt_)),
        "background": (bg[esel] - E_MEANS[esel, None, None]) / E_STDS[esel, None, None],
        "invariants": inv,
    }


# ------------------------------------------------------------------ the hand-written store, read


def test_sample_index_follows_the_reference_rules(ref):
    root = ref["root"]
    ds = make(root, [2021])
    assert ds.layout == "physicsnemo" and ds.grid == REGION and ds.store_grid == (HS, WS)
    # Dec 31 16..23 minus 19 (missing) and 18 (its target is missing); 23 pairs with 2022-01-01T00
    states = [iso(ds.sample_times(i)[0]) for i in range(len(ds))]
    assert states == [f"2021-12-31T{h}" for h in (16, 17, 20, 21, 22, 23)]
    assert ds.sample_times(len(ds) - 1) == (int(TIMES[2021][-1]), int(TIMES[2022][0]))  # crosses the year
    assert ds.locate(len(ds) - 1) == (2021, 7)
    # 2022: the last state hour is Dec 15 00:00; Jan 1 00 and 01 touch the missing Jan 1 01:00
    ds = make(root, [2022])
    assert [iso(ds.sample_times(i)[0]) for i in range(len(ds))] == ["2022-12-14T22", "2022-12-14T23", "2022-12-15T00"]
    # 2018: the first state hour is Aug 1 01:00 (HRRR v3)
    ds = make(root, [2018])
    assert [iso(ds.sample_times(i)[0]) for i in range(len(ds))] == ["2018-08-01T01", "2018-08-01T02"]
    # several years: in the order given; dt=2 (missing: 2021-12-31T19, 2022-01-01T01)
    ds = make(root, [2022, 2021], dt=2)
    got = [(iso(a), iso(b)) for a, b in (ds.sample_times(i) for i in range(len(ds)))]
    assert got == [
        ("2022-01-01T00", "2022-01-01T02"),
        ("2022-12-14T22", "2022-12-15T00"),
        ("2022-12-14T23", "2022-12-15T01"),
        ("2022-12-15T00", "2022-12-15T02"),
        ("2021-12-31T16", "2021-12-31T18"),
        ("2021-12-31T18", "2021-12-31T20"),
        ("2021-12-31T20", "2021-12-31T22"),
        ("2021-12-31T21", "2021-12-31T23"),
        ("2021-12-31T22", "2022-01-01T00"),
    ]


@pytest.mark.parametrize("background_time", ["input", "target"])
def test_samples_match_values_computed_here(ref, background_time):
    ds = make(ref["root"], [2021, 2022], background_time=background_time)
    assert len(ds) == 9
    for i in range(len(ds)):
        t, target = ds.sample_times(i)
        bg_hour = t if background_time == "input" else target
        assert ds.background_hour(i) == bg_hour
        sample = ds[i]
        expect = expected_sample(ref, t, 1, bg_hour)
        for key, value in expect.items():
            assert sample[key].dtype == torch.float32 and sample[key].shape == value.shape, key
            np.testing.assert_allclose(sample[key].numpy(), value, rtol=1e-5, atol=2e-5, err_msg=f"{key} {iso(t)}")
    np.testing.assert_array_equal(ds.hrrr_means, H_MEANS[[3, 1, 2]].astype(np.float32))
    np.testing.assert_array_equal(ds.era5_stds, E_STDS[[2, 0]].astype(np.float32))


def test_interpolation_at_known_points(ref):
    """A point on an ERA5 node takes its value; raw (unnormalised) values; raw invariants."""
    ds = make(ref["root"], [2021], normalize=False, invariant_norm="none")
    i = 0
    t = ds.sample_times(i)[0]
    sample = ds[i]
    era5 = ref["era5"][2021][int(np.flatnonzero(TIMES[2021] == t)[0])]
    # HRRR point (0, 0) is (37 N, -100 E) = the ERA5 node (37, 260)
    node = (int(np.flatnonzero(LAT1D == 37.0)[0]), int(np.flatnonzero(LON1D == 260.0)[0]))
    np.testing.assert_allclose(sample["background"][:, 0, 0].numpy(), era5[[2, 0], node[0], node[1]], rtol=1e-6)
    # point (1, 0): (37.3, -100.1) -> between lat 38/37 and lon 259.9 in [259, 260]
    np.testing.assert_allclose(sample["background"][:, 1, 0].numpy(), bilinear(era5, 37.3, -100.1)[[2, 0]], rtol=1e-6)
    inv = ref["inv"][[1, 0], : REGION[0], : REGION[1]]
    np.testing.assert_array_equal(sample["invariants"].numpy(), inv)  # not normalised
    hrrr = ref["hrrr"][2021][0]
    np.testing.assert_array_equal(sample["state"].numpy(), hrrr[[3, 1, 2], : REGION[0], : REGION[1]])


def test_interpolation_weights_on_a_global_grid():
    """Descending latitudes, longitudes 0..359 wrapping past 359 -> 360 = 0, points in -180..180."""
    lat1d = np.arange(90.0, -90.5, -2.0)
    lon1d = np.arange(0.0, 360.0, 2.0)
    lat2d = np.array([[10.0, 10.0, -89.0], [89.5, 0.5, 45.3]])
    lon2d = np.array([[-1.0, 359.0, 0.0], [179.9, -0.5, -120.7]])
    rng = np.random.default_rng(0)
    field = rng.standard_normal((2, len(lat1d), len(lon1d))).astype(np.float32)
    interp = pn.LatLonBilinear(lat1d, lon1d, lat2d, lon2d, Path("era5.zarr"))
    got = interp(field)

    def one(c, la, lo):
        lo %= 360.0
        i = int((90.0 - la) // 2.0)
        j = int(lo // 2.0)
        fy, fx = (90.0 - la) / 2.0 - i, lo / 2.0 - j
        j1 = (j + 1) % len(lon1d)
        f = field[c].astype(np.float64)
        return (
            (1 - fy) * (1 - fx) * f[i, j]
            + (1 - fy) * fx * f[i, j1]
            + fy * (1 - fx) * f[i + 1, j]
            + fy * fx * f[i + 1, j1]
        )

    want = np.array([[[one(c, lat2d[y, x], lon2d[y, x]) for x in range(3)] for y in range(2)] for c in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # 359 E (= -1 E) is the mean of the nodes 358 and 0 (wrapped)
    np.testing.assert_allclose(got[:, 0, 0], got[:, 0, 1], rtol=0, atol=0)
    # any band of rows equals the same rows of the whole grid, bit for bit
    np.testing.assert_array_equal(interp(field, slice(1, 2)), got[:, 1:2])
    with pytest.raises(DataError, match="does not cover"):
        pn.LatLonBilinear(lat1d[:40], lon1d, lat2d, lon2d, Path("era5.zarr"))  # 90 .. 12 N only


def test_row_bands_read_only_their_rows(ref, zarr_reads):
    ds = make(ref["root"], [2021, 2022])
    full = ds.read(5)
    for rows in (slice(0, 2), slice(1, 3), slice(2, None)):
        part = ds.read(5, rows)
        for key in ("state", "target", "background", "invariants"):
            torch.testing.assert_close(part[key], full[key][:, rows], rtol=0, atol=0)
    zarr_reads.clear()
    ds.read(4, slice(0, 2))
    hrrr_chunks = {k for k, _ in zarr_reads if k.startswith("HRRR/")}
    # chunks (1, 1, 2, W): rows 0-1 are chunk row 0 only; state + target, 3 channels each
    assert len(hrrr_chunks) == 6 and all(k.split(".")[2] == "0" for k in hrrr_chunks), hrrr_chunks


def test_pickles_without_handles_or_weights(ref):
    ds = make(ref["root"], [2021])
    first = ds[2]
    blob = pickle.dumps(ds)
    clone = pickle.loads(blob)
    assert clone._handles is None and clone._interp is None and len(blob) < 100_000
    for key in ("state", "background", "invariants"):
        torch.testing.assert_close(clone[2][key], first[key], rtol=0, atol=0)


def test_layout_is_detected_or_forced(ref, tmp_path):
    root = ref["root"]
    assert make(root, [2021], layout="physicsnemo").layout == "physicsnemo"
    assert pn.detect_layout(root) == "physicsnemo"
    with pytest.raises(DataError, match="hrrr/2021.zarr"):
        make(root, [2021], layout="native")
    native = write_synthetic(tmp_path / "native", height=8, width=8, hours_per_year=3, years=(2020,))
    assert pn.detect_layout(native) == "native"
    both = Path(shutil.copytree(native, tmp_path / "both"))
    (both / "missing_samples_hrrr_v3.npy").write_bytes((root / "missing_samples_hrrr_v3.npy").read_bytes())
    with pytest.raises(DataError, match="data.layout=native or data.layout=physicsnemo"):
        pn.detect_layout(both)
    with pytest.raises(DataError, match="no HRRR/ERA5 stores found"):
        pn.detect_layout(tmp_path)
    with pytest.raises(ConfigError, match="layout must be one of"):
        make(root, [2021], layout="xarray")


def test_bad_reference_data_is_one_line(ref, tmp_path):
    root = ref["root"]
    for fn, parts in (
        (lambda: make(root, [2019]), ["hrrr_v3/**/2019.zarr", "found years: 2018, 2021, 2022"]),
        (
            lambda: HrrrEra5Dataset(root, [2021], ["t2m", "refd"], ERA5_SEL, INV_SEL, grid=REGION),
            ["2021.zarr", "'refd'", "variable 'HRRR'", "t2m, u10m, refc, msl"],
        ),
        (lambda: make(root, [2021], grid=(8, 8)), ["data.grid", "[6, 7]"]),
    ):
        with pytest.raises((DataError, ConfigError)) as info:
            fn()
        assert "\n" not in str(info.value) and all(p in str(info.value) for p in parts), str(info.value)
    dup = Path(shutil.copytree(root, tmp_path / "dup"))
    shutil.copytree(dup / "era5" / "valid" / "2022.zarr", dup / "era5" / "train" / "2022.zarr")
    with pytest.raises(DataError, match="a second ERA5 store for 2022"):
        make(dup, [2021])
    shutil.rmtree(dup / "era5" / "train" / "2022.zarr")
    store = dup / "era5" / "train" / "more" / "2021.zarr"
    arr = zarr.open_group(str(store), mode="r+")["data"]
    arr.attrs["_ARRAY_DIMENSIONS"] = ["time", "channel", "longitude", "latitude"]
    zarr.consolidate_metadata(str(store))
    with pytest.raises(DataError, match=r"2021.zarr: variable 'data' has dimensions .*'longitude', 'latitude'"):
        make(dup, [2021])


# ------------------------------------------------------------------ time and missing samples


def test_time_coordinates_decode(tmp_path):
    g = zarr.create_group(str(tmp_path / "t.zarr"), zarr_format=2)
    _v2(g, "a", np.array([0.0, 1 / 24, 2 / 24]), ["time"], {"units": "days since 2020-03-01 00:00:00"})
    _v2(g, "b", np.array([0, 60, 120]), ["time"], {"units": "minutes since 2020-03-01T00:00:00+00:00"})
    _v2(g, "c", np.array([0, 30]), ["time"], {"units": "minutes since 2020-03-01"})
    _v2(g, "d", np.array([1, 2]), ["time"])
    _v2(g, "e", np.array([0, 1]), ["time"], {"units": "hours since 2020-03-01", "calendar": "noleap"})
    want = hours("2020-03-01T00", 3)
    for name in ("a", "b"):
        np.testing.assert_array_equal(pn.decode_hours(g[name], Path("t.zarr"), name), want)
    for name, match in (("c", "not on a whole hour"), ("d", "no CF units"), ("e", "calendar 'noleap'")):
        with pytest.raises(DataError, match=match):
            pn.decode_hours(g[name], Path("t.zarr"), name)


def test_a_coordinate_is_checked_by_its_declared_shape_before_it_is_read(tmp_path):
    """A store can declare any shape, and zarr fills absent chunks with the fill value: a crafted
    coordinate of 2**40 entries (8 TiB if read) is refused by its shape, in one line, unread."""
    from recipes.weather import dataset

    g = zarr.create_group(str(tmp_path / "t.zarr"), zarr_format=2)
    huge = g.create_array("time", shape=(1 << 40,), chunks=(1 << 20,), dtype="int64", fill_value=0)
    huge.attrs["units"] = "hours since 1970-01-01"
    g.create_array("channel", shape=(1 << 40,), chunks=(1 << 20,), dtype="int64", fill_value=0)
    path = Path("t.zarr")
    with pytest.raises(
        DataError, match=r"t.zarr: coordinate 'time' has 1099511627776 entries of 8 bytes \(at most 4194304"
    ):
        pn.decode_hours(g["time"], path, "time")
    with pytest.raises(DataError, match="'time' has 1099511627776 entries but the data has 24 along its axis"):
        pn.decode_hours(g["time"], path, "time", expected=24)
    with pytest.raises(DataError, match="at most 4194304"):  # our layout's time variable, its data as long
        dataset._check_time(g, path, 1 << 40, 2021, 1)
    with pytest.raises(DataError, match="names 1099511627776 channels but variable 'x' has 3"):
        dataset._coord_channels(g, path, "x", 3)
    with pytest.raises(DataError, match="at most 4194304"):
        dataset._coord_channels(g, path, "x", 1 << 40)
    _v2(g, "ok", np.arange(3), ["time"], {"units": "hours since 1970-01-01"})
    np.testing.assert_array_equal(pn.decode_hours(g["ok"], path, "ok", expected=3), [0, 1, 2])
    # data whose every read would decode a 32 GiB chunk, or a shard index of 2**28 chunks
    g.create_array("data", shape=(1 << 20, 8, 1024, 1024), chunks=(1 << 10, 8, 1024, 1024), dtype="float32")
    with pytest.raises(DataError, match=r"'data' has chunks \(1024, 8, 1024, 1024\) of 34359738368 bytes each"):
        dataset.checked_array(g, path, "data", 4)
    v3 = zarr.create_group(str(tmp_path / "v3.zarr"))
    v3.create_array(
        "data", shape=(1 << 20, 8, 1024, 1024), chunks=(1, 8, 64, 64), shards=(1 << 20, 8, 1024, 1024), dtype="float32"
    )
    with pytest.raises(DataError, match=r"'data' has shards \(1048576, 8, 1024, 1024\) of more than 16777216 chunks"):
        dataset.checked_array(v3, path, "data", 4)
    assert dataset.checked_array(g, path, "ok", 1).shape == (3,)
    # bytes, not only entries: 16384 fixed-width names of 65536 characters (4 GiB), or a fill value
    # of 256 Ki characters repeated for every entry of an absent chunk
    g.create_array("wide", shape=(16384,), chunks=(16384,), dtype="<U65536")
    with pytest.raises(DataError, match=r"'wide' has 16384 entries of 262144 bytes \(at most"):
        pn.coordinate_values(g["wide"], path, "wide")
    v3.create_array("names", shape=(4096,), chunks=(4096,), dtype=str, fill_value="x" * (1 << 18))
    with pytest.raises(DataError, match="'names' has a fill value of 262144 characters"):
        pn.coordinate_values(v3["names"], path, "names")
    with pytest.raises(DataError, match="'names' has dtype .*, expected numbers or datetimes"):
        pn.decode_hours(v3["names"], path, "names")
    # a grid of 2**40 points in small chunks: the region read (lat/lon, invariants) would be 8 TiB
    g.create_array("grid", shape=(2, 3, 1 << 20, 1 << 20), chunks=(1, 1, 1024, 1024), dtype="float32")
    with pytest.raises(DataError, match=r"'grid' has a grid of \(1048576, 1048576\) points \(at most 1073741824\)"):
        dataset.checked_array(g, path, "grid", 4)
    # channel names go into error lines: one line each
    g.attrs["channels"] = ["u10m", "t2m\nerror: forged"]
    with pytest.raises(DataError, match=re.escape(r"not a short printable string: 't2m\nerror: forged'")):
        dataset._store_channels(g, path, 2)


def test_missing_samples_formats(tmp_path):
    want = np.array(sorted(int(np.datetime64(m, "h").astype(np.int64)) for m in MISSING))
    for name, values in (
        ("pickled.npy", np.array(MISSING, dtype=object)),
        ("datetime64.npy", np.array(MISSING, dtype="datetime64[h]")),
        ("strings.npy", np.array(["2021-12-31T19:00", "2022-01-01 01:00:00"])),
        ("numpy_scalars.npy", np.array([np.datetime64(m, "h") for m in MISSING], dtype=object)),
    ):
        np.save(tmp_path / name, values, allow_pickle=values.dtype == object)
        np.testing.assert_array_equal(pn.load_missing_hours(tmp_path / name), want, err_msg=name)
    np.save(tmp_path / "floats.npy", np.array([1.5]))
    with pytest.raises(DataError, match="dtype float64"):
        pn.load_missing_hours(tmp_path / "floats.npy")
    np.save(tmp_path / "objects.npy", np.array([1.5, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="entry 0 is a float"):
        pn.load_missing_hours(tmp_path / "objects.npy")


def test_a_missing_samples_file_that_is_no_regular_file_is_refused_at_once(tmp_path):
    """A named pipe would wait forever for a writer, a link to /dev/zero fill the memory."""
    fifo, zero = tmp_path / "fifo.npy", tmp_path / "zero.npy"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero):
        with pytest.raises(DataError, match=f"{re.escape(str(path))} is not a regular file"):
            pn.load_missing_hours(path)


def test_malicious_missing_samples_pickle_is_refused(ref, tmp_path):
    root = Path(shutil.copytree(ref["root"], tmp_path / "data"))
    marker = tmp_path / "marker"
    evil = root / "missing_samples_hrrr_v3.npy"
    np.save(evil, np.array([dt.datetime(2021, 12, 31, 19), MarkerPayload(marker)], dtype=object), allow_pickle=True)
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(DataError) as info:
        make(root, [2021])
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 3
    assert message.startswith(f"{evil}: refused") and "open'" in message, message
    assert not marker.exists() and sorted(p for p in tmp_path.rglob("*")) == before
    # a bare pickle (not even an array) is refused the same way
    evil.write_bytes(evil.read_bytes()[:10] + b"")  # truncated: not a .npy
    with pytest.raises(DataError, match="not a .npy file"):
        make(root, [2021])


class _FlaglessObjectDtype:
    """A copy of numpy's object dtype whose pickled state clears its "holds objects" flag."""

    def __reduce__(self):
        return (np.dtype, ("O", False, True), (3, "|", None, None, None, -1, -1, 0))


class _ArrayFromRawBytes:
    """An array of that dtype rebuilt from raw bytes: numpy would read them as object pointers."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def __reduce__(self):
        return (
            np.ndarray.__reduce__(np.zeros(0))[0],
            (np.ndarray, (0,), b"b"),
            (1, (1,), _FlaglessObjectDtype(), False, self.raw),
        )


def test_missing_samples_pickle_with_an_altered_dtype_is_refused(tmp_path):
    """Only allowed names, yet memory-unsafe: the dtype's state is checked as it is built."""
    evil = tmp_path / "missing.npy"
    with open(evil, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": (1,)})
        pickle.dump(_ArrayFromRawBytes(id(None).to_bytes(8, "little")), f, protocol=2)
    with pytest.raises(DataError, match=r"refused to unpickle the missing-samples file: a dtype with altered state"):
        pn.load_missing_hours(evil)
    legit = tmp_path / "legit.npy"  # the reference's own object array still loads
    np.save(legit, np.array([dt.datetime(2021, 1, 1, 2)], dtype=object), allow_pickle=True)
    assert pn.load_missing_hours(legit).tolist() == [
        (dt.datetime(2021, 1, 1, 2) - dt.datetime(1970, 1, 1)) // dt.timedelta(hours=1)
    ]


class _ObjectArrayOverBytes:
    """``ndarray((1,), object, buffer)``: numpy reads the buffer's bytes as object pointers."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def __reduce__(self):
        return (np.ndarray, ((1,), np.dtype("O"), self.raw))


class _HexEncode:
    """``_codecs.encode(text, "hex")`` doubles its input: chained through the memo, memory."""

    def __reduce__(self):
        import codecs

        return (codecs.encode, ("abcd", "hex"))


@pytest.mark.parametrize(
    "payload,error",
    [
        (_ObjectArrayOverBytes(id(None).to_bytes(8, "little")), "calling numpy.ndarray is not allowed"),
        (_HexEncode(), "encoding with 'hex' is not allowed"),
    ],
    ids=["ndarray-over-bytes", "hex-codec"],
)
def test_missing_samples_pickle_calling_a_named_global_is_refused(tmp_path, payload, error):
    """A global the pickle may name (ndarray, as an argument of numpy's reconstruction) is not
    one it may call; the codec that makes bytes is latin-1 only."""
    evil = tmp_path / "missing.npy"
    with open(evil, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": (1,)})
        pickle.dump(payload, f, protocol=2)
    with pytest.raises(DataError, match=rf"refused to unpickle the missing-samples file: {error}"):
        pn.load_missing_hours(evil)


PICKLE_ZARRAY = {
    # an object coordinate (as xarray writes strings), read whole when the store is checked
    "object-coordinate": ("channel", {"dtype": "|O", "filters": [{"id": "pickle"}], "compressor": None}),
    # the data, float as the reader asks, decoded by a sample read
    "float-data": ("HRRR", {"dtype": "<f4", "filters": None, "compressor": {"id": "pickle"}}),
}


@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "plain"])
@pytest.mark.parametrize("case", list(PICKLE_ZARRAY))
def test_a_store_naming_the_pickle_codec_is_refused_unread(ref, tmp_path, monkeypatch, case, consolidated):
    """Stores come from others and must never run code: zarr 3.1 refuses a v2 array whose
    metadata names numcodecs' ``pickle`` codec (docs/data.md), so its chunks are never unpickled."""
    import numcodecs.pickles

    # numcodecs >= 0.16 refuses Pickle.decode by default (older ones have no switch): allowed here, so
    # that zarr's own refusal is what is tested, and a zarr that took the codec would run the payload
    monkeypatch.setattr(numcodecs.pickles, "ALLOW_UNSAFE_PICKLE_DECODE", True, raising=False)
    var, codec = PICKLE_ZARRAY[case]
    root = Path(shutil.copytree(ref["root"], tmp_path / "data"))
    store = root / "hrrr_v3" / "train" / "more" / "2021.zarr"
    zarray = json.loads((store / var / ".zarray").read_text()) | codec | {"fill_value": None}
    (store / var / ".zarray").write_text(json.dumps(zarray))
    if consolidated:
        zmeta = json.loads((store / ".zmetadata").read_text())
        zmeta["metadata"][f"{var}/.zarray"] = zarray
        (store / ".zmetadata").write_text(json.dumps(zmeta))
    else:
        (store / ".zmetadata").unlink()
    marker = tmp_path / "marker"
    blob = pickle.dumps(MarkerPayload(marker))  # no compressor but pickle: the chunk's bytes are the pickle
    chunks = [p for p in (store / var).iterdir() if not p.name.startswith(".")]
    assert chunks
    for chunk in chunks:
        chunk.write_bytes(blob)
    with pytest.raises(DataError) as info:
        make(root, [2021])[0]
    message = str(info.value)
    # consolidated: "<store>: cannot open the HRRR 2021 store as a zarr group (ValueError: No Zarr data
    # type found that matches {'name': '|O', 'object_codec_id': 'pickle'})"; plain: "<store>: cannot
    # open variable 'channel' (ValueError: ...)"
    assert "\n" not in message and info.value.exit_code == 3
    assert message.startswith(f"{store}: cannot open") and "'pickle'" in message, message
    assert consolidated or f"variable '{var}'" in message, message
    assert not marker.exists()
    pickle.loads(blob)  # the control: the same bytes, unpickled, do write the marker
    assert marker.exists()


# ------------------------------------------------------------------ synthetic data in the reference layout

SYN = dict(height=16, width=16, hours_per_year=30, years=(2020, 2021), row_chunk=8)
CH = (["u10m", "v10m", "t2m", "msl"], ["u850", "v850", "t850"], ["lsm", "orog"])


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """The same synthetic data in both layouts (no missing samples, so the sample lists agree)."""
    base = tmp_path_factory.mktemp("twins")
    return (
        write_synthetic(base / "native", latlon=True, **SYN),
        write_synthetic(base / "physicsnemo", layout="physicsnemo", missing=[], **SYN),
    )


def test_synthetic_writes_the_reference_layout(twins, tmp_path):
    root = twins[1]
    for source, var, folder in (("hrrr_v3", "HRRR", "train"), ("era5", "data", "train"), ("hrrr_v3", "HRRR", "valid")):
        year = 2020 if folder == "train" else 2021
        store = root / source / folder / f"{year}.zarr"
        meta = json.loads((store / ".zmetadata").read_text())["metadata"]  # v2, consolidated
        assert json.loads((store / ".zgroup").read_text())["zarr_format"] == 2
        dims = meta[f"{var}/.zattrs"]["_ARRAY_DIMENSIONS"]
        want = ["time", "channel", "y", "x"] if var == "HRRR" else ["time", "channel", "latitude", "longitude"]
        assert dims == want
        assert "since" in meta["time/.zattrs"]["units"]
        g = zarr.open_group(str(store), mode="r")
        assert [str(c) for c in g["channel"][...]] == (CH[0] if var == "HRRR" else CH[1])
        if var == "data":  # ERA5 on a coarser regular grid, latitudes descending
            lat, lon = g["latitude"][...], g["longitude"][...]
            assert lat[0] > lat[-1] and np.allclose(np.diff(lon), 1.0) and np.allclose(np.diff(lat), -1.0)
            assert g["data"].shape[-2:] == (len(lat), len(lon))
        else:
            assert g["latitude"].shape == g["longitude"].shape == (16, 16)
            spacing = np.hypot(np.diff(g["latitude"][...], axis=1), np.diff(g["longitude"][...], axis=1))
            assert np.allclose(spacing, 0.25)
    inv = zarr.open_group(str(root / "hrrr_v3" / "invariants.zarr"), mode="r")
    assert inv["HRRR_invariants"].shape == (2, 16, 16)
    for f in ("hrrr_v3/stats_v3_2019_2021/means.npy", "era5/stats/stds.npy", "era5/stats/time_means.npy"):
        assert (root / f).is_file()
    # the default missing-samples file: an object array of datetimes, as the reference writes it
    default = write_synthetic(tmp_path / "default", layout="physicsnemo", **dict(SYN, hours_per_year=8, years=(2020,)))
    with pytest.raises(ValueError, match="allow_pickle"):
        np.load(default / "missing_samples_hrrr_v3.npy")
    assert list(np.load(default / "missing_samples_hrrr_v3.npy", allow_pickle=True)) == [dt.datetime(2020, 1, 1, 5)]
    ds = HrrrEra5Dataset(default, [2020], *CH)
    assert [iso(ds.sample_times(i)[0])[-2:] for i in range(len(ds))] == ["00", "01", "02", "03", "06"]


def test_synthetic_cli_writes_the_reference_layout(tmp_path, capsys):
    from recipes.weather import synthetic

    root = tmp_path / "cli"
    args = [
        "--root",
        str(root),
        "--layout",
        "physicsnemo",
        "--height",
        "8",
        "--width",
        "8",
        "--years",
        "2020",
        "--hours-per-year",
        "7",
        "--hrrr-channels",
        "t2m",
        "--era5-channels",
        "t850",
        "--missing",
        "2020-01-01T02",
    ]
    assert synthetic.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {root}") and "missing_samples_hrrr_v3.npy" in out
    ds = HrrrEra5Dataset(root, [2020], ["t2m"], ["t850"], [])
    assert [iso(ds.sample_times(i)[0])[-2:] for i in range(len(ds))] == ["00", "03", "04", "05"]
    assert synthetic.main(["--root", str(tmp_path / "x"), "--missing", "2020-01-01T02"]) == 2  # native: no missing file
    assert "physicsnemo layout" in capsys.readouterr().err


@pytest.mark.parametrize("background_time", ["input", "target"])
def test_both_layouts_give_identical_samples(twins, background_time):
    native, reference = (HrrrEra5Dataset(r, [2020, 2021], *CH, background_time=background_time) for r in twins)
    assert (native.layout, reference.layout) == ("native", "physicsnemo")
    assert len(native) == len(reference) == 2 * 29
    np.testing.assert_array_equal(native.era5_means, reference.era5_means)
    for i in range(len(native)):
        assert native.sample_times(i) == reference.sample_times(i)
        a, b = native[i], reference[i]
        for key in ("state", "target", "background", "invariants"):
            assert torch.equal(a[key], b[key]), (i, key)
    band = reference.read(3, slice(4, 12))
    assert torch.equal(band["background"], native[3]["background"][:, 4:12])


def test_both_layouts_train_to_identical_losses(twins, tmp_path):
    from tests.conftest import run_cli

    losses = []
    for root in twins:
        run = tmp_path / Path(root).name
        args = [
            f"hydra.run.dir={run}",
            "data=hrrr_era5",
            f"data.root={root}",
            "data.grid=[16,16]",
            "data.train_years=[2020]",
            "data.val_years=[2021]",
            "data.hrrr_channels=[u10m,v10m,t2m,msl]",
            "data.era5_channels=[u850,v850,t850]",
            "data.num_workers=0",
            "data.batch_size=4",
            "model=songunet_tiny",
            "model.model_channels=8",
            "trainer.max_steps=3",
            "trainer.log_every=1",
            "trainer.val_every=3",
            "trainer.val_batches=1",
            "trainer.progress=false",
            "checkpoint=none",
            "schedule.warmup_steps=1",
            "deterministic=true",
        ]
        proc = run_cli(args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses.append([(r["step"], r["split"], r["loss"]) for r in rows if "loss" in r])
    assert len([r for r in losses[0] if r[1] == "train"]) == 3
    assert losses[0] == losses[1]
