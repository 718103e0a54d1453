"""benchmarks/gluon_natten.py: the fused forward's algorithm in Gluon, with and without the
next tile's product in flight (docs/benchmarks.md, run 30)."""

import pytest
import torch

from benchmarks import gluon_natten

needs_gluon = pytest.mark.skipif(gluon_natten.gluon is None, reason="this Triton has no Gluon Hopper API")


def _products_before_the_softmax(ttgir: str) -> int:
    """Tensor-core products issued in the main loop before its first exp2."""
    lines = ttgir.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if "scf.for" in line) :]
    first_exp2 = next(i for i, line in enumerate(body) if "math.exp2" in line)
    return sum("ttng.warp_group_dot " in line for line in body[:first_exp2])


@needs_gluon
def test_the_overlap_issues_the_next_tiles_product_before_this_tiles_softmax():
    # built for sm90 on any machine: the schedule the benchmark compares is the one it claims
    # (one product in flight through the softmax, none without the overlap), and the ring of
    # three tiles the overlap needs is the 16 KiB of shared memory that costs it occupancy
    plain, ring, overlap = (gluon_natten.build(o, s) for o, s in ((False, 2), (False, 3), (True, 3)))
    assert _products_before_the_softmax(plain.asm["ttgir"]) == 0
    assert _products_before_the_softmax(ring.asm["ttgir"]) == 0
    assert _products_before_the_softmax(overlap.asm["ttgir"]) == 1
    tile = 64 * 64 * 2  # bytes of one (64 tokens, 64 channels) bf16 tile
    assert ring.metadata.shared - plain.metadata.shared == 2 * tile + 8  # a key and a value tile, a barrier
    assert overlap.metadata.shared == ring.metadata.shared


@needs_gluon
def test_the_overlap_without_a_third_tile_is_refused():
    x = torch.zeros(1, 1, 8, 8, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ring of 3"):
        gluon_natten.forward(x, x, x, 7, overlap=True, slots=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="sm90")
@needs_gluon
def test_the_gluon_forward_equals_the_fused_kernels_to_the_bit():
    # a ragged grid (partial tiles on both axes), two heads, windows of 7: every schedule
    from recipes.stormscope import fused_natten

    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(2, 13, 21, 3, 2, 48, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = qkv.permute(3, 0, 4, 1, 2, 5).unbind(0)
    want = fused_natten._forward(q, k, v, 7, 0, 0, 13)[0]
    for overlap, slots in ((False, 2), (False, 3), (True, 3)):
        assert torch.equal(gluon_natten.forward(q, k, v, 7, overlap, slots), want), (overlap, slots)
