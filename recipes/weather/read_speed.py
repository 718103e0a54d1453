"""Read speed of HrrrEra5Dataset in the native and the PhysicsNeMo layout, on the same synthetic data.

Writes one synthetic year twice (``write_synthetic(latlon=True)`` and
``write_synthetic(layout="physicsnemo")``: the same samples), then times, per layout, opening
the dataset (validation, and for PhysicsNeMo the interpolation weights), whole-sample reads
and a half-grid row band (what one of two domain-parallel ranks reads), in samples/s on
this process (no DataLoader workers). The numbers in docs/data.md come from::

    python -m recipes.weather.read_speed --root /tmp/read_speed --height 256 --width 320 --hours 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from recipes.weather.dataset import HrrrEra5Dataset
from recipes.weather.synthetic import write_synthetic

LEVELS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 20, 25, 30)
# the 99 HRRR channels of PhysicsNeMo's StormCast recipe, the paper's 26 ERA5 channels
HRRR_99 = (
    ["u10m", "v10m", "t2m", "msl"]
    + [f"{v}{lev}" for v in "uvtqz" for lev in LEVELS]
    + [f"p{lev}" for lev in LEVELS[:14]]
    + ["refc"]
)
ERA5_26 = ["u10m", "v10m", "t2m", "tcwv", "sp", "msl"] + [f"{v}{p}" for v in "uvztq" for p in (1000, 850, 500, 250)]


def _time_reads(ds: HrrrEra5Dataset, rows, repeats: int) -> float:
    """Median samples/s over ``repeats`` passes through every sample."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(len(ds)):
            ds.read(i, rows)
        rates.append(len(ds) / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure(
    root: Path, height: int, width: int, hours: int, hrrr_spacing: float, era5_spacing: float, repeats: int = 3
) -> list[dict]:
    kw = dict(
        height=height,
        width=width,
        hours_per_year=hours,
        years=(2020,),
        hrrr_channels=HRRR_99,
        era5_channels=ERA5_26,
        hrrr_spacing=hrrr_spacing,
        era5_spacing=era5_spacing,
    )
    stores = {
        "native": (root / "native", dict(latlon=True)),
        "physicsnemo": (root / "physicsnemo", dict(layout="physicsnemo", missing=[])),
    }
    out = []
    for name, (path, extra) in stores.items():
        t0 = time.perf_counter()
        write_synthetic(path, **kw, **extra)
        written = time.perf_counter() - t0
        t0 = time.perf_counter()
        ds = HrrrEra5Dataset(path, [2020], HRRR_99, ERA5_26, ["lsm", "orog"], grid=(height, width))
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        ds.read(0)  # opens the stores, reads the invariants (and builds the weights after pickling)
        first = time.perf_counter() - t0
        full = _time_reads(ds, None, repeats)
        band = _time_reads(ds, slice(0, height // 2), repeats)
        mb = (2 * len(HRRR_99) + len(ERA5_26) + 2) * height * width * 4 / 1e6
        out.append(
            dict(
                layout=name,
                write_s=written,
                open_s=opened,
                first_read_s=first,
                samples=len(ds),
                samples_per_s=full,
                band_samples_per_s=band,
                sample_mb=mb,
            )
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.weather.read_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="scratch directory for the two stores (reused if present)")
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--hours", type=int, default=8, help="hours in the year (samples = hours - 1)")
    ap.add_argument("--hrrr-spacing", type=float, default=0.03, help="degrees between HRRR points (~3 km)")
    ap.add_argument("--era5-spacing", type=float, default=0.25, help="degrees of the ERA5 grid")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = measure(
        Path(args.root), args.height, args.width, args.hours, args.hrrr_spacing, args.era5_spacing, args.repeats
    )
    print(
        f"{args.height}x{args.width}, {len(HRRR_99)} HRRR + {len(ERA5_26)} ERA5 + 2 invariant channels, "
        f"{rows[0]['sample_mb']:.1f} MB per sample (float32), {rows[0]['samples']} samples"
    )
    print(f"{'layout':12s} {'write s':>8s} {'open s':>7s} {'1st read s':>10s} {'samples/s':>10s} {'half band/s':>12s}")
    for r in rows:
        print(
            f"{r['layout']:12s} {r['write_s']:8.1f} {r['open_s']:7.2f} {r['first_read_s']:10.2f} "
            f"{r['samples_per_s']:10.2f} {r['band_samples_per_s']:12.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
