"""The StormScope DiT: shapes, options, adaLN-zero, rope, mask token, checkpointing, bands."""

from __future__ import annotations

import pytest
import torch

from recipes.stormscope.dit import DiT, NeighbourhoodAttention, PosEmbed2d, Rope2d
from recipes.stormscope.natten import dense_neighbourhood_attention


def tiny(**kw):
    cfg = dict(
        img_resolution=(16, 24),
        in_channels=3,
        out_channels=2,
        patch_size=4,
        hidden_size=32,
        depth=2,
        num_heads=4,
        attn_kernel=3,
    )
    return DiT(**(cfg | kw))


def perturb_(model, std=0.05, seed=0):
    """Move every parameter off its (often zero) init so gradients can reach everything."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * std)


def inputs(batch=2, seed=0, shape=(16, 24), channels=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, *shape, generator=g), torch.randn(batch, generator=g)


@pytest.mark.parametrize("pos_embed", ["learned", "rope", "none"])
def test_output_shape_and_zero_init(pos_embed):
    model = tiny(pos_embed=pos_embed)
    x, t = inputs()
    out = model(x, t)
    assert out.shape == (2, 2, 16, 24)
    assert torch.count_nonzero(out) == 0  # adaLN-zero: a fresh model predicts zeros
    assert (model.pos_embed is not None) == (pos_embed == "learned")
    assert all((b.attn.rope is not None) == (pos_embed == "rope") for b in model.blocks)


@pytest.mark.parametrize("pos_embed", ["learned", "rope"])
def test_gradients_reach_every_parameter(pos_embed):
    model = tiny(pos_embed=pos_embed, mask_token=True, num_scalar_conditions=2)
    perturb_(model)
    x, t = inputs()
    mask = torch.zeros(2, 1, 16, 24, dtype=torch.bool)
    mask[:, :, :4, :8] = True  # two patches of each sample use the mask token
    out = model(x, t, scalar_conditions=torch.randn(2, 2), mask=mask)
    assert out.abs().sum() > 0
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_learned_vs_rope_vs_none_differ():
    x, t = inputs()
    outs = {}
    for pe in ("learned", "rope", "none"):
        torch.manual_seed(0)
        model = tiny(pos_embed=pe)
        perturb_(model)
        outs[pe] = model(x, t)
    assert not torch.allclose(outs["learned"], outs["none"])
    assert not torch.allclose(outs["rope"], outs["none"])


def test_rope_scores_depend_only_on_relative_offset():
    rope = Rope2d(16)
    g = torch.Generator().manual_seed(0)
    qv, kv = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def score(qpos, kpos):
        grid = torch.zeros(1, 12, 12, 16)
        q, k = grid.clone(), grid.clone()
        q[0, qpos[0], qpos[1]], k[0, kpos[0], kpos[1]] = qv, kv
        q, k = rope(q), rope(k)
        return torch.dot(q[0, qpos[0], qpos[1]], k[0, kpos[0], kpos[1]])

    base = score((2, 3), (5, 1))
    torch.testing.assert_close(score((6, 8), (9, 6)), base)  # both shifted by (4, 5)
    torch.testing.assert_close(score((0, 2), (3, 0)), base)  # both shifted by (-2, -1)
    assert not torch.allclose(score((2, 3), (5, 2)), base)  # a different offset scores differently
    # and the norm is preserved (pure rotation)
    torch.testing.assert_close(rope(qv.expand(1, 3, 4, 16)).norm(dim=-1), qv.norm().expand(1, 3, 4))


def test_rope_row_offset_matches_full_rows():
    rope = Rope2d(8)
    x = torch.randn(2, 10, 5, 8)
    torch.testing.assert_close(rope(x[:, 4:7], row_offset=4), rope(x)[:, 4:7])


def _attention_inputs(model):
    """Run-time inputs of every block's attention (after the mask-token splice), by block index."""
    captured = {}
    hooks = [
        b.attn.register_forward_pre_hook(lambda m, a, i=i: captured.update({i: a[0]}))
        for i, b in enumerate(model.blocks)
    ]
    return captured, hooks


