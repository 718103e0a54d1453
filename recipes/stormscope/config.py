"""Schemas of the StormScope recipe's config nodes (its data, the DiT model, the diffusion task)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from framework.config.resume import MAY
from framework.config.schema import Invalid, non_negative, one_of, path_field, positive
from recipes.stormscope.natten import BLOCKS
from recipes.weather.config import DiffusionTaskConfig, SyntheticStores, ZarrDataConfig


@dataclass
class StormScopeDataConfig(ZarrDataConfig):
    """StormScope's stores in the native layout (docs/data.md) under its own names: the nowcast state
    (GOES ABI brightness temperatures, MRMS reflectivity: the field predicted) in ``<root>/state/``,
    the coarse background in ``<root>/background/``."""

    name: str = "stormscope"
    state_channels: list[str] = MISSING
    background_channels: list[str] = MISSING


@dataclass
class StormScopeSyntheticDataConfig(SyntheticStores, StormScopeDataConfig):
    """Synthetic satellite/radar-like stores in StormScope's layout, written on first use."""

    name: str = "stormscope_synthetic"
    root: str = path_field("data/stormscope_synthetic")
    state_channels: list[str] = field(default_factory=lambda: ["abi08", "abi13", "refc"])
    background_channels: list[str] = field(default_factory=lambda: ["u850", "v850", "t850"])


@dataclass
class DiTConfig:
    name: str = "dit"
    patch_size: int = 4
    hidden_size: int = 768
    depth: int = 16
    num_heads: int = 16
    mlp_ratio: float = 4.0
    attn_kernel: int = 31  # odd: a (kernel x kernel) patch neighbourhood per token
    pos_embed: str = "learned"  # learned (additive table) | rope (2-D rotary) | none
    num_scalar_conditions: int = 0
    mask_token: bool = False
    checkpoint_blocks: bool = False
    attn_impl: str = "auto"  # auto | flex | fused | reference
    # flex's sparse block in tokens: 64 (8 x 8 tiles) or 128 (8 x 16); null: 64 for 16-bit heads
    # under 64 on Hopper GPUs, where it is the faster, else 128
    attn_block: int | None = None
    # the MLP's bias + GELU: fused (one Triton op each way, recipes/stormscope/gelu.py; its torch
    # formulas on CPU) | torch (F.gelu after fc1 with its bias: inductor's kernels when compiled)
    mlp_impl: str = "fused"
    # each block's two gated residual sums and the adaLN norm between them: torch (as written in
    # torch: inductor's kernels when compiled) | fused (Triton ops whose backward also sums the adaLN
    # terms' and the output biases' gradients, recipes/stormscope/residual.py; torch formulas on CPU;
    # +2.7% on the compiled DiT step on an H100: docs/benchmarks.md, run 39)
    residual_impl: str = "fused"
    # the fused attention kernels' 16-bit tiles (attn_impl fused, or auto on CUDA): null, the shipped
    # ones with each GPU's register caps (recipes/stormscope/fused_natten.py); SPEC for all three
    # kernels or fwd=SPEC,dq=SPEC,dkdv=SPEC for any of them (the rest shipped), SPEC in the notation
    # benchmarks/natten.py --best-tiles writes for a GPU; given tiles run as given, without caps
    attn_tiles: str | None = None

    # how the model computes, not what its weights mean: a resumed run may change them
    RESUME_RULES = (
        ("checkpoint_blocks", MAY, None),
        ("attn_impl", MAY, None),
        ("attn_block", MAY, None),
        ("mlp_impl", MAY, None),
        ("residual_impl", MAY, None),
        ("attn_tiles", MAY, None),
    )

    def __post_init__(self):
        positive(self, "patch_size", "hidden_size", "depth", "num_heads", "attn_kernel")
        non_negative(self, "num_scalar_conditions")
        one_of(self, "pos_embed", ("learned", "rope", "none"))
        one_of(self, "attn_impl", ("auto", "flex", "fused", "reference"))
        one_of(self, "mlp_impl", ("fused", "torch"))
        one_of(self, "residual_impl", ("fused", "torch"))
        if self.attn_block not in BLOCKS:
            raise Invalid("attn_block", f"must be null (auto), 64 or 128 tokens (got {self.attn_block!r})")
        if self.attn_kernel % 2 == 0:
            raise Invalid("attn_kernel", f"must be odd (got {self.attn_kernel})")
        if self.hidden_size % self.num_heads:
            raise Invalid("num_heads", f"must divide hidden_size={self.hidden_size} (got {self.num_heads})")
        if self.pos_embed == "rope" and (self.hidden_size // self.num_heads) % 4:
            raise Invalid(
                "pos_embed", f"rope needs a head dim divisible by 4 (got {self.hidden_size // self.num_heads})"
            )
        if self.mlp_ratio <= 0:
            raise Invalid("mlp_ratio", f"must be positive (got {self.mlp_ratio})")
        if self.attn_tiles is not None:
            from recipes.stormscope.fused_natten import run_tiles

            try:
                run_tiles(self.attn_tiles)
            except ValueError as e:
                raise Invalid("attn_tiles", str(e)) from None

    @property
    def downsample_factor(self) -> int:  # grid rows/cols and domain bands: whole patches
        return self.patch_size

    @property
    def downsample_reason(self) -> str:
        return f"patch size model.patch_size={self.patch_size}"


@dataclass
class StormScopeTaskConfig(DiffusionTaskConfig):
    """Diffusion only: [state, background, invariants] -> the next state (no regression stage)."""

    name: str = "stormscope"
    conditions: list[str] = field(default_factory=lambda: ["state", "background", "invariants"])
    residual: bool = False
