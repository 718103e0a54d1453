"""Validation figures: written by rank 0, from fields gathered over the domain ranks, in physical
units with their units, valid time and persistence; and synthetic data that gives the error panel
no edge ring of its own."""

import re

import matplotlib.image as mpimg
import numpy as np
import pytest
from PIL import Image

from recipes.weather import layout, plots
from tests.conftest import run_layout

pytestmark = pytest.mark.timeout(600)

EXTRA = [
    "data.grid=[16,16]",
    "data.hours_per_year=48",
    "data.batch_size=4",
    "model.model_channels=8",
    "trainer.val_every=3",
    "trainer.val_batches=1",
    "trainer.figures=true",
]


def png_text(path) -> dict:
    with Image.open(path) as im:
        return dict(im.text)


def test_domain_run_draws_the_figure_of_a_single_process_run(tmp_path):
    extra = [*EXTRA, f"data.root={tmp_path / 'data'}"]
    run_layout(["parallel=none"], 1, tmp_path / "one", 3, extra)
    run_layout(["parallel=domain"], 2, tmp_path / "two", 3, extra)
    one = sorted((tmp_path / "one" / "plots").glob("val_*.png"))
    two = sorted((tmp_path / "two" / "plots").glob("val_*.png"))
    assert (tmp_path / "two" / "plots" / "spectrum_00000003_u10m.png").is_file()
    assert [p.name for p in one] == [p.name for p in two] == ["val_00000003_u10m.png"]
    a, b = mpimg.imread(one[0]), mpimg.imread(two[0])
    assert a.shape == b.shape
    # Same fields (to float tolerance), same colours: the gathered figure is the whole field.
    assert np.mean(np.abs(a - b) > 1 / 255) < 0.001

    # What the task put in: the sample's valid time and lead (validation is 2021, one hour ahead),
    # persistence and both errors, colour bars in m/s; the spectrum per grid cell (synthetic grid).
    text = png_text(one[0])
    assert re.search(r"step 3: first validation sample, valid 2021-01-\d\d \d\d:00 UTC, \+1 h$", text["Title"])
    panels = dict(p.split(": ", 1) for p in text["Description"].split("; "))
    assert panels == {
        "u10m truth": "u10m [m s⁻¹]",
        "u10m prediction": "u10m [m s⁻¹]",
        "u10m persistence": "u10m [m s⁻¹]",
        "prediction − truth": "u10m error [m s⁻¹]",
        "persistence − truth": "u10m error [m s⁻¹]",
    }
    spectrum = png_text(tmp_path / "one" / "plots" / "spectrum_00000003_u10m.png")
    assert spectrum["Title"] == text["Title"]
    assert spectrum["Description"] == "u10m spectrum: x wavenumber [cycles per grid cell], y power [(m s⁻¹)²]"


@pytest.mark.parametrize(
    "name, unit",
    [
        ("u10m", "m s⁻¹"),
        ("v80m", "m s⁻¹"),
        ("u850", "m s⁻¹"),
        ("v13", "m s⁻¹"),  # a HRRR hybrid level
        ("t2m", "K"),
        ("t500", "K"),
        ("msl", "Pa"),
        ("sp", "Pa"),
        ("p20", "Pa"),
        ("q500", "kg kg⁻¹"),
        ("q1", "kg kg⁻¹"),
        ("z500", "m² s⁻²"),  # ERA5's geopotential
        ("z1", None),  # a hybrid level: geopotential or its height, the stores do not say
        ("refc", "dBZ"),
        ("tcwv", "kg m⁻²"),
        ("abi13", "K"),  # an infrared band: brightness temperature
        ("abi02", None),  # a visible band: reflectance
        ("lsm", None),
        ("tp", None),
        ("w500", None),  # vertical velocity: Pa/s in ERA5, m/s elsewhere
        ("z10m", None),
        ("whatever7", None),
    ],
)
def test_channel_units_know_the_stormcast_names_and_leave_the_rest_blank(name, unit):
    assert plots.channel_units(name) == unit