def test_mask_token_is_spliced_before_qkv_and_nan_is_contained():
    model = tiny(mask_token=True)
    perturb_(model)
    x, t = inputs()
    mask = torch.zeros(2, 1, 16, 24, dtype=torch.bool)
    mask[0, 0, 5, 9] = True  # one pixel invalidates patch (1, 2) of sample 0
    x_nan = x.clone()
    x_nan[mask.expand_as(x)] = float("nan")
    captured, hooks = _attention_inputs(model)
    out = model(x_nan, t, mask=mask)
    for h in hooks:
        h.remove()
    assert torch.isfinite(out).all()
    # every block's attention sees its own token at the invalid patch, its normal input elsewhere
    for i, blk in enumerate(model.blocks):
        torch.testing.assert_close(captured[i][0, 1, 2], blk.attn.mask_token[0, 0])
        assert not torch.allclose(captured[i][0, 1, 3], blk.attn.mask_token[0, 0])
        assert not torch.allclose(captured[i][1, 1, 2], blk.attn.mask_token[0, 0])
    # the invalid pixels' values never matter (zeroed first, as the reference's nan_to_num does)...
    x_other = x.clone()
    x_other[mask.expand_as(x)] = 100.0
    torch.testing.assert_close(model(x_other, t, mask=mask), out)
    # ...but the patch's valid pixels still do (the residual stream keeps the patch embedding)
    x_valid = x.clone()
    x_valid[0, :, 4, 8] += 1.0
    assert not torch.allclose(model(x_valid, t, mask=mask), out)
    # without the mask the network sees the patch as it is
    assert not torch.allclose(model(x, t), out)


def test_mask_token_parameters_one_per_block_zero_at_init():
    model = tiny(mask_token=True, depth=3)
    tokens = {n: p for n, p in model.named_parameters() if "mask_token" in n}
    assert sorted(tokens) == [f"blocks.{i}.attn.mask_token" for i in range(3)]
    assert all(p.shape == (1, 1, 32) and not p.any() for p in tokens.values())
    assert not any("mask_token" in n for n, _ in tiny().named_parameters())
    # a mask without tokens only zeroes the invalid pixels
    plain = tiny()
    perturb_(plain)
    x, t = inputs()
    mask = torch.zeros(2, 1, 16, 24, dtype=torch.bool)
    mask[:, :, :2] = True
    torch.testing.assert_close(plain(x, t, mask=mask), plain(x.masked_fill(mask, 0.0), t))


def test_parameterisation_matches_the_reference_dit():
    """Learned table (1, N, D) std 0.02; timestep MLP D -> 2D -> D over D sinusoidal features, xavier;
    scalar conditions bias-free and zero; qkv with bias, no qk-norm."""
    torch.manual_seed(0)
    d = 64
    model = DiT(
        (64, 96), 3, 2, patch_size=4, hidden_size=d, depth=2, num_heads=4, attn_kernel=3, num_scalar_conditions=3
    )
    assert model.pos_embed.weight.shape == (1, 16 * 24, d)
    assert abs(model.pos_embed.weight.std().item() - 0.02) < 0.002
    te = model.t_embed
    assert te.freq_dim == d
    assert te.mlp[0].weight.shape == (2 * d, d) and te.mlp[2].weight.shape == (d, 2 * d)
    for lin in (te.mlp[0], te.mlp[2]):  # xavier uniform: |w| <= sqrt(6 / (fan_in + fan_out))
        bound = (6 / sum(lin.weight.shape)) ** 0.5
        assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.9 * bound
        assert not lin.bias.any()
    assert te.scalars.bias is None and te.scalars.weight.shape == (d, 3) and not te.scalars.weight.any()
    for blk in model.blocks:
        assert blk.attn.qkv.bias is not None and blk.attn.qkv.weight.shape == (3 * d, d)
        assert not any("norm" in n for n, _ in blk.attn.named_parameters())
    # the features: [cos, sin] of D/2 frequencies 10000^(-i / (D/2)), i = 0 .. D/2 - 1
    t = torch.tensor([0.3, -1.7])
    half = d // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    arg = t.double()[:, None] * freqs
    feats = torch.cat([arg.cos(), arg.sin()], -1).float()
    torch.testing.assert_close(te(t, torch.zeros(2, 3)), te.mlp(feats))


