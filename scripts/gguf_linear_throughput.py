"""Throughput of the GGUF kernel on a model's own decoder linears, in multiply-adds per second.

Why: a change to ``verispec/models/kernels/gguf_linear.cpp`` should be judged on the products a
forward actually runs, apart from attention, norms and the Python around them. Two numbers per row
count M:

- ``cold``: every decoder linear once, in forward order, best of 5 sweeps. A 1.5B's ~1 GB of
  weights is past any L3, so M=1 shows the memory-bound decode step and larger M whether the
  weight stream hides behind the products (cold close to hot) or adds to them;
- ``hot``: each linear three times in a row (its weights in cache): the products' own rate, to
  hold against the CPU's peak (AVX-512 VNNI: 64 multiply-adds per cycle and core where the
  products issue once a cycle).

The LM head is left out (decode and verify run it, prefill does not). Example, on the machine's
own threads::

    PYTHONPATH=. python3 scripts/gguf_linear_throughput.py --rows 1,8,16,64 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.config import ModelLoadConfig
from verispec.models import load_model
from verispec.models.gguf_linear import GGUFLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", default="1,8,16,64", help="comma list of row counts M")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.target, ModelLoadConfig(quantization="gguf", threads=args.threads))
    linears = [m for m in model.decoder.layers.modules() if isinstance(m, GGUFLinear)]
    per_row = sum(m.in_features * m.out_features for m in linears)
    kinds = sorted({m.qtype.name for m in linears})
    print(f"{model.name}: {len(linears)} decoder linears ({', '.join(kinds)}), {per_row / 1e9:.3f} G MAC/row")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in {m.in_features for m in linears}}
        cold = min(_sweep(linears, inputs) for _ in range(5))
        hot = 0.0
        for m in linears:
            x = inputs[m.in_features]
            m(x)
            started = time.perf_counter()
            for _ in range(3):
                m(x)
            hot += (time.perf_counter() - started) / 3
        print(
            f"M={rows:4d}  cold {cold * 1e3:8.1f} ms {per_row * rows / cold / 1e9:6.1f} G/s"
            f"  |  hot {hot * 1e3:8.1f} ms {per_row * rows / hot / 1e9:6.1f} G/s"
        )


def _sweep(linears: list[GGUFLinear], inputs: dict[int, torch.Tensor]) -> float:
    """Seconds for one pass over every linear, in order."""
    started = time.perf_counter()
    for m in linears:
        m(inputs[m.in_features])
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
