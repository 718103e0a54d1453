"""Validation figures: written by rank 0, from fields gathered over the domain ranks."""

import matplotlib.image as mpimg
import numpy as np
import pytest

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


def test_radial_spectrum_finds_the_wavenumber_of_a_wave():
    from recipes.weather.plots import radial_spectrum

    y, x = np.mgrid[0:64, 0:64]
    k, p = radial_spectrum(np.sin(2 * np.pi * 5 * x / 64))
    assert k[np.argmax(p)] == 5
