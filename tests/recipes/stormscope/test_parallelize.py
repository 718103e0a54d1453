"""The DiT's domain-parallel rules (recipes/stormscope/parallelize.py) on real gloo ranks.

``split(DiT(...), dg, PLAN)`` (the DiT's plan, ``recipes.stormscope.parallelize.PLAN``) on bands
of patch rows reproduces the single-device DiT in float64 (and, wrapped in the diffusion task's
EDM preconditioner, in float32):
forward output, input gradient, the gradients of the noise labels / scalar conditions and
every parameter gradient (summed over the domain ranks), for even, uneven and thin-edge
bands on 2 and 4 ranks, with learned and rope positions, scalar conditions, the mask token
and checkpointed blocks. The asymmetric k/v halo exchange moves exactly the rows each band's
windows reach and sends their gradients back. What cannot split is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from framework.domain import splitter
from framework.domain.comm import DomainGroup, halo_rows
from framework.errors import ConfigError
from recipes.stormscope import parallelize
from recipes.stormscope.dit import DiT, NeighbourhoodAttention, PatchEmbed
from recipes.stormscope.natten import kv_rows_needed
from recipes.stormscope.parallelize import PLAN
from recipes.weather.edm import EDMPrecond
from tests.framework.domain.helpers import band, compare_split, for_each_group, randomize
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)


def split(model, dg):
    """Split by the DiT's plan."""
    return splitter.split(model, dg, PLAN)


B, GRID, P = 2, (32, 24), 2  # 32 x 24 pixels, patch 2 -> 16 x 12 tokens
BASE = dict(img_resolution=GRID, in_channels=3, out_channels=2, patch_size=P, hidden_size=32, depth=2)

# (name, DiT options, world sizes). Kernel 17 >= 16 patch rows is full attention along rows:
# every band needs every other row, so it splits over 2 bands only.
CASES = [
    (
        "learned, kernel 5, scalar conditions",
        dict(num_heads=2, attn_kernel=5, pos_embed="learned", num_scalar_conditions=2),
        (2, 4),
    ),
    (
        "rope, kernel 7, mask token + mask, checkpointed blocks, the residual ops",
        dict(
            num_heads=4, attn_kernel=7, pos_embed="rope", mask_token=True, checkpoint_blocks=True, residual_impl="fused"
        ),
        (2, 4),
    ),
    (
        "learned, kernel 17 (all rows), mask token + mask",
        dict(num_heads=2, attn_kernel=17, pos_embed="learned", mask_token=True),
        (2,),
    ),
]
# Pixel rows per band (multiples of P). "thin first band" [4, 28]: 2 patch rows, fewer than
# kernel // 2 + 1, so its windows reach further into the next band than kernel // 2.
SPLITS = {
    2: {"even": [16, 16], "uneven": [20, 12], "thin first band": [4, 28]},
    4: {"even": [8, 8, 8, 8], "uneven": [10, 6, 8, 8], "thin edges": [6, 10, 10, 6]},
}


class Masked(nn.Module):
    """The DiT with its mask carried as the input's last channel (1 = invalid), so the mask is
    banded with the input (compare_split bands only the first argument)."""

    def __init__(self, model: DiT):
        super().__init__()
        self.dit = model

    def forward(self, xm, noise_labels, scalar_conditions=None):
        return self.dit(xm[:, :-1], noise_labels, scalar_conditions, mask=xm[:, -1:] > 0.5)


def _dit(**kw):
    return DiT(**(BASE | kw))


def _inputs(kw, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, BASE["in_channels"], *GRID, generator=g)
    args = (torch.randn(B, generator=g),)
    if kw.get("num_scalar_conditions"):
        args += (torch.randn(B, kw["num_scalar_conditions"], generator=g),)
    if kw.get("mask_token"):
        mask = torch.rand(B, 1, *GRID, generator=g) < 0.05  # scattered invalid pixels: some patches masked
        x = torch.cat([x, mask.to(x.dtype)], 1)
    return x, args


