"""Tests for the plain-PyTorch SongUNet (recipes/stormcast/songunet.py, layers.py)."""

import ast
import copy
from functools import partial
from pathlib import Path

import pytest
import torch

import recipes.stormcast.songunet as songunet_mod
from recipes.stormcast import layers
from recipes.stormcast.layers import UNetBlock, group_norm_by_channel
from recipes.stormcast.songunet import SongUNet

STORMCAST_DIR = Path(songunet_mod.__file__).parent

PAPER_REGRESSION = dict(
    img_resolution=(512, 640),
    in_channels=127,
    out_channels=99,
    model_channels=128,
    channel_mult=[1, 2, 2, 2, 2],
    num_blocks=4,
    attn_resolutions=[],
    embedding_type="zero",
    dropout=0.0,
)


def tiny(**overrides):
    kw = dict(
        img_resolution=(32, 48),
        in_channels=3,
        out_channels=2,
        model_channels=16,
        channel_mult=[1, 2],
        num_blocks=1,
        attn_resolutions=[16],
        dropout=0.0,
    )
    kw.update(overrides)
    return SongUNet(**kw)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_paper_regression_config_has_78_6M_params():
    with torch.device("meta"):
        model = SongUNet(**PAPER_REGRESSION)
    assert abs(n_params(model) - 78.6e6) < 0.1e6, n_params(model)
    assert model.downsample_factor == 16
    # attn_resolutions=[] still leaves exactly one attention block: the bottleneck.
    attn_blocks = [n for n, m in model.named_modules() if isinstance(m, UNetBlock) and m.attn is not None]
    assert attn_blocks == ["dec.32_in0"]


def test_attention_placed_by_row_resolution():
    model = tiny()  # rows 32 -> 16; attention at 16 rows (level 1) + bottleneck
    has_attn = {n: m.attn is not None for n, m in model.named_modules() if isinstance(m, UNetBlock)}
    assert not has_attn["enc.32_block0"]
    assert has_attn["enc.16_block0"]
    assert has_attn["dec.16_in0"] and has_attn["dec.16_block1"] and not has_attn["dec.16_block0"]
    assert not any(v for k, v in has_attn.items() if k.startswith("dec.32"))


@pytest.mark.parametrize("embedding_type", ["positional", "zero"])
def test_output_shape(embedding_type):
    torch.manual_seed(0)
    model = tiny(embedding_type=embedding_type)
    x = torch.randn(2, 3, 32, 48)
    noise = torch.rand(2) if embedding_type == "positional" else None
    out = model(x, noise)
    assert out.shape == (2, 2, 32, 48)
    assert torch.isfinite(out).all()


def test_zero_embedding_has_no_mapping_network():
    model = tiny(embedding_type="zero")
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("map_") for n in names)
    assert any(n.startswith("map_") for n, _ in tiny().named_parameters())


def test_non_divisible_grid_raises_naming_numbers():
    with pytest.raises(ValueError, match=r"H=30, W=48.*= 4"):
        tiny(img_resolution=(30, 48), channel_mult=[1, 2, 2])
    model = tiny()
    with pytest.raises(ValueError, match=r"H=32, W=47.*= 2"):
        model(torch.randn(1, 3, 32, 47), torch.rand(1))


def test_additive_pos_embed_shape():
    model = tiny(additive_pos_embed=True)
    assert model.pos_embed.weight.shape == (1, 16, 32, 48)
    assert tiny().pos_embed is None
    out = model(torch.randn(1, 3, 32, 48), torch.rand(1))
    assert out.shape == (1, 2, 32, 48)


@pytest.mark.parametrize("embedding_type", ["positional", "zero"])
def test_gradients_reach_every_parameter(embedding_type):
    torch.manual_seed(0)
    model = tiny(embedding_type=embedding_type, additive_pos_embed=True).double()
    x = torch.randn(2, 3, 32, 48, dtype=torch.float64)
    model(x, torch.rand(2, dtype=torch.float64)).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        # With "zero" the block affine layers see an all-zero embedding: their
        # weights get exactly zero gradient by construction (only biases learn).
        if embedding_type == "zero" and name.endswith("affine.weight"):
            assert p.grad.abs().max() == 0, name
        else:
            assert p.grad.abs().max() > 0, name


