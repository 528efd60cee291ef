"""The cache of target hidden states that heads train on, memory-mapped and resumable.

:class:`HiddenStore` runs the target once over every sequence of the example stream
(:func:`~verispec.training.data.build_examples`) and keeps, per token: its id, whether it is
labelled, the target's hidden state (float16) and the target's argmax next token. Training then
never runs the target again, and the cache is shared by Medusa and EAGLE runs with the same data
settings. It is written incrementally, resumes after an interruption, and grows: asking for more
tokens than it holds computes only the stream's next sequences. Which store a target's data lives
in, and the checks before reusing one, are :mod:`verispec.training.cache`'s.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.heads.identity import TargetIdentity
from verispec.models.quant import lm_head_kind
from verispec.training.data import SOURCES, Cursor, DataSpec, Example, build_examples
from verispec.training.states import lm_head_argmax, target_states


@dataclass
class HiddenStore:
    """Per-token arrays over all sequences laid end to end (memory-mapped ``.npy`` files):

    ``tokens`` int32 [T], ``labelled`` bool [T], ``hidden`` float16 [T, H] (the target's last hidden
    state after each token), with ``DataSpec.feature_layers`` ``taps`` float16 [T, F * H] (those
    layers' normed inputs, or with ``DataSpec.raw_taps`` their raw inputs), ``argmax`` int32 [T] (the
    target's greedy next token after each token), ``starts`` int64 [S + 1] (sequence boundaries),
    ``heldout`` bool [S], ``source`` uint8 [S] (index into :data:`SOURCES`).

    The sequences are a prefix of the example stream (:func:`build_examples`); :meth:`extend` appends
    the next ones, so more data never recomputes the hidden states already cached.
    """

    folder: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    @property
    def tokens(self) -> int:
        return int(self.meta.get("tokens", 0))

    @property
    def cursor(self) -> Cursor:
        return Cursor(**self.meta["cursor"]) if "cursor" in self.meta else Cursor()

    def array(self, name: str, mode: str = "r") -> np.ndarray:
        return np.load(self.folder / f"{name}.npy", mmap_mode=mode)  # type: ignore[arg-type]

    @classmethod
    def open(cls, folder: Path) -> HiddenStore:
        old = folder.with_name(folder.name + ".old")
        if old.is_dir() and not folder.exists():
            old.rename(folder)  # an extension was interrupted between its two renames
        meta_path = folder / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        return cls(folder, meta)

    def extend(
        self,
        examples: list[Example],
        cursor: Cursor,
        identity: TargetIdentity,
        spec: DataSpec,
        hidden_size: int,
        *,
        quantization: str = "none",
        lm_head: str = "float",
    ) -> None:
        """Append ``examples`` (hidden states still to be computed; :meth:`fill` does that).
        ``quantization``: the target's, recorded by a new store (its hidden states depend on it);
        ``lm_head``: the kind of its LM head (:func:`~verispec.models.quant.lm_head_kind`; the argmaxes
        depend on it).

        The grown arrays are written beside the store with the cached part copied in, then swapped in
        by renaming folders, so an interruption leaves the old store or the new one, never a mix.
        """
        if not examples:
            return
        before = self.meta.get("sequences", 0) if self.meta else 0
        old_total = self.tokens if self.meta else 0
        lengths = [len(e.ids) for e in examples]
        starts = np.zeros(before + len(examples) + 1, dtype=np.int64)
        if before:
            starts[: before + 1] = self.array("starts")
        starts[before + 1 :] = old_total + np.cumsum(lengths)
        total = int(starts[-1])
        index = np.arange(len(starts) - 1)
        new = {
            "starts": starts,
            "heldout": index % spec.heldout_every == spec.heldout_every - 1,
            "tokens": np.array([t for e in examples for t in e.ids], dtype=np.int32),
            "labelled": np.array([x for e in examples for x in e.labelled], dtype=bool),
            "source": np.array([SOURCES.index(e.source) for e in examples], dtype=np.uint8),
        }
        grown = self.folder.with_name(self.folder.name + ".next")
        if grown.exists():
            shutil.rmtree(grown)
        grown.mkdir(parents=True)
        for name in ("tokens", "labelled", "source"):
            old = np.asarray(self.array(name)) if before else np.zeros(0, dtype=new[name].dtype)
            np.save(grown / f"{name}.npy", np.concatenate([old, new[name]]))
        np.save(grown / "starts.npy", starts)
        np.save(grown / "heldout.npy", new["heldout"])
        filled = self.filled() if before else np.zeros(0, dtype=bool)
        np.save(grown / "filled.npy", np.concatenate([filled, np.zeros(len(examples), dtype=bool)]))
        prompts = self.prompt_lengths() if before else np.zeros(0, dtype=np.int32)
        np.save(
            grown / "prompts.npy",
            np.concatenate([prompts, [e.prompt_len for e in examples]]).astype(np.int32),
        )
        taps = len(spec.feature_layers)
        for name, shape, dtype in (
            ("hidden", (total, hidden_size), np.float16),
            *((("taps", (total, taps * hidden_size), np.float16),) if taps else ()),
            ("argmax", (total,), np.int32),
        ):
            out = np.lib.format.open_memmap(grown / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
            if before:
                cached = self.array(name)
                for a in range(0, old_total, 65536):
                    out[a : min(a + 65536, old_total)] = cached[a : min(a + 65536, old_total)]
            out.flush()
            del out
        meta = self.meta or {
            "target": identity.to_dict(),
            "quantization": quantization,
            "lm_head": lm_head,
            "data": {k: v for k, v in spec.to_dict().items() if k != "max_tokens"},
            "done": 0,
            "seconds": 0.0,
            "cpu_seconds": 0.0,
        }
        by_source = dict(meta.get("tokens_by_source", {}))
        for e in examples:
            by_source[e.source] = by_source.get(e.source, 0) + len(e.ids)
        meta.update(
            sequences=len(starts) - 1,
            tokens=total,
            tokens_by_source=by_source,
            labelled_tokens=int(meta.get("labelled_tokens", 0)) + int(new["labelled"].sum()),
            cursor=cursor.to_dict(),
            complete=False,
        )
        text = json.dumps(meta, indent=1) + "\n"
        (grown / "meta.json").write_text(text)
        old_folder = self.folder.with_name(self.folder.name + ".old")
        if old_folder.exists() and self.folder.exists():
            shutil.rmtree(old_folder)  # left by an extension interrupted after its swap
        if self.folder.exists():
            self.folder.rename(old_folder)
        grown.rename(self.folder)
        if old_folder.exists():
            shutil.rmtree(old_folder)
        self.meta = json.loads(text)

    @property
    def lm_head(self) -> str:
        """The kind of LM head its argmaxes are from (stores made before it was kept: the int8 head
        the quantized paths all had then)."""
        default = "int8" if self.meta.get("quantization") in ("int8", "int4") else "float"
        return str(self.meta.get("lm_head", default))

    def recompute_argmax(self, target: Any, *, progress: bool = True) -> None:
        """The filled sequences' argmaxes again, through ``target``'s LM head, from the states kept.

        Why: the int4 path's LM head became int4 on AVX2 CPUs, and a store filled beside
        the int8 one would mix two targets' greedy tokens (in accuracies, ``--labels target``, and
        the states ``verispec distill --keep-hidden`` adds). The states are float16 here, so at a
        near-tie the token may differ from the one the engine picked from the float32 row."""
        from tqdm import tqdm

        starts, filled = self.array("starts"), self.filled()
        hidden, argmax = self.array("hidden"), self.array("argmax", "r+")
        lengths = np.diff(np.asarray(starts))
        head = lm_head_kind(target)
        bar = tqdm(
            total=int(lengths[filled].sum()), unit="tok", desc=f"argmax under the {head} LM head",
            disable=not progress,
        )  # fmt: skip
        for s in np.flatnonzero(filled):
            a, b = int(starts[s]), int(starts[s + 1])
            rows = torch.from_numpy(np.asarray(hidden[a:b], dtype=np.float32))
            argmax[a:b] = lm_head_argmax(target, rows).numpy()
            bar.update(b - a)
        bar.close()
        argmax.flush()
        del argmax
        self.meta["lm_head"] = head
        self._write_meta()

    def filled(self) -> np.ndarray:
        """``[S]`` bool: which sequences hold their hidden states (stores made before the mask was
        kept hold them for their first ``done`` sequences)."""
        if (self.folder / "filled.npy").is_file():
            return np.load(self.folder / "filled.npy")
        return np.arange(int(self.meta.get("sequences", 0))) < int(self.meta.get("done", 0))

    def prompt_lengths(self) -> np.ndarray:
        """``[S]`` int32: each distilled reply's prompt tokens (0: prefilled whole, as every sequence
        of a store made before they were kept)."""
        if (self.folder / "prompts.npy").is_file():
            return np.load(self.folder / "prompts.npy")
        return np.zeros(int(self.meta.get("sequences", 0)), dtype=np.int32)

    def recover_prompt_lengths(self, spec: DataSpec) -> bool:
        """For a store made before prompt lengths were kept: its distilled replies' prompt lengths,
        read again from the file (the example stream does not depend on how it was read, so it lines
        up; checked against every sequence's length). False where it cannot line up."""
        count = int(self.meta.get("sequences", 0))
        if (
            not count
            or spec.sources != ("distilled",)
            or spec.skip_tokens
            or (self.folder / "prompts.npy").is_file()
        ):
            return False
        examples, _ = build_examples(None, spec, self.tokens, Cursor(), progress=False)
        lengths = np.diff(np.asarray(self.array("starts")))
        if len(examples) < count or [len(e.ids) for e in examples[:count]] != lengths.tolist():
            return False
        np.save(
            self.folder / "prompts.npy", np.array([e.prompt_len for e in examples[:count]], dtype=np.int32)
        )
        return True

    def put(self, rows: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Write sequences' states computed elsewhere (``verispec distill --keep-hidden``): ``rows``
        maps a sequence index to its hidden ``[n, H]`` and argmax ``[n]``, n its length. :meth:`fill`
        then skips them; the store is complete once every sequence is filled."""
        if self.feature_layers:
            raise VerispecError("hidden states kept while generating carry no feature layers (taps)")
        starts = self.array("starts")
        hidden, argmax = self.array("hidden", "r+"), self.array("argmax", "r+")
        filled = self.filled()
        for s, (h, top) in rows.items():
            a, b = int(starts[s]), int(starts[s + 1])
            if h.shape != (b - a, hidden.shape[1]) or top.shape != (b - a,):
                raise ValueError(f"sequence {s} has {b - a} tokens, got states {h.shape} / {top.shape}")
            hidden[a:b] = h.astype(np.float16)
            argmax[a:b] = top
            filled[s] = True
        hidden.flush()
        argmax.flush()
        del hidden, argmax
        self._save_filled(filled)

    def _save_filled(self, filled: np.ndarray) -> None:
        tmp = self.folder / "filled.tmp.npy"
        np.save(tmp, filled)
        tmp.replace(self.folder / "filled.npy")
        done = int(np.argmin(filled)) if not filled.all() else len(filled)  # the first one still to fill
        self.meta.update(done=done, complete=bool(filled.all()))
        self._write_meta()

    def sequences_for(self, max_tokens: int) -> int:
        """How many of the first sequences cover ``max_tokens`` tokens (all, if the store is short)."""
        starts = self.array("starts")
        return min(len(starts) - 1, int(np.searchsorted(starts, max_tokens, side="left")))

    def arrays(self, max_tokens: int | None = None) -> dict[str, np.ndarray]:
        """The arrays of the first sequences covering ``max_tokens`` (all when None), memory-mapped."""
        count = len(self.array("starts")) - 1 if max_tokens is None else self.sequences_for(max_tokens)
        starts = self.array("starts")[: count + 1]
        end = int(starts[-1])
        names = ("tokens", "labelled", "hidden", "argmax") + (("taps",) if self.feature_layers else ())
        out = {name: self.array(name)[:end] for name in names}
        return {**out, "starts": starts, "heldout": self.array("heldout")[:count]}

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.meta.get("data", {}).get("feature_layers", ()))

    @property
    def raw_taps(self) -> bool:
        """Whether the taps are the layers' raw inputs (EAGLE-3) rather than their normed ones."""
        return bool(self.meta.get("data", {}).get("raw_taps", False))

    def summary(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Sequence and token counts of the data :meth:`arrays` returns for ``max_tokens``."""
        arrays = self.arrays(max_tokens)
        count = len(arrays["starts"]) - 1
        lengths = np.diff(np.asarray(arrays["starts"]))
        sources = np.asarray(self.array("source")[:count])
        return {
            "sequences": count,
            "tokens": int(arrays["starts"][-1]),
            "tokens_by_source": {s: int(lengths[sources == i].sum()) for i, s in enumerate(SOURCES)},
            "labelled_tokens": int(np.asarray(arrays["labelled"]).sum()),
        }

    def _write_meta(self) -> None:
        tmp = self.folder / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1) + "\n")
        tmp.replace(self.folder / "meta.json")

    def fill(self, target: Any, *, progress: bool = True, save_every_s: float = 30.0) -> None:
        """Run the target over the sequences not done yet; resumable (progress saved as it goes)."""
        from tqdm import tqdm

        starts = self.array("starts")
        tokens = self.array("tokens")
        hidden = self.array("hidden", "r+")
        layers = self.feature_layers
        raw = {"raw_features": True} if self.raw_taps else {}  # other stores call it as before
        taps = self.array("taps", "r+") if layers else None
        argmax = self.array("argmax", "r+")
        done = int(self.meta["done"])
        filled, prompts = self.filled(), self.prompt_lengths()
        lengths = np.diff(np.asarray(starts))
        bar = tqdm(
            total=int(starts[-1]), initial=int(lengths[filled].sum()), unit="tok",
            desc="target hidden states", disable=not progress,
        )  # fmt: skip
        last_save = began = time.perf_counter()
        began_cpu = time.process_time()  # stands still while the process is stopped (paused jobs)
        seconds = float(self.meta.get("seconds", 0.0))
        cpu_seconds = float(self.meta.get("cpu_seconds", 0.0))
        for s in range(done, len(starts) - 1):
            if filled[s]:  # kept while generating (put)
                continue
            a, b = int(starts[s]), int(starts[s + 1])
            h, top = target_states(target, tokens[a:b].tolist(), layers, int(prompts[s]), **raw)
            hidden[a:b] = h[:, : hidden.shape[1]].numpy().astype(np.float16)
            if taps is not None:
                taps[a:b] = _half(h[:, hidden.shape[1] :], s)
            argmax[a:b] = top.numpy()
            filled[s] = True
            bar.update(b - a)
            now = time.perf_counter()
            if now - last_save > save_every_s:
                self._save_progress(filled, hidden, taps, argmax, seconds + now - began,
                                    cpu_seconds + time.process_time() - began_cpu)  # fmt: skip
                last_save = now
        bar.close()
        now = time.perf_counter()
        self._save_progress(filled, hidden, taps, argmax, seconds + now - began,
                            cpu_seconds + time.process_time() - began_cpu)  # fmt: skip

    def _save_progress(
        self, filled: np.ndarray, hidden: np.ndarray, taps: np.ndarray | None, argmax: np.ndarray,
        seconds: float, cpu_seconds: float,
    ) -> None:  # fmt: skip
        """Flush the arrays, then record which sequences they hold (never the other way round)."""
        hidden.flush()
        if taps is not None:
            taps.flush()
        argmax.flush()
        self.meta.update(seconds=seconds, cpu_seconds=cpu_seconds)
        self._save_filled(filled)


def _half(rows: torch.Tensor, sequence: int) -> np.ndarray:
    """Taps as float16, refused where a value does not fit: a raw residual stream is not normed, and
    a model with outlier activations beyond float16's 65504 would otherwise be cached as infinities
    that a drafter trains on without a word."""
    out = rows.numpy().astype(np.float16)
    if not np.isfinite(out).all():
        raise VerispecError(
            f"sequence {sequence}: tapped states beyond float16's range ({float(rows.abs().max()):.3g}); "
            "this target's taps cannot be cached in float16"
        )
    return out
