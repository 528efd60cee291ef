"""The EAGLE drafter (Li et al. 2024): one decoder layer over (token embedding, target feature) pairs.

Pair j is ``(h_j, x_{j+1})``: the target's last hidden state after token j (after the final norm,
what the engine hands proposers) and the token that followed. The layer sees the pairs causally, at
position j, and its output ``g_j`` is trained to be the *next* feature ``h_{j+1}``, so the target's
LM head on ``g_j`` predicts ``x_{j+2}``:

    g_j = norm(Layer(fc([embed_norm(E x_{j+1}); feature_norm(h_j)])))

At a decode step the drafter has ``h_0 .. h_{m-1}`` and the tokens up to the pending ``x_m``; the last
true pair ``(h_{m-1}, x_m)`` predicts ``x_{m+1}`` (the tree's first level). Deeper levels feed the
drafter its own outputs in place of the target's features: a candidate ``t`` for ``x_{m+1}`` becomes
the pair ``(g_{m-1}, t)`` at position m, and so on. Training unrolls that (EAGLE-3's training-time
test): pass d re-runs the layer on the features pass d-1 predicted, attending to true-feature keys
up to d-1 positions back and to its own chain of predicted-feature keys after them, exactly the
keys a depth-d draft node sees at inference (:func:`unrolled_masks`).

The layer is a Llama/Qwen decoder layer (RMSNorm, rotary attention with grouped KV heads, SwiGLU)
with the target's sizes by default; ``intermediate_size`` may be smaller to keep a 1.5B target's
drafter small. Its KV cache (:class:`DraftCache`) holds the true-feature pairs of one sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def for_target(cls, target: Any, intermediate_size: int | None = None) -> EagleConfig:
        """The target's own layer sizes (``intermediate_size`` may override the MLP width)."""
        cfg = target.config
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(intermediate_size or cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rope_theta=float(theta or getattr(cfg, "rope_theta", 10000.0) or 10000.0),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6) or 1e-6),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., head_dim]`` for integer ``positions [...]`` (the Llama/Qwen half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions.double()[..., None] * inv_freq  # [..., d/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class DraftCache:
    """Keys and values ``[kv_heads, T, head_dim]`` of one sequence's true-feature pairs."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @classmethod
    def empty(cls, config: EagleConfig) -> DraftCache:
        shape = (config.num_key_value_heads, 0, config.head_dim)
        return cls(torch.empty(shape), torch.empty(shape))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, keys], dim=1)
        self.values = torch.cat([self.values, values], dim=1)


class EagleDrafter(nn.Module):
    """One decoder layer over (embedding, feature) pairs; see the module docstring.

    Tensor names follow the EAGLE checkpoints' (``fc``, ``layers.0.self_attn.q_proj`` ...,
    ``layers.0.mlp.gate_proj`` ...), plus ``embed_norm``/``feature_norm`` before ``fc`` (as EAGLE-3)
    and ``norm`` after the layer (its output is compared with post-norm target features).
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.embed_norm = RMSNorm(h, config.rms_norm_eps)
        self.feature_norm = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([_Layer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self._heads, self._kv, self._d = config.num_attention_heads, config.num_key_value_heads, d

    @torch.no_grad()
    def init_identity(self) -> EagleDrafter:
        """Start training from the identity on the feature: ``fc`` passes ``h_j`` through and the
        attention and MLP branches add nothing (their output projections are zero), so the untrained
        drafter predicts what the target's LM head predicts from ``h_j``, the start Medusa's
        zero-initialised heads get. From a random layer, a few hundred CPU steps learned mostly a
        token-to-token model: held-out accuracy flat over depth and below Medusa's first head."""
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, h:].copy_(torch.eye(h))
        self.layers[0].self_attn.o_proj.weight.zero_()
        self.layers[0].mlp.down_proj.weight.zero_()
        return self

    def forward(
        self,
        embeds: torch.Tensor,  # [B, S, H] embeddings of the pairs' tokens
        features: torch.Tensor,  # [B, S, H] the pairs' features (target's or predicted)
        positions: torch.Tensor,  # [S] or [B, S]
        mask: torch.Tensor,  # [S, T + S] or [B, S, T + S] bool: which keys each query sees
        past: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B, kv, T, d] keys and values
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Outputs ``[B, S, H]`` (predicted next features) and the new keys/values ``[B, kv, S, d]``."""
        x = self.fc(torch.cat([self.embed_norm(embeds), self.feature_norm(features)], dim=-1))
        x, keys, values = self.layers[0](x, positions, mask, past)
        return self.norm(x), keys, values


class _Layer(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, keys, values = self.self_attn(self.input_layernorm(x), positions, mask, past)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), keys, values


class _Attention(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        positions: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, cfg.head_dim, cfg.rope_theta)
        if cos.dim() == 3:  # per-row positions [B, S, d]
            cos, sin = cos[:, None], sin[:, None]
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        all_k = torch.cat([past[0], k], dim=2) if past is not None else k
        all_v = torch.cat([past[1], v], dim=2) if past is not None else v
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        attn_mask = mask[:, None] if mask.dim() == 3 else mask
        out = F.scaled_dot_product_attention(
            q,
            all_k.repeat_interleave(groups, dim=1),
            all_v.repeat_interleave(groups, dim=1),
            attn_mask=attn_mask,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), k, v


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def unrolled_masks(length: int, passes: int) -> list[torch.Tensor]:
    """Attention masks of training-time test: ``masks[d - 1]`` is pass d's ``[L, d * L]`` mask over
    the keys of passes 1..d laid side by side.

    Pass 1 is the ordinary causal pass over true features. In pass d >= 2 the pair at position j
    carries the feature pass d-1 predicted at j-1 (a depth d-1 draft node's child). It sees what
    that node sees at inference: true keys at positions <= j-d+1 (the committed cache), and the key
    of pass e at position j-d+e for e = 2..d (its draft ancestors and itself). Queries with
    j < d-1 have no such chain inside the window and see nothing but themselves (masked in the loss).
    """
    idx = torch.arange(length)
    masks = []
    for d in range(1, passes + 1):
        blocks = [idx[None, :] <= (idx[:, None] - d + 1)]  # pass-1 keys
        for e in range(2, d + 1):
            blocks.append(idx[None, :] == (idx[:, None] - d + e))
        mask = torch.cat(blocks, dim=1)
        mask[idx, (d - 1) * length + idx] = True  # always at least itself
        masks.append(mask)
    return masks