def _check_halo(group, world, rank):
    """halo_rows gives each band exactly its windows' rows; gradients go back to the owners."""
    for kind, extents in SPLITS[world].items():
        dg = DomainGroup(group, extents)
        tokens = [e // P for e in extents]
        for kernel in (3, 5, 7):
            plan = parallelize.halo_plan(tuple(tokens), kernel)
            g = torch.Generator().manual_seed(kernel)
            full = torch.randn(2, B, 16, 3, generator=g).requires_grad_()
            grads = [
                torch.randn(
                    2,
                    B,
                    kv_rows_needed(sum(tokens[:r]), sum(tokens[: r + 1]), kernel, 16)[1]
                    - kv_rows_needed(sum(tokens[:r]), sum(tokens[: r + 1]), kernel, 16)[0],
                    3,
                    generator=g,
                )
                for r in range(world)
            ]
            ref = 0
            for r in range(world):  # every band's rows, gradients summed over bands
                lo, hi = kv_rows_needed(sum(tokens[:r]), sum(tokens[: r + 1]), kernel, 16)
                ref = ref + (full[:, :, lo:hi] * grads[r]).sum()
            ref.backward()
            local = band(full.detach(), tokens, rank).clone().requires_grad_()
            out = halo_rows(local, plan, dg, dim=2)
            lo, hi = kv_rows_needed(sum(tokens[:rank]), sum(tokens[: rank + 1]), kernel, 16)
            where = f"halo {kind} {extents}, kernel {kernel}, rank {rank}"
            assert out.shape[2] == hi - lo, where  # exactly the rows the windows reach
            torch.testing.assert_close(out, full.detach()[:, :, lo:hi], rtol=0, atol=0, msg=where)
            (out * grads[rank]).sum().backward()
            torch.testing.assert_close(local.grad, band(full.grad, tokens, rank), msg=where)


def _check_dit(group, world, rank):
    checked = 0
    for kind, extents in SPLITS[world].items():
        dg = DomainGroup(group, extents)
        for i, (name, kw, worlds) in enumerate(CASES):
            if world not in worlds:
                continue
            torch.manual_seed(i)
            model = randomize(_dit(**kw), seed=i, std=0.2)  # off the adaLN-zero init
            if kw.get("mask_token"):
                model = Masked(model)
            x, args = _inputs(kw, seed=10 + i)
            compare_split(f"DiT {name}, {kind} bands", model, dg, x, split_fn=split, args=args, seed=i)
            checked += 1
    assert checked == len(SPLITS[world]) * sum(world in c[2] for c in CASES)

    # The diffusion task's model: the EDM preconditioner around the DiT (no parameters, per pixel:
    # the DiT's plan covers it). It computes in float32, as in training: float32 tolerances.
    extents = SPLITS[world]["uneven"]
    model = EDMPrecond(
        randomize(_dit(in_channels=2, num_heads=2, attn_kernel=5), seed=9, std=0.2), sigma_data=[0.5, 2.0]
    ).float()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(B, 2, *GRID, generator=g, dtype=torch.float32)
    sigma = torch.rand(B, generator=g, dtype=torch.float32) * 5 + 0.1
    compare_split(
        f"EDMPrecond(DiT), {extents} bands",
        model,
        DomainGroup(group, extents),
        x,
        split_fn=split,
        args=(sigma,),
        seed=9,
        tol=dict(rtol=1e-4, atol=1e-4),
    )


def _on_ranks(rank, world):
    for_each_group(rank, _check_halo)
    for_each_group(rank, _check_dit)
    dist.barrier()


def test_split_dit_matches_the_whole_one_on_2_and_4_ranks():
    spawn(_on_ranks, 4)


def _compiled(rank, world):
    """trainer.compile on the split DiT (with the residual ops): the blocks' halo exchanges (of other
    widths per band, as the clamped windows ask) in their graphs, no graph break, the whole model's
    values."""
    from framework.train.compile import compile_model

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    stats = []

    def split_compiled(model, dg):
        torch._dynamo.reset()
        model = split(model, dg)
        stats.append(compile_model(model, device_type="cpu", backend="aot_eager"))
        return model

    kw = dict(num_heads=2, attn_kernel=5, pos_embed="learned", num_scalar_conditions=2, residual_impl="fused")
    model = randomize(_dit(**kw), seed=3, std=0.2)
    x, args = _inputs(kw, seed=13)
    dg = DomainGroup(dist.group.WORLD, SPLITS[2]["thin first band"])
    compare_split("compiled DiT, thin first band", model, dg, x, split_fn=split_compiled, args=args, seed=3)
    s = stats[0].stats()
    assert stats[0].enabled and s["graphs"] > 0 and s["graph_breaks"] == 0, s


def test_compiled_split_dit_matches_the_whole_one():
    spawn(_compiled, 2)


# ------------------------------------------------------------------ conversion (no communication)


def _fake(extents):
    return DomainGroup(None, list(extents))  # converts, never communicates


def test_split_converts_attention_and_pos_embed_and_keeps_names_and_checkpoints():
    plain = _dit(num_heads=2, attn_kernel=5, pos_embed="learned", mask_token=True)
    model = split(copy.deepcopy(plain), _fake([16, 16]))
    converted = {n for n, m in model.named_modules() if type(m).__name__.startswith("Domain")}
    assert converted == {"pos_embed", "blocks.0.attn", "blocks.1.attn"}
    assert type(model.patch_embed.proj) is nn.Conv2d  # the PatchEmbed rule answers for its strided conv
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    other = randomize(_dit(num_heads=2, attn_kernel=5, pos_embed="learned", mask_token=True), seed=3)
    model.load_state_dict(other.state_dict())
    plain.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), other.state_dict().values()))
    copy.deepcopy(model)

    rope = split(_dit(num_heads=4, attn_kernel=7, pos_embed="rope"), _fake([8, 8, 8, 8]))
    assert type(rope.blocks[0].attn.rope).__name__ == "Rope2d"  # parameter-free; attention passes global rows


