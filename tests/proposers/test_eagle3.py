"""The eagle3 proposer: an EAGLE-3 drafter in the speculators format drafts trees for the engine,
lossless against plain decoding, with its reduced vocabulary; drafters for other targets are refused.

The drafter here is built by hand so that its first level is right by construction: the target is a
"counting" model (every layer's output projections zeroed, so its state after a token is that
token's normed embedding, and its LM head maps the embedding of x to x + 1); the drafter's ``fc``
passes the raw embedding the target hands over (the input of layer 0) straight through, and its LM
head maps the embedding of x to x + 2, the token after the next. So level-1 drafts are accepted
wherever x + 2 is in the draft vocabulary, and deeper levels (which would need the drafted token)
are rejected: both outcomes of verification, and the d2t mapping, run in every generation.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.conftest import TINY_VOCAB, tiny_llama
from tests.proposers.heads_checks import PROMPTS, SAMPLINGS, assert_trees_sample_the_target, plain_outputs
from verispec.api import default_method
from verispec.config import SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.heads.eagle3 import Eagle3Config, Eagle3Drafter
from verispec.heads.speculators_save import save_speculators
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.proposers.eagle3 import Eagle3Proposer, default_aux_layers, same_model

pytestmark = pytest.mark.usefixtures("one_thread")

IN_DRAFT_VOCAB = [t for t in range(TINY_VOCAB) if t % 3 != 0]
"""The drafter's vocabulary: two tokens in three, so some right guesses cannot be drafted."""


@pytest.fixture(scope="module")
def counting_target() -> HFCausalLM:
    model = copy.deepcopy(tiny_llama(0))
    with torch.no_grad():
        embed = torch.randn(TINY_VOCAB, 64, generator=torch.Generator().manual_seed(0))
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(8 * embed.roll(1, dims=0))  # row y is the embedding of y - 1
    return HFCausalLM(model, name="tiny-counting")


def counting_drafter(target: HFCausalLM, **overrides: object) -> Eagle3Drafter:
    settings: dict[str, object] = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "draft_vocab_size": len(IN_DRAFT_VOCAB),
        "target_vocab_size": TINY_VOCAB,
        "aux_layer_ids": (0, 1, 0),
    }
    config = Eagle3Config(**{**settings, **overrides})  # type: ignore[arg-type]
    torch.manual_seed(1)
    drafter = Eagle3Drafter(config)
    embed = target.model.get_input_embeddings().weight.detach()
    ids = torch.tensor(IN_DRAFT_VOCAB)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :64] = torch.eye(64)  # h = the raw input of layer 0: the token's embedding
        layer = drafter.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        drafter.lm_head.weight.copy_(8 * embed[ids - 2])  # draft id of y scores the embedding of y - 2
        drafter.d2t.copy_(ids - torch.arange(len(ids)))
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
    return drafter


def saved(tmp_path, drafter: Eagle3Drafter, verifier: str | None = "tiny-counting"):
    folder = tmp_path / "eagle3"
    save_speculators(drafter, folder, verifier)
    return folder


def engine_for(target: HFCausalLM, folder, method: str = "eagle3", k: int = 4) -> SpecEngine:
    spec = SpecConfig(method=method, num_speculative_tokens=k, depth="fixed", heads=str(folder))  # type: ignore[arg-type]
    return SpecEngine(target, build_proposer(spec, target, None), spec)


@pytest.mark.parametrize("method", ["eagle3", "eagle3+ngram"])
def test_greedy_eagle3_equals_plain_with_first_levels_accepted(tmp_path, counting_target, method):
    engine = engine_for(counting_target, saved(tmp_path, counting_drafter(counting_target)), method)
    want = plain_outputs(counting_target, PROMPTS, 24)
    alone = [engine.generate(p, max_new_tokens=24) for p in PROMPTS]
    batched = engine.generate_batch(PROMPTS, max_new_tokens=24)
    assert [g.token_ids for g in alone] == want
    assert [g.token_ids for g in batched] == want
    drafted = sum(g.stats.drafted_at[0] for g in alone if g.stats.drafted_at)
    accepted = sum(g.stats.accepted_at[0] for g in alone if g.stats.accepted_at)
    assert 0 < accepted < drafted, (accepted, drafted)  # right where x + 2 is in the draft vocabulary


