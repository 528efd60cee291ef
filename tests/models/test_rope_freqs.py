"""Llama 3's per-frequency RoPE divisors: the ``llama3`` parameters that state them, and the model's
frequencies set from them, against transformers' own Llama 3 RoPE scaling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRotaryEmbedding

from verispec.errors import VerispecError
from verispec.models.rope_freqs import (
    LLAMA_3_1,
    llama3_divisors,
    llama3_parameters,
    set_frequencies,
    state_in_config,
    wavelengths,
)

LLAMA_3_2 = {**LLAMA_3_1, "factor": 32.0}  # Llama 3.2 1B/3B's config.json


def tiny_config(head_dim: int = 64, **rope: object) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64, hidden_size=2 * head_dim, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, **rope},
    )  # fmt: skip


def transformers_frequencies(params: dict, head_dim: int = 64) -> torch.Tensor:
    return LlamaRotaryEmbedding(tiny_config(head_dim, **params)).inv_freq


def file_divisors(params: dict, head_dim: int = 64) -> np.ndarray:
    """What llama.cpp's converter writes to rope_freqs.weight for ``params`` (float32)."""
    return llama3_divisors(params, wavelengths(500000.0, head_dim)).astype(np.float32)


@pytest.mark.parametrize("params", [LLAMA_3_1, LLAMA_3_2], ids=["llama-3.1", "llama-3.2"])
def test_divisors_are_transformers_llama3_scaling(params):
    unscaled = transformers_frequencies({})
    want = transformers_frequencies(params)
    assert not torch.allclose(unscaled, want)  # the scaling changes the low frequencies
    got = unscaled / torch.from_numpy(file_divisors(params))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("params", [LLAMA_3_1, LLAMA_3_2, {**LLAMA_3_1, "high_freq_factor": 2.0}])
def test_parameters_fitted_from_the_divisors_are_the_stated_ones(params, head_dim):
    assert llama3_parameters(file_divisors(params, head_dim), 500000.0, head_dim) == params


def test_divisors_that_no_llama3_parameters_give_are_refused():
    divisors = np.linspace(1.0, 3.0, 32, dtype=np.float32)
    with pytest.raises(VerispecError, match="not Llama 3's RoPE scaling"):
        llama3_parameters(divisors, 500000.0, 64)
    with pytest.raises(VerispecError, match="16 divisors for a head of 64"):
        llama3_parameters(divisors[:16], 500000.0, 64)


def test_state_in_config_is_required_only_where_asked():
    config = tiny_config()
    assert state_in_config(config, file_divisors(LLAMA_3_2), required=True)
    assert config.rope_parameters == {"rope_theta": 500000.0, **LLAMA_3_2}
    odd = np.linspace(1.0, 3.0, 32, dtype=np.float32)
    config = tiny_config()
    assert not state_in_config(config, odd, required=False)
    assert config.rope_parameters["rope_type"] == "default"
    with pytest.raises(VerispecError, match="not Llama 3's"):
        state_in_config(config, odd, required=True)
    assert state_in_config(config, np.ones(32, dtype=np.float32), required=True)  # nothing to scale
    assert config.rope_parameters["rope_type"] == "default"


def test_set_frequencies_gives_the_model_llama3_rotation():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    reference = LlamaForCausalLM(tiny_config(**LLAMA_3_1)).eval()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (1, 600))
    with torch.no_grad():
        before, want = model(ids).logits, reference(ids).logits
        set_frequencies(model, file_divisors(LLAMA_3_1))
        got = model(ids).logits
    assert (before - want).abs().max() > 100 * (got - want).abs().max()  # the divisors matter here
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_set_frequencies_refuses_a_wrong_count_or_a_model_without_rotation():
    model = LlamaForCausalLM(tiny_config())
    with pytest.raises(VerispecError, match="16 divisors where the model rotates 32"):
        set_frequencies(model, np.ones(16, dtype=np.float32))
    with pytest.raises(VerispecError, match="no rotary embedding"):
        set_frequencies(torch.nn.Sequential(torch.nn.Linear(2, 2)), np.ones(32, dtype=np.float32))