@pytest.mark.parametrize(
    "kw,option",
    [
        (dict(img_resolution=(18, 24)), "patch_size"),
        (dict(attn_kernel=4), "attn_kernel"),
        (dict(pos_embed="sincos"), "pos_embed"),
        (dict(attn_impl="natten"), "attn_impl"),
        (dict(attn_block=32), "attention block"),
        (dict(mlp_impl="cuda"), "mlp_impl"),
        (dict(residual_impl="cuda"), "residual_impl"),
        (dict(num_heads=5), "num_heads"),
        (dict(hidden_size=24, num_heads=4, pos_embed="rope"), "rope"),
    ],
)
def test_bad_options_raise(kw, option):
    with pytest.raises(ValueError, match=option):
        tiny(**kw)


def test_attn_block_reaches_every_attention_and_is_checked_in_the_config():
    """model.attn_block: flex's sparse block, null (auto) by default, on every block's attention;
    a size flex is not set up for is a config error naming the key."""
    import recipes.stormscope.registry  # noqa: F401  (registers the dit builder)
    from framework import registry
    from framework.config.schema import Invalid
    from recipes.stormscope.config import DiTConfig

    assert DiTConfig().attn_block is None
    cfg = DiTConfig(hidden_size=32, depth=2, num_heads=2, attn_kernel=5, attn_block=64)
    model = registry.models.entry("dit").builder(cfg, in_channels=3, out_channels=2, img_resolution=[16, 16])
    blocks = [m.block for m in model.modules() if isinstance(m, NeighbourhoodAttention)]
    assert blocks == [64, 64]
    with pytest.raises(Invalid, match=r"attn_block.*null \(auto\), 64 or 128 tokens \(got 32\)"):
        DiTConfig(attn_block=32)


def test_attn_tiles_set_the_kernels_tiles_for_the_run_and_are_checked_in_the_config(monkeypatch):
    """model.attn_tiles: null keeps the shipped tiles (with each GPU's caps); a set names some or all
    of the three kernels' tiles over the shipped ones, in benchmarks/natten.py's notation; a model
    built after it with null is back on the shipped tiles; bad tiles are a config error naming the key."""
    import recipes.stormscope.registry  # noqa: F401  (registers the dit builder)
    from framework import registry
    from framework.config.schema import Invalid
    from recipes.stormscope import fused_natten
    from recipes.stormscope.config import DiTConfig

    monkeypatch.setattr(fused_natten, "TILES", dict(fused_natten.TILES))
    shipped = dict(fused_natten._SHIPPED)
    build = registry.models.entry("dit").builder
    small = dict(hidden_size=32, depth=1, num_heads=2, attn_kernel=5)
    assert DiTConfig().attn_tiles is None
    build(DiTConfig(**small, attn_tiles="dq=8x8/8x8/4/2,dkdv=4x8/8x8/4/3/tma"), in_channels=3, out_channels=2,
          img_resolution=[16, 16])  # fmt: skip
    Tiles = fused_natten.Tiles
    want = {"fwd": shipped["fwd"], "dq": Tiles(8, 8, 8, 8, 4, 2), "dkdv": Tiles(4, 8, 8, 8, 4, 3, tma=True)}
    assert fused_natten.TILES == want
    assert fused_natten.TILES["fwd"] is shipped["fwd"]  # (so it keeps each GPU's caps)
    build(DiTConfig(**small), in_channels=3, out_channels=2, img_resolution=[16, 16])
    assert all(fused_natten.TILES[n] is shipped[n] for n in shipped)
    with pytest.raises(Invalid, match=r"attn_tiles: tiles must read QHxQW/KHxKW"):
        DiTConfig(attn_tiles="8x8")
    with pytest.raises(Invalid, match=r"attn_tiles: tile set 'fwd=8x8/8x8,attn=8x8/8x8': expected SPEC or"):
        DiTConfig(attn_tiles="fwd=8x8/8x8,attn=8x8/8x8")
    with pytest.raises(Invalid, match=r"attn_tiles: fused attention tiles 2x4/4x4/4/2 \(dq\): a GPU needs at least 16"):
        DiTConfig(attn_tiles="dq=2x4/4x4")


