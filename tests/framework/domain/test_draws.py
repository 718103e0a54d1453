"""Keyed random draws: the same numbers however the field is split, and good normals."""

from __future__ import annotations

import math
import random

import pytest
import torch

from framework.domain import draws

M32 = 0xFFFFFFFF


def _py_mix(h: int) -> int:
    """lowbias32 in Python's unbounded ints: the reference the int64 tensor version must match."""
    h &= M32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & M32
    return h ^ (h >> 16)


def _py_fold(*key: int) -> int:
    h = 0x9E3779B9
    for k in key:
        for part in (k & M32, (k >> 32) & M32):
            h = _py_mix(h ^ _py_mix(part + 0x632BE5AB))
    return h


def _py_field_value(key, index: int) -> float:
    """One element of field_normal, from the documented recipe: hash -> 24-bit uniforms -> Box-Muller."""
    k = _py_fold(*key) if isinstance(key, tuple) else _py_fold(key)

    def bits(stream):
        return _py_mix(_py_mix(index ^ k) ^ _py_fold(k, stream))

    u1 = ((bits(1) >> 8) + 0.5) / 2**24
    u2 = ((bits(2) >> 8) + 0.5) / 2**24
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def _ks_normal(z: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of the sample ``z`` to the standard normal."""
    z = z.double().flatten().sort().values
    n = z.numel()
    cdf = torch.special.ndtr(z)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())


# -- the hash ----------------------------------------------------------------------------------
def test_tensor_hash_equals_the_unbounded_integer_hash():
    # Including values near 2**32, where a naive int64 product (h * c) would overflow.
    rng = random.Random(0)
    vals = [0, 1, 0xFFFF, 0x10000, M32 - 1, M32] + [rng.randrange(1 << 32) for _ in range(2000)]
    got = draws._mix(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [_py_mix(v) for v in vals]
    assert got == [draws._mix(v) for v in vals]  # the same mixer on Python ints (fold uses it)
    assert all(0 <= g <= M32 for g in got)


def test_fold_matches_reference_and_counts_64_bit_ints_whole():
    for key in [(0,), (1,), (2**40,), (3, 7, 11), (M32, 2**63 - 1)]:
        assert draws.fold(*key) == _py_fold(*key)
    # Keys that differ only above bit 32 must fold apart (a large seed is not its low word).
    base = 123456789
    folded = {draws.fold(base + (j << 32)) for j in range(64)}
    assert len(folded) == 64
    assert draws.fold(1 << 40) != draws.fold(1 << 41) != draws.fold(0)
    assert draws.fold(2**63 - 1) != draws.fold(2**32 - 1)
    # Order and length of the tuple count.
    assert draws.fold(1, 2) != draws.fold(2, 1)
    assert draws.fold(5) != draws.fold(5, 0)
    assert all(0 <= draws.fold(*k) <= M32 for k in [(0,), (2**63 - 1,), (1, 2, 3)])


# -- field_normal: splits ----------------------------------------------------------------------
def test_field_value_equals_the_pure_python_recipe():
    keys = [7, (3, 1, 4)]
    f = draws.field_normal(keys, (2, 5, 6), dtype=torch.float64)
    for b, key in enumerate(keys):
        for c, r, col in [(0, 0, 0), (1, 4, 5), (0, 2, 3), (1, 0, 1)]:
            ref = _py_field_value(key, (c * 5 + r) * 6 + col)
            assert f[b, c, r, col].item() == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_band_near_the_32_bit_index_limit_matches_the_recipe():
    # The last row of a 65535 x 65535 field: global indices up to 2**32 - 2**17.
    n = 65535
    band = draws.field_normal([11], (1, n), row_offset=n - 1, full_rows=n, dtype=torch.float64)
    for col in [0, 1, 12345, n - 1]:
        index = (n - 1) * n + col
        assert band[0, 0, col].item() == pytest.approx(_py_field_value(11, index), rel=1e-12, abs=1e-12)
    assert torch.isfinite(band).all()


@pytest.mark.parametrize("bounds", [[0, 16, 32], [0, 10, 23, 24, 37], [0, 1, 36, 37], [0, 37]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_bands_equal_the_rows_of_the_full_field_bitwise(bounds, dtype):
    keys = [0, (1, 2), 2**40 + 5]
    rows, shape = bounds[-1], (3, bounds[-1], 11)
    full = draws.field_normal(keys, shape, dtype=dtype)
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        band = draws.field_normal(keys, (3, b - a, 11), row_offset=a, full_rows=rows, dtype=dtype)
        assert band.dtype == dtype and band.shape == (3, 3, b - a, 11)
        assert torch.equal(band, full[:, :, a:b])
        parts.append(band)
    assert torch.equal(torch.cat(parts, dim=2), full)


def test_empty_band_is_allowed_and_bands_around_it_still_tile_the_field():
    full = draws.field_normal([4], (2, 9, 5))
    empty = draws.field_normal([4], (2, 0, 5), row_offset=9, full_rows=9)
    assert empty.shape == (1, 2, 0, 5)
    top = draws.field_normal([4], (2, 9, 5), row_offset=0, full_rows=9)
    assert torch.equal(torch.cat([top, empty], dim=2), full)


@pytest.mark.parametrize("dim", [-1, 0, 2])
def test_bands_along_another_dim_equal_the_full_field(dim):
    shape = [4, 6, 19]
    d = dim % 3
    full = draws.field_normal([9, 10], shape, dtype=torch.float64)
    n = shape[d]
    cuts = [0, n // 3, n // 3 + 1, n]  # uneven, one of width 1
    for a, b in zip(cuts[:-1], cuts[1:]):
        part_shape = list(shape)
        part_shape[d] = b - a
        band = draws.field_normal([9, 10], part_shape, row_offset=a, full_rows=n, dim=dim, dtype=torch.float64)
        assert torch.equal(band, full.narrow(d + 1, a, b - a))


def test_dtype_is_the_float64_field_rounded():
    f64 = draws.field_normal([3], (8, 33), dtype=torch.float64)
    f32 = draws.field_normal([3], (8, 33), dtype=torch.float32)
    bf16 = draws.field_normal([3], (8, 33), dtype=torch.bfloat16)
    assert torch.equal(f32, f64.float())
    assert torch.equal(bf16, f64.to(torch.bfloat16))


def test_values_do_not_depend_on_the_chunk_size(monkeypatch):
    keys = [1, (2, 3)]
    ref = draws.field_normal(keys, (3, 17, 13), dtype=torch.float64)
    ref_band = draws.field_normal(keys, (3, 5, 13), row_offset=7, full_rows=17, dtype=torch.float64)
    for chunk in [1, 7, 64, 3 * 17 * 13 - 1]:
        monkeypatch.setattr(draws, "_CHUNK", chunk)
        assert torch.equal(draws.field_normal(keys, (3, 17, 13), dtype=torch.float64), ref)
        band = draws.field_normal(keys, (3, 5, 13), row_offset=7, full_rows=17, dtype=torch.float64)
        assert torch.equal(band, ref_band)


# -- keys --------------------------------------------------------------------------------------
def test_key_forms_int_tuple_list_and_tensor():
    shape = (4, 4)
    a = draws.field_normal([5], shape)
    assert torch.equal(a, draws.field_normal([(5,)], shape))
    assert torch.equal(a, draws.field_normal([[5]], shape))
    assert torch.equal(a, draws.field_normal([torch.tensor(5)], shape))
    assert not torch.equal(a, draws.field_normal([(5, 0)], shape))
    assert not torch.equal(draws.field_normal([(1, 2)], shape), draws.field_normal([(2, 1)], shape))
    # One field per key, each equal to drawing that key alone.
    both = draws.field_normal([(1, 2), 5], shape)
    assert torch.equal(both[1], a[0])
    assert torch.equal(both[0], draws.field_normal([(1, 2)], shape)[0])


def test_different_keys_give_different_uncorrelated_fields():
    # Neighbouring keys, as (seed, step, sample) tuples: no shared values and no correlation.
    keys = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), 0, 1, 2**32, 2**32 + 1]
    f = draws.field_normal(keys, (128, 128), dtype=torch.float64)
    n = f[0].numel()
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            assert (f[i] == f[j]).sum() <= 1
            assert abs(_corr(f[i], f[j])) < 5 / math.sqrt(n)


# -- field_normal: statistics ------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_field():
    return draws.field_normal([(2024, 1)], (1024, 1024), dtype=torch.float64)[0]


def test_large_field_moments(big_field):
    z = big_field
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * n)
    assert abs(float((z**3).mean())) < 5 * math.sqrt(15 / n)  # skewness, var(z^3) = 15
    assert abs(float((z**4).mean()) - 3) < 5 * math.sqrt(96 / n)  # kurtosis, var(z^4) = 96


def test_large_field_is_normal_in_distribution(big_field):
    z = big_field
    n = z.numel()
    assert _ks_normal(z) < 1.95 / math.sqrt(n)  # KS at the 0.1% level
    p = math.erfc(3 / math.sqrt(2))  # P(|z| > 3) = 0.0027
    tail = float((z.abs() > 3).double().mean())
    assert abs(tail - p) < 5 * math.sqrt(p * (1 - p) / n)
    # Each half of the plane and each sign of neighbours equally likely.
    assert abs(float((z > 0).double().mean()) - 0.5) < 5 * 0.5 / math.sqrt(n)


def test_large_field_has_no_duplicates_beyond_chance(big_field):
    # Two 24-bit uniforms per value: ~2**47 distinct normals, ~0.004 collisions expected here.
    n = big_field.numel()
    assert torch.unique(big_field).numel() >= n - 2


def test_large_field_has_no_lag_correlation(big_field):
    z = big_field
    tol = 5 / math.sqrt(z.numel())
    assert abs(_corr(z[:, 1:], z[:, :-1])) < tol  # along a row (consecutive indices)
    assert abs(_corr(z[1:], z[:-1])) < tol  # down a column
    assert abs(_corr(z[1:, 1:], z[:-1, :-1])) < tol  # diagonal
    flat = z.flatten()
    assert abs(_corr(flat[1024:], flat[:-1024])) < tol
    # Sign agreement of neighbours (catches dependence that correlation can miss).
    same = float(((z[:, 1:] > 0) == (z[:, :-1] > 0)).double().mean())
    assert abs(same - 0.5) < 5 * 0.5 / math.sqrt(z.numel())
    # |z| of neighbours uncorrelated too (the two Box-Muller streams are independent).
    assert abs(_corr(z[:, 1:].abs(), z[:, :-1].abs())) < tol


# -- uniform() and normal() --------------------------------------------------------------------
def test_uniform_is_in_the_open_unit_interval_and_uniform():
    n = 4000
    u = draws.uniform(range(n))
    assert u.dtype == torch.float64 and u.shape == (n,)
    assert float(u.min()) > 0 and float(u.max()) < 1
    s = u.sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    ks = float(torch.maximum(i / n - s, s - (i - 1) / n).max())
    assert ks < 1.95 / math.sqrt(n)
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    # Tuple keys (step, sample) too, and no repeats among them.
    ut = draws.uniform([(s_, b) for s_ in range(40) for b in range(100)])
    st = ut.sort().values
    assert float(torch.maximum(i / n - st, st - (i - 1) / n).max()) < 1.95 / math.sqrt(n)
    assert torch.unique(ut).numel() >= n - 2  # 24-bit values: ~0.5 collisions expected
    # Lag-1 correlation over consecutive keys.
    assert abs(_corr(u[1:], u[:-1])) < 5 / math.sqrt(n)


def test_uniform_extremes_of_the_24_bit_grid_are_not_0_or_1():
    u = draws._uniform(torch.tensor([0, 255, M32], dtype=torch.int64))
    assert u.tolist() == [0.5 / 2**24, 0.5 / 2**24, 1 - 0.5 / 2**24]


def test_uniform_and_normal_are_keyed_and_reproducible():
    keys = [3, (1, 2), 2**50]
    assert torch.equal(draws.uniform(keys), draws.uniform(list(keys)))
    assert torch.equal(draws.normal(keys), draws.normal(keys))
    assert draws.uniform([5]).item() == draws.uniform([(5,)]).item()
    assert draws.uniform([5]).item() != draws.uniform([6]).item()
    # Each key alone gives its own value, whatever the rest of the batch.
    assert draws.normal([(1, 2)]).item() == draws.normal(keys)[1].item()


def test_normal_moments_and_independence_from_uniform():
    n = 4000
    keys = [(7, i) for i in range(n)]
    z = draws.normal(keys)
    assert z.dtype == torch.float64
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / n)
    assert _ks_normal(z) < 1.95 / math.sqrt(n)
    # The training step uses uniform() and normal() of the same keys: they must not be related.
    u = draws.uniform(keys)
    assert abs(_corr(z, u)) < 5 / math.sqrt(n)
    assert abs(_corr(z.abs(), u)) < 5 / math.sqrt(n)


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,offset,full,dim",
    [
        ((2, 8, 4), -1, 16, -2),
        ((2, 8, 4), 9, 16, -2),
        ((2, 8, 4), 0, 7, -2),
        ((2, 8, 4), 1, 4, -1),
        ((3, 8, 4), 2, 4, 0),
        ((2, 8, 4), 1, None, -2),  # no full_rows: the shape is the whole field, no offset possible
    ],
)
def test_rows_outside_the_field_raise(shape, offset, full, dim):
    with pytest.raises(ValueError, match="outside"):
        draws.field_normal([0], shape, row_offset=offset, full_rows=full, dim=dim)


def test_field_too_large_for_32_bit_positions_raises_before_allocating():
    with pytest.raises(ValueError, match="too large"):
        draws.field_normal([0], (1 << 16, 1 << 16))
    with pytest.raises(ValueError, match="too large"):  # a small band of a too-large field
        draws.field_normal([0], (1, 70000), row_offset=0, full_rows=70000)
    with pytest.raises(ValueError, match="too large"):
        draws.field_normal([0], (2, 1, 1 << 31), full_rows=1, dim=1)