def test_field_figure_shows_units_valid_time_persistence_and_both_errors():
    truth = np.linspace(270, 290, 20 * 24).reshape(20, 24)
    fig = plots.make_field_figure(
        "t2m",
        truth,
        truth + 0.5,
        "step 10, " + plots.valid_label(447630, 1),
        persistence=truth - 2.0,
        units="K",
    )
    titles = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert fig.get_suptitle() == "step 10, valid 2021-01-24 06:00 UTC, +1 h"
    assert set(titles) == {
        "t2m truth",
        "t2m prediction",
        "t2m persistence",
        "prediction − truth",
        "persistence − truth",
    }
    bars = {t: ax.images[0].colorbar.ax.get_ylabel() for t, ax in titles.items()}
    assert bars["t2m persistence"] == bars["t2m truth"] == "t2m [K]"
    assert bars["persistence − truth"] == "t2m error [K]"
    # the fields share the truth's colour scale, the errors one symmetric scale
    assert titles["t2m persistence"].images[0].get_clim() == titles["t2m truth"].images[0].get_clim()
    lo, hi = titles["prediction − truth"].images[0].get_clim()
    assert (lo, hi) == titles["persistence − truth"].images[0].get_clim() and lo == -hi >= -2.0
    np.testing.assert_allclose(titles["persistence − truth"].images[0].get_array(), -2.0)
    scores = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "RMSE [K]\n  prediction: 0.5\n  persistence: 2\n" in scores
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_an_unknown_unit_is_left_out_rather_than_guessed():
    fig = plots.make_field_figure("whatever", np.zeros((8, 8)), np.ones((8, 8)), "t", units=None)
    bars = [ax.images[0].colorbar.ax.get_ylabel() for ax in fig.axes if ax.images]
    assert bars == ["whatever", "whatever", "whatever error"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_valid_label():
    assert plots.valid_label(0, 1) == "valid 1970-01-01 00:00 UTC, +1 h"
    jan2 = int(np.datetime64("2021-01-02T06", "h").astype(np.int64))
    assert plots.valid_label(jan2, 6) == "valid 2021-01-02 06:00 UTC, +6 h"


def test_radial_spectrum_finds_the_wavenumber_of_a_wave():
    y, x = np.mgrid[0:64, 0:96]
    k, p = plots.radial_spectrum(np.sin(2 * np.pi * 12 * x / 96) + np.sin(2 * np.pi * 4 * y / 64))
    top = sorted(k[np.argsort(p)[-2:]])
    assert top == pytest.approx([4 / 64, 12 / 96])  # cycles per grid cell, whichever axis
    assert k.max() == pytest.approx(0.5)  # up to the Nyquist wavenumber of the shorter axis


def test_spectrum_axis_is_in_cycles_per_km_when_the_spacing_is_known():
    field = np.sin(2 * np.pi * 8 * np.arange(64) / 64)[None, :].repeat(32, 0)  # 8 cycles on 64 cells
    fig = plots.make_spectra_figure("t2m", {"truth": field}, "t", units="K", spacing_km=3.0)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "wavenumber [cycles per km]" and ax.get_ylabel() == "power [K²]"
    k, p = ax.lines[0].get_data()
    assert k[np.argmax(p)] == pytest.approx(8 / 64 / 3.0)  # a 24 km wave
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_grid_spacing_is_hrrr_s_for_real_stormcast_stores_and_unknown_for_synthetic_ones(tmp_path):
    assert plots.grid_spacing_km(tmp_path, layout.STORMCAST) == 3.0
    assert plots.grid_spacing_km(tmp_path, layout.STORMSCOPE) is None
    layout.manifest_file(tmp_path).write_text("{}")  # a synthetic store
    assert plots.grid_spacing_km(tmp_path, layout.STORMCAST) is None


# ---------------------------------------------------------------- the edge ring


def test_synthetic_fields_have_nothing_at_the_edges_for_a_ring_to_come_from(tmp_path):
    """The synthetic domain is periodic and the model pads with zeros. That is no source of an error
    ring along the edges because the fields continue smoothly across the wrap (the step from the
    last column to the first is an ordinary neighbour step, so what the wrap carries in is what the
    edge's own neighbourhood predicts) and the hourly change, what the model must predict, is no
    larger at the edges than inside. A ring in the error panel is the network's own (docs)."""
    import zarr

    from recipes.weather.synthetic import write_synthetic

    root = write_synthetic(tmp_path / "data", height=32, width=32, hours_per_year=96, years=(2021,))
    h = zarr.open_group(str(layout.year_store(root, layout.HRRR, 2021)), mode="r")["data"][...].astype(np.float64)
    h /= h.std(axis=(0, 2, 3), keepdims=True)  # each channel in its own standard deviations

    def rms(a):
        return float(np.sqrt(np.mean(np.square(a))))

    for axis in (-1, -2):  # across columns, across rows
        inner = rms(np.diff(h, axis=axis))
        wrap = rms(np.take(h, 0, axis=axis) - np.take(h, -1, axis=axis))
        assert 0.5 * inner < wrap < 1.5 * inner, (axis, wrap, inner)
    change = h[1:] - h[:-1]
    edge = np.zeros(h.shape[-2:], bool)
    edge[0] = edge[-1] = edge[:, 0] = edge[:, -1] = True
    assert 0.8 < rms(change[..., edge]) / rms(change[..., ~edge]) < 1.25