def test_the_drafter_reads_the_raw_layer_inputs_and_maps_draft_ids_to_target_ids(tmp_path, counting_target):
    proposer = Eagle3Proposer.for_target(saved(tmp_path, counting_drafter(counting_target)), counting_target)
    assert proposer.raw_features and proposer.feature_layers == (0, 1, 0)
    out = counting_target.forward_batch(
        [counting_target.new_cache()],
        [[5, 8, 11]],
        logits_to_keep=[3],
        return_hidden=True,
        feature_layers=proposer.feature_layers,
        raw_features=True,
    )
    with torch.inference_mode():  # as the engine drafts
        features = proposer._features(out.hidden[0])
        draft_ids = proposer.vocab_head(features).argmax(dim=-1)
    embed = counting_target.model.get_input_embeddings().weight
    torch.testing.assert_close(features, embed[[5, 8, 11]])
    assert proposer.vocab_head.to_target(draft_ids).tolist() == [7, 10, 13]  # x + 2, all in the vocabulary


def test_research_folders_without_layer_ids_take_the_usual_three():
    assert default_aux_layers(28) == (2, 14, 25)
    assert default_aux_layers(32) == (2, 16, 29)


def test_a_drafter_for_another_target_is_refused(tmp_path, counting_target):
    other_vocab = HFCausalLM(tiny_llama(0, vocab=TINY_VOCAB + 4), name="tiny-counting")
    folder = saved(tmp_path, counting_drafter(counting_target))
    with pytest.raises(VerispecError, match=r"vocabulary has 96 tokens, the target's 100"):
        Eagle3Proposer.for_target(folder, other_vocab)
    renamed = saved(tmp_path, counting_drafter(counting_target), verifier="meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(VerispecError, match=r"trained for 'meta-llama/Llama-3.1-8B-Instruct'"):
        Eagle3Proposer.for_target(renamed, counting_target)
    wide = Eagle3Drafter(
        Eagle3Config(
            hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, draft_vocab_size=TINY_VOCAB,
            target_vocab_size=TINY_VOCAB, aux_layer_ids=(0, 1, 1),
        )
    )  # fmt: skip
    with pytest.raises(VerispecError, match=r"states of width 32, the target's are 64"):
        Eagle3Proposer.for_target(saved(tmp_path / "w", wide), counting_target)
    deep = counting_drafter(counting_target, aux_layer_ids=(0, 1, 5))
    with pytest.raises(VerispecError, match=r"decoder layers 0\.\.1"):
        Eagle3Proposer.for_target(saved(tmp_path / "d", deep), counting_target)


def test_verifier_names_match_across_hubs_files_and_quantizations():
    assert same_model("Qwen/Qwen2.5-Coder-1.5B-Instruct", ["qwen2.5-coder-1.5b-instruct"])
    assert same_model("Qwen/Qwen2.5-Coder-1.5B-Instruct", ["/models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"])
    assert same_model("/data/smollm2-135m-instruct/", ["x", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert not same_model("Qwen/Qwen2.5-Coder-7B-Instruct", ["qwen2.5-coder-1.5b-instruct"])


def test_the_method_needs_a_folder_and_is_the_default_for_one(tmp_path, counting_target):
    with pytest.raises(VerispecError, match="method eagle3 needs --heads DIR"):
        build_proposer(SpecConfig(method="eagle3"), counting_target, None)
    folder = saved(tmp_path, counting_drafter(counting_target))
    assert default_method(counting_target, None, folder) == "eagle3+suffix"
    (tmp_path / "not").mkdir()
    (tmp_path / "not" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(VerispecError, match="not a verispec heads config"):
        default_method(counting_target, None, tmp_path / "not")


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_eagle3_trees_sample_the_target_distribution(tmp_path, small_vocab_target, prefix_logits, sampling):
    """A random EAGLE-3 drafter (its LM head the target's, so its candidates are as sharp) drafts
    3-deep trees: sampled sequences must follow the target's joint distribution whatever it proposes."""
    cfg = small_vocab_target.config
    torch.manual_seed(4)
    drafter = Eagle3Drafter(
        Eagle3Config(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=cfg.vocab_size,
            target_vocab_size=cfg.vocab_size, aux_layer_ids=(0, 1, 1),
        )
    )  # fmt: skip
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(small_vocab_target.model.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(small_vocab_target.lm_head.weight)
    save_speculators(drafter, tmp_path / "d", small_vocab_target.name)
    spec = SpecConfig(method="eagle3", num_speculative_tokens=3, depth="fixed", tree_nodes=6, tree_width=3)
    proposer = Eagle3Proposer.for_target(tmp_path / "d", small_vocab_target, spec)
    assert_trees_sample_the_target(SpecEngine(small_vocab_target, proposer, spec), prefix_logits, sampling)


def test_a_heads_folder_may_hold_the_drafter_as_its_eagle3_subfolder(tmp_path, counting_target):
    """As heads folders hold one subfolder per kind: one --heads serves eagle and eagle3 in a bench."""
    save_speculators(counting_drafter(counting_target), tmp_path / "eagle3", "tiny-counting")
    spec = SpecConfig(method="eagle3", heads=str(tmp_path))
    assert isinstance(build_proposer(spec, counting_target, None), Eagle3Proposer)
