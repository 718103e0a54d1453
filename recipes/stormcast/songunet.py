"""EDM / DDPM++ "SongUNet" as used by NVIDIA StormCast (regression and diffusion nets).

Our own plain-PyTorch implementation of the architecture described by Karras et
al. (2022, "Elucidating the Design Space of Diffusion-Based Generative Models")
and Song et al. (2021, DDPM++), with the StormCast/PhysicsNeMo extensions:
rectangular images, ``embedding_type="zero"`` (no noise conditioning), an optional
learned additive position embedding and gradient checkpointing.

Only the DDPM++ "standard" encoder/decoder are implemented.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from recipes.stormcast.layers import (
    AdditivePosEmbed,
    Conv2d,
    GroupNorm,
    Linear,
    PositionalEmbedding,
    UNetBlock,
    set_compiled_form,
)

_EMBEDDING_TYPES = ("positional", "zero")
# EDM and PhysicsNeMo build the SongUNet's GroupNorms with eps=1e-6 (not the layer
# default 1e-5); matching it keeps outputs identical for reference-trained weights.
_GN_EPS = 1e-6


class SongUNet(nn.Module):
    """DDPM++ U-Net.

    Layout (EDM): a 3x3 input conv, then per resolution level ``num_blocks``
    UNetBlocks (levels > 0 start with a downsampling UNetBlock); every encoder
    output (input conv included) is stored as a skip. The decoder starts with two
    blocks at the lowest resolution (the first always with self-attention), then per
    level ``num_blocks + 1`` blocks that each concatenate one skip, with an
    upsampling UNetBlock between levels; the output is GroupNorm -> SiLU -> 3x3 conv.

    Args:
        img_resolution: ``H`` or ``(H, W)``.
        in_channels, out_channels: input / output channels.
        model_channels: base width; level ``i`` has ``model_channels * channel_mult[i]``.
        channel_mult: width multipliers per level; ``len - 1`` 2x downsamplings.
        channel_mult_emb: embedding width = ``model_channels * channel_mult_emb``.
        num_blocks: residual blocks per level in the encoder (decoder: +1).
        attn_resolutions: self-attention in the blocks of levels whose *row*
            resolution ``H >> level`` is listed (EDM compares the square side; for
            rectangles PhysicsNeMo uses the row count, so do we). The bottleneck
            block always has attention regardless.
        dropout: dropout probability inside the UNetBlocks.
        embedding_type: ``"positional"`` (sinusoidal noise-level embedding + 2-layer
            MLP, DDPM++) or ``"zero"`` (no conditioning, as StormCast's regression
            net: no mapping network; the blocks get an all-zero embedding, so only
            the biases of their affine layers matter, see ``__init__``).
        channel_mult_noise: noise embedding width = ``model_channels * channel_mult_noise``.
        resample_filter: fixed up/down sampling filter (``[1, 1]`` for DDPM++).
        additive_pos_embed: add a learned ``pos_embed`` of shape
            ``(1, model_channels, H, W)`` after the input conv (then the input must
            be exactly ``(H, W)``).
        checkpoint_level: gradient checkpointing of UNetBlocks; 0 disables it,
            ``L > 0`` checkpoints the blocks of the ``L`` finest levels (where the
            activations are largest); ``L >= len(channel_mult)`` checkpoints all.
        recompute_norm_levels: levels (0: the finest) whose blocks' GroupNorm + SiLU outputs are
            recomputed in backward instead of kept for the convolutions after them (``GroupNorm.
            recompute``, compiled blocks only): memory for a pass over each norm's input (the
            regression preset at 512x640, batch 4: level 0 holds 7.5 GiB of them in bf16, level 1
            4.1, level 2 1.0). The output norm is not among them: its output leaves its compiled
            region for the output convolution's, which keeps its input anyway. A domain split
            replaces the GroupNorm's forward with the framework's split norm, which honours it through
            ``torch.utils.checkpoint`` (its statistics' all-gather recomputed too).
        compiled_norm: the GroupNorm form of compiled blocks (``layers.GroupNorm.compiled_form``:
            "auto", "fused", "explicit", ...); eager runs use torch's kernel either way.

    ``forward(x, noise_labels=None, class_labels=None)``: ``x`` is ``(B, in_channels,
    H', W')`` with ``H', W'`` multiples of ``downsample_factor``; ``noise_labels`` is
    ``(B,)`` (required for ``"positional"``, ignored for ``"zero"``). This model has
    no label conditioning; ``class_labels`` is accepted for interface compatibility
    with EDM-style preconditioners and ignored.
    """

    @property
    def compile_regions(self) -> tuple[str, ...]:
        """Compiled beside the blocks (``trainer.compile``): the output GroupNorm + SiLU, which eager
        runs as torch's kernel on a float32, NCHW copy of the full-resolution activation, and the
        input and output convolutions, whose casts, channel padding, crop, bias and (output) layout
        change eager runs as separate copies of full-resolution tensors (docs/benchmarks.md, run 12)."""
        return (f"enc.{self.img_resolution[0]}_conv", "out_norm", "out_conv")

    def __init__(
        self,
        img_resolution: int | Sequence[int],
        in_channels: int,
        out_channels: int,
        model_channels: int = 128,
        channel_mult: Sequence[int] = (1, 2, 2, 2),
        channel_mult_emb: int = 4,
        num_blocks: int = 4,
        attn_resolutions: Sequence[int] = (16,),
        dropout: float = 0.10,
        embedding_type: str = "positional",
        channel_mult_noise: int = 1,
        resample_filter: Sequence[int] = (1, 1),
        additive_pos_embed: bool = False,
        checkpoint_level: int = 0,
        compiled_norm: str = "auto",
        recompute_norm_levels: Sequence[int] = (),
    ):
        super().__init__()
        if embedding_type not in _EMBEDDING_TYPES:
            raise ValueError(f"embedding_type must be one of {_EMBEDDING_TYPES}, got {embedding_type!r}")
        if isinstance(img_resolution, int):
            img_resolution = (img_resolution, img_resolution)
        if len(img_resolution) != 2:
            raise ValueError(f"img_resolution must be an int or an (H, W) pair, got {img_resolution!r}")
        self.img_resolution = (int(img_resolution[0]), int(img_resolution[1]))
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.channel_mult = tuple(channel_mult)
        self.embedding_type = embedding_type
        self.checkpoint_level = int(checkpoint_level)
        self._check_divisible(*self.img_resolution, what="img_resolution")

        # Note on "zero": like PhysicsNeMo, the blocks keep their embedding affine
        # layers and are fed an all-zero embedding, so the affine *weights* are dead
        # and only their biases act (a learned per-channel shift). Dropping them
        # would give 72.0 M instead of StormCast's published 78.6 M parameters and
        # break checkpoint compatibility, so they stay.
        self.emb_channels = model_channels * channel_mult_emb
        noise_channels = model_channels * channel_mult_noise
        block_kwargs = dict(
            emb_channels=self.emb_channels,
            num_heads=1,  # EDM's SongUNet: one head with all channels
            dropout=dropout,
            skip_scale=math.sqrt(0.5),
            eps=_GN_EPS,
            resample_filter=resample_filter,
            resample_proj=True,
            adaptive_scale=False,
        )

        # Noise-level mapping network (absent for "zero").
        if embedding_type == "positional":
            self.map_noise = PositionalEmbedding(noise_channels, endpoint=True)
            self.map_layer0 = Linear(noise_channels, self.emb_channels)
            self.map_layer1 = Linear(self.emb_channels, self.emb_channels)

        self.pos_embed = AdditivePosEmbed(model_channels, self.img_resolution) if additive_pos_embed else None

        # Encoder. Keys are "<rows at that level>_<role>" (EDM-like, for
        # readability); the level of each entry is kept for checkpointing.
        h = self.img_resolution[0]
        self.enc = nn.ModuleDict()
        self._enc_levels: list[int] = []
        cout = in_channels
        for level, mult in enumerate(self.channel_mult):
            res = h >> level
            if level == 0:
                self.enc[f"{res}_conv"] = Conv2d(cout, model_channels, kernel=3)
                # compiled channels-last, it reads the NCHW input as it comes (its graph fuses
                # the change of layout with the cast and channel padding; docs/benchmarks.md, run 13)
                self.enc[f"{res}_conv"].compile_contiguous_inputs = True
                cout = model_channels
            else:
                self.enc[f"{res}_down"] = UNetBlock(cout, cout, down=True, **block_kwargs)
            self._enc_levels.append(level)
            for idx in range(num_blocks):
                cin, cout = cout, model_channels * mult
                self.enc[f"{res}_block{idx}"] = UNetBlock(cin, cout, attention=res in attn_resolutions, **block_kwargs)
                self._enc_levels.append(level)
        skips = [m.out_channels for m in self.enc.values()]

        # Decoder: each block whose input width differs from the running width
        # consumes one skip (EDM's rule; the two bottleneck blocks and the
        # upsampling blocks take none).
        self.dec = nn.ModuleDict()
        self._dec_levels: list[int] = []
        last = len(self.channel_mult) - 1
        for level in reversed(range(len(self.channel_mult))):
            res = h >> level
            mult = self.channel_mult[level]
            if level == last:
                self.dec[f"{res}_in0"] = UNetBlock(cout, cout, attention=True, **block_kwargs)
                self.dec[f"{res}_in1"] = UNetBlock(cout, cout, **block_kwargs)
                self._dec_levels += [level, level]
            else:
                # Counted at its output (finer) level: that is where its activations live.
                self.dec[f"{res}_up"] = UNetBlock(cout, cout, up=True, **block_kwargs)
                self._dec_levels.append(level)
            for idx in range(num_blocks + 1):
                cin, cout = cout + skips.pop(), model_channels * mult
                attn = idx == num_blocks and res in attn_resolutions
                self.dec[f"{res}_block{idx}"] = UNetBlock(cin, cout, attention=attn, **block_kwargs)
                self._dec_levels.append(level)
        assert not skips, "every encoder skip must be consumed"

        self.out_norm = GroupNorm(cout, eps=_GN_EPS)
        # Near-zero output conv (EDM init_zero): the untrained net predicts ~0.
        self.out_conv = Conv2d(cout, out_channels, kernel=3, init_weight=1e-5)
        # Compiled channels-last, the output leaves in the targets' NCHW layout, made inside the
        # compiled output convolution (with its crop and bias): the loss, and EDM's preconditioner
        # mixing it with its NCHW input, then run on one layout, and the gradient that comes back
        # is the layout the region was traced for (docs/benchmarks.md, run 12). (Split over a
        # domain, the halo crop after it leaves a view of NCHW rows: those layouts stay NCHW.)
        self.out_conv.contiguous_output = True
        set_compiled_form(self, compiled_norm)
        self.set_norm_recompute(recompute_norm_levels)

    def set_norm_recompute(self, levels: Sequence[int]) -> None:
        """Recompute in backward the GroupNorm outputs of the blocks at ``levels`` (only there)."""
        levels = {int(v) for v in levels}
        bad = sorted(v for v in levels if not 0 <= v < len(self.channel_mult))
        if bad:
            raise ValueError(f"recompute_norm_levels {bad}: levels run 0..{len(self.channel_mult) - 1}")
        placed = [(b, lv) for b, lv in zip(self.enc.values(), self._enc_levels)]
        placed += [(b, lv) for b, lv in zip(self.dec.values(), self._dec_levels)]
        for module, level in placed:
            for m in module.modules():
                if isinstance(m, GroupNorm):
                    m.recompute = level in levels

    # -- helpers -----------------------------------------------------------------

    @property
    def downsample_factor(self) -> int:
        """Total spatial downsampling; H and W must be multiples of it."""
        return 2 ** (len(self.channel_mult) - 1)

    def _check_divisible(self, h: int, w: int, what: str) -> None:
        f = self.downsample_factor
        if h % f or w % f:
            raise ValueError(
                f"SongUNet {what} (H={h}, W={w}) must be divisible by 2**(len(channel_mult)-1) = {f} "
                f"(channel_mult={list(self.channel_mult)})"
            )

    def _run_block(
        self, block: nn.Module, level: int, x: torch.Tensor, emb: torch.Tensor | None, skip: torch.Tensor | None = None
    ) -> torch.Tensor:
        if level < self.checkpoint_level and torch.is_grad_enabled():
            return checkpoint(block, x, emb, skip, use_reentrant=False)
        return block(x, emb, skip)

    # -- forward -------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        noise_labels: torch.Tensor | None = None,
        class_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"SongUNet expects (B, {self.in_channels}, H, W) input, got {tuple(x.shape)}")
        self._check_divisible(x.shape[-2], x.shape[-1], what="input")

        if self.embedding_type == "zero":
            emb = x.new_zeros(x.shape[0], self.emb_channels)
        else:
            if noise_labels is None:
                raise ValueError("embedding_type='positional' needs noise_labels")
            emb = self.map_noise(noise_labels)
            # EDM swaps to [sin, cos] order; kept for parity with its trained weights.
            emb = emb.reshape(emb.shape[0], 2, -1).flip(1).reshape(emb.shape)
            emb = F.silu(self.map_layer0(emb))
            emb = F.silu(self.map_layer1(emb))

        skips = []
        for (_name, block), level in zip(self.enc.items(), self._enc_levels):
            if isinstance(block, UNetBlock):
                x = self._run_block(block, level, x, emb)
            else:
                x = block(x)
                if self.pos_embed is not None:
                    x = self.pos_embed(x)
            skips.append(x)

        for block, level in zip(self.dec.values(), self._dec_levels):
            skip = skips.pop() if x.shape[1] != block.in_channels else None  # the block concatenates it
            x = self._run_block(block, level, x, emb, skip)

        return self.out_conv(self.out_norm(x, silu=True))
