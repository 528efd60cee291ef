"""The distillation file: JSON lines of the target's replies with their exact token ids.

One record per answered prompt: the prompt (:class:`~verispec.training.prompts.DistillPrompt`'s
fields), ``prompt_ids``, ``completion_ids``, ``completion``, ``finish_reason``, and the target that
wrote it (``target``, ``target_config_sha256``). The file is only ever appended to, so a reader
drops a line an interruption cut off instead of failing on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verispec.errors import VerispecError
from verispec.heads.identity import TargetIdentity

KINDS = ("chat", "text")
"""A record's ``kind``: a prompt given through the chat template, or raw text."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a distillation file; a line cut off by an interruption is dropped.

    Lines end at ``\\n`` only: records are written with ``ensure_ascii=False``, so a prompt's U+2028
    (LINE SEPARATOR) or U+0085 stays raw inside its line, where ``str.splitlines`` would cut it and the
    record would be lost: answered, then never trained on, packed or seen as done."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") in KINDS and record.get("completion_ids"):
            records.append(record)
    return records


def check_file(path: Path, identity: TargetIdentity | None = None) -> list[dict[str, Any]]:
    """The records of ``path``, or a clear error where there are none or (with ``identity``) where
    another model wrote them: its token ids would mean other tokens, or none, to this target."""
    records = read_records(path)
    if not records:
        raise VerispecError(f"{path} holds no distillation records; make it with `verispec distill`")
    if identity is not None:
        for r in records:
            other = r.get("target_config_sha256") not in (None, identity.config_sha256)
            if other or max(r["prompt_ids"] + r["completion_ids"]) >= identity.vocab_size:
                raise VerispecError(
                    f"{path} holds replies of {r.get('target', 'another model')}, not of {identity.name}; "
                    f"make them with `verispec distill --target {identity.name}`"
                )
    return records
