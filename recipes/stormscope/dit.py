"""StormScope's diffusion transformer (DiT with adaLN-zero) and 2-D neighbourhood attention.

Plain PyTorch: parallelism is applied to the finished model from outside. Two choices make
that easy. Tokens stay a 2-D grid ``(B, Hp, Wp, D)`` end to end, so a band of patch rows is
a natural domain shard; and every piece is its own small module class, so a domain splitter
can swap classes by type. Everything that depends on *which* rows a tensor holds takes a
``row_offset`` (global index of its first row): ``PosEmbed2d.forward``, ``Rope2d.forward``,
``NeighbourhoodAttention.project``/``attend``. The plain model always passes 0.

The parameterisation is that of PhysicsNeMo's StormScope DiT (so its checkpoints map onto this
model by renaming alone, ``recipes/weather/mdlus.py``): a learned positional table of shape
(1, N, D) (std 0.02), a timestep embedder of ``hidden_size`` sinusoidal features through an MLP
hidden -> 2 hidden -> hidden (xavier), scalar conditions through a bias-free zero-initialised
Linear added after it, qkv with bias and no qk-norm, and an optional mask token per block
(zero-initialised, shape (1, 1, D)) that replaces the invalid tokens of the attention input
right before the qkv projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from recipes.stormscope import natten
from recipes.stormscope.gelu import bias_gelu
from recipes.stormscope.natten import IMPLS, check_kernel, neighbourhood_attention, shared_masks
from recipes.stormscope.residual import gated_residual, residual_norm

POS_EMBEDS = ("learned", "rope", "none")
MLP_IMPLS = ("fused", "torch")
RESIDUAL_IMPLS = ("fused", "torch")


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> token grid (B, Hp, Wp, hidden)."""

    def __init__(self, in_channels: int, hidden_size: int, patch_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        # Xavier on the conv seen as a Linear over a flattened patch (as DiT does).
        nn.init.xavier_uniform_(self.proj.weight.view(hidden_size, -1))
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).permute(0, 2, 3, 1)


class PosEmbed2d(nn.Module):
    """Learned additive positional embedding: a table of shape (1, Hp * Wp, D), row-major over the
    token grid (the reference's layout), added to the grid (B, Hp, Wp, D)."""

    def __init__(self, grid: tuple[int, int], hidden_size: int):
        super().__init__()
        self.grid = (int(grid[0]), int(grid[1]))
        self.weight = nn.Parameter(torch.empty(1, self.grid[0] * self.grid[1], hidden_size))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
        # A band of rows adds the matching rows of the table.
        table = self.weight.unflatten(1, self.grid)
        return x + table[:, row_offset : row_offset + x.shape[1]].to(x.dtype)


class Rope2d(nn.Module):
    """2-D rotary position embedding: the first half of the head dim rotates with the row
    index, the second half with the column index (each half in "rotate-half" pairs).

    Parameter-free; tables are computed from integer positions on the fly, so a band simply
    passes its global rows and nothing needs sharding or survives meta-device init.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"rope needs head_dim divisible by 4 (hidden_size / num_heads), got head_dim={head_dim}")
        self.head_dim = head_dim
        self.theta = theta

    def angles(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (len(rows), len(cols), head_dim // 2) for integer positions."""
        axis_dim = self.head_dim // 2
        inv_freq = self.theta ** (-torch.arange(0, axis_dim, 2, device=rows.device, dtype=torch.float32) / axis_dim)
        ar = rows.float()[:, None] * inv_freq  # (R, head_dim/4)
        ac = cols.float()[:, None] * inv_freq  # (C, head_dim/4)
        ang = torch.cat([ar[:, None, :].expand(-1, len(cols), -1), ac[None, :, :].expand(len(rows), -1, -1)], -1)
        return ang.cos(), ang.sin()

    def forward(self, x: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
        """Rotate x (..., R, C, head_dim) whose rows are global rows row_offset .. row_offset + R."""
        rows = torch.arange(row_offset, row_offset + x.shape[-3], device=x.device)
        cos, sin = self.angles(rows, torch.arange(x.shape[-2], device=x.device))
        quarter = self.head_dim // 4
        xf = x.float().unflatten(-1, (2, 2, quarter))  # (axis: row/col, pair half, freq)
        x1, x2 = xf[..., 0, :], xf[..., 1, :]
        cos, sin = cos.unflatten(-1, (2, quarter)), sin.unflatten(-1, (2, quarter))
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-2)
        return out.flatten(-3).to(x.dtype)


