"""The EAGLE-3 drafter exactly as vllm-project/speculators defines it, so its checkpoints (and the
EAGLE authors', SGLang's and vLLM's, which share its arithmetic) draft in verispec unchanged.

Why a second drafter beside :class:`~verispec.heads.eagle.EagleDrafter`: that one is verispec's own
EAGLE layer (it reads the target's post-norm last state and ends in the target's LM head), while the
EAGLE-3 checkpoints people train and publish compute something else, and a drafter only helps with
the weights it was trained for. Parameter names equal speculators' state-dict names (``embed_tokens``,
``fc``, ``layers.0.*``, ``norm``, ``lm_head``, buffers ``d2t``/``t2d``), so its files load by name.

Pair j is ``(g_j, x_{j+1})``: ``g_j`` the concatenated *raw residual-stream* states of a few target
layers at token j (``[low; mid; high]``, ``[num_aux * H]``, what the target's ``output_hidden_states``
gives: entry i is the input of decoder layer i, vLLM's and speculators' ``aux_layer_ids`` convention)
and the token that followed. ``fc`` maps ``g_j`` to ``h_j [H]``; the one decoder layer sees both::

    q, k, v  = proj([input_layernorm(E x_{j+1}); hidden_norm(h_j)])       # 2H inputs
    y_j      = r_j + o_proj(attention)            r_j = h_j (or hidden_norm(h_j): norm_before_residual)
    out_j    = y_j + mlp(post_attention_layernorm(y_j))
    logits_j = lm_head(norm(out_j))               # over draft_vocab_size tokens; target id = d + d2t[d]

``logits_j`` predicts ``x_{j+2}``. Deeper drafting feeds the layer's own output back as the next
position's ``h`` (pre-norm ``out_j``; post-norm with ``norm_output``, "EAGLE 3.1"), paired with the
drafted token, while the keys and values of every earlier pass stay visible: training-time test
(TTT). In speculators' training forward, pass s at row j carries ``(out_j of pass s-1, x_{j+1+s})`` at
position ``j + 1 + s`` and sees pass-0 keys at rows <= j plus its own row's key in passes 1..s
(:func:`ttt_masks`), exactly the keys a depth-s draft node sees at inference: the committed cache and
its chain of ancestors. Rotary embeddings are relative, so the absolute offset (speculators starts
pass 0 at 1, vLLM at 0) changes nothing.

Options that change the arithmetic, all from speculators' ``Eagle3SpeculatorConfig``:
``norm_before_residual``; ``norm_before_fc`` (one RMSNorm over the concatenated ``g``, gpt-oss style)
or ``fc_norm`` (one RMSNorm per aux state); ``norm_output``; a Qwen3 layer (``qk_norm``: RMSNorm on
each query and key head before the rotary embedding); Llama's ``attention_bias``/``mlp_bias``; the
rotary scalings ``linear`` and ``llama3``. Anything else is refused where the checkpoint is read
(:mod:`verispec.heads.speculators_io`), not run approximately.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from verispec.errors import VerispecError
from verispec.heads.draft_ops import apply_norm, attention_and_mlp, joint, native_ready, rowwise_ready
from verispec.heads.eagle import DraftRows, RMSNorm, _apply_rotary
from verispec.models.rope_freqs import llama3_divisors

__all__ = ["Eagle3Config", "Eagle3Drafter", "inverse_frequencies", "rope_tables", "ttt_masks"]

ROPE_TYPES = ("default", "linear", "llama3")
"""Rotary scalings implemented (transformers' ``rope_type``); the others depend on the sequence
length or rescale cos/sin, and no EAGLE-3 checkpoint we know of uses them."""


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    draft_vocab_size: int
    target_vocab_size: int
    norm_before_residual: bool = False
    """The residual around attention is ``hidden_norm(h)`` rather than ``h``. False is the model
    config's default in speculators and the EAGLE authors' arithmetic, but speculators' training
    config defaults to True, so its checkpoints usually say True: read it from the file."""
    aux_layer_ids: tuple[int, ...] = ()
    """Target layers whose *inputs* (residual stream before layer i, ``output_hidden_states[i]``) are
    concatenated, vLLM's and speculators' convention; empty when the checkpoint does not say."""
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    target_hidden_size: int | None = None
    """Width of each aux state when the target's hidden size differs from the drafter's (vLLM and
    SGLang read it; speculators itself assumes equal sizes)."""
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    """transformers' rope parameters besides ``rope_theta`` (``rope_type``, ``factor`` ...), as sorted
    items; empty for plain rotary embeddings. A mapping is accepted and normalised."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        scaling = dict(self.rope_scaling)
        scaling.pop("rope_theta", None)
        if float(scaling.get("partial_rotary_factor", 1.0)) == 1.0:
            scaling.pop("partial_rotary_factor", None)
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = {k: v for k, v in scaling.items() if k == "partial_rotary_factor"}
        object.__setattr__(self, "rope_scaling", tuple(sorted(scaling.items())))
        if self.norm_before_fc and self.fc_norm:
            raise VerispecError("EAGLE-3: norm_before_fc and fc_norm exclude each other (as in speculators)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise VerispecError(
                f"EAGLE-3: {self.num_attention_heads} attention heads do not share "
                f"{self.num_key_value_heads} key/value heads evenly"
            )
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise VerispecError(
                f"EAGLE-3: draft_vocab_size {self.draft_vocab_size} must be in 1..{self.target_vocab_size} "
                "(the target's vocabulary)"
            )
        inverse_frequencies(self)  # refuses unsupported rotary scalings now, not at the first draft

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers the drafter reads (their raw inputs), as the engine names them."""
        return self.aux_layer_ids

    @property
    def num_aux(self) -> int:
        """How many target states ``fc`` concatenates (speculators: 3 when the ids are not given)."""
        return len(self.aux_layer_ids) or 3

    @property
    def aux_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        out["rope_scaling"] = dict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Eagle3Config:
        return cls(**dict(values))


def inverse_frequencies(config: Eagle3Config) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim / 2]`` (float64) as transformers' ``ROPE_INIT_FUNCTIONS``
    compute them for ``default``, ``linear`` and ``llama3`` (Llama 3.1's long-context smoothing)."""
    d = config.head_dim
    scaling = dict(config.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise VerispecError(
            f"EAGLE-3: rope_type {kind!r} is not supported (verispec implements {', '.join(ROPE_TYPES)})"
        )
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise VerispecError("EAGLE-3: partial rotary embeddings (partial_rotary_factor) are not supported")
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    if kind == "default":
        return inv
    factor = float(_rope_field(scaling, "factor"))
    if kind == "linear":
        return inv / factor
    fields = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    params = {"factor": factor, **{name: float(_rope_field(scaling, name)) for name in fields}}
    return inv / torch.from_numpy(llama3_divisors(params, (2 * math.pi / inv).numpy()))


def _rope_field(scaling: dict[str, Any], name: str) -> Any:
    if name not in scaling:
        raise VerispecError(f"EAGLE-3: rope scaling {scaling} lacks {name!r}")
    return scaling[name]


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., head_dim]`` (float32) at integer ``positions [...]``, the half-split layout of
    :func:`verispec.heads.eagle.rotary`, for any inverse frequencies."""
    angles = positions.double()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def ttt_masks(length: int, steps: int) -> list[torch.Tensor]:
    """speculators' training-time-test masks: ``masks[s]`` is pass s's ``[L, (s + 1) L]`` mask over the
    keys of passes 0..s laid side by side. Row j sees pass-0 keys at rows <= j (causal: the true pairs
    up to its own) and, in every later pass, only its own row (its chain of drafted ancestors)."""
    eye = torch.eye(length, dtype=torch.bool)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return [torch.cat([causal] + [eye] * s, dim=1) for s in range(steps)]


class Eagle3Drafter(nn.Module):
    """speculators' ``Eagle3DraftModel`` with one decoder layer; see the module docstring.

    :meth:`forward` is its training forward (all TTT passes over whole sequences, for training and for
    the tests that compare with speculators); :meth:`step` is the incremental drafting forward over a
    per-sequence :class:`~verispec.heads.eagle.DraftCache`, shaped like ``EagleDrafter.step`` so a
    proposer drives both the same way: catch up on true pairs ``(fuse(g_j), x_{j+1})``, then expand
    draft nodes with their parent's output as ``features``, and score any output with :meth:`logits`.
    """

    def __init__(self, config: Eagle3Config, *, native_ops: bool = True) -> None:
        super().__init__()
        self.config = config
        self.native_ops = native_ops
        """:meth:`step`, :meth:`fuse` and :meth:`logits` use ``kernels/layer_ops.cpp``'s norms, rotary
        embedding and SiLU product where they build (float32 on CPU), as ``EagleDrafter.step`` does;
        False keeps torch's everywhere (:meth:`forward`, the training forward, always does)."""
        h, eps = config.hidden_size, config.rms_norm_eps
        width = config.num_aux * config.aux_width
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        if config.norm_before_fc:
            self.input_norm = RMSNorm(width, eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(config.aux_width, eps) for _ in range(config.num_aux)])
        self.fc = nn.Linear(width, h, bias=False)
        self.layers = nn.ModuleList([_Layer(config)])
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.target_vocab_size, dtype=torch.bool))
        """``d2t``: target id = draft id + ``d2t[draft id]`` (zeros: the identity, a full draft
        vocabulary); ``t2d``: which target ids the draft vocabulary holds."""
        self.inv_freq = inverse_frequencies(config)
        """float64, not a buffer: ``.to(torch.bfloat16)`` must not round the rotary frequencies."""

    @property
    def position_invariant(self) -> bool:
        """Whether a catch-up pass gives every true pair the same bits however the pairs are grouped
        into passes (``EagleDrafter.position_invariant``'s conditions): the C++ operations, the row-wise
        attention, and every Linear quantized (verispec's int4 and int8 kernels compute each row on its
        own). Then the prefix cache keeps the pairs, and a later request that starts the same way
        feeds the drafter only its new positions."""
        if not self.native_ops or not native_ready(self.norm.weight):
            return False
        return not any(type(module) is nn.Linear for module in self.modules()) and rowwise_ready()

    def _ops(self, x: torch.Tensor) -> Any:
        """``torch.ops.verispec_layer`` where :attr:`native_ops` asks for them and they run on ``x``,
        and nothing is differentiated (they have no backward: training takes torch's)."""
        if not self.native_ops or torch.is_grad_enabled():
            return None
        return torch.ops.verispec_layer if native_ready(x) else None

    @property
    def uses_draft_vocab(self) -> bool:
        """Whether the draft vocabulary is a subset (speculators has no ``d2t``/``t2d`` otherwise)."""
        return self.config.draft_vocab_size != self.config.target_vocab_size

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``h [..., H]`` of true pairs from the target's concatenated aux states ``[..., num_aux * H]``
        (the optional input norms, then ``fc``)."""
        cfg = self.config
        if aux_hidden.shape[-1] != cfg.num_aux * cfg.aux_width:
            raise ValueError(
                f"the EAGLE-3 drafter wants rows of {cfg.num_aux} target states of {cfg.aux_width} "
                f"({cfg.num_aux * cfg.aux_width} values), got {aux_hidden.shape[-1]}"
            )
        x = aux_hidden.to(self.embed_tokens.weight.dtype)  # fc may be quantized: no tensor weight
        ops = self._ops(x)
        if cfg.norm_before_fc:
            x = apply_norm(self.input_norm, x, ops)
        if cfg.fc_norm:
            chunks = x.chunk(cfg.num_aux, dim=-1)
            x = torch.cat(
                [apply_norm(norm, c, ops) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1
            )
        return self.fc(x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., draft_vocab_size]`` of outputs of :meth:`step`/:meth:`forward`'s passes
        (those are what the next position takes as ``h``: pre-norm, or already normed with
        ``norm_output``, where speculators scores the same normed tensor it feeds back)."""
        normed = features if self.config.norm_output else apply_norm(self.norm, features, self._ops(features))
        return self.lm_head(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (any shape): ``d + d2t[d]``."""
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, T, num_aux * H]: g_j, the target's states at token j
        input_ids: torch.Tensor,  # [B, T]: x_{j+1}, the token after each
        steps: int = 1,
        positions: torch.Tensor | None = None,  # [T] or [B, T]; speculators' default 1 + arange(T)
    ) -> list[torch.Tensor]:
        """Draft logits ``[B, T, draft_vocab_size]`` of each of ``steps`` TTT passes, as speculators'
        ``Eagle3DraftModel.forward(..., ttt_steps=steps)`` computes them before its argmax.

        Pass s >= 1 feeds each row the output of pass s-1 and the token s places further on (teacher
        forcing, speculators' choice: rows whose token would fall past the end get token 0, and their
        logits mean nothing), at positions + s, attending as :func:`ttt_masks` says.
        """
        b, t = input_ids.shape
        device = input_ids.device
        if positions is None:
            positions = torch.arange(1, t + 1, device=device)
        hidden = self.fuse(aux_hidden)
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = []
        for s, mask in enumerate(ttt_masks(t, steps)):
            ids = torch.cat([input_ids[:, s:], input_ids.new_zeros(b, s)], dim=1)
            cos, sin = (r.to(hidden.dtype) for r in rope_tables(positions + s, self.inv_freq))
            x, keys, values = self.layer_pass(self.embed(ids), hidden, cos, sin, mask.to(device), past)
            past.append((keys, values))
            hidden = self.norm(x) if self.config.norm_output else x
            out.append(self.logits(hidden))
        return out

    def layer_pass(
        self,
        embeds: torch.Tensor,  # [B, T, H]
        hidden: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [T, d] or [B, T, d]
        sin: torch.Tensor,
        mask: torch.Tensor,  # [T, K + T]
        past: list[tuple[torch.Tensor, torch.Tensor]],  # earlier passes' [B, kv, T, d]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer pass over whole sequences: outputs ``[B, T, H]`` and this pass's keys and values."""
        layer = self.layers[0]
        x, residual = layer.inputs(embeds, hidden)
        q, k, v = (p.transpose(1, 2) for p in layer.self_attn.project(x))  # [B, heads, T, d]
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        keys = torch.cat([*(p[0] for p in past), k], dim=2)
        values = torch.cat([*(p[1] for p in past), v], dim=2)
        shared = self.config.num_attention_heads // self.config.num_key_value_heads
        attn = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(shared, dim=1), values.repeat_interleave(shared, dim=1), attn_mask=mask
        )
        attn = layer.self_attn.o_proj(attn.transpose(1, 2).flatten(2))
        return layer.finish(residual, attn), k, v

    @torch.inference_mode()
    def step(self, embeds: torch.Tensor, features: torch.Tensor, groups: Sequence[DraftRows]) -> torch.Tensor:
        """The drafting forward: the layer over a flat batch of pairs ``embeds``/``features [N, H]``
        (true pairs: ``features = fuse(g)``; draft nodes: their parent's output), split into
        consecutive :class:`DraftRows` (one per sequence), returning the outputs ``[N, H]`` (score them
        with :meth:`logits`, feed them to children as ``features``); each group's keys and values are
        written into its cache at its slots, so the next pass sees them.

        Why not :meth:`forward` with a padded batch: at decode time a pass has a few rows and the cost
        is per-operation overhead, so every row goes through the Linears together and each sequence
        attends over its own cache in place (as ``EagleDrafter.step``). With the C++ operations
        (:attr:`native_ops`, float32 on CPU) the norms, the rotary embedding and the SiLU product are
        single calls that work row by row, and catch-up rows attend position by position (the
        row-wise kernel), which rounds differently from torch's operations in the last bits (a draft
        has to be good, not exact) and makes the pairs position-invariant where the Linears are
        quantized (:attr:`position_invariant`). Otherwise torch's operations, matching :meth:`forward`
        to float32 rounding.
        """
        ops = self._ops(embeds)
        if ops is None:
            return self._torch_step(embeds, features, groups)
        cfg = self.config
        layer = self.layers[0]
        attn = layer.self_attn
        normed = apply_norm(layer.hidden_norm, features, ops)
        residual = normed if layer.norm_before_residual else features
        x = torch.cat([apply_norm(layer.input_layernorm, embeds, ops), normed], dim=-1)
        qkv = joint(attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj", x).contiguous()
        heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if cfg.qk_norm:  # Qwen3: each query and key head normed on its own, before the rotation
            parts = qkv.view(qkv.shape[0], heads + 2 * kv, d)
            for norm, lo, hi in ((attn.q_norm, 0, heads), (attn.k_norm, heads, heads + kv)):
                parts[:, lo:hi] = apply_norm(norm, parts[:, lo:hi].reshape(-1, d), ops).view(-1, hi - lo, d)
        cos, sin = (r.to(x.dtype) for r in self._rope(torch.cat([g.positions for g in groups]).to(x.device)))
        ops.rotary_(qkv, cos.contiguous(), sin.contiguous(), heads + kv)
        rowwise = any(g.catch_up for g in groups) and rowwise_ready()
        x, delta = attention_and_mlp(layer, residual, qkv, groups, cfg, rowwise, ops)
        out = x + delta
        return apply_norm(self.norm, out, ops) if cfg.norm_output else out

    def _torch_step(
        self, embeds: torch.Tensor, features: torch.Tensor, groups: Sequence[DraftRows]
    ) -> torch.Tensor:
        """:meth:`step` in torch's operations (any device and dtype)."""
        layer = self.layers[0]
        x, residual = layer.inputs(embeds, features)
        q, k, v = layer.self_attn.project(x)  # [N, heads or kv, d]
        cos, sin = (r.to(x.dtype) for r in self._rope(torch.cat([g.positions for g in groups]).to(x.device)))
        q, k = _apply_rotary(q, cos[:, None], sin[:, None]), _apply_rotary(k, cos[:, None], sin[:, None])
        attn = layer.self_attn.o_proj(_attend(q, k, v, groups))
        out = layer.finish(residual, attn)
        return self.norm(out) if self.config.norm_output else out

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, head_dim]`` at ``positions [N]`` from a table grown by doubling (one float64
        computation per growth, not per pass)."""
        need = int(positions.max()) + 1
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < need or table[0].device != positions.device:
            size = max(need, 2 * (table[0].shape[0] if table is not None else 128))
            table = rope_tables(torch.arange(size, device=positions.device), self.inv_freq)
            self._rope_table = table
        return table[0][positions], table[1][positions]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[DraftRows]) -> torch.Tensor:
    """Attention of each group's rows over its cache, ``[N, heads * d]`` from ``q [N, heads, d]`` and
    the new ``k``/``v [N, kv, d]`` (written to the cache first). Query heads sharing a key/value head
    are stacked as extra rows of that head, so one SDPA call per sequence reads the cache in place."""
    n_all, heads, d = q.shape
    kv = k.shape[1]
    shared = heads // kv
    outs, row = [], 0
    for g in groups:
        n = g.count
        rows = slice(row, row + n)
        row += n
        g.cache.write(g.slot, k[rows].transpose(0, 1), v[rows].transpose(0, 1))
        keys, values = g.cache.visible(g.slot + n)
        query = q[rows].transpose(0, 1).reshape(kv, shared * n, d)
        mask = g.mask.to(q.device).repeat(shared, 1)
        out = F.scaled_dot_product_attention(query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
        outs.append(out.view(heads, n, d).transpose(0, 1).reshape(n, heads * d))
    if row != n_all:
        raise ValueError(f"draft rows cover {row} of {n_all} rows")
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class _Layer(nn.Module):
    """speculators' ``Eagle3FirstLayerMixin`` over a Llama (or Qwen3) decoder layer."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's input ``[input_layernorm(embeds); hidden_norm(hidden)]`` and the residual."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class _Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(2 * h, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[..., heads, d]``, keys and values ``[..., kv, d]`` of ``x [..., 2H]``, before the
        rotary embedding (after Qwen3's per-head norms)."""
        cfg = self.config
        q = self.q_proj(x).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        k = self.k_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        v = self.v_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class _MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, m, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, m, bias=bias)
        self.up_proj = nn.Linear(h, m, bias=bias)
        self.down_proj = nn.Linear(m, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