def _edm_block(m: UNetBlock, x, emb, skip):
    """EDM's (and PhysicsNeMo's) UNetBlock written out: each convolution with its bias, the
    embedding's shift added to conv0's output, the sum of the two paths times ``skip_scale``."""
    import torch.nn.functional as F

    def norm(n, t):
        return F.group_norm(t, n.num_groups, n.weight, n.bias, n.eps)

    x = x if skip is None else torch.cat([x, skip], dim=1)
    orig = x
    x = m.conv0(F.silu(norm(m.norm0, x)))
    if m.affine is not None:
        params = m.affine(emb)[:, :, None, None]
        if m.adaptive_scale:
            scale, shift = params.chunk(2, dim=1)
            x = F.silu(shift + norm(m.norm1, x) * (scale + 1))
        else:
            x = F.silu(norm(m.norm1, x + params))
    else:
        x = F.silu(norm(m.norm1, x))
    x = m.conv1(x)
    return (x + (m.skip(orig) if m.skip is not None else orig)) * m.skip_scale


@pytest.mark.parametrize(
    "kw",
    [
        dict(in_channels=16, out_channels=16, emb_channels=8),  # identity skip
        dict(in_channels=16, out_channels=32, emb_channels=8),  # a 1x1 skip convolution
        dict(in_channels=16, out_channels=16, emb_channels=8, down=True),
        dict(in_channels=16, out_channels=16, emb_channels=8, up=True),
        dict(in_channels=16, out_channels=16, emb_channels=8, adaptive_scale=True),
        dict(in_channels=16, out_channels=16, emb_channels=0),  # no embedding
        dict(in_channels=32, out_channels=16, emb_channels=8, skip=16),  # a decoder's concatenation
    ],
    ids=["identity", "skip-conv", "down", "up", "adaptive", "no-emb", "concat"],
)
def test_block_computes_edms_formula(kw):
    """The block folds conv0's bias into norm1's shift and ``skip_scale`` into the convolutions'
    weights (fewer passes over activations): the same function as the reference's, in float64."""
    kw = dict(kw)
    skip_channels = kw.pop("skip", 0)
    torch.manual_seed(0)
    m = UNetBlock(**kw).double()
    for p in m.parameters():  # (biases start at zero, conv1 near zero: both made to matter)
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, kw["in_channels"] - skip_channels, 8, 12, dtype=torch.float64)
    skip = torch.randn(2, skip_channels, 8, 12, dtype=torch.float64) if skip_channels else None
    emb = torch.randn(2, kw["emb_channels"], dtype=torch.float64) if kw["emb_channels"] else None
    torch.testing.assert_close(m(x, emb, skip), _edm_block(m, x, emb, skip), rtol=1e-12, atol=1e-12)


def test_a_compiled_block_for_an_h200_makes_no_pass_for_conv0s_bias_or_the_skip_scale():
    """The regression net's blocks compiled as the trainer compiles them on a GPU, with inductor's
    code generated for an H200 on this machine (benchmarks/unet_lowering.py): outside the fused
    norms and the convolutions, a block's Triton kernels move about three activations forward (the
    residual sum) and one backward (a bias gradient); adding conv0's bias by itself, and
    multiplying the sum and its gradient by skip_scale, moved two more each way. A decoder block
    adds its concatenation (four)."""
    from tests.conftest import benchmark_json

    args = ("--batch", 1, "--grid", 256, 320, "--units", "enc.256_block0", "dec.256_block1")
    units = {u["name"]: u for u in benchmark_json("unet_lowering.py", *args)["units"]}
    activation = 1 * 128 * 256 * 320 * 2 / 1e9  # GB: one bf16 activation of level 0
    moved = {}
    for name, unit in units.items():
        for part in ("forward", "backward"):
            assert unit[part]["error"] is None, unit[part]
            moved[name, part] = sum(gb for _, gb in unit[part]["kernels"]) / activation
    assert moved["enc.256_block0", "forward"] < 3.5 and moved["enc.256_block0", "backward"] < 1.5, moved
    assert moved["dec.256_block1", "forward"] < 7.5 and moved["dec.256_block1", "backward"] < 1.5, moved