class TimestepEmbed(nn.Module):
    """Sinusoidal features of the noise label through an MLP, plus optional scalar conditions.

    ``freq_dim`` features (default ``hidden_size``): [cos, sin] of ``freq_dim / 2`` geometric
    frequencies 1 ... 1/10000, then Linear(freq_dim, 2 hidden) -> SiLU -> Linear(2 hidden, hidden),
    xavier-initialised. Scalar conditions go through a bias-free Linear that starts at zero (a
    fresh model ignores them) and are added to the MLP's output.
    """

    def __init__(
        self,
        hidden_size: int,
        num_scalar_conditions: int = 0,
        freq_dim: int | None = None,
        mlp_hidden: int | None = None,
    ):
        super().__init__()
        self.freq_dim = int(freq_dim or hidden_size)
        if self.freq_dim % 2:
            raise ValueError(f"TimestepEmbed needs an even freq_dim, got {self.freq_dim}")
        inner = int(mlp_hidden or 2 * hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.freq_dim, inner), nn.SiLU(), nn.Linear(inner, hidden_size))
        self.scalars = nn.Linear(num_scalar_conditions, hidden_size, bias=False) if num_scalar_conditions else None
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        if self.scalars is not None:
            nn.init.zeros_(self.scalars.weight)

    def frequencies(self, device=None) -> torch.Tensor:
        """The freq_dim / 2 frequencies (float32), computed as the reference does (bit for bit)."""
        half = self.freq_dim // 2
        return (1 / 10000) ** (torch.arange(half, dtype=torch.float32, device=device) / half)

    def forward(self, noise_labels: torch.Tensor, scalar_conditions: torch.Tensor | None = None) -> torch.Tensor:
        arg = noise_labels.float()[:, None] * self.frequencies(noise_labels.device)[None]
        c = self.mlp(torch.cat([arg.cos(), arg.sin()], -1).to(self.mlp[0].weight.dtype))
        if self.scalars is not None:
            c = c + self.scalars(scalar_conditions.to(c.dtype))
        return c