def test_one_domain_rank_runs_the_split_model_as_the_whole_one():
    model = randomize(_dit(num_heads=2, attn_kernel=5, pos_embed="learned", num_scalar_conditions=2), seed=1)
    x, args = _inputs(dict(num_scalar_conditions=2), seed=1)
    want = model(x, *args)
    torch.testing.assert_close(split(copy.deepcopy(model), _fake([32]))(x, *args), want)


def test_the_dit_splits_through_the_registry_entry():
    from framework import registry
    from framework.config.schema import SplitterConfig

    model = _dit(num_heads=2, attn_kernel=5)
    plan = registry.models.entry("dit").split_plan  # what the runtime passes
    assert plan is PLAN
    out = registry.splitters.build(
        "rows", model, SplitterConfig(name="rows"), topology=None, domain=_fake([16, 16]), plan=plan, model_name="dit"
    )
    assert out is model and type(model.blocks[1].attn).__name__ == "DomainNeighbourhoodAttention"


# ------------------------------------------------------------------ what the rules refuse


def _classes(model):
    return {n: type(m) for n, m in model.named_modules()}


@pytest.mark.parametrize(
    "kw,extents,match",
    [
        (
            dict(attn_kernel=5),
            [15, 17],
            r"domain extents \[15, 17\] \(pixel rows\) must be multiples of patch_size=2, "
            r"so every band holds whole patch rows",
        ),
        (dict(attn_kernel=5), [16, 14], r"domain extents \[16, 14\] cover 30 pixel rows but the model's grid has 32"),
        (
            dict(attn_kernel=7),
            [2, 2, 14, 14],
            r"neighbourhood attention with kernel 7 on 16 patch rows cannot be split into "
            r"bands of \[1, 1, 7, 7\] patch "
            r"rows: band 0 \(rows \[0, 1\)\) needs key rows \[0, 7\), beyond its neighbours' rows \[0, 2\); give every "
            r"band at least kernel // 2 \+ 1 = 4 patch rows",
        ),
        (
            dict(attn_kernel=17),
            [8, 8, 8, 8],
            r"neighbourhood attention with kernel 17 on 16 patch rows cannot be split .* a kernel spanning every row "
            r"splits over at most 2 bands",
        ),
    ],
)
def test_bands_the_dit_cannot_use_are_refused(kw, extents, match):
    model = _dit(num_heads=2, **kw)
    before = _classes(model)
    with pytest.raises(ConfigError, match=r"^splitter: module '<root>' \(DiT\): " + match):
        split(model, _fake(extents))
    assert _classes(model) == before  # all or nothing


def test_a_patch_embedding_on_bands_of_partial_patches_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"module '<root>' \(PatchEmbed\): domain extents \[6, 10\] \(pixel rows\) "
        r"must be multiples of patch_size=4",
    ):
        split(PatchEmbed(3, 8, 4), _fake([6, 10]))
    split(PatchEmbed(3, 8, 4), _fake([8, 8]))
    with pytest.raises(ConfigError, match=r"nn\.Conv2d with .* stride \(4, 4\)"):  # a bare strided conv is not local
        split(nn.Sequential(nn.Conv2d(3, 8, 4, stride=4)), _fake([8, 8]))


def test_a_layer_norm_over_more_than_the_last_dim_is_refused():
    split(nn.Sequential(nn.LayerNorm(8)), _fake([8, 8]))
    with pytest.raises(
        ConfigError,
        match=r"splitter: module '0' \(LayerNorm\): nn\.LayerNorm over \(4, 8\) cannot "
        r"be split over rows",
    ):
        split(nn.Sequential(nn.LayerNorm((4, 8))), _fake([8, 8]))


def test_split_attention_alone_checks_its_bands_before_communicating():
    attn = split(NeighbourhoodAttention(16, 2, kernel=7), _fake([2, 2, 12]))  # token rows, no patch size known
    with pytest.raises(ConfigError, match=r"band 0 \(rows \[0, 2\)\) needs key rows \[0, 7\)"):
        attn(torch.randn(1, 2, 5, 16))
    attn = split(NeighbourhoodAttention(16, 2, kernel=3), _fake([3, 5]))
    with pytest.raises(ConfigError, match=r"domain extents \[3, 5\] \(pixel rows\) do not scale to whole token rows"):
        attn(torch.randn(1, 1, 5, 16))