@pytest.mark.parametrize("level", [1, 2])
def test_checkpointing_matches_plain(level, monkeypatch):
    torch.manual_seed(0)
    plain = tiny(dropout=0.1, additive_pos_embed=True)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpoint_level = level
    x = torch.randn(2, 3, 32, 48)
    noise = torch.rand(2)

    calls = []
    real = songunet_mod.checkpoint
    monkeypatch.setattr(songunet_mod, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))

    outs, grads = [], []
    for model in (plain, ckpt):
        torch.manual_seed(123)  # same dropout masks in both runs
        out = model(x, noise)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    # level 1: only the 32-row blocks (enc 32_block0, dec 16->32 up + 2 blocks); level 2: all 10.
    assert len(calls) == (4 if level == 1 else 10)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], atol=1e-6, rtol=1e-6, msg=name)


def test_channels_last_input_matches_contiguous():
    torch.manual_seed(0)
    model = tiny().eval()
    x = torch.randn(2, 3, 32, 48)
    noise = torch.rand(2)
    with torch.no_grad():
        ref = model(x, noise)
        out = model(x.to(memory_format=torch.channels_last), noise)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.contiguous(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cin,cout", [(5, 3), (13, 16), (16, 11)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_aligned_conv_computes_the_plain_convolution(cin, cout, channels_last):
    """The channel padding that CUDA's 16-bit convolutions get (zero channels in, zero filters
    out, sliced off) is the plain convolution, forward and both gradients, in the input's layout."""
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, cin, 6, 7, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(cout, cin, 3, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.conv2d(x, w, padding=1)
    out = layers._aligned_conv2d(x, w)
    assert out.shape == ref.shape
    assert out.stride(1) == 1 if channels_last else out.stride(1) == 6 * 7  # the input's layout (sliced)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    gy = torch.randn_like(ref)
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w), gy)
    gx, gw = torch.autograd.grad(out, (x, w), gy)
    torch.testing.assert_close(gx, gx_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(gw, gw_ref, atol=1e-12, rtol=1e-12)
    assert gx.stride() == gx_ref.stride()  # the input's gradient in the input's layout too
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 is not autocast: it stays float64
        torch.testing.assert_close(layers._aligned_conv2d(x, w), ref, atol=1e-12, rtol=1e-12)
    unbatched = layers._aligned_conv2d(x[0].detach(), w.detach())  # (C, H, W), as F.conv2d takes
    torch.testing.assert_close(unbatched, ref[0].detach(), atol=1e-12, rtol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cast like autocast, then padded
        xf, wf = x.detach().float(), w.detach().float()
        half, half_ref = layers._aligned_conv2d(xf, wf), torch.nn.functional.conv2d(xf, wf, padding=1)
    assert half.dtype == half_ref.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), half_ref.float(), atol=0.1, rtol=2e-2)