class NeighbourhoodAttention(nn.Module):
    """Multi-head 2-D neighbourhood attention on a token grid (B, R, W, D).

    ``forward`` is ``attend(*project(x))``; a domain-parallel subclass can fetch halo rows of
    k/v between the two and tell ``attend`` which global rows each tensor holds. (Over the whole
    grid without rope, the fused kernels take the projection whole instead, so that backward
    hands its gradient back as one tensor: ``natten.packed_neighbourhood_attention``.)

    With ``mask_token`` it owns a learned token (1, 1, D), zero at init, that the block splices
    into its input at invalid positions (``apply_mask_token``) right before ``forward``, so the
    qkv projection sees the token there. The splice is per token: bands need nothing extra.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        kernel: int,
        rope: bool = False,
        impl: str = "auto",
        mask_token: bool = False,
        block: int | None = None,
    ):
        super().__init__()
        if block not in natten.BLOCKS:
            raise ValueError(f"attention block must be one of {natten.BLOCKS} tokens, got {block!r}")
        self.block = block  # flex's sparse block (None: natten.auto_block)
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.kernel = kernel
        self.impl = impl
        self.mask_token = nn.Parameter(torch.zeros(1, 1, hidden_size)) if mask_token else None
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.rope = Rope2d(self.head_dim) if rope else None
        self.proj = nn.Linear(hidden_size, hidden_size)
        natten.prepare()  # before any compiled step traces the attention

    def apply_mask_token(self, x: torch.Tensor, invalid: torch.Tensor | None) -> torch.Tensor:
        """x (B, R, W, D) with the mask token at ``invalid`` (B, R, W, 1) bool tokens; x itself when
        there is no token or no mask. Equal bit for bit to the reference's x (1 - a) + token a."""
        if self.mask_token is None or invalid is None:
            return x
        return torch.where(invalid, self.mask_token.to(x.dtype), x)

    def _projection(self, x: torch.Tensor, detached_bias: bool = False) -> torch.Tensor:
        """The qkv projection as (B, R, W, 3, heads, head_dim); ``detached_bias``: its bias added
        detached (its gradient then comes from whoever is handed the bias)."""
        b, r, w, _ = x.shape
        bias = self.qkv.bias.detach() if detached_bias else self.qkv.bias
        return F.linear(x, self.qkv.weight, bias).view(b, r, w, 3, self.num_heads, self.head_dim)

    def project(self, x: torch.Tensor, row_offset: int = 0):
        """q, k, v of shape (B, heads, R, W, head_dim), rope applied at global rows row_offset..."""
        return self._split(self._projection(x), row_offset)

    def _split(self, qkv: torch.Tensor, row_offset: int = 0):
        """q, k, v of a (B, R, W, 3, heads, head_dim) projection (views unless rope or flex)."""
        q, k, v = qkv.permute(3, 0, 4, 1, 2, 5)
        if self.rope is not None:
            q, k = self.rope(q, row_offset), self.rope(k, row_offset)
        if torch.compiler.is_compiling() and natten.resolved_impl(self.impl, q) == "flex":
            # Flex's block-mask builder runs eagerly, so the compiled block's graph ends before the
            # attention; q, k, v leaving it as views of the projection had their gradient rebuilt
            # by eager autograd (zero fills, strided copies: ~40 ms of the preset's 389 ms step).
            # (The fused kernels read the views in place, inside the graph.)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return q, k, v

    def attend(
        self,
        q,
        k,
        v,
        q_row_offset: int = 0,
        kv_row_offset: int = 0,
        grid_rows: int | None = None,
        out_bias: bool = True,
    ):
        """Attention of q rows over k/v rows (global offsets as in natten), heads merged, projected
        (without the projection's bias when ``out_bias`` is false: the caller adds it)."""
        o = neighbourhood_attention(
            q,
            k,
            v,
            self.kernel,
            impl=self.impl,
            block=self.block,
            q_row_offset=q_row_offset,
            kv_row_offset=kv_row_offset,
            grid_rows=grid_rows,
        )
        return self._merge(o, out_bias)

    def _merge(self, o: torch.Tensor, out_bias: bool = True) -> torch.Tensor:
        """Heads merged (a free reshape of the attention's token-major output), projected."""
        b, _, r, w, _ = o.shape
        return F.linear(
            o.permute(0, 2, 3, 1, 4).reshape(b, r, w, -1), self.proj.weight, self.proj.bias if out_bias else None
        )

    def forward(self, x: torch.Tensor, out_bias: bool = True) -> torch.Tensor:
        """The attention's output; without the projection's bias when ``out_bias`` is false."""
        if self.rope is None and natten.takes_packed(self.impl, x):
            # (x: the projection's device, and a dtype the kernels take exactly where they take its)
            # The fused kernels take the projection whole: its gradient comes back as one tensor,
            # and its bias's gradient (that summed over tokens) from their sums of what they store.
            qkv = self._projection(x, detached_bias=True)
            return self._merge(natten.packed_neighbourhood_attention(qkv, self.kernel, self.qkv.bias), out_bias)
        return self.attend(*self._split(self._projection(x)), out_bias=out_bias)


class Mlp(nn.Module):
    """fc1, GELU(tanh), fc2. ``impl="fused"``: fc1's bias is added in the GELU's kernel, whose
    backward also sums the bias gradient (``gelu.bias_gelu``: the same function, one pass less over
    the hidden layer); ``"torch"``: ``F.gelu`` after fc1 with its bias (inductor's kernels when
    compiled). The same parameters either way."""

    def __init__(self, hidden_size: int, mlp_ratio: float, impl: str = "fused"):
        super().__init__()
        if impl not in MLP_IMPLS:
            raise ValueError(f"mlp_impl must be one of {MLP_IMPLS}, got mlp_impl={impl!r}")
        inner = int(hidden_size * mlp_ratio)
        self.fc1 = nn.Linear(hidden_size, inner)
        self.fc2 = nn.Linear(inner, hidden_size)
        self.impl = impl

    def forward(self, x: torch.Tensor, out_bias: bool = True) -> torch.Tensor:
        """The MLP's output; without fc2's bias when ``out_bias`` is false (the caller adds it)."""
        if self.impl == "torch":
            hidden = F.gelu(self.fc1(x), approximate="tanh")
        else:
            hidden = bias_gelu(F.linear(x, self.fc1.weight), self.fc1.bias)
        return F.linear(hidden, self.fc2.weight, self.fc2.bias if out_bias else None)