@pytest.mark.parametrize("knob", ["mlp_impl", "residual_impl"])
def test_an_impl_knob_reaches_every_block_computes_the_same_and_is_checked_in_the_config(knob):
    """model.mlp_impl: the bias + GELU op (fused, the default) or F.gelu after fc1 (torch);
    model.residual_impl: the gated residual and norm ops (fused, the default) or the torch
    expressions (torch); on every block, with the same parameters, and outputs and gradients equal to
    float64 round-off."""
    import recipes.stormscope.registry  # noqa: F401  (registers the dit builder)
    from framework import registry
    from framework.config.schema import Invalid
    from recipes.stormscope.config import DiTConfig
    from recipes.stormscope.dit import DiTBlock, Mlp

    holder = {"mlp_impl": (Mlp, "impl"), "residual_impl": (DiTBlock, "residual_impl")}[knob]
    assert getattr(DiTConfig(), knob) == {"mlp_impl": "fused", "residual_impl": "fused"}[knob]
    build = registry.models.entry("dit").builder
    outs = []
    for impl in ("fused", "torch"):
        cfg = DiTConfig(hidden_size=32, depth=2, num_heads=2, attn_kernel=5, mask_token=True, **{knob: impl})
        torch.manual_seed(0)
        model = build(cfg, in_channels=3, out_channels=2, img_resolution=[16, 16]).double()
        assert [getattr(m, holder[1]) for m in model.modules() if isinstance(m, holder[0])] == [impl, impl]
        for p in model.parameters():  # (adaLN-zero starts every block as the identity: wake them)
            torch.nn.init.normal_(p, std=0.2)
        x, t = torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.rand(2, dtype=torch.float64)
        mask = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
        mask[0, :, 3:9, 5:7] = True
        y = model(x, t, mask=mask)
        outs.append((y, *torch.autograd.grad(y.square().sum(), list(model.parameters()))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    with pytest.raises(Invalid, match=knob):
        DiTConfig(**{knob: "triton"})


def test_scalar_conditions_must_match_option():
    x, t = inputs()
    with pytest.raises(ValueError, match="num_scalar_conditions"):
        tiny(num_scalar_conditions=2)(x, t)
    with pytest.raises(ValueError, match="num_scalar_conditions"):
        tiny()(x, t, scalar_conditions=torch.randn(2, 2))


def test_checkpoint_blocks_same_output_and_grads():
    torch.manual_seed(0)
    plain = tiny(pos_embed="rope", depth=3)
    perturb_(plain)
    ckpt = tiny(pos_embed="rope", depth=3, checkpoint_blocks=True)
    ckpt.load_state_dict(plain.state_dict())
    x, t = inputs()
    outs = []
    for model in (plain, ckpt):
        out = model(x, t)
        out.square().mean().backward()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1])
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_trainer_compile_takes_the_patch_embedding_and_final_layer_beside_the_blocks():
    # (eager, they are float32 passes and casts over the whole token grid: run 22's profile)
    from framework.train.compile import compile_model

    torch._dynamo.reset()
    plain = tiny(pos_embed="learned", num_scalar_conditions=2)
    perturb_(plain)
    model = tiny(pos_embed="learned", num_scalar_conditions=2)
    model.load_state_dict(plain.state_dict())
    c = compile_model(model, device_type="cpu", backend="aot_eager")
    assert [n for n, _ in c.units_list] == ["blocks.0", "blocks.1", "patch_embed", "final"]
    x, t = inputs()
    s = torch.randn(2, 2)
    outs = []
    for m in (plain, model):
        out = m(x, t, scalar_conditions=s)
        out.square().mean().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0])
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    stats = c.stats()
    assert stats["graph_breaks"] == 0 and stats["graphs"] == 3, stats  # one per block signature and region
    torch._dynamo.reset()
    # the patch embedding's convolution does not turn the token blocks channels-last on CUDA (a
    # layout copy of the token grid at every block)
    assert compile_model(tiny(), device_type="cuda", backend="eager", cudnn_benchmark=False).channels_last is False
    torch._dynamo.reset()


