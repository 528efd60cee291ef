"""Proposers, registered by name in :mod:`verispec.proposers.base`: importing this package imports
every built-in proposer module, whose ``@register`` fills the registry, so the look-ups live here
rather than in ``base`` (which the proposer modules import)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verispec.errors import VerispecError
from verispec.proposers import draft_model, eagle, eagle3, hybrid, medusa, ngram, suffix  # noqa: F401 - registers them
from verispec.proposers.base import REGISTRY, Proposer

if TYPE_CHECKING:
    from verispec.config import SpecConfig
    from verispec.models.base import CausalLM


def build_proposer(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer | None:
    """The proposer named by ``spec.method``, or None for plain decoding."""
    if spec.method is None:
        return None
    try:
        factory = REGISTRY[spec.method]
    except KeyError:
        raise VerispecError(
            f"unknown speculation method {spec.method!r}; available: {', '.join(sorted(REGISTRY))}"
        ) from None
    return factory(spec, target, draft)


def registered_methods() -> list[str]:
    """Names of every registered proposer."""
    return sorted(REGISTRY)