class DiTBlock(nn.Module):
    """adaLN-zero transformer block: modulation starts at zero, so each block starts as identity.

    ``residual_impl="torch"``: the residual sums and norms as written in torch (inductor's kernels
    when compiled); ``"fused"``: the two gated residual sums and the norm between them run as
    ``residual.residual_norm`` and ``residual.gated_residual`` (Triton ops each way whose backward
    also sums the gradients of the adaLN terms and of the attention's and the MLP's output biases,
    which those ops add). The same function and parameters either way."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float,
        kernel: int,
        rope: bool,
        impl: str,
        mask_token: bool = False,
        block: int | None = None,
        mlp_impl: str = "fused",
        residual_impl: str = "fused",
    ):
        super().__init__()
        if residual_impl not in RESIDUAL_IMPLS:
            raise ValueError(f"residual_impl must be one of {RESIDUAL_IMPLS}, got residual_impl={residual_impl!r}")
        self.residual_impl = residual_impl
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = NeighbourhoodAttention(
            hidden_size, num_heads, kernel, rope=rope, impl=impl, mask_token=mask_token, block=block
        )
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, mlp_ratio, mlp_impl)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        nn.init.zeros_(self.adaLN_modulation[1].weight)
        nn.init.zeros_(self.adaLN_modulation[1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, invalid: torch.Tensor | None = None) -> torch.Tensor:
        """``invalid`` (B, R, W, 1) bool: tokens the attention input replaces by the mask token."""
        # (B, 6D) -> six (B, 1, 1, D) terms broadcast over the token grid.
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c)[:, None, None].chunk(6, dim=-1)
        h = self.attn.apply_mask_token(_modulate(self.norm1(x), shift1, scale1), invalid)
        if self.residual_impl == "torch":
            x = x + gate1 * self.attn(h)
            return x + gate2 * self.mlp(_modulate(self.norm2(x), shift2, scale2))
        x, h = residual_norm(
            x, self.attn(h, out_bias=False), self.attn.proj.bias, gate1, shift2, scale2, self.norm2.eps
        )
        return gated_residual(x, self.mlp(h, out_bias=False), self.mlp.fc2.bias, gate2)


class FinalLayer(nn.Module):
    """adaLN + Linear to patch_size**2 * out_channels per token, zero-initialised."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        for m in (self.adaLN_modulation[1], self.linear):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c)[:, None, None].chunk(2, dim=-1)
        return self.linear(_modulate(self.norm(x), shift, scale))


def unpatchify(x: torch.Tensor, patch_size: int, out_channels: int) -> torch.Tensor:
    """(B, Hp, Wp, p*p*C) -> (B, C, Hp*p, Wp*p)."""
    b, hp, wp, _ = x.shape
    p = patch_size
    x = x.reshape(b, hp, wp, p, p, out_channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, out_channels, hp * p, wp * p)


