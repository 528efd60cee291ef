"""Verifiers: decide which draft tokens to keep (see ``rejection`` for the vocabulary)."""

from verispec.verify.rejection import greedy_verify, rejection_sample, verify

__all__ = ["greedy_verify", "rejection_sample", "verify"]
