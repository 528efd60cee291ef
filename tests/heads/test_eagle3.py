"""The EAGLE-3 drafter without speculators installed: the incremental drafting API against the
training forward, the rotary scalings against transformers', and the checkpoint formats' round trips
and refusals. tests/heads/test_speculators_interop.py compares with speculators itself."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.errors import VerispecError
from verispec.heads.eagle import DraftCache, DraftRows
from verispec.heads.eagle3 import Eagle3Config, Eagle3Drafter, inverse_frequencies, ttt_masks
from verispec.heads.speculators_io import load_eagle3
from verispec.heads.speculators_save import save_sglang, save_speculators
from verispec.models import native
from verispec.models.attention import NATIVE_SOURCE as ATTENTION_SOURCE
from verispec.models.fused import fuse_projections
from verispec.models.lean import NATIVE_SOURCE
from verispec.models.quant import quantize_model

H, VOCAB, DRAFT_VOCAB = 32, 50, 20
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def tiny_config(**overrides) -> Eagle3Config:
    values = dict(
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        draft_vocab_size=DRAFT_VOCAB,
        target_vocab_size=VOCAB,
        norm_before_residual=True,
        aux_layer_ids=(1, 2, 3),
    )
    values.update(overrides)
    return Eagle3Config(**values)


def random_drafter(config: Eagle3Config, seed: int = 0) -> Eagle3Drafter:
    """Random weights everywhere (norms around 1, a random draft vocabulary), so every term counts."""
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        chosen = torch.randperm(config.target_vocab_size)[: config.draft_vocab_size].sort().values
        drafter.d2t.copy_(chosen - torch.arange(config.draft_vocab_size))
        drafter.t2d.zero_()
        drafter.t2d[chosen] = True
    return drafter


def inputs(config: Eagle3Config, length: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, config.num_aux * config.aux_width, generator=gen)
    return aux, torch.randint(0, config.target_vocab_size, (1, length), generator=gen)


VARIANTS = {
    "plain": {"norm_before_residual": False},
    "norm_before_residual": {},
    "eagle3.1": {"norm_output": True, "fc_norm": True},
    "qwen3_llama3_rope": {"qk_norm": True, "norm_before_fc": True, "rope_scaling": LLAMA3_ROPE},
    "biases_wide_target": {"attention_bias": True, "mlp_bias": True, "target_hidden_size": 24},
}


def test_parameter_names_are_speculators_state_dict_names():
    drafter = Eagle3Drafter(tiny_config())
    assert set(drafter.state_dict()) == {
        "embed_tokens.weight",
        "fc.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "layers.0.input_layernorm.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.post_attention_layernorm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    assert drafter.layers[0].self_attn.q_proj.in_features == 2 * H
    assert drafter.fc.in_features == 3 * H
    qwen = Eagle3Drafter(tiny_config(qk_norm=True, fc_norm=True))
    assert {"layers.0.self_attn.q_norm.weight", "fc_norm.2.weight"} <= set(qwen.state_dict())


def test_ttt_masks_see_the_causal_prefix_and_their_own_chain():
    masks = ttt_masks(4, 3)
    assert [tuple(m.shape) for m in masks] == [(4, 4), (4, 8), (4, 12)]
    assert masks[2][2].tolist() == [True, True, True, False] + [False, False, True, False] * 2


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0}, LLAMA3_ROPE])
def test_rotary_scalings_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={**rope, "rope_theta": 5e5})
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    ours = inverse_frequencies(tiny_config(head_dim=16, rope_theta=5e5, rope_scaling=rope))
    torch.testing.assert_close(ours.float(), expected, rtol=1e-6, atol=0)


def test_config_refuses_what_it_cannot_compute():
    with pytest.raises(VerispecError, match="yarn"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(VerispecError, match="exclude"):
        tiny_config(norm_before_fc=True, fc_norm=True)
    with pytest.raises(VerispecError, match="draft_vocab_size"):
        tiny_config(draft_vocab_size=VOCAB + 1)
    assert tiny_config(rope_scaling={"rope_type": "default", "rope_theta": 1.0}).rope_scaling == ()
    with pytest.raises(ValueError, match="96 values"):
        Eagle3Drafter(tiny_config()).fuse(torch.zeros(2, 64))


def test_deeper_passes_do_not_change_earlier_ones():
    cfg = tiny_config()
    drafter = random_drafter(cfg)
    aux, ids = inputs(cfg)
    with torch.no_grad():
        one, three = drafter(aux, ids, steps=1), drafter(aux, ids, steps=3)
    assert len(three) == 3 and three[0].shape == (1, 9, DRAFT_VOCAB)
    torch.testing.assert_close(one[0], three[0])


def catch_up(
    drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, n: int
) -> tuple[DraftCache, torch.Tensor]:
    """Commit the first ``n`` true pairs to a fresh cache (positions 1..n, as speculators numbers them)."""
    cache = DraftCache(drafter.config)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = drafter.step(
        drafter.embed(ids[0, :n]),
        drafter.fuse(aux[0, :n]),
        [DraftRows(cache, 0, torch.arange(1, n + 1), causal)],
    )
    cache.commit(n)
    return cache, out


@pytest.mark.parametrize("native", [True, False], ids=["cpp-ops", "torch-ops"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.inference_mode()
def test_incremental_drafting_equals_the_training_forward(variant, native):
    """Pass 1 over a prefix, then a chain of draft nodes, each in the cache's scratch slots after the
    committed pairs and seeing them plus its ancestors: the same logits as the full forward's TTT
    passes, where row j of pass s is the depth-s node after the pairs 0..j (with verispec's C++
    norms, rotary embedding and SiLU product, or torch's)."""
    cfg = tiny_config(**VARIANTS[variant])
    drafter = random_drafter(cfg)
    drafter.native_ops = native
    aux, ids = inputs(cfg)
    full = drafter(aux, ids, steps=3)
    for j in (0, 3, 6):
        cache, out = catch_up(drafter, aux, ids, j + 1)
        torch.testing.assert_close(drafter.logits(out), full[0][0, : j + 1], rtol=1e-5, atol=1e-5)
        feature, committed = out[-1:], j + 1
        for depth in (1, 2):
            slot = committed + depth - 1
            mask = torch.ones(1, slot + 1, dtype=torch.bool)  # the committed pairs and the chain
            rows = DraftRows(cache, slot, torch.tensor([j + 1 + depth]), mask)
            feature = drafter.step(drafter.embed(ids[0, j + depth : j + depth + 1]), feature, [rows])
            torch.testing.assert_close(drafter.logits(feature)[0], full[depth][0, j], rtol=1e-5, atol=1e-5)
        assert cache.length == committed  # draft keys went to scratch slots


@torch.inference_mode()
def test_one_pass_drafts_several_sequences_and_tree_siblings():
    """Two sequences in one :meth:`step`, one of them expanding two siblings that must not see each
    other: each row equals the same node drafted alone."""
    cfg = tiny_config()
    drafter = random_drafter(cfg)
    (aux_a, ids_a), (aux_b, ids_b) = inputs(cfg, 6, seed=2), inputs(cfg, 4, seed=3)
    cache_a, out_a = catch_up(drafter, aux_a, ids_a, 6)
    cache_b, out_b = catch_up(drafter, aux_b, ids_b, 4)
    tokens = torch.tensor([3, 7, 11])
    siblings = torch.tensor([[True] * 6 + [True, False], [True] * 6 + [False, True]])
    groups = [
        DraftRows(cache_a, 6, torch.tensor([7, 7]), siblings),
        DraftRows(cache_b, 4, torch.tensor([5]), torch.ones(1, 5, dtype=torch.bool)),
    ]
    features = torch.cat([out_a[-1:], out_a[-1:], out_b[-1:]])
    together = drafter.step(drafter.embed(tokens), features, groups)
    for row, (cache, n, feature) in enumerate(
        [(cache_a, 6, out_a), (cache_a, 6, out_a), (cache_b, 4, out_b)]
    ):
        alone = drafter.step(
            drafter.embed(tokens[row : row + 1]),
            feature[-1:],
            [DraftRows(cache, n, torch.tensor([n + 1]), torch.ones(1, n + 1, dtype=torch.bool))],
        )
        torch.testing.assert_close(together[row], alone[0], rtol=1e-5, atol=1e-5)


def test_to_target_ids_uses_d2t():
    drafter = random_drafter(tiny_config())
    draft_ids = torch.tensor([[0, 5], [19, 2]])
    targets = drafter.to_target_ids(draft_ids)
    assert torch.equal(targets, draft_ids + drafter.d2t[draft_ids])
    assert bool(drafter.t2d[targets].all())
    full = Eagle3Drafter(tiny_config(draft_vocab_size=VOCAB))
    assert not full.uses_draft_vocab and torch.equal(full.to_target_ids(draft_ids), draft_ids)


def assert_same_logits(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    aux, ids = inputs(a.config)
    with torch.no_grad():
        for x, y in zip(a(aux, ids, steps=3), b(aux, ids, steps=3), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculators_format_round_trip(tmp_path, variant):
    cfg = tiny_config(**VARIANTS[variant])
    drafter = random_drafter(cfg)
    save_speculators(drafter, tmp_path, "org/target", speculative_tokens=5)
    loaded, meta = load_eagle3(tmp_path)
    assert loaded.config == cfg
    assert (meta.format, meta.verifier, meta.speculative_tokens) == ("speculators", "org/target", 5)
    assert_same_logits(drafter, loaded)


def test_config_dict_round_trip_and_lower_precision_load(tmp_path):
    cfg = tiny_config(rope_scaling=LLAMA3_ROPE, fc_norm=True)
    assert Eagle3Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    save_speculators(random_drafter(cfg), tmp_path, None)
    drafter, _ = load_eagle3(tmp_path, dtype=torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16 and drafter.d2t.dtype == torch.long
    assert drafter.inv_freq.dtype == torch.float64  # the rotary frequencies are not rounded
    aux, ids = inputs(cfg)
    with torch.no_grad():
        assert all(bool(torch.isfinite(x).all()) for x in drafter(aux, ids, steps=2))


def test_sglang_format_round_trip_and_layer_ids(tmp_path):
    cfg = tiny_config(aux_layer_ids=(2, 14, 25), norm_output=True, rope_scaling=LLAMA3_ROPE)
    drafter = random_drafter(cfg)
    save_sglang(drafter, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 13, 24]  # SGLang: output of i
    assert written["norm_before_residual"] is True and written["draft_vocab_size"] == DRAFT_VOCAB
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "midlayer.hidden_norm.weight" in names and not any(n.startswith("layers.") for n in names)
    loaded, meta = load_eagle3(tmp_path)
    assert meta.format == "research" and loaded.config == cfg
    assert_same_logits(drafter, loaded)
    with pytest.raises(VerispecError, match="q/k norms"):
        save_sglang(random_drafter(tiny_config(qk_norm=True)), tmp_path / "qwen")


def test_research_folder_as_the_eagle_authors_ship_it(tmp_path):
    """pytorch_model.bin, ``model.``-prefixed names, no embeddings (shared with the target), no t2d,
    no layer ids and no flags (the authors' residual is the raw h): loads with the target's
    embeddings, refuses without them."""
    cfg = tiny_config(norm_before_residual=False, aux_layer_ids=())
    drafter = random_drafter(cfg)
    save_sglang(drafter, tmp_path / "tmp")
    config = json.loads((tmp_path / "tmp" / "config.json").read_text())
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "tmp" / "model.safetensors"))
    embeddings = tensors.pop("embed_tokens.weight")
    del tensors["t2d"]
    torch.save({"model." + k: v for k, v in tensors.items()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(VerispecError, match="target_embeddings"):
        load_eagle3(tmp_path)
    with pytest.raises(VerispecError, match="shape"):
        load_eagle3(tmp_path, target_embeddings=torch.zeros(VOCAB, H + 1))
    loaded, meta = load_eagle3(tmp_path, target_embeddings=embeddings)
    assert meta.embeddings_from_target and loaded.config == cfg
    assert torch.equal(loaded.t2d, drafter.t2d)
    assert_same_logits(drafter, loaded)


def test_sharded_speculators_folder_loads(tmp_path):
    drafter = random_drafter(tiny_config())
    save_speculators(drafter, tmp_path, None)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_logits(drafter, load_eagle3(tmp_path)[0])


def edit_checkpoint(folder, config_edit=None, tensor_edit=None) -> None:
    if config_edit:
        config = json.loads((folder / "config.json").read_text())
        config_edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    if tensor_edit:
        tensors = load_file(str(folder / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))


def _set(d, key, value):
    d[key] = value


MALFORMED = {
    "unknown format": (
        lambda c: [c.pop("speculators_model_type"), c.pop("draft_vocab_size")],
        None,
        "not an",
    ),
    "other algorithm": (lambda c: _set(c, "speculators_model_type", "mlp"), None, "'mlp'"),
    "two layers": (lambda c: _set(c["transformer_layer_config"], "num_hidden_layers", 2), None, "2 decoder"),
    "gelu": (lambda c: _set(c["transformer_layer_config"], "hidden_act", "gelu"), None, "gelu"),
    "yarn": (
        lambda c: _set(c["transformer_layer_config"], "rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
        None,
        "yarn",
    ),
    "wrong size": (lambda c: _set(c["transformer_layer_config"], "intermediate_size", 40), None, "shape"),
    "missing tensor": (None, lambda t: t.pop("layers.0.hidden_norm.weight"), "missing layers.0.hidden_norm"),
    "extra tensor": (None, lambda t: _set(t, "layers.1.mlp.up_proj.weight", torch.zeros(2)), "does not have"),
    "never loaded": (None, lambda t: t["fc.weight"].fill_(float("nan")), "NaN"),
    "no d2t": (None, lambda t: t.pop("d2t"), "needs d2t"),
    "d2t collides": (None, lambda t: t["d2t"].copy_(-torch.arange(DRAFT_VOCAB)), "distinct"),
    "t2d disagrees": (None, lambda t: t["t2d"].logical_not_(), "t2d"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoints_are_refused(tmp_path, case):
    save_speculators(random_drafter(tiny_config()), tmp_path, None)
    config_edit, tensor_edit, message = MALFORMED[case]
    edit_checkpoint(tmp_path, config_edit, tensor_edit)
    with pytest.raises(VerispecError, match=message):
        load_eagle3(tmp_path)


def test_unreadable_folders_are_refused(tmp_path):
    with pytest.raises(VerispecError, match=r"no config\.json"):
        load_eagle3(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(VerispecError, match="cannot read"):
        load_eagle3(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(VerispecError, match="transformer_layer_config"):
        load_eagle3(tmp_path)
    save_speculators(random_drafter(tiny_config()), tmp_path, None)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(VerispecError, match="cannot read"):
        load_eagle3(tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.inference_mode()
def test_catch_up_pairs_are_the_same_bits_however_the_passes_group_them(variant):
    """With quantized Linears and the C++ operations a true pair's key, value and output do not depend
    on the pairs beside it in a catch-up pass, nor does its fused feature or its draft logits (what
    lets the prefix cache hand one request's pairs to another); float Linears do not claim it."""
    if native.load(NATIVE_SOURCE) is not None or native.load(ATTENTION_SOURCE) is not None:
        pytest.skip("the C++ operations did not build here")
    cfg = tiny_config(**VARIANTS[variant])
    drafter = random_drafter(cfg)
    assert not drafter.position_invariant  # float products through BLAS
    fuse_projections(quantize_model(drafter, "int8"))
    assert drafter.position_invariant
    aux, ids = inputs(cfg, length=23)

    def catch_up_in(passes: list[int]) -> tuple[DraftCache, torch.Tensor, torch.Tensor]:
        cache, outs, features, start = DraftCache(drafter.config, capacity=4), [], [], 0
        for n in passes:
            causal = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
            rows = DraftRows(cache, start, torch.arange(start + 1, start + n + 1), causal, catch_up=True)
            features.append(drafter.fuse(aux[0, start : start + n]))
            outs.append(drafter.step(drafter.embed(ids[0, start : start + n]), features[-1], [rows]))
            cache.commit(n)
            start += n
        return cache, torch.cat(features), torch.cat(outs)

    whole, whole_features, whole_out = catch_up_in([23])
    parts, parts_features, parts_out = catch_up_in([1, 4, 2, 5, 3, 1, 7])
    assert torch.equal(whole_features, parts_features)
    assert torch.equal(whole.keys, parts.keys) and torch.equal(whole.values, parts.values)
    assert torch.equal(whole_out, parts_out)
    assert torch.equal(drafter.logits(whole_out[-3:]), drafter.logits(whole_out)[-3:])
