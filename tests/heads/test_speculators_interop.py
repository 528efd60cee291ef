"""verispec's EAGLE-3 drafter against vllm-project/speculators' own ``Eagle3DraftModel``: the same
draft logits, pass for pass of training-time test, for checkpoints speculators wrote, for checkpoints
verispec wrote and speculators loaded, and through SGLang's research format.

speculators' forward returns argmax tokens only; its logits are read off a hook on its ``lm_head``
(called once per TTT pass). Its default attention, flex attention, needs lengths that are multiples
of 128 on CPU, so the models here use SDPA (the same arithmetic).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

speculators = pytest.importorskip(
    "speculators",
    reason="speculators is not installed: pip install -e '.[interop]' && "
    "pip install --no-deps -r requirements/interop.txt",
)

from speculators import SpeculatorModel  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config  # noqa: E402

from verispec.heads.eagle3 import Eagle3Drafter  # noqa: E402
from verispec.heads.speculators_io import load_eagle3  # noqa: E402
from verispec.heads.speculators_save import save_sglang, save_speculators  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
"""transformers 5 about speculators' own attention call."""

H, VOCAB, DRAFT_VOCAB, LENGTH, STEPS = 32, 50, 20, 11, 3
AUX_LAYERS = [1, 2, 3]
LAYER = dict(
    vocab_size=VOCAB,
    hidden_size=H,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
CASES = {
    "norm_before_residual": dict(norm_before_residual=True),
    "raw_residual": dict(norm_before_residual=False),
    "eagle3.1_llama3_rope": dict(norm_before_residual=True, norm_output=True, fc_norm=True, rope=LLAMA3_ROPE),
    "qwen3_layer": dict(norm_before_residual=False, norm_before_fc=True, layer="qwen3"),
}
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
"""float32 rounding: the logits are O(1); speculators' rotary tables are float32, ours float64."""


def speculators_model(
    norm_before_residual: bool,
    layer: str = "llama",
    rope: dict | None = None,
    verifier: str | None = None,
    **flags: bool,
) -> Eagle3DraftModel:
    """A tiny random speculators EAGLE-3 drafter (the norms near 1, a random draft vocabulary)."""
    if layer == "qwen3":
        layer_config = Qwen3Config(**LAYER)
    else:
        layer_config = LlamaConfig(**LAYER, **({"rope_parameters": rope} if rope else {}))
    layer_config._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=AUX_LAYERS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"]),
        ),
        **flags,
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        chosen = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
        model.load_vocab_mappings(_t2d(chosen), chosen - torch.arange(DRAFT_VOCAB))
    return model


def _t2d(chosen: torch.Tensor) -> torch.Tensor:
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[chosen] = True
    return t2d


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(1, LENGTH, 3 * H, generator=gen), torch.randint(0, VOCAB, (1, LENGTH), generator=gen)


@torch.no_grad()
def speculators_logits(model: Eagle3DraftModel) -> list[torch.Tensor]:
    """speculators' draft logits of each TTT pass, read where its forward computes them."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.clone()))
    aux, ids = inputs()
    try:
        model(aux, ids, torch.zeros_like(ids), ttt_steps=STEPS)
    finally:
        hook.remove()
    assert len(captured) == STEPS
    return captured


@torch.no_grad()
def verispec_logits(drafter: Eagle3Drafter) -> list[torch.Tensor]:
    aux, ids = inputs()
    return drafter(aux, ids, steps=STEPS)


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, step=step: f"TTT pass {step}: {m}")


@pytest.fixture
def verifier_folder(tmp_path):
    """A stand-in target folder: speculators' ``from_pretrained`` reads the verifier's config and its
    embeddings/LM head (0.9.0 cannot load an eagle3 checkpoint whose verifier is null)."""
    folder = tmp_path / "verifier"
    folder.mkdir()
    config = LlamaConfig(**{**LAYER, "num_hidden_layers": 4}).to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    weights = {
        "model.embed_tokens.weight": torch.randn(VOCAB, H),
        "lm_head.weight": torch.randn(VOCAB, H),
        "model.norm.weight": torch.ones(H),
    }
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("case", list(CASES))
def test_speculators_checkpoint_drafts_the_same_logits(tmp_path, case):
    model = speculators_model(**CASES[case])
    model.save_pretrained(tmp_path)
    drafter, meta = load_eagle3(tmp_path)
    assert meta.format == "speculators" and meta.speculative_tokens == STEPS
    assert drafter.config.aux_layer_ids == tuple(AUX_LAYERS)
    assert drafter.config.norm_before_residual is CASES[case]["norm_before_residual"]
    assert torch.equal(drafter.to_target_ids(torch.arange(DRAFT_VOCAB)), model.t2d.nonzero()[:, 0])
    assert_same(verispec_logits(drafter), speculators_logits(model))


def load_with_speculators(folder) -> Eagle3DraftModel:
    """``SpeculatorModel.from_pretrained`` on a folder, with SDPA attention (its config parsed by
    speculators' own config class, so the folder's config.json is what is tested)."""
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = SpeculatorModel.from_pretrained(folder, config=config)
    assert isinstance(model, Eagle3DraftModel)
    return model.eval()


@pytest.mark.parametrize("case", ["norm_before_residual", "raw_residual", "qwen3_layer"])
def test_verispec_checkpoint_loads_in_speculators(tmp_path, case, verifier_folder):
    """The reverse: a drafter verispec saves is one speculators loads, with the same logits."""
    model = speculators_model(**CASES[case])
    model.save_pretrained(tmp_path / "original")
    drafter, _ = load_eagle3(tmp_path / "original")
    save_speculators(drafter, tmp_path / "saved", verifier_folder, speculative_tokens=STEPS)
    reloaded = load_with_speculators(tmp_path / "saved")
    assert reloaded.config.norm_before_residual is CASES[case]["norm_before_residual"]
    assert reloaded.config.eagle_aux_hidden_state_layer_ids == AUX_LAYERS
    assert_same(verispec_logits(drafter), speculators_logits(reloaded))
    assert_same(speculators_logits(reloaded), speculators_logits(model))


@pytest.mark.parametrize("case", ["norm_before_residual", "eagle3.1_llama3_rope"])
def test_research_format_round_trip(tmp_path, case):
    """save_sglang -> load_eagle3: the same logits as the speculators model it came from."""
    model = speculators_model(**CASES[case])
    model.save_pretrained(tmp_path / "original")
    drafter, _ = load_eagle3(tmp_path / "original")
    save_sglang(drafter, tmp_path / "sglang")
    reloaded, meta = load_eagle3(tmp_path / "sglang")
    assert meta.format == "research" and reloaded.config == drafter.config
    assert_same(verispec_logits(reloaded), speculators_logits(model))
