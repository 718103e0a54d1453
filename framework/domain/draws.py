"""Random draws keyed by (key, global position): the same numbers however the field is split.

A per-pixel draw made with a stateful generator depends on how many numbers were drawn
before it, so a rank holding rows 256..511 cannot reproduce what a single device draws
for those rows. Here every element is a hash of its key and its global index instead:
any band of rows, on any device, gives bitwise the same values as the full field.

The hash is a 32-bit integer mixer evaluated in int64 arithmetic with every product
kept below 2**63 (torch has no unsigned 32-bit multiply that wraps portably).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # "lowbias32" constants (a well-mixing 32-bit hash)
_CHUNK = 1 << 24  # elements hashed at once: bounds the int64 temporaries on big fields


def _mul32(h, c: int):
    """(h * c) mod 2**32 for h < 2**32, without a product of 2**63 or more."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix(h):
    """The 32-bit mixer, on a tensor of values < 2**32 or on one Python int."""
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 15)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def fold(*key: int) -> int:
    """One 32-bit key from a tuple of ints (seed, step, sample index, purpose...)."""
    h = 0x9E3779B9
    for k in key:
        k = int(k)
        for part in (k & _M32, (k >> 32) & _M32):  # 64-bit ints (e.g. large seeds) count whole
            h = _mix(h ^ _mix((part + 0x632BE5AB) & _M32))
    return h


def _key(key) -> int:
    return fold(*key) if isinstance(key, (tuple, list)) else fold(key)


def _bits(index: torch.Tensor, key: int, stream: int) -> torch.Tensor:
    return _mix(_mix(index ^ key) ^ fold(key, stream))


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) from the top 24 bits, in float64 (exact there; never 0 or 1)."""
    return ((bits >> 8).to(torch.float64) + 0.5) / float(1 << 24)


def _box_muller(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def uniform(keys: Sequence, device=None) -> torch.Tensor:
    """One uniform (0, 1) per key (an int or a tuple of ints), float64, shape (len(keys),)."""
    bits = torch.tensor([fold(_key(k), 0) for k in keys], dtype=torch.int64, device=device)
    return _uniform(bits)


def normal(keys: Sequence, device=None) -> torch.Tensor:
    """One standard normal per key, float64, shape (len(keys),)."""
    u1 = torch.tensor([fold(_key(k), 1) for k in keys], dtype=torch.int64, device=device)
    u2 = torch.tensor([fold(_key(k), 2) for k in keys], dtype=torch.int64, device=device)
    return _box_muller(_uniform(u1), _uniform(u2))


def field_normal(
    keys: Sequence,
    shape: Sequence[int],
    *,
    row_offset: int = 0,
    full_rows: int | None = None,
    dim: int = -2,
    device=None,
    dtype=torch.float32,
) -> torch.Tensor:
    """Standard normals of shape ``(len(keys), *shape)``: one field per key (per sample).

    ``shape`` is this rank's part of the field, cut along ``dim`` (of ``shape``; rows by
    default) at ``row_offset`` of ``full_rows``. Element values depend only on the key
    and the element's index in the full field, so every split agrees with the whole.
    """
    shape = list(shape)
    dim = dim % len(shape)
    full = list(shape)
    full[dim] = shape[dim] if full_rows is None else int(full_rows)
    if row_offset < 0 or row_offset + shape[dim] > full[dim]:
        raise ValueError(f"rows {row_offset}..{row_offset + shape[dim]} are outside the field's {full[dim]} rows")
    if math.prod(full) >= 1 << 32:
        raise ValueError(f"field of {math.prod(full)} elements is too large for 32-bit position keys")
    # Global flat index of every local element: strides of the full field, rows shifted.
    stride = [math.prod(full[i + 1 :]) for i in range(len(full))]
    index = torch.zeros((), dtype=torch.int64, device=device)
    for i, n in enumerate(shape):
        ax = torch.arange(n, dtype=torch.int64, device=device) + (row_offset if i == dim else 0)
        index = index.unsqueeze(-1) + ax * stride[i]
    flat = index.reshape(-1)
    out = torch.empty((len(keys), flat.numel()), dtype=dtype, device=device)
    for b, key in enumerate(keys):
        key = _key(key)
        for s in range(0, flat.numel(), _CHUNK):
            idx = flat[s : s + _CHUNK]
            z = _box_muller(_uniform(_bits(idx, key, 1)), _uniform(_bits(idx, key, 2)))
            out[b, s : s + _CHUNK] = z.to(dtype)
    return out.reshape(len(keys), *shape)
