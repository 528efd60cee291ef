"""Proposers, registered by name in :mod:`verispec.proposers.base`; importing this package registers them."""

from verispec.proposers import draft_model, eagle, hybrid, medusa, ngram  # noqa: F401
