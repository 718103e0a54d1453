"""StormCast data: the on-disk layout, the synthetic writer and HrrrEra5Dataset."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from framework.errors import DataError
from recipes.weather import layout, synthetic
from recipes.weather.dataset import HrrrEra5Dataset
from recipes.weather.synthetic import (
    DEFAULT_ERA5_CHANNELS,
    DEFAULT_HRRR_CHANNELS,
    DEFAULT_INVARIANTS,
    write_synthetic,
)
from tests.conftest import MarkerPayload

H, W, T, ROW_CHUNK = 16, 24, 30, 8
YEARS = (2020, 2021)
SMALL = dict(height=H, width=W, hours_per_year=T, years=YEARS, row_chunk=ROW_CHUNK)
HRRR = list(DEFAULT_HRRR_CHANNELS)
ERA5 = list(DEFAULT_ERA5_CHANNELS)
INV = list(DEFAULT_INVARIANTS)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("stormcast") / "store", **SMALL)


@pytest.fixture
def copy(store, tmp_path) -> Path:
    """A private copy of the small store, free to break."""
    return Path(shutil.copytree(store, tmp_path / "store"))


def make(root, *, years=YEARS, hrrr=HRRR, era5=ERA5, inv=INV, **kw) -> HrrrEra5Dataset:
    return HrrrEra5Dataset(root, years, hrrr, era5, inv, **kw)


def raw(root, source, year):
    group = zarr.open_group(str(layout.year_store(root, source, year)), mode="r")
    return group[layout.DATA_VAR][...], group[layout.TIME_VAR][...], group.attrs[layout.CHANNELS_ATTR]


def stats(root, source):
    return (np.load(layout.stats_file(root, source, "means")), np.load(layout.stats_file(root, source, "stds")))


# ---------------------------------------------------------------- layout / writer


def test_layout(store):
    for source, names in ((layout.HRRR, HRRR), (layout.ERA5, ERA5)):
        for year in YEARS:
            path = store / source / f"{year}.zarr"
            assert path == layout.year_store(store, source, year) and path.is_dir()
            group = zarr.open_group(str(path), mode="r")
            assert group.attrs["channels"] == names
            data, time = group["data"], group["time"]
            assert data.shape == (T, len(names), H, W) and data.dtype == np.float32
            assert data.chunks == (1, len(names), ROW_CHUNK, W)  # all of a store's channels by default
            assert time.shape == (T,) and time.dtype == np.int64
            jan1 = int(np.datetime64(f"{year}-01-01T00", "h").astype(np.int64))
            np.testing.assert_array_equal(time[...], jan1 + np.arange(T))
            assert np.isfinite(data[...]).all()
        means, stds = stats(store, source)
        assert means.shape == stds.shape == (len(names),) and np.issubdtype(means.dtype, np.floating)
        every = np.concatenate([raw(store, source, y)[0] for y in YEARS]).astype(np.float64)
        np.testing.assert_allclose(means, every.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(stds, every.std(axis=(0, 2, 3)), rtol=1e-3)
    inv = zarr.open_group(str(store / "invariants.zarr"), mode="r")
    assert inv.attrs["channels"] == INV
    assert inv["data"].shape == (len(INV), H, W) and inv["data"].dtype == np.float32
    assert inv["data"].chunks == (1, ROW_CHUNK, W)
    assert json.loads((store / "synthetic.json").read_text())["hrrr_channels"] == HRRR


def test_channels_have_physical_scales(store):
    means, stds = stats(store, layout.HRRR)
    m = dict(zip(HRRR, means))
    s = dict(zip(HRRR, stds))
    assert 250 < m["t2m"] < 310 and abs(m["u10m"]) < 10 and 9e4 < m["msl"] < 1.1e5
    assert s["msl"] > 50 * s["u10m"]  # so normalisation matters
    lsm, orog = zarr.open_group(str(store / "invariants.zarr"), mode="r")["data"][...]
    assert lsm.min() >= 0 and lsm.max() <= 1 and orog.min() >= 0 and orog.max() > 100


def test_channel_chunking_changes_no_sample_and_an_old_store_is_reused(store, tmp_path):
    one = write_synthetic(tmp_path / "one", **SMALL, channel_chunk=1)
    data = zarr.open_group(str(layout.year_store(one, layout.HRRR, YEARS[0])), mode="r")["data"]
    assert data.chunks == (1, 1, ROW_CHUNK, W)
    a, b = make(store, hrrr=["t2m", "u10m"]), make(one, hrrr=["t2m", "u10m"])
    for i in (0, 7, len(a) - 1):
        for (ka, va), (kb, vb) in zip(a[i].items(), b[i].items()):
            assert ka == kb and (torch.equal(va, vb) if torch.is_tensor(va) else va == vb)
    # a store written one channel per chunk (or before the key existed) serves the default request
    manifest = layout.manifest_file(one)
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "channel_chunk"}))
    assert write_synthetic(one, **SMALL) == one
    assert zarr.open_group(str(layout.year_store(one, layout.HRRR, YEARS[0])), mode="r")["data"].chunks[1] == 1
    with pytest.raises(ValueError, match="channel_chunk must be >= 0"):
        write_synthetic(tmp_path / "bad", **SMALL, channel_chunk=-1)


def test_write_is_idempotent(tmp_path):
    kw = dict(SMALL, hours_per_year=4, years=(2020,))
    root = tmp_path / "a" / "store"
    assert write_synthetic(root, **kw) == root
    manifest = root / "synthetic.json"
    stamp = manifest.stat().st_mtime_ns
    (root / "sentinel").write_text("x")
    assert write_synthetic(root, **kw) == root
    assert (root / "sentinel").exists() and manifest.stat().st_mtime_ns == stamp
    assert [p.name for p in root.parent.iterdir()] == ["store"]  # no temp dir left
    with pytest.raises(FileExistsError, match="other parameters"):
        write_synthetic(root, **dict(kw, seed=1))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a complete synthetic store"):
        write_synthetic(foreign, **kw)
    assert (foreign / "x").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    write_synthetic(empty, **kw)
    assert (empty / "synthetic.json").exists()
    for bad in (b"[1]", b"[" * 100_000 + b"]" * 100_000):  # a damaged manifest: someone else's store
        (foreign / "synthetic.json").write_bytes(bad)
        with pytest.raises(FileExistsError, match="not a complete synthetic store"):
            write_synthetic(foreign, **kw)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(out, params):
        (out / "hrrr").mkdir()
        raise RuntimeError("disk full")

    monkeypatch.setattr(synthetic, "_write_contents", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        write_synthetic(tmp_path / "store", **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_share_the_winner(tmp_path, monkeypatch):
    kw = dict(SMALL, hours_per_year=4, years=(2020,))
    root = tmp_path / "store"
    barrier = threading.Barrier(2, timeout=30)
    publish = synthetic._publish
    results, published = [], []

    def both_finish_then_publish(tmp, root_, params):
        barrier.wait()  # both copies are complete before either is renamed
        published.append(publish(tmp, root_, params))
        return published[-1]

    monkeypatch.setattr(synthetic, "_publish", both_finish_then_publish)
    threads = [threading.Thread(target=lambda: results.append(write_synthetic(root, **kw))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [root, root] and sorted(published) == [False, True]
    assert [p.name for p in tmp_path.iterdir()] == ["store"]
    assert make(root, years=(2020,))[0]["state"].shape == (len(HRRR), H, W)


def test_a_killed_writers_partial_copy_is_removed_by_the_next_write(tmp_path):
    """kill -9 leaves the hidden partial copy; the next write beside it on this host removes it,
    and never a live writer's copy (this process's own) or another host's."""
    import signal
    import subprocess
    import sys

    from tests.conftest import wait_for_files

    root = tmp_path / "store"
    args = ["--root", str(root), "--height", "128", "--width", "128", "--years", "2020", "--hours-per-year", "400"]
    proc = subprocess.Popen([sys.executable, "-m", "recipes.weather.synthetic", *args], stderr=subprocess.PIPE)
    try:
        wait_for_files(proc, tmp_path, ".store.tmp-*/*", "the synthetic write")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    (dead,) = tmp_path.glob(".store.tmp-*")
    prefix = synthetic._tmp_prefix(root)
    live = tmp_path / f"{prefix}{os.getpid()}-x"
    # another host's, whatever its pid means here: one named like this host plus "-12"
    other = tmp_path / f"{prefix[:-1]}_12-{proc.pid}-x"
    for d in (live, other):
        d.mkdir()
    assert write_synthetic(root, **SMALL) == root
    assert not dead.exists() and live.is_dir() and other.is_dir()


