"""Learned drafters that read the target's own hidden states: Medusa heads and an EAGLE layer.

Both draft from the target's last-layer hidden state (after the final norm), which the engine hands
to proposers that set ``needs_hidden``. Both propose *token trees* of deterministic candidates (the
draft's top tokens, no sampling), which :func:`verispec.verify.tree.verify_tree` verifies exactly:
greedy output equals plain greedy output and sampled output follows the target's distribution,
whatever the heads predict. Heads only decide how often a draft is accepted.

Modules:

- :mod:`~verispec.heads.identity`: which target a set of heads was trained for (refused otherwise);
- :mod:`~verispec.heads.vocab`: the target's frozen LM head, restricted to a draft vocabulary;
- :mod:`~verispec.heads.medusa`, :mod:`~verispec.heads.eagle`: the networks;
- :mod:`~verispec.heads.trees`: turning draft scores into a tree-shaped :class:`~verispec.types.Draft`;
- :mod:`~verispec.heads.io`: the on-disk format (safetensors + JSON) and the shipped heads;

Training them (data, the hidden-state cache, self-distillation, the loop) is :mod:`verispec.training`,
which the runtime never imports.
"""
