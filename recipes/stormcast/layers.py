"""Building blocks of the EDM / DDPM++ "SongUNet" (Karras et al. 2022, Song et al. 2021).

Plain PyTorch, no dependency on ``framework``. The layers keep EDM's parameter
names (``weight``/``bias``, ``norm0``/``conv0``/``affine``/...) so that the module
tree reads like the reference architecture, and EDM's initialisation scheme:
weights are xavier-uniform multiplied by ``init_weight`` and biases start at zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from recipes.stormcast import fused_norm
from recipes.stormcast.group_stats import group_moments, input_grad_coefficients, spread


def _xavier_uniform_(tensor: torch.Tensor, fan_in: int, fan_out: int, gain: float) -> None:
    # Explicit fans (instead of nn.init's inference) so convs and linears share one rule.
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        tensor.uniform_(-bound, bound)


class Linear(nn.Module):
    """Fully connected layer with EDM init (xavier-uniform times ``init_weight``, zero bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init_weight: float = 1.0):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        _xavier_uniform_(self.weight, in_features, out_features, init_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """channels_last for a channels-last 4-D tensor (that is not also plain contiguous), else contiguous."""
    cl = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if cl else torch.contiguous_format


_ALIGN = 8  # channel multiple that cuDNN's 16-bit tensor-core convolution kernels want


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a convolution of ``x`` computes in: autocast's for the types it casts, else x's."""
    if torch.is_autocast_enabled(x.device.type) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _conv2d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.conv2d`` with "same" padding; on CUDA in 16-bit with unaligned channels, ``_aligned_conv2d``."""
    if (
        x.is_cuda
        and (w.shape[0] % _ALIGN or w.shape[1] % _ALIGN)
        and _compute_dtype(x) in (torch.bfloat16, torch.float16)
    ):
        return _aligned_conv2d(x, w)
    return F.conv2d(x, w, padding=w.shape[-1] // 2)


def _aligned_conv2d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same convolution with zero input channels and zero filters added up to multiples of 8,
    the extra outputs cropped: the same sums, but cuDNN then runs its aligned kernels, 1.7-1.9x
    faster on an H200 for StormCast's 127-in and 99-out convolutions (docs/benchmarks.md, run 11).
    Pads, not slices, so that input, output and both gradients keep the input's memory format (a
    slice's backward writes NCHW, and the convolution's backward then copies to the input's)."""
    cout, cin = w.shape[:2]
    extra_in, extra_out = -cin % _ALIGN, -cout % _ALIGN
    if extra_in:  # cast first, as autocast would, so that the padded copy is the 16-bit one
        x = F.pad(x.to(_compute_dtype(x)), (0, 0, 0, 0, 0, extra_in))
    y = F.conv2d(x, F.pad(w, (0, 0, 0, 0, 0, extra_in, 0, extra_out)), padding=w.shape[-1] // 2)
    return F.pad(y, (0, 0, 0, 0, 0, -extra_out)) if extra_out else y


class Conv2d(nn.Module):
    """2-D convolution with optional 2x up/down sampling by a fixed separable filter.

    As in EDM the resampling is a separate, parameter-free depthwise step with the
    normalised outer product of ``resample_filter`` (``[1, 1]`` = box filter):
    a stride-2 depthwise conv for ``down``, a stride-2 depthwise transposed conv
    (filter x4 to keep the mean) for ``up``. The learned ``kernel x kernel`` conv
    runs afterwards at the new resolution. ``kernel=0`` gives a pure resampler
    without parameters.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: int,
        bias: bool = True,
        up: bool = False,
        down: bool = False,
        resample_filter: Sequence[int] = (1, 1),
        init_weight: float = 1.0,
    ):
        super().__init__()
        if up and down:
            raise ValueError("Conv2d cannot both upsample and downsample")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.up = up
        self.down = down
        # a network's last layer: its output in the plain (NCHW) layout of targets and inputs,
        # whatever the layout it computes in (see SongUNet)
        self.contiguous_output = False
        # a network's first layer: compiled, it takes the NCHW input as it comes (the framework
        # reads this) and, when the blocks run channels-last (``configure_compile``), changes its
        # layout inside its graph, where the change fuses with the cast and channel padding
        self.compile_contiguous_inputs = False
        self._channels_last_input = False
        self.weight = None
        self.bias = None
        if kernel:
            self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel, kernel))
            _xavier_uniform_(self.weight, in_channels * kernel * kernel, out_channels * kernel * kernel, init_weight)
            if bias:
                self.bias = nn.Parameter(torch.zeros(out_channels))
        # [1, 1] (DDPM++): the depthwise resampling is a 2x2 mean (down) or a 2x2 repeat (up);
        # pooling/nearest kernels do that exactly, fuse under torch.compile and work in any
        # memory format, where a depthwise cuDNN conv is slow (channels-last most of all).
        self._box = (up or down) and len(resample_filter) == 2 and resample_filter[0] == resample_filter[1]
        if up or down:
            f = torch.as_tensor(list(resample_filter), dtype=torch.float32)
            f = torch.outer(f, f) / f.sum().square()
            # A buffer (not a parameter): the filter is fixed, but moves with .to()/.cuda().
            self.register_buffer("resample_filter", f[None, None])
        else:
            self.resample_filter = None

    def configure_compile(self, *, cudagraphs: bool, channels_last: bool = False) -> None:
        """Called by the framework's compile before it compiles (see ``compile_contiguous_inputs``)."""
        self._channels_last_input = channels_last and self.compile_contiguous_inputs

    def forward(self, x: torch.Tensor, scale: float = 1.0, add_bias: bool = True) -> torch.Tensor:
        """The convolution of ``x``, times ``scale`` (folded into the weight and bias: a scalar
        the output would be multiplied by, taken in the parameters' small cast instead of a pass
        over the output and one over its gradient); ``add_bias=False`` leaves the bias to the
        caller (the next layer's per-channel shift, say)."""
        if self._channels_last_input and torch.compiler.is_compiling():
            x = x.contiguous(memory_format=torch.channels_last)
        f = self.resample_filter
        if f is not None and self._box:
            if self.down:
                x = F.avg_pool2d(x, 2)
            else:  # each pixel repeated 2x2; as an expand, its backward is a sum, not a scatter-add
                b, c, h, w = x.shape
                fmt = _memory_format(x)  # reshape's copy would be NCHW: keep a channels-last input so
                x = x[:, :, :, None, :, None].expand(b, c, h, 2, w, 2).reshape(b, c, 2 * h, 2 * w)
                x = x.contiguous(memory_format=fmt)  # (a compiled graph fuses this into the copy)
        elif f is not None:
            c = x.shape[1]
            f = f.to(x.dtype).tile(c, 1, 1, 1)
            pad = (f.shape[-1] - 1) // 2
            if self.up:
                x = F.conv_transpose2d(x, f * 4, groups=c, stride=2, padding=pad)
            else:
                x = F.conv2d(x, f, groups=c, stride=2, padding=pad)
        if self.weight is not None:
            w = self.weight
            if torch.compiler.is_compiling() and _memory_format(x) == torch.channels_last and w.is_contiguous():
                # a channels-last convolution's weight gradient is channels-last: handed back so,
                # autograd copies it into the parameter's layout (113 launches, 1.5 ms of the
                # regression step); made dense here, the copy fuses into the gradient's cast
                w = _DenseGrad.apply(w)
            x = _conv2d(x, (w * scale if scale != 1 else w).to(x.dtype))
        elif scale != 1:
            x = x * scale
        if self.bias is not None and add_bias:
            x = x + self.bias_as(x.dtype, scale).reshape(1, -1, 1, 1)
        return x.contiguous() if self.contiguous_output else x

    def bias_as(self, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        """The bias, times ``scale``, in ``dtype`` (what ``forward`` adds)."""
        return (self.bias * scale if scale != 1 else self.bias).to(dtype)


class GroupNorm(nn.Module):
    """GroupNorm with EDM's group rule: ``min(num_groups, C // min_channels_per_group)`` groups.

    This keeps at least 4 channels per group for narrow layers instead of failing
    when C < 32.
    """

    def __init__(self, num_channels: int, num_groups: int = 32, min_channels_per_group: int = 4, eps: float = 1e-5):
        super().__init__()
        self.num_groups = max(1, min(num_groups, num_channels // min_channels_per_group))
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))

    # Under torch.compile. "fused": the Triton kernels of ``fused_norm`` on CUDA (statistics,
    # normalise + SiLU, and the backward's two passes over tiles of pixels x channels; a sixth
    # less GPU time, but four launches per norm from Python, which pay only when the compiled
    # graphs replay as CUDA graphs: docs/benchmarks.md, runs 8-9). "explicit" (also where Triton
    # cannot run, e.g. on CPU): per-channel statistics combined into groups
    # (``group_norm_by_channel``), which inductor reduces with coalesced reads in either memory
    # format, with an explicit backward. "auto" (the default): "fused" when the framework's
    # compile replays the graphs as CUDA graphs (``configure_compile``), else "explicit".
    # "composite" differentiates the per-channel form through autograd, and "aten" keeps torch's
    # kernel when compiled too (these two for side-by-side measurements). Eager: torch's kernel.
    # Set per model with ``set_compiled_form`` (``model.compiled_norm``).
    compiled_form = "auto"
    # Compiled blocks recompute the output (after the SiLU) in backward instead of keeping it for
    # the convolution that reads it: one pass over the input, which the norm's own backward keeps
    # anyway. Set per instance (``SongUNet``'s ``recompute_norm_levels``). "fused": through the
    # custom op the framework's compile marks must-recompute (``recomputed_ops``); the other forms:
    # ``torch.utils.checkpoint`` around the norm, whose nodes the partitioner then recomputes
    # (statistics included). Eager runs keep it: a checkpoint of the norm alone frees nothing
    # there, since the convolution after it keeps its input (``checkpoint_level`` is eager's knob).
    recompute = False
    recomputed_ops = fused_norm.RECOMPUTED_OPS

    def configure_compile(self, *, cudagraphs: bool, channels_last: bool = False) -> None:
        """Called by the framework's compile before it compiles: "auto" becomes a form (set on
        the instance, so it travels with the blocks to precompilation's worker processes)."""
        if self.compiled_form == "auto":
            self.compiled_form = "fused" if cudagraphs else "explicit"

    def forward(
        self, x: torch.Tensor, shift: torch.Tensor | None = None, silu: bool = False, dropout: float = 0.0
    ) -> torch.Tensor:
        """GroupNorm of ``x + shift`` (``shift``: one value per sample and channel, (B, C) or
        (B, C, 1, 1)), then SiLU if ``silu``, then dropout at rate ``dropout`` in training."""
        p = dropout if self.training else 0.0
        # (training only: a variant's eval-mode ``normalise`` must hold, e.g. PhysicsNeMo's)
        fused = self.compiled_form == "fused" and self.training and torch.compiler.is_compiling()
        if fused and fused_norm.available(x):
            # in the dtype the convolution after it computes in: the same values, half the bytes;
            # the dropout inside the kernel, its mask drawn again in backward rather than kept
            out = torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else x.dtype
            w, b = self.weight.to(x.dtype), self.bias.to(x.dtype)
            return fused_norm.group_norm(
                x,
                self.num_groups,
                w,
                b,
                self.eps,
                shift=shift,
                silu=silu,
                dtype=out,
                recompute=self.recompute,
                dropout=p,
            )
        if self.recompute and self.training and torch.compiler.is_compiling():
            y = checkpoint(self._norm_silu, x, shift, silu, use_reentrant=False)
        else:
            y = self._norm_silu(x, shift, silu)
        return F.dropout(y, p=p) if p else y

    def _norm_silu(self, x: torch.Tensor, shift: torch.Tensor | None, silu: bool) -> torch.Tensor:
        if shift is not None:
            x = x + shift.reshape(*shift.shape[:2], *(1,) * (x.dim() - 2))
        y = self.normalise(x)
        return F.silu(y) if silu else y

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """The normalisation alone (what a variant of this GroupNorm overrides)."""
        w, b = self.weight.to(x.dtype), self.bias.to(x.dtype)
        if self.compiled_form != "aten" and torch.compiler.is_compiling():
            explicit = self.compiled_form != "composite"
            return group_norm_by_channel(x, self.num_groups, w, b, self.eps, explicit=explicit)
        return F.group_norm(x, self.num_groups, w, b, self.eps)


FORMS = ("auto", "fused", "explicit", "composite", "aten")


def set_compiled_form(model: nn.Module, form: str) -> None:
    """Every GroupNorm of ``model`` compiles as ``form`` (see ``GroupNorm.compiled_form``). Set on
    the instances: it travels with the blocks that precompilation's worker processes unpickle,
    where a class attribute would stay behind (they would build the other form's graphs)."""
    if form not in FORMS:
        raise ValueError(f"GroupNorm form {form!r}: expected one of {', '.join(FORMS)}")
    for m in model.modules():
        if isinstance(m, GroupNorm):
            m.compiled_form = form


def _moments(xf: torch.Tensor, groups: int):
    """Per-channel means (B, C), and the groups' means and variances (B, G, 1)."""
    var_c, mean_c = torch.var_mean(xf, dim=tuple(range(2, xf.dim())), correction=0)
    return mean_c, *group_moments(mean_c, var_c, groups)


def _normalise(xf, mean, rstd, weight, bias) -> torch.Tensor:
    """(x - group mean) * group rstd * weight + bias, with the groups' (B, G, 1) statistics."""
    c, dims = xf.shape[1], xf.dim() - 2
    scale = spread(rstd, c, dims)
    if weight is not None:
        scale = scale * weight.to(xf.dtype).reshape(1, c, *(1,) * dims)
    y = (xf - spread(mean, c, dims)) * scale
    if bias is not None:
        y = y + bias.to(xf.dtype).reshape(1, c, *(1,) * dims)
    return y


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    # F.group_norm's: float32 under CUDA autocast (its float32 list holds group_norm; CPU
    # autocast's does not), else the input's
    low = x.dtype in (torch.float16, torch.bfloat16)
    return torch.float32 if low and x.is_cuda and torch.is_autocast_enabled("cuda") else x.dtype


class _GroupNormByChannel(torch.autograd.Function):
    """``group_norm_by_channel``'s explicit backward: one reduction over the pixels for both
    per-channel sums (of the gradient, and of the gradient times the input less its channel
    mean), then the weight, bias and group terms from those (B, C) sums, then one pointwise pass
    for the input's gradient. Differentiated through autograd instead, the backward also reduces
    over batch and pixels for the weight and bias, and inductor writes float32 copies of the
    centred input and of the gradient (one of them transposed) to share between the reductions
    (the regression preset on an H200: 1.9 ms for a 0.3 ms read, the top kernel of the step)."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, eps: float, out_dtype: torch.dtype):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        mean_c, mean, var = _moments(xf, groups)
        rstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean_c, mean, rstd)
        ctx.groups, ctx.has_bias = groups, bias is not None
        y = _normalise(xf, mean, rstd, weight, bias)
        # no ``.to`` where the dtype already fits: torch 2.11's dynamo hands the backward of an
        # autograd function returning such an alias zeros instead of the gradient
        return y if y.dtype == out_dtype else y.to(out_dtype)

    @staticmethod
    def backward(ctx, gy):
        x, weight, mean_c, mean, rstd = ctx.saved_tensors
        b, c, dims, groups = x.shape[0], x.shape[1], x.dim() - 2, ctx.groups
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        g = gy.to(xf.dtype)
        pix = tuple(range(2, x.dim()))
        s1 = g.sum(pix)  # (B, C): sum of the gradient
        s2 = (g * (xf - mean_c.reshape(b, c, *(1,) * dims))).sum(pix)  # centred by channel: no cancellation
        mean_b, rstd_b = spread(mean, c, 0), spread(rstd, c, 0)  # (B, C)
        t = rstd_b * (s2 + (mean_c - mean_b) * s1)  # sum of gradient x normalised input
        w = weight.to(xf.dtype).reshape(1, c) if weight is not None else torch.ones_like(s1[:1])
        n = (c // groups) * math.prod(x.shape[2:])
        coefficients = input_grad_coefficients(s1, t, w, rstd_b, -mean_b, groups, n)[:3]
        k_g, k_x, k_0 = (k.reshape(b, c, *(1,) * dims) for k in coefficients)  # dx = g k_g + x k_x + k_0
        dx = (g * k_g + xf * k_x + k_0).to(x.dtype)
        dw = t.sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = s1.sum(0).to(gy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def group_norm_by_channel(
    x: torch.Tensor,
    groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    explicit: bool = True,
) -> torch.Tensor:
    """``F.group_norm`` from per-channel moments: each channel's mean and variance over its
    pixels, combined exactly into its group's.

    Why: a group's elements are strided by C in a channels-last tensor, so a per-group reduction
    reads them badly; a per-channel one reads C contiguous values per pixel (and NCHW rows
    contiguously). The normalisation then fuses with what follows (SiLU, the cast for the conv),
    and the output keeps the input's memory format (torch's CUDA kernel returns NCHW).
    Computed in at least float32; the output dtype is ``F.group_norm``'s. ``explicit``: the
    backward of ``_GroupNormByChannel``; False differentiates the forward through autograd.
    """
    if explicit:
        return _GroupNormByChannel.apply(x, weight, bias, groups, eps, _out_dtype(x))
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    _, mean, var = _moments(xf, groups)
    return _normalise(xf, mean, torch.rsqrt(var + eps), weight, bias).to(_out_dtype(x))


class PositionalEmbedding(nn.Module):
    """Transformer-style sinusoidal embedding of the (scalar) noise level.

    Returns ``[cos(x * f_i), sin(x * f_i)]`` with geometrically spaced frequencies
    ``f_i`` from 1 down to ``1 / max_positions`` (inclusive when ``endpoint``).
    """

    def __init__(self, num_channels: int, max_positions: int = 10000, endpoint: bool = False):
        super().__init__()
        if num_channels % 2:
            raise ValueError(f"PositionalEmbedding needs an even num_channels, got {num_channels}")
        self.num_channels = num_channels
        self.max_positions = max_positions
        self.endpoint = endpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.num_channels // 2
        # At least fp32: sin/cos of noise levels in half precision is too coarse.
        dtype = torch.promote_types(x.dtype, torch.float32)
        freqs = torch.arange(half, dtype=dtype, device=x.device)
        freqs = freqs / (half - (1 if self.endpoint else 0))
        freqs = (1.0 / self.max_positions) ** freqs
        x = torch.outer(x.reshape(-1).to(dtype), freqs)
        return torch.cat([x.cos(), x.sin()], dim=1)


class AdditivePosEmbed(nn.Module):
    """A learned field of shape (1, C, H, W) added to the activations (as its own module,
    so a domain-parallel rank can add just its rows of it)."""

    def __init__(self, channels: int, resolution: tuple[int, int]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, channels, *resolution))
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != self.weight.shape[-2:]:
            raise ValueError(
                f"additive_pos_embed needs input of size {tuple(self.weight.shape[-2:])}, got {tuple(x.shape[-2:])}"
            )
        return x + self.weight.to(x.dtype)


class Attention(nn.Module):
    """Single-/multi-head self-attention over all pixels, as a residual add-on to a UNetBlock.

    The qkv 1x1 conv output is split as EDM does, with channels ordered
    (head, channel-in-head, q/k/v); the output projection starts near zero
    (``init_zero``) so a fresh block is close to the identity.
    """

    def __init__(
        self,
        channels: int,
        num_heads: int,
        eps: float = 1e-5,
        init_attn: float = math.sqrt(0.2),
        init_zero: float = 1e-5,
    ):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"Attention: {channels} channels not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.norm = GroupNorm(channels, eps=eps)
        self.qkv = Conv2d(channels, channels * 3, kernel=1, init_weight=init_attn)
        self.proj = Conv2d(channels, channels, kernel=1, init_weight=init_zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, self.num_heads, c // self.num_heads, 3, h * w)
        # SDPA wants (batch, heads, tokens, head_dim); tokens are the pixels.
        q, k, v = (t.transpose(-1, -2) for t in qkv.unbind(3))
        a = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head_dim), as EDM
        a = a.transpose(-1, -2).reshape(b, c, h, w).contiguous(memory_format=_memory_format(x))  # x's layout
        return self.proj(a)


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient in its input's memory format.

    Under torch.compile each block's backward is traced for dense gradients of its outputs in
    their layout, and copies any other it receives before it starts (AOTAutograd's tangent
    coercion): the channel slices that cat's backward makes of a decoder block's gradient, and
    the NCHW gradients that resampling's backward makes of a channels-last input. Applied to a
    compiled block's inputs, the kernel that produces each gradient writes it dense instead (the
    regression preset on an H200: 10 copies and 13 ms of a 300 ms step, channels-last). The
    forward's clone fuses into the block's first kernels (and keeps the output from aliasing
    the input, which torch 2.11's compiled autograd functions mishandle)."""

    @staticmethod
    def forward(ctx, x):
        ctx.fmt = _memory_format(x)
        return x.clone(memory_format=ctx.fmt)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous(memory_format=ctx.fmt)


class UNetBlock(nn.Module):
    """DDPM++ residual block, optionally resampling and with optional self-attention.

    ``x -> GN -> SiLU -> conv3x3 (up/down) -> + emb affine -> GN -> SiLU -> dropout
    -> conv3x3``, plus a skip (1x1 conv when channels change or the block resamples,
    else identity); the sum is scaled by ``skip_scale`` (1/sqrt(2)) to keep the
    variance. Attention, if any, is a second scaled residual step.

    ``emb_channels=0`` builds no affine layer at all (used for an unconditional
    regression net); ``adaptive_scale`` makes the embedding produce scale and shift
    (FiLM) instead of a plain additive shift.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        emb_channels: int = 0,
        up: bool = False,
        down: bool = False,
        attention: bool = False,
        num_heads: int | None = None,
        channels_per_head: int = 64,
        dropout: float = 0.0,
        skip_scale: float = math.sqrt(0.5),
        eps: float = 1e-5,
        resample_filter: Sequence[int] = (1, 1),
        resample_proj: bool = True,
        adaptive_scale: bool = False,
        init_zero: float = 1e-5,
        init_attn: float = math.sqrt(0.2),
    ):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.dropout = dropout
        self.skip_scale = skip_scale
        self.adaptive_scale = adaptive_scale

        self.norm0 = GroupNorm(in_channels, eps=eps)
        self.conv0 = Conv2d(in_channels, out_channels, kernel=3, up=up, down=down, resample_filter=resample_filter)
        self.affine = None
        if emb_channels:
            self.affine = Linear(emb_channels, out_channels * (2 if adaptive_scale else 1))
        self.norm1 = GroupNorm(out_channels, eps=eps)
        # Near-zero last conv: the block starts out as (scaled) identity on the skip path.
        self.conv1 = Conv2d(out_channels, out_channels, kernel=3, init_weight=init_zero)

        self.skip = None
        if out_channels != in_channels or up or down:
            kernel = 1 if resample_proj or out_channels != in_channels else 0
            self.skip = Conv2d(
                in_channels, out_channels, kernel=kernel, up=up, down=down, resample_filter=resample_filter
            )

        self.attn = None
        if attention:
            heads = num_heads if num_heads is not None else out_channels // channels_per_head
            self.attn = Attention(out_channels, max(1, heads), eps=eps, init_attn=init_attn, init_zero=init_zero)

    def forward(
        self, x: torch.Tensor, emb: torch.Tensor | None = None, skip: torch.Tensor | None = None
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the gradients this block hands back: dense (see _DenseGrad)
            x, skip = _DenseGrad.apply(x), None if skip is None else _DenseGrad.apply(skip)
        if skip is not None:  # a decoder skip connection: concatenated here, inside the block, so
            x = torch.cat([x, skip], dim=1)  # that a compiled block fuses the copy into its first ops
        orig = x
        if self.affine is not None and emb is None:
            raise ValueError("UNetBlock was built with an embedding affine but got emb=None")
        if self.adaptive_scale:
            x = self.conv0(self.norm0(x, silu=True))
            scale, shift = self.affine(emb).to(x.dtype)[:, :, None, None].chunk(2, dim=1)
            x = F.silu(torch.addcmul(shift, self.norm1(x), scale + 1))
            if self.dropout:  # (at 0 a compiled graph would still copy x and keep the copy for conv1)
                x = F.dropout(x, p=self.dropout, training=self.training)
        else:
            # conv0's bias joins the embedding's shift, which norm1 adds before normalising: no
            # pass of its own over conv0's output (a compiled graph cannot fuse it into the norm's
            # kernels, nor eager into the convolution)
            x = self.conv0(self.norm0(x, silu=True), add_bias=False)
            shift = None if self.conv0.bias is None else self.conv0.bias_as(x.dtype).expand(x.shape[0], -1)
            if self.affine is not None:
                params = self.affine(emb).to(x.dtype)
                shift = params if shift is None else params + shift
            x = self.norm1(x, shift=shift, silu=True, dropout=self.dropout)
        # skip_scale multiplies the convolutions' weights and biases (see Conv2d.forward), not
        # their sum and its gradient
        s = self.skip_scale
        x = self.conv1(x, scale=s) + (self.skip(orig, scale=s) if self.skip is not None else orig * s)
        if self.attn is not None:
            x = (x + self.attn(x)) * self.skip_scale
        return x
