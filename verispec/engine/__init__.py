"""The engine: request building, scheduling and the decode step, behind one :class:`SpecEngine`.

- :mod:`~verispec.engine.core`: :class:`SpecEngine`, which wires the parts below together;
- :mod:`~verispec.engine.requests`: prompts and settings become validated :class:`Request` values;
- :mod:`~verispec.engine.scheduler`: the waiting queue, admission into the batch, abort;
- :mod:`~verispec.engine.step`: prefill, then decode: propose -> verify -> commit or roll back ->
  stats, with the propose stage in :mod:`~verispec.engine.drafting` and the commit in
  :mod:`~verispec.engine.commit`;
- :mod:`~verispec.engine.hooks`: the depth policy's cost model and the distillation tap;
- :mod:`~verispec.engine.state`: the request, the running sequence, and what a step reports.
"""

from verispec.engine.core import SpecEngine
from verispec.engine.hooks import HiddenObserver
from verispec.engine.requests import Prompt
from verispec.engine.state import Request, RequestOutput, SeqState, StepReport, TokenLogprobs

__all__ = [
    "HiddenObserver",
    "Prompt",
    "Request",
    "RequestOutput",
    "SeqState",
    "SpecEngine",
    "StepReport",
    "TokenLogprobs",
]
