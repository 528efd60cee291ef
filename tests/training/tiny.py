"""Tiny training data and trained heads for tests: the tiny target's own greedy text, so heads have
something learnable (a random model's greedy continuation soon falls into loops), in milliseconds."""

from __future__ import annotations

import numpy as np
import torch

from verispec.config import SchedulerConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.models.hf import HFCausalLM
from verispec.training.config import TrainSettings
from verispec.training.states import target_states
from verispec.training.tokens import TokenData
from verispec.training.train import train_heads


def greedy_texts(target: HFCausalLM, prompts: list[list[int]], length: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (plain decoding, batched)."""
    engine = SpecEngine(target, None, SpecConfig(), scheduler=SchedulerConfig(max_batch_size=64))
    outputs = engine.generate_batch(prompts, max_new_tokens=length)
    return [p + g.token_ids for p, g in zip(prompts, outputs, strict=True)]


def token_arrays(
    target: HFCausalLM, sequences: list[list[int]], heldout_every: int = 5, layers: tuple[int, ...] = ()
) -> dict[str, np.ndarray]:
    """The arrays a :class:`~verispec.training.store.HiddenStore` holds, computed in memory (with
    ``layers``, their normed inputs as ``taps``)."""
    hidden, argmax = [], []
    for ids in sequences:
        h, top = target_states(target, ids, layers)
        hidden.append(h.numpy().astype(np.float16))
        argmax.append(top.numpy())
    starts = np.zeros(len(sequences) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(s) for s in sequences])
    rows = np.concatenate(hidden)
    size = target.hidden_size
    taps = {"taps": rows[:, size:]} if layers else {}
    return {
        **taps,
        "tokens": np.array([t for s in sequences for t in s], dtype=np.int32),
        "labelled": np.ones(int(starts[-1]), dtype=bool),
        "hidden": rows[:, :size],
        "argmax": np.concatenate(argmax).astype(np.int32),
        "starts": starts,
        "heldout": np.arange(len(sequences)) % heldout_every == heldout_every - 1,
    }


def tiny_data(
    target: HFCausalLM, count: int = 150, length: int = 40, seed: int = 0, layers: tuple[int, ...] = ()
) -> TokenData:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (4,), generator=gen).tolist() for _ in range(count)]
    arrays = token_arrays(target, greedy_texts(target, prompts, length), layers=layers)
    return TokenData(arrays, feature_layers=layers)


_TRAINED: dict[tuple[int, str], tuple] = {}


def trained(target: HFCausalLM, kind: str, layers: tuple[int, ...] = (), **overrides: object) -> tuple:
    """(module, draft vocab, report) of heads fitted on :func:`tiny_data`, cached per target and kind;
    ``layers``: an EAGLE drafter fusing those layers' normed inputs (data with their taps)."""
    key = (id(target), kind + repr(layers) + repr(sorted(overrides.items())))
    if key not in _TRAINED:
        settings = dict(kind=kind, num_heads=3, unroll=2, draft_vocab=0, epochs=10, batch_tokens=256, lr=1e-2)
        settings.update(overrides)
        _TRAINED[key] = train_heads(
            target,
            _data(target, layers),
            TrainSettings(**settings),
            progress=False,  # type: ignore[arg-type]
        )
    return _TRAINED[key]


def _data(target: HFCausalLM, layers: tuple[int, ...] = ()) -> TokenData:
    cache = target.__dict__.setdefault("_tiny_heads_data", {})
    if layers not in cache:
        cache[layers] = tiny_data(target, layers=layers)
    return cache[layers]
