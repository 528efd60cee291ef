"""Every user-facing setting, made once from the config dataclasses (:mod:`verispec.config`).

A :class:`Setting` is one scalar field of a config dataclass, seen from outside: its public name
(``verispec.load``'s keyword and :attr:`~verispec.errors.ConfigError.field`), its flags, kind,
choices, bounds, default and help (the docstring under the field, read from the source with
:mod:`ast`, so the one text serves the API reference and ``--help`` alike). From them come the
command-line flags of ``generate``, ``serve``, ``bench``, ``train`` and ``distill``
(:func:`add_flags`), the configs a parsed command line stands for (:func:`from_args`), and the
server's per-request fields (:mod:`verispec.server.protocol`). ``verispec.load`` keeps a written-out
signature that IDEs, type checkers and the API reference read as it is; a test holds it to these
settings, name by name and default by default.

This module is the core's: the tools (bench, training) import it, never ``verispec.cli``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, TypeVar

from verispec.config import (
    AUTO,
    METHODS,
    PLAIN,
    Bounds,
    FieldType,
    ModelLoadConfig,
    SamplingConfig,
    SchedulerConfig,
    SpecConfig,
    field_types,
    name_of,
)

C = TypeVar("C")

ROOTS: tuple[type, ...] = (SpecConfig, ModelLoadConfig, SchedulerConfig, SamplingConfig)
"""The configs whose fields are user-facing settings (nested configs, as ``SpecConfig.ngram``, included)."""

ASKED_METHODS: tuple[str, ...] = (AUTO, *METHODS, PLAIN)
"""What a user may ask ``method`` for: the config holds a resolved method (None for ``none``), and
``auto``, the default everywhere a user asks, is resolved for the target by
:func:`verispec.api.default_method`."""


@dataclass(frozen=True)
class Setting:
    """One scalar field of a config dataclass, as the CLI, the API and the server name and type it."""

    name: str
    """Public name: ``verispec.load``'s keyword, the flag's argparse ``dest``, ``ConfigError.field``."""
    owner: type
    """The dataclass whose field it is."""
    field: str
    flags: tuple[str, ...]
    kind: type
    """int, float, str or bool."""
    optional: bool
    """None is a value (it means what the help says)."""
    choices: tuple[Any, ...] | None
    bounds: Bounds | None
    default: Any
    """The field's default, as the config holds it."""
    user_default: Any
    """The default a user gets, on the command line and in ``verispec.load``: ``default``, but
    ``auto`` for the method, which the config holds resolved."""
    help: str
    """The field's docstring as plain text."""

    def flag(self) -> str:
        """The long flag, for messages."""
        return self.flags[-1]


@cache
def settings() -> dict[str, Setting]:
    """Every setting by public name, in the order of the configs' fields."""
    out: dict[str, Setting] = {}
    for root in ROOTS:
        for setting in _walk(root):
            if setting.name in out:
                raise AssertionError(f"two settings are called {setting.name}: see verispec.config.NAMES")
            out[setting.name] = setting
    return out


def setting(name: str) -> Setting:
    return settings()[name]


def names_of(config: type) -> tuple[str, ...]:
    """The public names of ``config``'s settings (its nested configs' included), in field order."""
    return tuple(s.name for s in _walk(config))


def _walk(cls: type) -> list[Setting]:
    docs = field_docs(cls)
    out: list[Setting] = []
    for f in fields(cls):
        kind = field_types(cls)[f.name]
        if not isinstance(kind, FieldType):
            out += _walk(kind)  # a nested config
            continue
        name = name_of(cls, f.name)
        out.append(
            Setting(
                name=name.public,
                owner=cls,
                field=f.name,
                flags=name.flags or ("--" + name.public.replace("_", "-"),),
                kind=kind.kind,
                optional=kind.optional,
                choices=kind.choices,
                bounds=f.metadata.get("bounds"),
                default=f.default if f.default is not MISSING else None,
                user_default=AUTO if name.public == "method" else f.default,
                help=docs.get(f.name, ""),
            )
        )
    return out


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under ``cls``'s fields (the string right after an annotated assignment), as
    plain text: where :mod:`ast` finds them, as the API reference's docstring readers do."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    except OSError:  # installed without sources: flags without help rather than no command line
        return {}
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    out = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = plain(after.value.value)
    return out


def plain(doc: str) -> str:
    """reStructuredText to one line of plain text: roles keep their target's last name, literals
    lose their backquotes."""
    doc = re.sub(r":\w+:`~([^`]*?)`", lambda m: m.group(1).rsplit(".", 1)[-1], doc)
    doc = re.sub(r":\w+:`([^`]*?)`", r"\1", doc)
    return " ".join(doc.replace("``", "").split())


