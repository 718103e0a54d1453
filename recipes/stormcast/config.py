"""Schema of the StormCast recipe's model config node (the SongUNet)."""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.config.resume import MAY
from framework.config.schema import Invalid, non_negative, one_of, positive
from recipes.stormcast.layers import FORMS as GROUP_NORM_FORMS


@dataclass
class SongUNetConfig:
    name: str = "songunet"
    model_channels: int = 128
    channel_mult: list[int] = field(default_factory=lambda: [1, 2, 2, 2, 2])
    channel_mult_emb: int = 4
    num_blocks: int = 4
    attn_resolutions: list[int] = field(default_factory=list)
    dropout: float = 0.0
    embedding_type: str = "zero"  # zero | positional
    additive_pos_embed: bool = False
    checkpoint_level: int = 0
    # the GroupNorm (+ SiLU) of compiled blocks: "auto" (the Triton kernels of
    # recipes/stormcast/fused_norm.py when the compiled blocks replay as CUDA graphs on CUDA,
    # else inductor's kernels), "fused", "explicit" (inductor's), "composite" or "aten" (for
    # comparisons); eager runs: torch's kernel
    compiled_norm: str = "auto"
    # levels (0: the finest) whose GroupNorm + SiLU outputs are recomputed in backward rather
    # than kept: less activation memory for one more pass over each of their inputs
    recompute_norm_levels: list[int] = field(default_factory=list)

    # how the model computes, not what its weights mean: a resumed run may change them
    RESUME_RULES = (
        ("checkpoint_level", MAY, None),
        ("compiled_norm", MAY, None),
        ("recompute_norm_levels", MAY, None),
    )

    def __post_init__(self):
        positive(self, "model_channels", "channel_mult_emb", "num_blocks")
        non_negative(self, "checkpoint_level")
        if not self.channel_mult or any(m <= 0 for m in self.channel_mult):
            raise Invalid("channel_mult", f"must be a non-empty list of positive ints (got {list(self.channel_mult)})")
        if not 0 <= self.dropout < 1:
            raise Invalid("dropout", f"must be in [0, 1) (got {self.dropout})")
        one_of(self, "embedding_type", ("zero", "positional"))
        one_of(self, "compiled_norm", GROUP_NORM_FORMS)
        levels, asked = len(self.channel_mult), list(self.recompute_norm_levels)
        if any(not 0 <= v < levels for v in asked):
            raise Invalid(
                "recompute_norm_levels",
                f"levels run 0..{levels - 1} for channel_mult={list(self.channel_mult)} (got {asked})",
            )

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.channel_mult) - 1)

    @property
    def downsample_reason(self) -> str:
        return f"total down-sampling of model.channel_mult={list(self.channel_mult)}"
