"""verispec against llama.cpp on a Llama 3.1-shaped GGUF, per position, with and without its RoPE divisors.

Why: a Llama 3.1 or 3.2 GGUF keeps its long-context RoPE scaling as ``rope_freqs.weight``, which
transformers' GGUF support drops. This measures what that costs, on a random-weight file of the
test size (:data:`~verispec.bench.synthetic_gguf.LLAMA_SMALL`, weights of std 0.08 so that attention,
and with it the rotation, decides the logits): the share of positions where verispec's top token is
llama.cpp's, and the median largest logit difference, over one random sequence of token ids, for
verispec as it loads the file and for the same model with the rotary frequencies transformers alone
would give it. Needs llama-cpp-python. Example::

    PYTHONPATH=. python3 scripts/llama3_rope_vs_llamacpp.py --out /tmp/rope --tokens 2000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from verispec.bench.synthetic_gguf import LLAMA_SMALL, write_llama_gguf
from verispec.config import ModelLoadConfig
from verispec.models import load_model

SPANS = ((0, 64), (64, 512), (512, 1024), (1024, 2000), (2000, 4000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the file")
    parser.add_argument("--tokens", type=int, default=2000, help="sequence length (at most 4096)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import llama_cpp

    path = write_llama_gguf(args.out / "llama-3.1-small.gguf", shape=LLAMA_SMALL, seed=0, weight_std=0.08)
    n = args.tokens
    ids = [496, *np.random.default_rng(1).integers(0, 496, size=n - 1).tolist()]  # <|begin_of_text|>, bytes
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=4096, n_threads=args.threads, verbose=False, logits_all=True, n_batch=512
    )
    llm.eval(ids)
    reference = np.asarray(llm.scores[:n], dtype=np.float32)
    lm = load_model(str(path), ModelLoadConfig(quantization="gguf", threads=args.threads))
    rotary = lm.model.model.rotary_emb
    dim = LLAMA_SMALL.head_dim
    unscaled = 1.0 / (LLAMA_SMALL.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    for label, freqs in (("verispec", rotary.inv_freq.clone()), ("without rope_freqs", unscaled)):
        rotary.inv_freq = freqs
        with torch.no_grad():
            got = lm.model(torch.tensor([ids])).logits[0].float().numpy()
        for lo, hi in SPANS:
            hi = min(hi, n)
            if lo >= hi:
                continue
            top = (got[lo:hi].argmax(1) == reference[lo:hi].argmax(1)).mean()
            gap = np.median(np.abs(got[lo:hi] - reference[lo:hi]).max(axis=1))
            span = f"positions {lo:4d}-{hi:4d}"
            print(f"{label:20s} {span}: top-1 = llama.cpp's {top:6.1%}, median max |dlogit| {gap:.3f}")


if __name__ == "__main__":
    main()
