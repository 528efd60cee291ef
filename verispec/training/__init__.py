"""Training Medusa heads and EAGLE drafters for a target, and the data they learn from.

This package is apart from the runtime: the drafters themselves (:mod:`verispec.heads`), the
proposers, the engine and the server never import it, and it imports them (``tests/test_layers.py``
holds that). ``verispec train`` and ``verispec distill`` are its command lines.

Modules, in the order data flows through them:

- :mod:`~verispec.training.data`: text sources (ShareGPT, the standard library, distilled replies)
  and the example stream they are tokenized into;
- :mod:`~verispec.training.states`: the target's hidden states of one sequence, as the engine computes them;
- :mod:`~verispec.training.store`: :class:`~verispec.training.store.HiddenStore`, the memory-mapped,
  resumable cache of those states; :mod:`~verispec.training.cache`: which store a target's data
  lives in, checked before reuse, and making it ready;
- :mod:`~verispec.training.prompts`, :mod:`~verispec.training.records`,
  :mod:`~verispec.training.distill`, :mod:`~verispec.training.pack`, :mod:`~verispec.training.keep`:
  self-distillation (the target's own replies, their file, packs kept in git, and their hidden
  states kept while generating);
- :mod:`~verispec.training.config`: :class:`~verispec.training.config.TrainSettings`;
  :mod:`~verispec.training.tokens`: a store's labels and features per position;
- :mod:`~verispec.training.medusa`, :mod:`~verispec.training.eagle`, :mod:`~verispec.training.eagle3`:
  each kind's loss and accuracy (eagle3: an EAGLE-3 drafter in speculators' format);
  :mod:`~verispec.training.loop`: the optimisation loop and warm starts;
- :mod:`~verispec.training.train`: :func:`~verispec.training.train.train_heads` and ``verispec train``.
"""
