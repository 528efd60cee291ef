"""Verifiers: decide which draft tokens to keep (see ``rejection`` for the vocabulary).

:func:`make_verifier` picks the engine's one verifier from the config; :func:`verify` is the exact
one, for chains and trees alike.
"""

from verispec.verify.rejection import greedy_verify, rejection_sample, verify_chain
from verispec.verify.tree import verify_tree
from verispec.verify.typical import verify_typical
from verispec.verify.verifier import Verifier, make_verifier, verify

__all__ = [
    "Verifier",
    "greedy_verify",
    "make_verifier",
    "rejection_sample",
    "verify",
    "verify_chain",
    "verify_tree",
    "verify_typical",
]
