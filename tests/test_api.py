"""``verispec.load``: which method a target gets when none is named, and that it really speculates."""

from __future__ import annotations

from pathlib import Path

import pytest

import verispec
from tests.conftest import needs_smollm2, tiny_llama
from verispec.api import default_method
from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.identity import identify
from verispec.heads.io import save_heads, shipped_heads
from verispec.models.hf import HFCausalLM
from verispec.proposers.hybrid import SuffixHybridProposer
from verispec.proposers.suffix import SuffixProposer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 42, 8, 9, 5, 17, 42, 8, 9, 5, 17, 42]
"""Its last tokens occurred before in it: prompt lookup has a continuation to draft at once."""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """The tiny target (``tiny_llama(0)``, as the ``tiny_target`` fixture) as a model folder."""
    folder = tmp_path_factory.mktemp("api") / "tiny-folder"
    tiny_llama(0).save_pretrained(folder)
    return folder


def ship_eagle_heads(root: Path, name: str, model: HFCausalLM) -> None:
    """Untrained EAGLE heads for ``model``, laid out as if shipped for a target called ``name``."""
    drafter = EagleDrafter(EagleConfig.for_target(model))
    save_heads(root / name / "eagle", "eagle", drafter, identify(model), None)


def test_without_shipped_heads_the_default_is_suffix_decoding(tiny_target):
    assert shipped_heads(tiny_target.name, "eagle") is None
    assert default_method(tiny_target) == "suffix"


def test_a_given_draft_model_is_the_default(tiny_target):
    assert default_method(tiny_target, draft="some-draft") == "draft"


def test_shipped_eagle_heads_make_eagle_with_suffix_decoding_the_default(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr("verispec.heads.io.SHIPPED_DIR", tmp_path)
    ship_eagle_heads(tmp_path, tiny_target.name, tiny_target)
    assert default_method(tiny_target) == "eagle+suffix"
    assert default_method(tiny_target, draft="some-draft") == "draft"


def test_heads_shipped_under_the_name_of_another_model_are_passed_over(tiny_target, tmp_path, monkeypatch):
    """A local folder may carry a bundled model's name: its heads would be refused at load, so the
    default falls back to suffix decoding instead of failing where nothing was asked for."""
    monkeypatch.setattr("verispec.heads.io.SHIPPED_DIR", tmp_path)
    ship_eagle_heads(tmp_path, tiny_target.name, HFCausalLM(tiny_llama(5), name="another"))
    assert default_method(tiny_target) == "suffix"


def test_given_heads_set_the_default(tiny_target, tmp_path):
    ship_eagle_heads(tmp_path, "mine", tiny_target)
    assert default_method(tiny_target, heads=tmp_path / "mine") == "eagle+suffix"
    assert default_method(tiny_target, heads=tmp_path / "mine" / "eagle") == "eagle+suffix"
    with pytest.raises(VerispecError, match="no eagle or medusa heads"):
        default_method(tiny_target, heads=tmp_path)


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
def test_the_bundled_targets_with_heads_have_eagle_heads_shipped(name):
    assert shipped_heads(name, "eagle") is not None


def test_load_without_a_method_speculates_and_equals_plain(tiny_folder, flat_costs):
    engine = verispec.load(tiny_folder, costs=flat_costs)
    assert engine.spec.method == "suffix" and isinstance(engine.proposer, SuffixProposer)
    assert engine.spec.depth == "adaptive"
    spec = engine.generate(PROMPT, max_new_tokens=32)
    plain = engine.plain_engine().generate(PROMPT, max_new_tokens=32)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_drafted > 0 and spec.stats.num_accepted > 0
    assert spec.stats.num_steps < plain.stats.num_steps


def test_load_takes_shipped_eagle_heads_by_default(tiny_folder, flat_costs, tmp_path, monkeypatch):
    monkeypatch.setattr("verispec.heads.io.SHIPPED_DIR", tmp_path)
    ship_eagle_heads(tmp_path, tiny_folder.name, HFCausalLM(tiny_llama(0), name="tiny"))
    engine = verispec.load(tiny_folder, costs=flat_costs)
    assert engine.spec.method == "eagle+suffix" and isinstance(engine.proposer, SuffixHybridProposer)
    spec = engine.generate(PROMPT, max_new_tokens=32)
    assert spec.token_ids == engine.plain_engine().generate(PROMPT, max_new_tokens=32).token_ids
    assert spec.stats.num_drafted > 0


@pytest.mark.parametrize("method", ["none", None])
def test_method_none_decodes_plainly(tiny_folder, method):
    engine = verispec.load(tiny_folder, method=method)
    assert engine.spec.method is None and engine.proposer is None
    assert engine.generate(PROMPT, max_new_tokens=8).stats.num_drafted == 0


def test_a_draft_without_a_method_drafts_with_it(tiny_folder):
    engine = verispec.load(tiny_folder, draft=tiny_folder, depth="fixed")
    assert engine.spec.method == "draft" and engine.draft is not None


def test_an_unknown_method_is_refused_before_any_model_loads():
    with pytest.raises(VerispecError, match="unknown method 'bogus'"):
        verispec.load("no-such-model", method="bogus")  # type: ignore[arg-type]


@needs_smollm2
@pytest.mark.slow
def test_smollm2_gets_its_shipped_eagle_heads_with_lookup_by_default():
    engine = verispec.load("smollm2-135m-instruct")
    assert engine.spec.method == "eagle+suffix" and isinstance(engine.proposer, SuffixHybridProposer)