class DiT(nn.Module):
    """Diffusion transformer on a 2-D token grid with neighbourhood attention (StormScope).

    forward(x (B, in, H, W), noise_labels (B,), scalar_conditions (B, S) | None,
    mask (B, 1, H, W) bool | None, True = invalid) -> (B, out, H, W).

    With a mask, invalid pixels are zeroed first (so NaNs there never reach the network: the
    reference's recipe passes such inputs through nan_to_num) and, with ``mask_token``, every
    block replaces the attention input of each patch holding an invalid pixel by its token.
    """

    # Compiled beside the blocks (trainer.compile): eager, the patch embedding and the final layer
    # run as separate float32 passes and casts over the whole token grid (LayerNorm, modulation,
    # layout and dtype conversions: about 5 ms of the preset's step, docs/benchmarks.md run 22).
    compile_regions = ("patch_embed", "final")

    def __init__(
        self,
        img_resolution: tuple[int, int],
        in_channels: int,
        out_channels: int,
        patch_size: int = 4,
        hidden_size: int = 768,
        depth: int = 16,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        attn_kernel: int = 31,
        pos_embed: str = "learned",
        num_scalar_conditions: int = 0,
        mask_token: bool = False,
        checkpoint_blocks: bool = False,
        attn_impl: str = "auto",
        attn_block: int | None = None,
        mlp_impl: str = "fused",
        residual_impl: str = "fused",
    ):
        super().__init__()
        h, w = img_resolution
        if h % patch_size or w % patch_size:
            raise ValueError(f"img_resolution {tuple(img_resolution)} must be divisible by patch_size={patch_size}")
        if pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed must be one of {POS_EMBEDS}, got pos_embed={pos_embed!r}")
        if attn_impl not in IMPLS:
            raise ValueError(f"attn_impl must be one of {IMPLS}, got attn_impl={attn_impl!r}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
        try:
            check_kernel(attn_kernel)
        except ValueError:
            raise ValueError(f"attn_kernel must be a positive odd integer, got attn_kernel={attn_kernel!r}") from None
        if pos_embed == "rope" and (hidden_size // num_heads) % 4:
            raise ValueError(
                f"pos_embed='rope' needs hidden_size / num_heads divisible by 4, got {hidden_size} / {num_heads}"
            )
        self.img_resolution = (h, w)
        self.grid = (h // patch_size, w // patch_size)
        self.in_channels, self.out_channels, self.patch_size = in_channels, out_channels, patch_size
        self.num_scalar_conditions = num_scalar_conditions
        self.checkpoint_blocks = checkpoint_blocks

        self.mask_token = bool(mask_token)

        self.patch_embed = PatchEmbed(in_channels, hidden_size, patch_size)
        self.pos_embed = PosEmbed2d(self.grid, hidden_size) if pos_embed == "learned" else None
        self.t_embed = TimestepEmbed(hidden_size, num_scalar_conditions)
        self.blocks = nn.ModuleList(
            DiTBlock(
                hidden_size,
                num_heads,
                mlp_ratio,
                attn_kernel,
                pos_embed == "rope",
                attn_impl,
                mask_token=self.mask_token,
                block=attn_block,
                mlp_impl=mlp_impl,
                residual_impl=residual_impl,
            )
            for _ in range(depth)
        )
        self.final = FinalLayer(hidden_size, patch_size, out_channels)
        for blk in self.blocks:  # DiT init for the transformer linears (modulation stays zero)
            for lin in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc1, blk.mlp.fc2):
                nn.init.xavier_uniform_(lin.weight)
                nn.init.zeros_(lin.bias)

    def flops_per_sample(self) -> float:
        """Model FLOPs of one training sample (see ``train_flops``), for throughput and MFU."""
        return train_flops(self)

    def forward(
        self,
        x: torch.Tensor,
        noise_labels: torch.Tensor,
        scalar_conditions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (scalar_conditions is None) != (self.num_scalar_conditions == 0):
            raise ValueError(
                f"model built with num_scalar_conditions={self.num_scalar_conditions}; "
                f"scalar_conditions {'missing' if scalar_conditions is None else 'not expected'}"
            )
        if mask is not None:
            mask = mask.bool()
            # where, not multiply: NaN * 0 is NaN. Invalid pixels never reach the embedding.
            x = torch.where(mask, torch.zeros((), dtype=x.dtype, device=x.device), x)
        tokens = self.patch_embed(x)
        invalid = None
        if mask is not None and self.mask_token:
            invalid = F.max_pool2d(mask.to(x.dtype), self.patch_size)[:, 0, :, :, None] > 0  # any invalid pixel
        if self.pos_embed is not None:
            tokens = self.pos_embed(tokens)
        c = self.t_embed(noise_labels, scalar_conditions)
        with shared_masks():  # every block's reference attention has the same geometry
            for blk in self.blocks:
                if self.checkpoint_blocks and torch.is_grad_enabled():
                    tokens = checkpoint(blk, tokens, c, invalid, use_reentrant=False)
                else:
                    tokens = blk(tokens, c, invalid)
        return unpatchify(self.final(tokens, c), self.patch_size, self.out_channels)


def train_flops(model: DiT) -> float:
    """Model FLOPs of one training sample (forward + backward = 3x forward) of the whole grid.

    Written out because FlopCounterMode cannot see inside flex_attention: 2 x tokens x the
    weights of the per-token layers (patch embedding, attention and MLP linears, head),
    plus 4 x keys x hidden per token and block for the neighbourhood attention (scores and
    weighted values; keys = kernel^2 where the grid is at least a kernel wide).
    """
    (hp, wp), attn = model.grid, model.blocks[0].attn
    keys = min(attn.kernel, hp) * min(attn.kernel, wp)
    hidden = attn.head_dim * attn.num_heads
    per_token = model.patch_embed.proj.weight.numel() + model.final.linear.weight.numel()
    for blk in model.blocks:
        per_token += sum(lin.weight.numel() for lin in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc1, blk.mlp.fc2))
    return 3.0 * hp * wp * (2 * per_token + 4 * keys * hidden * len(model.blocks))


def stormscope_dit(img_resolution=(512, 640), in_channels: int = 10, out_channels: int = 5, **kw) -> DiT:
    """The StormScope preset: 16 blocks, hidden 768, 16 heads, patch 4, 31x31 neighbourhoods."""
    cfg = dict(patch_size=4, hidden_size=768, depth=16, num_heads=16, attn_kernel=31) | kw
    return DiT(img_resolution, in_channels, out_channels, **cfg)
