"""Vision transformer for 112x112 faces (patch 9, 144 tokens, no class token), arcface_torch names.

Training behaviour follows arcface_torch: a share of the patch tokens (``mask_ratio``, 10% for vit_t)
is dropped at random before the blocks and replaced by a learned mask token after them, and the
stochastic depth rate grows linearly over the blocks up to ``drop_path_rate``. Both are off in eval mode.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from backbones.base import Backbone, FaceBackbone, at_least_float32, scaled_width
from utils.errors import ConfigError
from utils.image import IMAGE_SIZE

PATCH_SIZE = 9
NUM_HEADS = 8


class ViTConfig(NamedTuple):
    embed_dim: int
    depth: int
    drop_path_rate: float
    mask_ratio: float
    using_checkpoint: bool  # recompute each block's activations in backward instead of keeping them


# As arcface_torch's get_model builds them (the *_dp005_* ones are its WebFace42M recipes).
VIT_CONFIGS: dict[str, ViTConfig] = {
    "vit_t": ViTConfig(256, 12, 0.1, 0.1, False),
    "vit_t_dp005_mask0": ViTConfig(256, 12, 0.05, 0.0, False),
    "vit_s": ViTConfig(512, 12, 0.1, 0.1, False),
    "vit_s_dp005_mask_0": ViTConfig(512, 12, 0.05, 0.0, False),
    "vit_b": ViTConfig(512, 24, 0.1, 0.1, True),
    "vit_b_dp005_mask_005": ViTConfig(512, 24, 0.05, 0.05, True),
    "vit_l_dp005_mask_005": ViTConfig(768, 24, 0.05, 0.05, True),
    "vit_h": ViTConfig(1024, 48, 0.1, 0.0, True),
}


class DropPath(nn.Module):
    """Stochastic depth: in training, zero a residual branch for a random subset of samples."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = 1.0 - self.drop_prob
        # Scaling the per-sample mask, not x, keeps it to one pass over the activations.
        scale = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep).div_(keep)
        return x * scale


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU6()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        # The fused kernel uses the same 1/sqrt(head_dim) scale as arcface_torch's explicit softmax.
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, drop_path: float) -> None:
        super().__init__()
        # Registration order fixes state_dict order; this is arcface_torch's.
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.drop_path = DropPath(drop_path)
        self.mlp = Mlp(dim, dim * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, embed_dim, kernel_size=PATCH_SIZE, stride=PATCH_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(FaceBackbone):
    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_features: int = 512,
        dropout: float = 0.0,
        width_mult: float = 1.0,
        mask_ratio: float = 0.1,
        drop_path_rate: float = 0.1,
        using_checkpoint: bool = False,
    ) -> None:
        super().__init__()
        embed_dim = scaled_width(embed_dim, width_mult, "ViT embedding width")
        if embed_dim % NUM_HEADS:
            raise ConfigError(
                f"width_mult={width_mult} gives a ViT embedding width of {embed_dim}, which does not "
                f"split into {NUM_HEADS} attention heads; pick a width_mult giving a multiple of "
                f"{NUM_HEADS}, such as 0.25 or 0.125"
            )
        if not 0.0 <= mask_ratio < 1.0:
            raise ConfigError(f"mask_ratio={mask_ratio} is outside [0, 1); set it to the share of patch "
                              f"tokens to drop in training, e.g. 0.1 (0 for none)")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ConfigError(f"drop_path_rate={drop_path_rate} is outside [0, 1); set it to the stochastic "
                              f"depth rate of the last block, e.g. 0.1 (0 for none)")
        self.embed_dim = embed_dim
        self.num_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
        self.mask_ratio = mask_ratio
        self.using_checkpoint = using_checkpoint
        self.patch_embed = PatchEmbed(embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, embed_dim))
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # linear, as upstream
        self.blocks = nn.ModuleList([Block(embed_dim, NUM_HEADS, rate) for rate in rates])
        self.norm = nn.LayerNorm(embed_dim)
        self.dropout = nn.Dropout(p=dropout)
        self.feature = nn.Sequential(
            nn.Linear(embed_dim * self.num_patches, embed_dim, bias=False),
            nn.BatchNorm1d(embed_dim, eps=2e-5),
            nn.Linear(embed_dim, num_features, bias=False),
            nn.BatchNorm1d(num_features, eps=2e-5),
        )
        # arcface_torch's state_dict holds mask_token for every ViT, so the parameter stays. Without masking
        # no step uses it, and DDP's reducer, waiting for a gradient that never comes, leaves that bucket
        # unfinished and raises at the second step; frozen, it is left out by DDP and the optimizer alike.
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim), requires_grad=mask_ratio > 0)
        self._initialize()

    def _initialize(self) -> None:
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def _keep_random_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's randomly kept tokens, and the permutation that puts tokens back in place."""
        batch, tokens, dim = x.shape
        keep = int(tokens * (1 - self.mask_ratio))
        shuffle = torch.rand(batch, tokens, device=x.device).argsort(dim=1)
        restore = shuffle.argsort(dim=1)
        kept = torch.gather(x, 1, shuffle[:, :keep, None].expand(-1, -1, dim))
        return kept, restore

    def _restore_tokens(self, x: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
        batch, kept, dim = x.shape
        masked = self.mask_token.to(x.dtype).expand(batch, restore.shape[1] - kept, dim)
        return torch.gather(torch.cat([x, masked], dim=1), 1, restore[:, :, None].expand(-1, -1, dim))

    def forward_trunk(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x) + self.pos_embed
        masking = self.training and self.mask_ratio > 0
        if masking:
            x, restore = self._keep_random_tokens(x)
        for block in self.blocks:
            if self.using_checkpoint and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.norm(at_least_float32(x))  # LayerNorm statistics in float32, as upstream
        if masking:
            x = self._restore_tokens(x, restore)
        return self.dropout(x.reshape(x.shape[0], self.num_patches * self.embed_dim))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature(x)


VIT_OPTIONS = ("mask_ratio", "drop_path_rate", "using_checkpoint")  # beyond get_model's own


def _vit(config: ViTConfig) -> Backbone:
    def build(**options) -> VisionTransformer:
        # the name's own training options unless asked otherwise
        defaults = dict(mask_ratio=config.mask_ratio, drop_path_rate=config.drop_path_rate,
                        using_checkpoint=config.using_checkpoint)
        return VisionTransformer(config.embed_dim, config.depth, **(defaults | options))
    return Backbone(build, "patch_embed.proj.weight", config.embed_dim, VIT_OPTIONS)


BACKBONES: dict[str, Backbone] = {name: _vit(config) for name, config in VIT_CONFIGS.items()}