def test_blocks_are_a_module_list_and_params_contiguous():
    model = tiny()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.parametrize("rope", [False, True])
def test_attention_band_with_halo_equals_rows_of_full(rope):
    # What the domain-parallel step does: project the band, add halo rows of k/v, attend in global rows.
    torch.manual_seed(0)
    attn = NeighbourhoodAttention(16, 2, kernel=5, rope=rope, impl="reference")
    x = torch.randn(2, 11, 6, 16)
    full = attn(x)
    q, k, v = attn.project(x)
    ref = attn.proj(dense_neighbourhood_attention(q, k, v, 5).permute(0, 2, 3, 1, 4).reshape(2, 11, 6, 16))
    torch.testing.assert_close(full, ref)
    for a, b in [(0, 4), (4, 8), (8, 11)]:
        lo, hi = max(0, a - 2), min(11, b + 2)
        qb, _, _ = attn.project(x[:, a:b], row_offset=a)
        _, kb, vb = attn.project(x[:, lo:hi], row_offset=lo)  # what the neighbours send, already rotated
        out = attn.attend(qb, kb, vb, q_row_offset=a, kv_row_offset=lo, grid_rows=11)
        torch.testing.assert_close(out, full[:, a:b])


def test_pos_embed_band_slices_rows():
    pe = PosEmbed2d((6, 4), 8)
    assert pe.weight.shape == (1, 24, 8)  # (1, N, D), row-major over the token grid
    x = torch.zeros(1, 2, 4, 8)
    torch.testing.assert_close(pe(x, row_offset=3), pe.weight[:, 12:20].reshape(1, 2, 4, 8))
    torch.testing.assert_close(pe(torch.zeros(1, 6, 4, 8)), pe.weight.reshape(1, 6, 4, 8))


