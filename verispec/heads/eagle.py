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

With quantized Linears and the C++ operations (how it runs beside a GGUF or int8 target on CPU), a
true pair's key, value and output are the same bits however the catch-up passes grouped the pairs
(:attr:`EagleDrafter.position_invariant`): the Linears and norms work row by row, and a catch-up's
attention runs position by position (verispec's row-wise kernel, as the target's). So a
later request that starts the same way can take a sequence's pairs from the prefix cache instead of
feeding the drafter its whole conversation again (:mod:`verispec.engine.prefix_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from verispec.heads.draft_ops import (
    add_norm,
    apply_norm,
    attention_and_mlp,
    joint,
    native_ready,
    rowwise_ready,
)
from verispec.models.base import head_dim_of


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    feature_layers: tuple[int, ...] = ()
    """Target decoder layers whose normed inputs are fused into the feature (EAGLE-3): empty for
    the last layer's state alone."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def for_target(
        cls, target: Any, intermediate_size: int | None = None, feature_layers: Sequence[int] = ()
    ) -> EagleConfig:
        """The target's own layer sizes (``intermediate_size`` may override the MLP width)."""
        cfg = target.config
        heads = int(cfg.num_attention_heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(intermediate_size or cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=head_dim_of(cfg),
            rope_theta=float(theta or getattr(cfg, "rope_theta", 10000.0) or 10000.0),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6) or 1e-6),
            feature_layers=tuple(feature_layers),
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
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    )
    angles = positions.double()[..., None] * inv_freq  # [..., d/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftCache:
    """Keys and values of one sequence's true-feature pairs, in buffers ``[kv_heads, capacity,
    head_dim]`` that grow by doubling (a step appends a few pairs; re-concatenating the whole cache
    each step would copy it every time).

    Slots past :attr:`length` are scratch: a drafting step writes its tree nodes' keys there
    (:meth:`EagleDrafter.step`), where the next step's true pairs overwrite them, so a draft never
    has to be rolled back.
    """

    def __init__(self, config: EagleConfig, capacity: int = 256, device: torch.device | None = None) -> None:
        shape = (config.num_key_value_heads, capacity, config.head_dim)
        self._keys, self._values = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
        self.length = 0

    @classmethod
    def empty(cls, config: EagleConfig) -> DraftCache:
        return cls(config)

    @property
    def keys(self) -> torch.Tensor:
        """``[kv_heads, length, head_dim]``: the committed pairs' keys (a view)."""
        return self._keys[:, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, : self.length]

    def reserve(self, end: int) -> None:
        """Make slots ``0 .. end - 1`` writable (committed ones keep their contents)."""
        capacity = self._keys.shape[1]
        if end <= capacity:
            return
        grown = max(end, 2 * capacity)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], grown, old.shape[2])
            new[:, :capacity] = old
            setattr(self, name, new)

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values [kv_heads, n, head_dim]`` at slots ``slot .. slot + n - 1``."""
        end = slot + keys.shape[1]
        self.reserve(end)
        self._keys[:, slot:end] = keys
        self._values[:, slot:end] = values

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers ``[kv_heads, capacity, head_dim]`` (slots past the
        committed and scratch ones are junk), where a row-wise attention reads them in place."""
        return self._keys, self._values

    def visible(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``0 .. end - 1`` (committed and scratch), as views."""
        return self._keys[:, :end], self._values[:, :end]

    def commit(self, count: int) -> None:
        """The ``count`` slots after the committed ones hold true pairs now (written by a pass)."""
        self.reserve(self.length + count)
        self.length += count

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.write(self.length, keys, values)
        self.commit(keys.shape[1])


@dataclass
class DraftRows:
    """One sequence's share of a drafting pass (:meth:`EagleDrafter.step`): ``count`` consecutive
    rows of the pass, at ``positions [count]``, whose keys and values go to ``cache`` slots
    ``slot .. slot + count - 1`` and which see the slots ``mask [count, slot + count]`` allows."""

    cache: DraftCache
    slot: int
    positions: torch.Tensor
    mask: torch.Tensor
    catch_up: bool = False
    """True pairs in order after the committed ones, each seeing those and the rows before it (the
    mask is causal): attended position by position where the row-wise kernel runs, so their keys and
    values do not depend on how the pairs were split into passes."""

    @property
    def count(self) -> int:
        return int(self.positions.shape[0])


class EagleDrafter(nn.Module):
    """One decoder layer over (embedding, feature) pairs; see the module docstring.

    Tensor names follow the EAGLE checkpoints' (``fc``, ``layers.0.self_attn.q_proj`` ...,
    ``layers.0.mlp.gate_proj`` ...), plus ``embed_norm``/``feature_norm`` before ``fc`` (as EAGLE-3)
    and ``norm`` after the layer (its output is compared with post-norm target features).

    With ``config.feature_layers`` (EAGLE-3's multi-layer features) a true pair's feature is
    :meth:`fuse`'s ``h_j + tap_fc(tap_norm(taps_j))``: the target's last state plus a learned
    projection of lower layers' states, which still carry what the last layer has already turned
    into the next token's prediction (the tokens after it are what a drafter needs). ``tap_fc``
    starts at zero, so a drafter trained without taps is the starting point, not a random one.
    """

    def __init__(self, config: EagleConfig, *, native_ops: bool = True) -> None:
        super().__init__()
        self.config = config
        self.native_ops = native_ops
        """:meth:`step` drafts with ``kernels/layer_ops.cpp``'s operations where they build (float32
        on CPU); False keeps torch's (the reference the tests compare to)."""
        h, d = config.hidden_size, config.head_dim
        if config.feature_layers:
            taps = len(config.feature_layers)
            self.tap_norm = nn.Parameter(torch.ones(taps, h))
            self.tap_fc = nn.Linear(taps * h, h, bias=False)
            nn.init.zeros_(self.tap_fc.weight)
        self.embed_norm = RMSNorm(h, config.rms_norm_eps)
        self.feature_norm = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([_Layer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self._heads, self._kv, self._d = config.num_attention_heads, config.num_key_value_heads, d

    @property
    def position_invariant(self) -> bool:
        """Whether a catch-up pass gives every true pair the same bits however the pairs are
        grouped into passes: on CPU with the C++ operations and the row-wise attention, and every
        Linear quantized (verispec's int4 and int8 kernels compute each row on its own; float
        products through BLAS may sum a row differently beside other rows)."""
        if not self.native_ops or not native_ready(self.norm.weight):
            return False
        return not any(type(module) is nn.Linear for module in self.modules()) and rowwise_ready()

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """A true pair's feature ``[..., H]`` from the target's hidden row ``[..., (1 + F) H]``: the
        last layer's state, plus the projected taps of ``config.feature_layers`` (each RMS-normed:
        the layers' scales differ)."""
        h, taps = self.config.hidden_size, len(self.config.feature_layers)
        if hidden.shape[-1] != (1 + taps) * h:
            raise ValueError(
                f"the EAGLE drafter wants target rows of {(1 + taps) * h} values (the last state and "
                f"{taps} feature layers of {h}), got {hidden.shape[-1]}"
            )
        if not taps:
            return hidden
        lower = hidden[..., h:].unflatten(-1, (taps, h)).float()
        lower = lower * torch.rsqrt(lower.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return hidden[..., :h] + self.tap_fc((lower * self.tap_norm).flatten(-2).to(hidden.dtype))

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

    @torch.inference_mode()
    def step(self, embeds: torch.Tensor, features: torch.Tensor, groups: Sequence[DraftRows]) -> torch.Tensor:
        """The drafting forward: :meth:`forward`'s arithmetic over a flat batch of pairs
        ``embeds``/``features [N, H]``, split into consecutive :class:`DraftRows` (one per sequence),
        returning the outputs ``[N, H]``; each group's keys and values are written into its cache.

        Why a second forward: at decode time a pass has a few rows, so its cost is the per-operation
        overhead, not arithmetic (1.5B drafter, 2 CPU cores: ~2.7 ms per pass through
        :meth:`forward`, for ~1 ms of weight reads). Here every row goes through the Linears
        together, but each sequence attends over its own cache in place (no padded copies of the
        caches, no ``repeat_interleave`` of the key/value heads), rotary tables are cached, and in
        float32 on CPU the norms, the rotary embedding and the SiLU product are single calls of
        :mod:`verispec.models.kernels` ``layer_ops.cpp``. Those round differently from torch's
        operations in the last bits, which only moves draft probabilities (a draft has to be good,
        not exact).
        """
        ops = torch.ops.verispec_layer if self.native_ops and native_ready(embeds) else None
        cfg = self.config
        layer = self.layers[0]
        attn = layer.self_attn
        pairs = [apply_norm(self.embed_norm, embeds, ops), apply_norm(self.feature_norm, features, ops)]
        x = self.fc(torch.cat(pairs, dim=-1))
        qkv = joint(
            attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj", apply_norm(layer.input_layernorm, x, ops)
        )
        qkv = qkv.contiguous()
        cos, sin = self._rope(torch.cat([g.positions for g in groups]).to(x.device))
        rotated = cfg.num_attention_heads + cfg.num_key_value_heads
        if ops is not None:
            ops.rotary_(qkv, cos, sin, rotated)
        else:
            heads = qkv.view(qkv.shape[0], -1, cfg.head_dim)
            heads[:, :rotated] = _apply_rotary(heads[:, :rotated], cos[:, None], sin[:, None])
        rowwise = ops is not None and any(g.catch_up for g in groups) and rowwise_ready()
        x, delta = attention_and_mlp(layer, x, qkv, groups, cfg, rowwise, ops)
        return add_norm(x, delta, self.norm, ops)[1]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, head_dim]`` at ``positions [N]``, from a table grown by doubling (the same
        values :func:`rotary` computes, without its float64 arithmetic per pass)."""
        need = int(positions.max()) + 1
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < need:
            size = max(need, 2 * (table[0].shape[0] if table is not None else 128))
            table = rotary(
                torch.arange(size, device=positions.device), self.config.head_dim, self.config.rope_theta
            )
            self._rope_table = table
        return table[0][positions], table[1][positions]


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