def test_no_hosts_partial_copy_prefix_begins_another_hosts(monkeypatch):
    """node-1 must not take node-12's partial copies for its own (and read "12" as a pid)."""
    import socket

    prefix = {}
    for host in ("node-1", "node-12", "node", "node.1"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        prefix[host] = synthetic._tmp_prefix(Path("store"))
    assert len(set(prefix.values())) == len(prefix)
    for a in prefix.values():
        assert not any(b != a and b.startswith(a) for b in prefix.values()), prefix


def test_cli(tmp_path, capsys):
    root = tmp_path / "cli"
    args = ["--root", str(root), "--height", "8", "--width", "12", "--years", "2020", "--hours-per-year", "3"]
    args += ["--hrrr-channels", "t2m", "u10m", "--era5-channels", "t850", "--row-chunk", "4"]
    assert synthetic.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {root}") and str(root / "hrrr" / "2020.zarr") in out
    assert zarr.open_group(str(root / "hrrr" / "2020.zarr"), mode="r")["data"].shape == (3, 2, 8, 12)
    assert synthetic.main(args) == 0
    assert "already complete" in capsys.readouterr().out


def test_the_cli_defaults_write_the_store_data_synthetic_asks_for(tmp_path, compose):
    """The documented command, then the default config on that root: the task finds the store
    complete (not "written with other parameters") and trains on it."""
    from framework import registry
    from framework.config.validate import validate
    from framework.distributed.env import DistEnv

    root = tmp_path / "demo"
    assert synthetic.main(["--root", str(root), "--height", "16", "--width", "16", "--years", "2020", "2021"]) == 0
    written = (root / "synthetic.json").stat().st_mtime_ns
    registry.load_providers()
    run = validate(compose(["data=synthetic", f"data.root={root}", "data.grid=[16,16]"]))
    task = registry.tasks.entry(run.task.name).builder(run, DistEnv(), torch.device("cpu"))
    assert len(task.train_dataset()) > 0 and len(task.val_dataset()) > 0
    assert (root / "synthetic.json").stat().st_mtime_ns == written  # used as it was, not rewritten


# ---------------------------------------------------------------- dataset values


@pytest.mark.parametrize("background_time", ["input", "target"])
def test_values_match_zarr(store, background_time):
    dt = 2
    ds = make(store, dt=dt, background_time=background_time)
    assert ds.layout == "native" and ds.background_time == background_time
    assert ds.grid == (H, W) and ds.channel_names == {"hrrr": HRRR, "era5": ERA5, "invariants": INV}
    hm, hs = stats(store, layout.HRRR)
    em, es = stats(store, layout.ERA5)
    np.testing.assert_array_equal(ds.hrrr_means, hm)
    np.testing.assert_array_equal(ds.hrrr_stds, hs)
    inv = zarr.open_group(str(store / "invariants.zarr"), mode="r")["data"][...].astype(np.float64)
    inv_norm = (inv - inv.mean(axis=(1, 2), keepdims=True)) / inv.std(axis=(1, 2), keepdims=True)
    raw_ds = make(store, dt=dt, normalize=False, background_time=background_time)
    shift = 0 if background_time == "input" else dt  # ERA5 at the state (input) or the target time
    for i in (0, 7, len(ds) // 2, len(ds) - 1):
        year, t = ds.locate(i)
        h, hours, _ = raw(store, layout.HRRR, year)
        e, _, _ = raw(store, layout.ERA5, year)
        assert ds.background_hour(i) == hours[t + shift]
        sample = ds[i]
        assert sample["index"] == i
        for key, value in sample.items():
            if key != "index":
                assert value.dtype == torch.float32
        expect = {
            "state": (h[t] - hm[:, None, None]) / hs[:, None, None],
            "target": (h[t + dt] - hm[:, None, None]) / hs[:, None, None],
            "background": (e[t + shift] - em[:, None, None]) / es[:, None, None],
            "invariants": inv_norm,
        }
        for key, value in expect.items():
            np.testing.assert_allclose(sample[key].numpy(), value, rtol=1e-5, atol=1e-5, err_msg=key)
        unnormalized = raw_ds[i]
        np.testing.assert_array_equal(unnormalized["state"].numpy(), h[t])
        np.testing.assert_array_equal(unnormalized["background"].numpy(), e[t + shift])
    raw_inv = make(store, invariant_norm="none")[0]["invariants"].numpy()
    np.testing.assert_array_equal(raw_inv, inv.astype(np.float32))  # invariant_norm=none: store units


def test_pairs_stay_within_a_year(store):
    for dt in (1, 3):
        ds = make(store, dt=dt)
        assert len(ds) == len(YEARS) * (T - dt)
        assert ds.locate(T - dt - 1) == (2020, T - dt - 1) and ds.locate(T - dt) == (2021, 0)
        by_time = {ds.sample_times(i)[0]: i for i in range(len(ds))}
        chained = [i for i in range(len(ds)) if ds.sample_times(i)[1] in by_time]
        assert len(chained) == len(YEARS) * (T - 2 * dt)
        assert all(ds.sample_times(i)[1] - ds.sample_times(i)[0] == dt for i in range(len(ds)))
        for i in chained[:: max(1, len(chained) // 8)] + chained[-1:]:
            j = by_time[ds.sample_times(i)[1]]
            assert ds.locate(j) == (ds.locate(i)[0], ds.locate(i)[1] + dt)
            torch.testing.assert_close(ds[i]["target"], ds[j]["state"], rtol=0, atol=0)


def test_pairs_skip_gaps(copy):
    for source in layout.SOURCES:  # drop the hour after index 9 from 2020
        group = zarr.open_group(str(layout.year_store(copy, source, 2020)), mode="r+")
        time = group["time"][...]
        time[10:] += 1
        group["time"][...] = time
    ds = make(copy, dt=1)
    assert len(ds) == (T - 2) + (T - 1)
    assert all(ds.sample_times(i)[1] - ds.sample_times(i)[0] == 1 for i in range(len(ds)))


def test_pairs_cross_between_contiguous_listed_years(copy):
    """2021's hours made to follow 2020's last: the pair (2020's last hour, 2021's first) exists."""
    last = raw(copy, layout.HRRR, 2020)[1][-1]
    for source in layout.SOURCES:
        group = zarr.open_group(str(layout.year_store(copy, source, 2021)), mode="r+")
        group["time"][...] = last + 1 + np.arange(T)
    ds = make(copy, dt=1)
    assert len(ds) == 2 * (T - 1) + 1
    i = T - 1  # after 2020's T - 1 inner pairs
    assert ds.sample_times(i) == (last, last + 1) and ds.locate(i) == (2020, T - 1)
    h2021 = raw(copy, layout.HRRR, 2021)[0]
    hm, hs = stats(copy, layout.HRRR)
    np.testing.assert_allclose(
        ds[i]["target"].numpy(), (h2021[0] - hm[:, None, None]) / hs[:, None, None], rtol=1e-5, atol=1e-5
    )
    assert len(make(copy, years=(2020,), dt=1)) == T - 1  # 2021 not listed: not opened, no crossing


def test_channel_selection_by_name(store):
    full = make(store)
    sub = make(store, hrrr=["msl", "t2m"], era5=["t850", "u850"], inv=["orog"])
    assert sub.channel_names == {"hrrr": ["msl", "t2m"], "era5": ["t850", "u850"], "invariants": ["orog"]}
    np.testing.assert_array_equal(sub.hrrr_means, full.hrrr_means[[3, 2]])
    np.testing.assert_array_equal(sub.hrrr_stds, full.hrrr_stds[[3, 2]])
    a, b = full[11], sub[11]
    for key, idx in (("state", [3, 2]), ("target", [3, 2]), ("background", [2, 0]), ("invariants", [1])):
        torch.testing.assert_close(b[key], a[key][idx], rtol=0, atol=0)


def test_read_rows_equals_slice(store):
    ds = make(store, hrrr=["t2m", "u10m"], dt=2)
    i = 5
    full = ds.read(i)
    assert all(torch.equal(full[k], ds[i][k]) for k in ("state", "target", "background", "invariants"))
    for rows in (slice(0, ROW_CHUNK), slice(3, 11), slice(ROW_CHUNK, None), slice(-4, None), slice(None)):
        part = ds.read(i, rows)
        assert part["index"] == i
        for key in ("state", "target", "background", "invariants"):
            torch.testing.assert_close(part[key], full[key][:, rows], rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows must be a contiguous slice"):
        ds.read(i, slice(0, H, 2))


def test_row_read_touches_fewer_chunks(store, zarr_reads):
    calls = zarr_reads
    # one uncompressed (1, channels, ROW_CHUNK, W) float32 chunk of either source
    chunk_bytes = {ROW_CHUNK * W * 4 * len(names) for names in (HRRR, ERA5)}

    def payload():
        return [c for c in calls if c[0].startswith("data/c") and c[1] in chunk_bytes]

    ds = make(store)
    assert payload() == []  # validation reads no sample data
    ds.read(0)  # opens the stores and caches the invariants
    calls.clear()
    ds.read(1)
    full_chunks, full_bytes = len(payload()), sum(n for _, n in calls)
    calls.clear()
    ds.read(1, slice(0, ROW_CHUNK))
    part_chunks, part_bytes = len(payload()), sum(n for _, n in calls)
    n_fields = 3  # state + target + background, all channels in one chunk
    assert full_chunks == n_fields * (H // ROW_CHUNK)
    assert part_chunks == n_fields
    assert part_bytes < full_bytes


def test_batched_read_equals_the_samples_read_one_by_one(store, zarr_reads):
    """read_many (the DataLoader's __getitems__): the same samples, across both years, with a
    channel subset and a band of rows, from one zarr selection per source and year store."""
    ds = make(store, hrrr=["t2m", "u10m"], era5=["t850", "u850"], dt=2)
    picked = [len(ds) - 1, 0, 5, T, 3, 5]  # unsorted, a repeat, both years
    for rows in (None, slice(3, 11)):
        many = ds.read_many(picked, rows)
        assert [m["index"] for m in many] == picked
        for i, got in zip(picked, many):
            one = ds.read(i, rows)
            for key in ("state", "target", "background", "invariants"):
                torch.testing.assert_close(got[key], one[key], rtol=0, atol=0)
    calls = zarr_reads
    calls.clear()
    ds.read_many([1, 2, 3, 4])
    batch_bytes = sum(n for _, n in calls)
    calls.clear()
    for i in (1, 2, 3, 4):
        ds.read(i)
    assert batch_bytes < sum(n for _, n in calls)  # the shared times (state of i+2 = target of i) read once
    loader = torch.utils.data.DataLoader(ds, batch_size=4)  # takes __getitems__
    batch = next(iter(loader))
    torch.testing.assert_close(batch["state"][2], ds[2]["state"], rtol=0, atol=0)


# ---------------------------------------------------------------- bad data


def assert_data_error(match_all, fn):
    with pytest.raises(DataError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 3
    for part in match_all:
        assert str(part) in message, (part, message)
    return message


def test_missing_year(store, copy):
    assert_data_error([store / "hrrr" / "2019.zarr"], lambda: make(store, years=(2020, 2019)))
    shutil.rmtree(copy / "era5" / "2021.zarr")
    assert_data_error([copy / "era5" / "2021.zarr"], lambda: make(copy))


def test_missing_channel(store):
    assert_data_error(
        ["'refc'", store / "hrrr" / "2020.zarr", "u10m, v10m, t2m, msl"], lambda: make(store, hrrr=["t2m", "refc"])
    )
    assert_data_error(["'z500'", store / "era5" / "2020.zarr", "t850"], lambda: make(store, era5=["z500"]))
    assert_data_error(["'soil'", store / "invariants.zarr", "orog"], lambda: make(store, inv=["lsm", "soil"]))


def test_bad_stats(copy):
    means = layout.stats_file(copy, layout.HRRR, "means")
    np.save(means, np.zeros(5, dtype=np.float32))
    assert_data_error([means, "5 values", "4 channels", copy / "hrrr" / "2020.zarr"], lambda: make(copy))
    stds = layout.stats_file(copy, layout.ERA5, "stds")
    stds.unlink()
    np.save(means, np.zeros(4, dtype=np.float32))
    assert_data_error([stds, "not found"], lambda: make(copy))


def test_stats_that_are_no_npy_array_or_no_regular_file_are_one_data_error(copy):
    """An .npz saved under the .npy's name (np.load reads it as an archive), a named pipe (an
    open() that waits forever for a writer) and a link to /dev/zero (a read that never ends):
    each is one DataError naming the file, and the last two return at once."""
    means = layout.stats_file(copy, layout.HRRR, "means")
    with open(means, "wb") as f:
        np.savez(f, means=np.zeros(4, dtype=np.float32))
    assert_data_error([means, "expected a .npy array, found a NpzFile"], lambda: make(copy))
    means.unlink()
    os.mkfifo(means)
    assert_data_error([means, "not a regular file"], lambda: make(copy))
    means.unlink()
    means.symlink_to("/dev/zero")
    assert_data_error([means, "not a regular file"], lambda: make(copy))


def test_non_finite_sample(copy):
    group = zarr.open_group(str(layout.year_store(copy, layout.HRRR, 2021)), mode="r+")
    group["data"][7, 2] = np.nan  # t2m, time index 7
    group = zarr.open_group(str(layout.year_store(copy, layout.ERA5, 2020)), mode="r+")
    group["data"][4, 1, 3, 5] = np.inf  # v850, time index 4
    ds = make(copy, dt=1)  # validation reads no sample data, so this still works
    index = {ds.locate(i): i for i in range(len(ds))}
    path = copy / "hrrr" / "2021.zarr"
    assert_data_error([path, "'data'", "'t2m'", "time index 7"], lambda: ds[index[2021, 7]])  # state
    assert_data_error([path, "'t2m'", "time index 7"], lambda: ds[index[2021, 6]])  # target
    path = copy / "era5" / "2020.zarr"
    assert_data_error([path, "'data'", "'v850'", "time index 4"], lambda: ds[index[2020, 4]])  # background at t
    ds[index[2020, 3]]
    ds[index[2021, 8]]
    target_time = make(copy, dt=1, background_time="target")
    assert_data_error([path, "'v850'", "time index 4"], lambda: target_time[index[2020, 3]])  # background at t+dt
    target_time[index[2020, 4]]


def test_year_too_short(store):
    assert_data_error([store / "hrrr" / "2020.zarr", "'time'", f"{T} hours"], lambda: make(store, dt=T))


def test_grids_differ(copy):
    path = layout.year_store(copy, layout.ERA5, 2021)
    shutil.rmtree(path)
    group = zarr.create_group(str(path), attributes={"channels": ERA5})
    group.create_array("data", shape=(T, len(ERA5), H, W + 2), dtype="float32", chunks=(1, 1, ROW_CHUNK, W + 2))
    group.create_array("time", shape=(T,), dtype="int64")[...] = raw(copy, layout.ERA5, 2020)[1] + 8784
    assert_data_error([path, f"({H}, {W + 2})", f"({H}, {W})", copy / "hrrr" / "2020.zarr"], lambda: make(copy))


@pytest.mark.parametrize("damage", ["truncated", "index"])
def test_a_damaged_chunk_is_one_line_naming_the_store(copy, damage):
    """A chunk that zarr cannot decode (its checksum, its codec) is a data error, not a traceback."""
    path = layout.year_store(copy, layout.HRRR, YEARS[0])
    chunks = sorted(p for p in (path / layout.DATA_VAR / "c").rglob("*") if p.is_file())
    for chunk in chunks:  # sample 0 reads the first; damage them all
        data = chunk.read_bytes()
        # "index": a bit of the shard's chunk index flipped, which its checksum catches
        chunk.write_bytes(data[:100] if damage == "truncated" else data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    assert_data_error(
        [f"{path}: variable 'data' cannot be read at time indices", "a damaged chunk?"], lambda: make(copy)[0]
    )


def _shard_of(inner: bytes, n_inner: int) -> bytes:
    """A shard whose ``n_inner`` chunks all hold ``inner``: the chunks, then the index ((offset,
    nbytes) per chunk, little-endian uint64) and its crc32c, as the store's index codecs say."""
    import google_crc32c  # zarr's own checksum dependency

    index = np.array([(k * len(inner), len(inner)) for k in range(n_inner)], dtype="<u8").tobytes()
    return inner * n_inner + index + np.uint32(google_crc32c.value(index)).tobytes()


@pytest.mark.parametrize(
    "name,where",
    [("numcodecs.pickle", "array"), ("pickle", "array"), ("numcodecs.pickle", "shard")],
    ids=["numcodecs.pickle", "pickle", "numcodecs.pickle-in-shard"],
)
def test_a_store_naming_a_pickle_codec_is_refused_unread(copy, monkeypatch, name, where):
    """Stores come from others and must never run code: zarr's v3 codec registry holds no pickle
    codec (docs/data.md), whether the array's codecs or its shards' inner codecs name it."""
    import numcodecs.pickles

    # numcodecs >= 0.16 refuses Pickle.decode by default (older ones have no switch): allowed here, so
    # that zarr's refusal is what is tested, and a zarr that took the codec would run the payload
    monkeypatch.setattr(numcodecs.pickles, "ALLOW_UNSAFE_PICKLE_DECODE", True, raising=False)
    path = layout.year_store(copy, layout.HRRR, YEARS[0])  # where sample 0 is read from
    meta_file = path / layout.DATA_VAR / "zarr.json"
    meta = json.loads(meta_file.read_text())
    sharding = meta["codecs"][0]["configuration"]
    marker = copy.parent / "marker"
    blob = pickle.dumps(MarkerPayload(marker))
    codec = {"name": name, "configuration": {"protocol": pickle.HIGHEST_PROTOCOL}}  # as zarr writes numcodecs'
    if where == "array":  # the chunk (the former shard) is the pickle
        meta["codecs"] = [codec]
        chunk_bytes = blob
    else:  # every inner chunk of the shard is the pickle; the index is intact
        sharding["codecs"] = [codec]
        n_inner = int(np.prod(np.array(meta["chunk_grid"]["configuration"]["chunk_shape"]) // sharding["chunk_shape"]))
        chunk_bytes = _shard_of(blob, n_inner)
    meta_file.write_text(json.dumps(meta))
    chunks = [p for p in (path / layout.DATA_VAR / "c").rglob("*") if p.is_file()]
    assert chunks
    for chunk in chunks:
        chunk.write_bytes(chunk_bytes)
    # "<store>: cannot open variable 'data' (UnknownCodecError: Unknown codec: 'numcodecs.pickle')"
    message = assert_data_error([f"{path}: cannot open variable 'data'", f"'{name}'"], lambda: make(copy)[0])
    assert not marker.exists(), message
    pickle.loads(blob)  # the control: the same bytes, unpickled, do write the marker
    assert marker.exists()


# ---------------------------------------------------------------- learnability


def test_dynamics_are_learnable(tmp_path):
    """A linear 5-point stencil on (state, background, invariants) clearly beats persistence on a held-out year."""
    root = write_synthetic(tmp_path / "big", height=32, width=32, hours_per_year=96)

    def features(year):
        h = raw(root, layout.HRRR, year)[0]
        e = raw(root, layout.ERA5, year)[0]
        hm, hs = stats(root, layout.HRRR)
        em, es = stats(root, layout.ERA5)
        h = (h - hm[:, None, None]) / hs[:, None, None]
        e = (e - em[:, None, None]) / es[:, None, None]
        inv = zarr.open_group(str(root / "invariants.zarr"), mode="r")["data"][...]
        inv = (inv - inv.mean(axis=(1, 2), keepdims=True)) / inv.std(axis=(1, 2), keepdims=True)
        x, y, b = h[:-1], h[1:], e[1:]
        n = len(x)
        stencil = [x] + [np.roll(x, s, axis=a) for s in (1, -1) for a in (-1, -2)]
        f = np.concatenate(stencil + [b, np.broadcast_to(inv, (n,) + inv.shape), np.ones_like(x[:, :1])], axis=1)

        def flat(a):
            return a.transpose(0, 2, 3, 1).reshape(-1, a.shape[1]).astype(np.float64)

        return flat(f), flat(y), flat(x)

    f_train, y_train, _ = features(2020)
    f_test, y_test, x_test = features(2021)
    coef, *_ = np.linalg.lstsq(f_train, y_train, rcond=None)
    persistence = np.sqrt(np.mean((y_test - x_test) ** 2))
    linear = np.sqrt(np.mean((y_test - f_test @ coef) ** 2))
    assert persistence > 0.03
    assert linear < 0.6 * persistence, (linear, persistence)


# ---------------------------------------------------------------- workers


def test_pickles_and_loads_in_spawned_workers(store):
    ds = make(store, hrrr=["t2m", "msl"], dt=2)
    first = ds[0]  # open the stores in this process first
    blob = pickle.dumps(ds)
    assert len(blob) < 100_000
    clone = pickle.loads(blob)
    assert clone._handles is None
    torch.testing.assert_close(clone[0]["state"], first["state"], rtol=0, atol=0)

    subset = torch.utils.data.Subset(ds, range(8))
    loader = torch.utils.data.DataLoader(subset, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 2
    state = torch.cat([b["state"] for b in batches])
    assert state.shape == (8, 2, H, W)
    torch.testing.assert_close(state, torch.stack([ds[i]["state"] for i in range(8)]), rtol=0, atol=0)
    assert torch.cat([b["index"] for b in batches]).tolist() == list(range(8))
