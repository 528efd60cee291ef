"""The prompts the target answers for self-distillation (``verispec distill``), and how each is
made again from its id.

- chat prompts: the first user turn of ShareGPT conversations, taken from the *end* of the seeded
  order that :mod:`verispec.training.data` consumes from the start, so the two never share a prompt;
- long prompts (``--long``): the first turns too long for a chat prompt (:data:`LONG_CHARS`), so
  that the heads also learn to draft a reply from a long input (summaries, translation, RAG);
- code prompts: a function's signature and docstring from the standard library (raw completion,
  the way HumanEval prompts are given; never HumanEval itself, nor any :mod:`verispec.data` prompt),
  or a method's, shown inside its class's header (``--code-from methods``);
- JSON-mode prompts (``--json``): ShareGPT first turns to answer, and standard-library functions to
  describe, as JSON objects of fixed schemas (:data:`JSON_SCHEMAS`), the reply constrained by the
  engine's structured output as a served ``response_format`` would be.

Every prompt's id names what it was made from (``sharegpt:<index>``, ``stdlib:<module>:<name>``,
``json-answer:...``, ``json-function:...``), so a pack (:mod:`verispec.training.pack`) keeps ids
and code, never ShareGPT's text, and :func:`rebuild_prompt` makes the prompt again.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, TypeGuard

from verispec.errors import VerispecError
from verispec.training.data import iter_sharegpt, iter_stdlib_files, sharegpt_file


@dataclass(frozen=True)
class DistillPrompt:
    """One prompt to answer: ``chat`` (user messages through the chat template) or ``text`` (raw).

    ``schema`` names a :data:`JSON_SCHEMAS` entry the reply is constrained to (JSON mode), or is
    empty; ``text`` is a raw prompt, or the code a JSON-mode prompt describes."""

    id: str
    kind: str
    messages: tuple[tuple[str, str], ...] = ()
    text: str = ""
    schema: str = ""


CHAT_CHARS = (16, 2000)
"""``--chat`` prompts: first turns of this many characters (a question, a short task)."""
LONG_CHARS = (2001, 3000)
"""``--long`` prompts: the first turns ``--chat`` skips for length (an article to summarise, text to
translate, a passage to answer about, code to review), up to what leaves a reply room in a training
sequence (3000 characters are ~700 tokens of the 1024 a store keeps). Heads trained only on short
prompts never learn to draft from a long input, which summaries, RAG and translation lean on."""


def sharegpt_prompts(limit: int, seed: int = 0, chars: tuple[int, int] = CHAT_CHARS) -> list[DistillPrompt]:
    """First user turns of ShareGPT conversations (of ``chars`` characters) from the end of the seeded
    order (see module doc)."""
    conversations = list(iter_sharegpt(sharegpt_file()))
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)  # the same permutation data.py applies to the same list
    out: list[DistillPrompt] = []
    for i in reversed(order):
        prompt = sharegpt_prompt(i, conversations[i], chars)
        if prompt is not None:
            out.append(prompt)
        if len(out) >= limit:
            break
    return out


def sharegpt_prompt(
    index: int, conversation: list[dict[str, str]], chars: tuple[int, int] = CHAT_CHARS
) -> DistillPrompt | None:
    """The prompt ``sharegpt:<index>``: the conversation's first turn where it is a user's of
    ``chars`` characters, else none. Its id is enough to make it again (:mod:`verispec.training.pack`)."""
    first = conversation[0]
    if first["role"] != "user" or not chars[0] <= len(first["content"]) <= chars[1]:
        return None
    return DistillPrompt(f"sharegpt:{index}", "chat", messages=(("user", first["content"]),))


JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "answer": {
        "type": "object",
        "properties": {
            "topic": {"type": "string"},
            "answer": {"type": "string"},
            "key_points": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["topic", "answer", "key_points"],
        "additionalProperties": False,
    },
    "function": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "summary": {"type": "string"},
            "parameters": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {n: {"type": "string"} for n in ("name", "type", "description")},
                    "required": ["name", "type", "description"],
                    "additionalProperties": False,
                },
            },
            "returns": {"type": "string"},
            "raises": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "summary", "parameters", "returns", "raises"],
        "additionalProperties": False,
    },
}
"""JSON-mode prompts' schemas: a chat question answered as an object, and a function described as
one. The heads meet JSON in serving (``response_format``, tool calls) where the grammar writes the
keys (:meth:`~verispec.structured.Constraint.forced`) and the heads must guess the values, text they
never see in ordinary replies."""

_ANSWER_ASK = (
    '\n\nReply with a JSON object: "topic" (a few words), "answer" (your full answer) and '
    '"key_points" (a list of short strings).'
)
_FUNCTION_ASK = (
    "Describe this Python function as a JSON object: its name, a one-line summary, its parameters "
    "(name, type, description), what it returns and the exceptions it raises.\n\n```python\n{code}```"
)


def json_answer_prompt(question: DistillPrompt) -> DistillPrompt:
    """A ShareGPT first turn (:func:`sharegpt_prompt`) asked to be answered in JSON (``answer``)."""
    (role, text), *_ = question.messages
    return DistillPrompt(f"json-answer:{question.id}", "chat", ((role, text + _ANSWER_ASK),), schema="answer")


def json_function_prompt(code: DistillPrompt) -> DistillPrompt:
    """A standard-library code prompt (:func:`stdlib_prompts`) to describe in JSON (``function``)."""
    ask = _FUNCTION_ASK.format(code=code.text if code.text.endswith("\n") else code.text + "\n")
    return DistillPrompt(
        f"json-function:{code.id}", "chat", (("user", ask),), text=code.text, schema="function"
    )


def json_prompts(limit: int, seed: int = 0) -> list[DistillPrompt]:
    """``limit`` JSON-mode prompts, alternating: ShareGPT first turns in an order seeded apart from
    the chat prompts' (so mostly other conversations), and standard-library functions (two per
    file, files in an order seeded apart from the code prompts')."""
    answers = [json_answer_prompt(p) for p in sharegpt_prompts((limit + 1) // 2, seed + 1)]
    functions = [json_function_prompt(p) for p in stdlib_prompts(limit // 2, seed + 1)]
    return [p for pair in zip_longest(answers, functions) for p in pair if p is not None][:limit]


def sharegpt_index(id: str) -> int | None:
    """The ShareGPT conversation a chat prompt's id names (``sharegpt:<i>``, ``json-answer:sharegpt:<i>``)."""
    for prefix in ("sharegpt:", "json-answer:sharegpt:"):
        if id.startswith(prefix) and id.removeprefix(prefix).isdigit():
            return int(id.removeprefix(prefix))
    return None


def made_of_code(id: str, kind: str) -> bool:
    """Whether this prompt is rebuilt from code a pack keeps as ``text`` (a raw completion, or a
    function described in JSON), rather than from a ShareGPT conversation named by its id."""
    return kind == "text" or id.startswith("json-function:")


def rebuildable(id: str, kind: str, text: str) -> bool:
    """Whether :func:`rebuild_prompt` can make this prompt again from what a pack keeps."""
    if made_of_code(id, kind):
        return bool(text)
    return sharegpt_index(id) is not None


def rebuild_prompt(
    id: str, kind: str, text: str, conversation: Callable[[int], list[dict[str, str]] | None]
) -> DistillPrompt | None:
    """The prompt with this id again (None if it cannot be): a raw ``text`` prompt, a ShareGPT one
    (``conversation(index)`` gives that conversation, None past the end), or a JSON-mode one made
    of either (:mod:`verispec.training.pack` keeps ids and code, never ShareGPT text)."""
    if made_of_code(id, kind) and not text:
        return None
    if kind == "text":
        return DistillPrompt(id, "text", text=text)
    if id.startswith("json-function:"):
        return json_function_prompt(DistillPrompt(id.removeprefix("json-function:"), "text", text=text))
    index = sharegpt_index(id)
    found = conversation(index) if index is not None else None
    if found is None:
        return None
    question = sharegpt_prompt(index, found, (CHAT_CHARS[0], LONG_CHARS[1]))  # --chat's or --long's
    if question is None:
        return None
    return json_answer_prompt(question) if id.startswith("json-answer:") else question


CODE_KINDS = ("functions", "methods")
"""What a code prompt completes: a top-level function, or a method inside its class's header."""


def _completable(node: ast.stmt) -> TypeGuard[ast.FunctionDef | ast.AsyncFunctionDef]:
    """An undecorated function with a docstring long enough to say what it does and a body after it."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
        return False
    doc = ast.get_docstring(node)
    return bool(doc) and len(doc) >= 40 and len(node.body) >= 2 and node.body[0].end_lineno is not None


def _parsed(source: str) -> tuple[ast.Module, list[str]]:
    """The module's syntax tree and lines; an empty module where the source does not parse."""
    try:
        return ast.parse(source), source.splitlines(keepends=True)
    except (SyntaxError, ValueError):
        return ast.Module(body=[], type_ignores=[]), []


def _up_to_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return "".join(lines[node.lineno - 1 : node.body[0].end_lineno])


def function_prompts(source: str) -> Iterator[tuple[str, str]]:
    """(name, prompt) for each top-level, undecorated function with a docstring: its source from the
    ``def`` line to the docstring's end, as a HumanEval-style completion prompt."""
    tree, lines = _parsed(source)
    for node in tree.body:
        if _completable(node):
            yield node.name, _up_to_docstring(lines, node)


def method_prompts(source: str) -> Iterator[tuple[str, str]]:
    """(``Class.method``, prompt) for each undecorated method with a docstring of a top-level class:
    the class's header (its ``class`` line(s), without the class body) followed by the method from its
    ``def`` line to the docstring's end. Python 3.11's standard library has about twice as many
    documented methods (3235) as top-level functions (1544), so this is where more code prompts come
    from; the header gives the method the context (``self``, the base classes) its body needs."""
    tree, lines = _parsed(source)
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef) or cls.decorator_list:
            continue
        header = "".join(lines[cls.lineno - 1 : _header_end(lines, cls)]).rstrip() + "\n"
        for node in cls.body:
            if _completable(node):
                yield f"{cls.name}.{node.name}", header + _up_to_docstring(lines, node)


def _header_end(lines: list[str], cls: ast.ClassDef) -> int:
    """The index after the line that ends the ``class`` statement (its bases may span lines; comments
    and the class docstring after it are left out)."""
    for i in range(cls.lineno - 1, cls.body[0].lineno - 1):
        if lines[i].split("#", 1)[0].rstrip().endswith(":"):
            return i + 1
    return cls.lineno


def stdlib_prompts(
    limit: int, seed: int = 0, per_file: int = 2, kind: str = "functions"
) -> list[DistillPrompt]:
    """Code prompts from the standard library's source (tests excluded), files in a seeded order: up to
    ``per_file`` top-level functions (``kind="functions"``) or methods (``"methods"``) from each."""
    if kind not in CODE_KINDS:
        raise VerispecError(f"code prompts complete {' or '.join(CODE_KINDS)}, not {kind!r}")
    prompts_of = function_prompts if kind == "functions" else method_prompts
    out: list[DistillPrompt] = []
    for module, source in iter_stdlib_files(f"distill:{seed}", skip=frozenset({"idlelib"})):
        for name, prompt in list(prompts_of(source))[:per_file]:
            if len(prompt) <= 3000:
                out.append(DistillPrompt(f"stdlib:{module}:{name}", "text", text=prompt))
        if len(out) >= limit:
            break
    return out[:limit]