@pytest.mark.gpu
def test_flex_and_reference_models_agree_on_cuda(monkeypatch):
    import recipes.stormscope.natten as natten

    torch.manual_seed(0)
    cfg = dict(pos_embed="rope", img_resolution=(32, 48), attn_kernel=5, hidden_size=64)  # flex: head_dim >= 16
    ref = tiny(attn_impl="reference", **cfg).cuda()
    perturb_(ref)
    flex = tiny(attn_impl="flex", **cfg).cuda()
    flex.load_state_dict(ref.state_dict())
    x, t = (a.cuda() for a in inputs(shape=(32, 48)))
    outs = []
    for model in (ref, flex):
        out = model(x, t)
        out.square().mean().backward()
        outs.append(out)
        # from here on, a silent fallback from flex to the reference would fail the test
        monkeypatch.setattr(natten, "reference_neighbourhood_attention", None)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(ref.named_parameters(), flex.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_train_flops_are_the_model_flops():
    """3 x (2 x tokens x per-token weights + 4 x keys x hidden x tokens x depth), by hand."""
    from recipes.stormscope.dit import train_flops

    model = DiT((16, 12), 3, 2, patch_size=2, hidden_size=16, depth=2, num_heads=2, attn_kernel=5)
    tokens, keys = 8 * 6, 5 * 5
    weights = 3 * 2 * 2 * 16 + 16 * 2 * 2 * 2  # patch embedding, head
    weights += 2 * (16 * 48 + 16 * 16 + 16 * 64 + 64 * 16)  # qkv, proj, fc1, fc2 per block
    assert train_flops(model) == 3 * tokens * (2 * weights + 4 * keys * 16 * 2)
    assert model.flops_per_sample() == train_flops(model)
    small = DiT((8, 8), 3, 2, patch_size=2, hidden_size=16, depth=1, num_heads=2, attn_kernel=7)
    assert train_flops(small) > 0 and small.grid == (4, 4)  # kernel wider than the grid: 4 x 4 keys


def test_flex_block_compiles_with_only_the_mask_builder_breaking_the_graph():
    """A DiT block on the flex path under dynamo: the only graph breaks are the block-mask
    builder's (eager by design, once per geometry); anything else (a warnings context, a view
    of the qkv projection crossing the break) would leave part of the attention to eager
    autograd. Forward only: CPU flex has no backward."""
    from torch._dynamo.utils import counters

    from recipes.stormscope.dit import DiTBlock

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = DiTBlock(64, 4, 4.0, 5, rope=False, impl="flex")
    x, c = torch.randn(2, 16, 32, 64), torch.randn(2, 64)
    with torch.no_grad():
        want = block(x, c)
        got = torch.compile(block.forward, backend="eager")(x, c)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    reasons = [r.splitlines()[0] for r in counters["graph_break"]]
    assert reasons and all("torch.compiler.disable" in r for r in reasons), reasons
    # q, k, v leave the compiled projection as tensors of their own, not views of its output
    q, k, v = torch.compile(block.attn.project, backend="aot_eager")(x)
    assert all(t._base is None for t in (q, k, v))


@pytest.mark.parametrize("rope", [False, True], ids=["packed", "rope"])
def test_a_compiled_block_for_an_h200_reads_q_k_v_in_place_and_keeps_attention_one_op(rope):
    """The block compiled as the trainer compiles it (bf16 autocast, AOTAutograd, inductor), with
    inductor's code generated for an H200 on this machine (benchmarks/block_lowering.py): the
    fused attention is one custom op each way, and so are the MLP's bias and GELU, and no forward
    kernel copies q, k or v out of the projection's output (inductor names a copy's kernel after
    its ``clone``). Without rope the ops take the projection whole, so no backward kernel stacks
    dQ, dK and dV into its gradient (``select_backward``: 0.76 of the preset block's 6.0 GB of
    backward traffic); with rope, q and k are rotated copies, and the views' op runs. The gated
    residual sums and the norm between them are one op each way too."""
    from tests.conftest import benchmark_json

    args = ("--batch", 1, "--grid", 12, 16, "--hidden", 64, "--heads", 4, "--kernel", 5, "--residual-impl", "fused")
    args += ("--rope",) if rope else ()
    result = benchmark_json("block_lowering.py", *args)
    forward, backward = result["forward"], result["backward"]
    assert forward["error"] is None and backward["error"] is None, result
    op = "natten" if rope else "natten_packed"
    assert forward["calls"].count(f"torch.ops.stormscope.{op}_forward") == 1, forward["calls"]
    assert backward["calls"].count(f"torch.ops.stormscope.{op}_backward") == 1, backward["calls"]
    if not rope:
        assert forward["kernels"] and not [k for k, _ in forward["kernels"] if "clone" in k], forward["kernels"]
        assert not [k for k, _ in backward["kernels"] if "select_backward" in k], backward["kernels"]
    # the MLP's bias and GELU are one op each way (recipes/stormscope/gelu.py): no inductor kernel
    # computes a GELU, so none sums fc1's bias gradient from the GELU backward's output again
    assert forward["calls"].count("torch.ops.stormscope.bias_gelu") == 1, forward["calls"]
    assert backward["calls"].count("torch.ops.stormscope.bias_gelu_backward") == 1, backward["calls"]
    assert not [k for k, _ in forward["kernels"] + backward["kernels"] if "gelu" in k and k.startswith("triton")]
    # and the gated residual sums with the norm between them (recipes/stormscope/residual.py): of the
    # two LayerNorm backwards, inductor's kernels run the first's alone
    for op in ("residual_norm", "gated_residual"):
        assert forward["calls"].count(f"torch.ops.stormscope.{op}") == 1, forward["calls"]
        assert backward["calls"].count(f"torch.ops.stormscope.{op}_backward") == 1, backward["calls"]
    assert len([k for k, _ in backward["kernels"] if "layer_norm_backward" in k]) == 1, backward["kernels"]