def test_conv_pads_channels_only_on_cuda_in_16_bit(monkeypatch):
    """Elsewhere (CPU, or float32 compute) the plain convolution runs: padding costs copies there."""
    calls = []
    monkeypatch.setattr(layers, "_aligned_conv2d", lambda x, w: calls.append(1))
    conv = layers.Conv2d(5, 3, kernel=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv(torch.randn(1, 5, 4, 4)).shape == (1, 3, 4, 4)
    assert conv(torch.randn(1, 5, 4, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert not calls


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit-backward", "autograd"])
@pytest.mark.parametrize(
    "shape,groups,channels_last",
    [((2, 64, 12, 20), 16, False), ((2, 64, 12, 20), 16, True), ((3, 8, 5, 7), 2, True), ((2, 12, 9), 3, False)],
)
def test_group_norm_by_channel_equals_torchs(shape, groups, channels_last, explicit):
    """The compiled path's GroupNorm (per-channel moments combined into groups) is torch's,
    forward and every gradient, with a mean far from zero (where a naive E[x^2] - E[x]^2 fails,
    and where the explicit backward's sums would cancel if they were not centred)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 50
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b, dy = (
        torch.randn(shape[1], generator=g, dtype=torch.float64),
        torch.randn(shape[1], generator=g, dtype=torch.float64),
        torch.randn(*shape, generator=g, dtype=torch.float64),
    )
    outs = []
    for fn in (torch.nn.functional.group_norm, partial(group_norm_by_channel, explicit=explicit)):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(leaves[0], groups, leaves[1], leaves[2], 1e-6)
        outs.append((y, *torch.autograd.grad(y, leaves, dy)))
    for name, ref, got in zip(("y", "dx", "dweight", "dbias"), *outs):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=name)
    if channels_last:  # it keeps the layout, so a compiled graph stays channels-last
        assert outs[1][0].is_contiguous(memory_format=torch.channels_last)


def test_group_norm_by_channel_keeps_torchs_dtypes():
    x = torch.randn(2, 8, 4, 4).bfloat16()
    assert group_norm_by_channel(x, 2, None, None, 1e-6).dtype == torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16):  # CPU autocast leaves group_norm in the input's dtype
        assert group_norm_by_channel(x, 2, None, None, 1e-6).dtype == torch.nn.functional.group_norm(x, 2).dtype
    torch.testing.assert_close(
        group_norm_by_channel(x, 2, None, None, 1e-6).float(),
        torch.nn.functional.group_norm(x.float(), 2, eps=1e-6),
        atol=2e-2,
        rtol=2e-2,
    )


def test_compiled_group_norm_uses_the_per_channel_form(monkeypatch):
    """The GroupNorm module takes the per-channel form inside torch.compile, torch's kernel outside."""
    from recipes.stormcast import layers

    calls = []
    real = layers.group_norm_by_channel
    monkeypatch.setattr(layers, "group_norm_by_channel", lambda *a, **k: calls.append(1) or real(*a, **k))
    norm = layers.GroupNorm(16)
    x = torch.randn(2, 16, 4, 4)
    norm(x)
    assert not calls
    torch._dynamo.reset()
    y = torch.compile(norm, backend="eager")(x)
    assert calls
    torch.testing.assert_close(y, torch.nn.functional.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps))
    torch._dynamo.reset()


def test_model_compiled_norm_reaches_every_group_norm():
    """model.compiled_norm (default auto) picks the compiled GroupNorm form of every norm the
    model builder makes; an unknown form is a config error naming the key and the choices."""
    import recipes.stormcast.registry  # noqa: F401  (registers the songunet builder)
    from framework import registry
    from framework.config.schema import Invalid
    from recipes.stormcast.config import SongUNetConfig
    from recipes.stormcast.layers import GroupNorm

    assert SongUNetConfig().compiled_norm == "auto"
    cfg = SongUNetConfig(model_channels=8, channel_mult=[1, 2], num_blocks=1, compiled_norm="explicit")
    model = registry.models.entry("songunet").builder(cfg, in_channels=3, out_channels=2, img_resolution=[16, 16])
    forms = [m.compiled_form for m in model.modules() if isinstance(m, GroupNorm)]
    assert len(forms) > 4 and set(forms) == {"explicit"}
    with pytest.raises(
        Invalid, match=r"compiled_norm.*must be one of auto, fused, explicit, composite, aten \(got 'triton'\)"
    ):
        SongUNetConfig(compiled_norm="triton")


@pytest.mark.parametrize("form", ["explicit", "composite", "fused"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_compiled_block_trains_like_the_eager_one(form, channels_last, monkeypatch):
    """A UNet block under torch.compile (dynamo + AOTAutograd, fp32, no graph break) gives the
    eager block's output and every gradient. Torch 2.11's dynamo handed the explicit GroupNorm
    backward zeros where its forward returned a no-op ``.to`` (every gradient upstream of the
    norm was lost); CI runs this on the oldest and the newest torch of the supported range, and
    the "fused" form (the Triton kernels, as custom ops) under Triton's interpreter."""
    from recipes.stormcast import fused_norm
    from recipes.stormcast.layers import GroupNorm

    if form == "fused" and not fused_norm.available(torch.empty(1, 1, 1)):
        pytest.skip("the fused kernels need Triton (on CPU: its interpreter, TRITON_INTERPRET=1)")
    monkeypatch.setattr(GroupNorm, "compiled_form", form)
    calls = []  # the fused kernels run where asked, and only compiled
    real = fused_norm.group_norm
    monkeypatch.setattr(fused_norm, "group_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    block = UNetBlock(16, 8, emb_channels=32, eps=1e-6)
    for p in block.parameters():  # no zero-initialised convolution: every gradient is non-trivial
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 16, 8, 8)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    emb, grad = torch.randn(2, 32), torch.randn(2, 8, 8, 8)
    results = []
    torch._dynamo.reset()
    for fn in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        fn(xi, emb).backward(grad)
        results.append([xi.grad] + [p.grad for p in block.parameters()])
        assert bool(calls) == (form == "fused" and fn is not block)
    torch._dynamo.reset()
    names = ["input"] + [n for n, _ in block.named_parameters()]
    for name, want, got in zip(names, *results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _norm_flags(model):
    return {n: m.recompute for n, m in model.named_modules() if isinstance(m, layers.GroupNorm)}


def test_recompute_norm_levels_mark_only_the_norms_of_those_levels():
    """model.recompute_norm_levels reaches the GroupNorms of the blocks at those levels, and only
    them (an up block counts at the finer level it writes; the output norm never: its output leaves
    its compiled region for the output convolution's, which keeps it anyway); a level the net does
    not have is a config error naming the key and the range."""
    import recipes.stormcast.registry  # noqa: F401  (registers the songunet builder)
    from framework import registry
    from framework.config.schema import Invalid
    from recipes.stormcast.config import SongUNetConfig

    cfg = SongUNetConfig(model_channels=8, channel_mult=[1, 2, 2], num_blocks=1, recompute_norm_levels=[1])
    model = registry.models.entry("songunet").builder(cfg, in_channels=3, out_channels=2, img_resolution=[16, 16])
    flags = _norm_flags(model)
    on = sorted({n.rsplit(".norm", 1)[0] for n, f in flags.items() if f})
    # level 1 rows: 8; the down block enters it, the up block from 4 rows leaves into it
    assert on == ["dec.8_block0", "dec.8_block1", "dec.8_up", "enc.8_block0", "enc.8_down"], on
    assert not flags["out_norm"] and all(len(n.split(".")) >= 2 for n in on)
    model.set_norm_recompute([0, 1, 2])
    flags = _norm_flags(model)
    assert not flags.pop("out_norm") and all(flags.values())
    model.set_norm_recompute([])
    assert not any(_norm_flags(model).values())
    with pytest.raises(ValueError, match=r"recompute_norm_levels \[3\]: levels run 0..2"):
        model.set_norm_recompute([3])
    message = r"recompute_norm_levels.*levels run 0..1 for channel_mult=\[1, 2\] \(got \[0, 2\]\)"
    with pytest.raises(Invalid, match=message):
        SongUNetConfig(channel_mult=[1, 2], recompute_norm_levels=[0, 2])


def _inductor(options: dict):
    """torch.compile with inductor as the framework sets it up (its cache settings: a custom op's
    new schema is a new cache key) with these inductor options."""
    from framework.train.compile import use_caches

    use_caches()
    return partial(torch.compile, backend="inductor", fullgraph=True, options=options)


def _saved_and_grads(block, compile_fn, masks: dict | None = None):
    """(elements of the distinct activations (8 x 8 pixels) the step kept for backward, the input's
    and the parameters' gradients); the byte and bool tensors kept (a dropout's mask) go into ``masks``."""
    torch.manual_seed(1)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    emb, grad = torch.randn(2, 32), torch.randn(2, 8, 8, 8)
    block.zero_grad(set_to_none=True)
    saved = {}

    def pack(t):
        if t.is_floating_point() and t.dim() == 4 and t.shape[2:] == (8, 8):
            saved[t.untyped_storage().data_ptr()] = t.numel()
        elif t.dtype in (torch.uint8, torch.bool) and masks is not None:
            masks[t.untyped_storage().data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compile_fn(block)(x, emb)
    out.backward(grad)
    return sum(saved.values()), [x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("form", ["eager", "explicit", "fused"])
def test_recomputed_norms_keep_less_for_backward_and_train_alike(form, monkeypatch):
    """A compiled block whose norms recompute keeps only the norms' inputs for backward (the block's
    input and the first convolution's output), not their outputs, and gives the same gradients:
    the explicit form through torch's checkpoint, the fused form (the Triton kernels, under the
    interpreter on CPU) through inductor and the framework's must-recompute pass on its custom op.
    An eager block keeps what it kept (a checkpoint of the norm alone would free nothing there)."""
    from framework.train.compile import RecomputeOps, recomputed_ops
    from recipes.stormcast import fused_norm

    if form == "fused" and not fused_norm.available(torch.empty(1, 1, 1)):
        pytest.skip("the fused kernels need Triton (on CPU: its interpreter, TRITON_INTERPRET=1)")
    calls = []
    real = fused_norm.gn_apply_recomputed
    monkeypatch.setattr(fused_norm, "gn_apply_recomputed", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    block = UNetBlock(16, 8, emb_channels=32, eps=1e-6)
    for p in block.parameters():  # no zero-initialised convolution: every gradient is non-trivial
        torch.nn.init.normal_(p, std=0.1)
    layers.set_compiled_form(block, "explicit" if form == "eager" else form)
    if form == "eager":
        compile_fn = lambda b: b  # noqa: E731
    elif form == "explicit":
        compile_fn = partial(torch.compile, backend="aot_eager", fullgraph=True)
    else:
        options = {"joint_custom_pre_pass": RecomputeOps(recomputed_ops(block))}
        compile_fn = _inductor(options)
    results = []
    for recompute in (False, True):
        torch._dynamo.reset()
        for m in block.modules():
            if isinstance(m, layers.GroupNorm):
                m.recompute = recompute
        results.append(_saved_and_grads(block, compile_fn))
    torch._dynamo.reset()
    (kept, want), (recomputed, got) = results
    if form == "eager":
        assert recomputed == kept, (kept, recomputed)
    else:
        assert recomputed == 2 * (16 + 8) * 8 * 8 < kept, (kept, recomputed)
    assert bool(calls) == (form == "fused")
    names = ["input"] + [n for n, _ in block.named_parameters()]
    for name, a, b in zip(names, want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_fused_dropout_keeps_no_mask_and_recomputes_the_same_one():
    """The fused form draws the block's dropout (after norm1's SiLU) inside the norm's kernel: a
    compiled block keeps nothing more for backward than without dropout (no mask, no second copy
    of conv1's input), and with its norms recomputed it draws the same mask again (same
    gradients), keeping only the norms' inputs."""
    from framework.train.compile import RecomputeOps, recomputed_ops
    from recipes.stormcast import fused_norm

    if not fused_norm.available(torch.empty(1, 1, 1)):
        pytest.skip("the fused kernels need Triton (on CPU: its interpreter, TRITON_INTERPRET=1)")
    options = {"joint_custom_pre_pass": RecomputeOps(fused_norm.RECOMPUTED_OPS)}
    compile_fn = _inductor(options)
    results, masks = {}, {}
    for dropout, recompute in ((0.0, False), (0.25, False), (0.25, True)):
        torch.manual_seed(0)
        block = UNetBlock(16, 8, emb_channels=32, eps=1e-6, dropout=dropout)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.1)
        layers.set_compiled_form(block, "fused")
        assert recomputed_ops(block) == fused_norm.RECOMPUTED_OPS
        for m in block.modules():
            if isinstance(m, layers.GroupNorm):
                m.recompute = recompute
        torch._dynamo.reset()
        masks[dropout, recompute] = {}
        results[dropout, recompute] = _saved_and_grads(block, compile_fn, masks[dropout, recompute])
    torch._dynamo.reset()
    (plain, _), (kept, want), (recomputed, got) = results.values()
    assert kept == plain and recomputed == 2 * (16 + 8) * 8 * 8 < kept, (plain, kept, recomputed)
    assert not any(masks.values()), masks  # no byte tensor kept: the mask is drawn again
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(results[0.0, False][1][0], want[0])  # the dropout did act


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_fused_dropout_gradients_follow_the_forwards_mask_below_budget_1(recompute, monkeypatch):
    """At the presets' memory budget (0.7) the partitioner would redraw a free-looking seed in
    backward; the framework's pass keeps it, so the gradients are those of the mask the forward
    drew (read off the norm's output), kept or recomputed."""
    import torch._functorch.config as functorch_config

    from framework.train.compile import RecomputeOps
    from recipes.stormcast import fused_norm
    from tests.recipes.stormcast.test_fused_norm import _reference

    if not fused_norm.available(torch.empty(1, 1, 1)):
        pytest.skip("the fused kernels need Triton (on CPU: its interpreter, TRITON_INTERPRET=1)")
    monkeypatch.setattr(functorch_config, "activation_memory_budget", 0.7)

    def step(norm):
        def f(x, w, b, shift, k):
            y = norm(x, w, b, shift)
            return torch.nn.functional.conv2d(y, k, padding=1), y

        return f

    def fused(x, w, b, shift):
        return fused_norm.group_norm(x, 4, w, b, 1e-6, shift=shift, silu=True, recompute=recompute, dropout=0.25)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 8, 8, generator=g) * 2 + 5
    w, b, shift = torch.randn(16, generator=g), torch.randn(16, generator=g), torch.randn(2, 16, generator=g)
    k, dy = torch.randn(16, 16, 3, 3, generator=g) * 0.1, torch.randn(2, 16, 8, 8, generator=g)
    options = {"joint_custom_pre_pass": RecomputeOps(fused_norm.RECOMPUTED_OPS)}
    torch._dynamo.reset()
    compiled = _inductor(options)(step(fused))
    leaves = [t.clone().requires_grad_() for t in (x, w, b, shift, k)]
    out, y = compiled(*leaves)
    got = torch.autograd.grad(out, leaves, dy)
    torch._dynamo.reset()
    keep = y.detach() != 0
    want_leaves = [t.clone().requires_grad_() for t in (x, w, b, shift, k)]
    want_out, _ = step(lambda x, w, b, s: _reference(x, 4, w, b, 1e-6, s, True) * keep / 0.75)(*want_leaves)
    want = torch.autograd.grad(want_out, want_leaves, dy)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    for name, a, r in zip(("x", "weight", "bias", "shift", "kernel"), got, want):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("filename", ["songunet.py", "layers.py", "fused_norm.py", "group_stats.py"])
def test_model_code_does_not_import_framework(filename):
    tree = ast.parse((STORMCAST_DIR / filename).read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
    bad = [m for m in imported if m == "framework" or m.startswith("framework.")]
    assert not bad, f"{filename} imports {bad}"
    assert "importlib" not in imported