# ------------------------------------------------------------------------------------ command line


SPEC_FLAGS = names_of(SpecConfig)
LOAD_FLAGS = names_of(ModelLoadConfig)
SAMPLING_FLAGS = names_of(SamplingConfig)
SCHEDULER_FLAGS = ("max_batch_size", "max_waiting", "prefix_cache_gb")
"""``prefill_chunk`` stays the engine's: it trades latency within a step, not anything a user sets."""
LOAD_SETTINGS = (*SPEC_FLAGS, *LOAD_FLAGS, *SCHEDULER_FLAGS)
"""The settings ``verispec.load`` takes as keywords, besides ``target``."""


def _method(value: str) -> str:
    """``--method``: a method, ``auto`` or ``none`` (also spelled ``plain``) for plain decoding."""
    if value.lower() in (PLAIN, "plain", ""):
        return PLAIN
    if value not in ASKED_METHODS:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(ASKED_METHODS)}")
    return value


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Iterable[str],
    *,
    restated_by: type | None = None,
) -> None:
    """Add the flags of the settings ``names``.

    A flag takes its setting's type, choices and default, and its help from the field's docstring
    with the bounds and default appended. Bounds are checked when the config is built, not by
    argparse, so a refusal is the one-line :class:`~verispec.errors.ConfigError` that names the flag.
    ``restated_by``: a tool's settings dataclass (:class:`verispec.bench.settings.BenchSettings`)
    whose fields of the same name give a default and help of their own, where the tool measures
    something else than serving does (bench drafts a fixed depth).
    """
    own = field_docs(restated_by) if restated_by is not None else {}
    own_defaults = {f.name: f.default for f in fields(restated_by)} if restated_by is not None else {}
    for name in names:
        s = setting(name)
        default = own_defaults.get(name, s.user_default)
        text = own.get(name) or s.help
        limits = f"{s.bounds.describe()}; " if s.bounds is not None else ""
        extra: dict[str, Any] = {"type": s.kind, "choices": s.choices, "metavar": _METAVARS.get(s.kind)}
        if name == "method":
            extra = {"type": _method, "choices": ASKED_METHODS, "metavar": "METHOD"}
            text += f" One of {', '.join(ASKED_METHODS)}."
        help_text = f"{text} ({limits}default: {_shown(default)})".replace("%", "%%")
        parser.add_argument(*s.flags, dest=name, default=default, help=help_text, **extra)


_METAVARS = {int: "N", float: "X"}
"""Short value names in usage lines (``-k N``); a string keeps its flag's name (``--heads HEADS``)."""


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


def add_target_flag(parser: argparse.ArgumentParser, default: str) -> None:
    """``--target``: the model every command that loads one runs (the target of speculation)."""
    parser.add_argument("--target", default=default, help="registry name, HF folder or .gguf file")


def add_load_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Where and how models run (:class:`~verispec.config.ModelLoadConfig`): every command that loads one."""
    add_flags(parser, LOAD_FLAGS)


def load_config(args: argparse.Namespace) -> ModelLoadConfig:
    """The :class:`ModelLoadConfig` of the flags added by :func:`add_load_flags`."""
    return from_args(ModelLoadConfig, args)


def from_args(cls: type[C], args: argparse.Namespace | Mapping[str, Any]) -> C:
    """``cls`` (nested configs included) from the settings in ``args``, by public name; a setting
    ``args`` lacks keeps its default. Raises :class:`~verispec.errors.ConfigError` as ``cls`` does."""
    given = vars(args) if isinstance(args, argparse.Namespace) else args
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        kind = field_types(cls)[f.name]
        if not isinstance(kind, FieldType):
            values[f.name] = from_args(kind, given)
            continue
        public = name_of(cls, f.name).public
        if public in given:
            values[f.name] = given[public]
    return cls(**values)


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``verispec.load`` given on the command line (every setting the
    command has a flag for); ``verispec.load`` builds and checks the configs from them."""
    return {name: value for name, value in vars(args).items() if name in LOAD_SETTINGS}


def flags_by_dest(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each argparse ``dest`` of ``parser`` and its subcommands with its long flag, for naming a
    refused setting in an error message the way the user typed it."""
    out: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for dest, flag in flags_by_dest(sub).items():
                    out.setdefault(dest, flag)
        elif action.option_strings:
            out.setdefault(action.dest, action.option_strings[-1])
    return out
