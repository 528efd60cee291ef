"""Workloads that repeat structure, built from the shipped data: what cross-request reuse is for.

Real traffic repeats itself in ways single prompts do not show. A coding assistant rewrites the same
file again and again with small changes, so most of each answer is already in the conversation; an
agent calls the same tools over and over, so each call is the previous one with other arguments,
and every request starts with the same long tool list. These workloads reproduce both, so that a
prefix KV cache (later turns resend the whole history) and drafting from earlier outputs (suffix
decoding) can be measured against Spec-Bench, where neither helps much:

- ``code_edit``: each HumanEval problem becomes a chat of 4-6 user turns: implement the function,
  then small changes (type checks, a docstring example, a rename, ...), each asking for the whole
  function again.
- ``tool_calls``: a system message lists :data:`~verispec.data.workloads.TOOLS` (their JSON schemas
  as text, so it works with any chat template, with or without tool support) and asks for each call
  as one JSON object ``{"name": ..., "arguments": {...}}``. The user asks for 5 or 6 similar things
  (the weather in 6 cities, ...); after each answer the conversation gets the tool's result as a
  ``tool`` message, computed from the call's arguments alone (:func:`tool_result`), and the user
  names the next item.
- ``mt_bench_6turn``: MT-bench's two turns followed by four generic follow-ups ("Make it shorter.",
  ...): a six-turn chat for the time to first token of late turns.

Everything is chosen by a conversation's index from fixed lists (:mod:`verispec.data.workloads`),
never by a model or a random draw, so every machine and every method sees the same prompts, and
equal answers (the lossless check) give equal tool results and so equal next turns.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from verispec.bench.datasets import BenchPrompt, Message, read_jsonl
from verispec.data import workloads as text

CODE_EDIT_TURNS = (4, 5, 6)
"""Turns of ``code_edit`` conversation i: ``CODE_EDIT_TURNS[i % 3]``."""
TOOL_CALL_CONVERSATIONS = 60
"""Conversations of ``tool_calls``: 12 per tool, each with other items."""
TOOL_CALL_ITEMS = (6, 5)
"""Items (user turns) of ``tool_calls`` conversation i: ``TOOL_CALL_ITEMS[i % 2]``."""
FOLLOW_UPS_PER_CHAT = 4


def code_edit(root: Path) -> Iterator[BenchPrompt]:
    """HumanEval problem i as a ``code_edit`` chat: implement it, then edits i, i + 1, ... of
    :data:`~verispec.data.workloads.CODE_EDITS` (wrapping), 3-5 of them."""
    edits = text.CODE_EDITS
    for i, row in enumerate(read_jsonl(root / "humaneval" / "HumanEval.jsonl.gz")):
        count = CODE_EDIT_TURNS[i % len(CODE_EDIT_TURNS)] - 1
        changes = [edits[(i + j) % len(edits)].format(name=row["entry_point"]) for j in range(count)]
        yield BenchPrompt(
            dataset="code_edit",
            category="code_edit",
            id=row["task_id"],
            turns=[text.CODE_EDIT_FIRST.format(prompt=row["prompt"])]
            + [change + text.CODE_EDIT_REPLY for change in changes],
            chat=True,
        )


def mt_bench_6turn(root: Path) -> Iterator[BenchPrompt]:
    """MT-bench question i's two turns, then follow-ups i, i + 1, ... of
    :data:`~verispec.data.workloads.FOLLOW_UPS` (wrapping): six turns each."""
    ups = text.FOLLOW_UPS
    for i, row in enumerate(read_jsonl(root / "mt_bench" / "question.jsonl")):
        follow = [ups[(i + j) % len(ups)] for j in range(FOLLOW_UPS_PER_CHAT)]
        yield BenchPrompt(
            dataset="mt_bench_6turn",
            category=row["category"],
            id=str(row["question_id"]),
            turns=[*row["turns"], *follow],
            chat=True,
        )


def tool_calls(root: Path | None = None) -> Iterator[BenchPrompt]:
    """:data:`TOOL_CALL_CONVERSATIONS` tool-calling chats, tool i % 5 in conversation i (so any five
    in a row use every tool); reads no file (``root`` is unused)."""
    system = tool_system_prompt()
    tools = [tool["function"]["name"] for tool in text.TOOLS]
    for i in range(TOOL_CALL_CONVERSATIONS):
        name = tools[i % len(tools)]
        nth = i // len(tools)  # this tool's nth conversation: other items than its earlier ones
        count = TOOL_CALL_ITEMS[i % len(TOOL_CALL_ITEMS)]
        items, unit = _ITEMS[name](nth, count)
        task = text.TOOL_TASKS[name]
        first = task["first"].format(
            count=count, items=", ".join(items), first=items[0], unit_name=unit.capitalize()
        )
        yield BenchPrompt(
            dataset="tool_calls",
            category="tool_calls",
            id=f"{name}-{nth}",
            turns=[first] + [task["next"].format(item=item) for item in items[1:]],
            chat=True,
            system=system,
            feedback=tool_feedback,
        )


def tool_system_prompt() -> str:
    """The system message of every ``tool_calls`` chat: the tools' schemas, one compact JSON line each."""
    lines = "\n".join(json.dumps(tool, separators=(",", ":")) for tool in text.TOOLS)
    return text.TOOL_SYSTEM_PROMPT.format(tools=lines)


def _window(pool: Sequence[Any], nth: int, count: int) -> list[Any]:
    """``count`` consecutive entries of ``pool`` (wrapping), starting where the previous window ended."""
    return [pool[(nth * count + j) % len(pool)] for j in range(count)]


def _cities(nth: int, count: int) -> tuple[list[str], str]:
    return _window(text.CITIES, nth, count), ("celsius", "fahrenheit")[nth % 2]


def _pair(items: Sequence[str], k: int, stride: int, shift: int) -> tuple[str, str]:
    """Item k and another one picked by ``stride`` and ``shift`` (the next one where they would meet):
    a call's two distinct arguments, varied from call to call."""
    first = items[k % len(items)]
    second = items[(k * stride + shift) % len(items)]
    return first, second if second != first else items[(k + 1) % len(items)]


def _amounts(nth: int, count: int) -> tuple[list[str], str]:
    out = []
    for j, amount in enumerate(_window(text.AMOUNTS, nth, count)):
        source, target = _pair(text.CURRENCIES, nth * count + j, 3, 1)
        out.append(f"{amount:g} {source} to {target}")
    return out, ""


def _trips(nth: int, count: int) -> tuple[list[str], str]:
    out = []
    for j in range(count):
        k = nth * count + j
        origin, destination = _pair(text.AIRPORTS, k, 5, 3)
        out.append(f"{origin} to {destination} on 2025-{1 + k % 12:02d}-{1 + (k * 7) % 28:02d}")
    return out, ""


def _stocks(nth: int, count: int) -> tuple[list[str], str]:
    return _window(text.STOCKS, nth, count), ""


def _times(nth: int, count: int) -> tuple[list[str], str]:
    return _window(text.CITIES[::-1], nth, count), ""


_ITEMS: dict[str, Callable[[int, int], tuple[list[str], str]]] = {
    "get_weather": _cities,
    "convert_currency": _amounts,
    "search_flights": _trips,
    "lookup_stock": _stocks,
    "get_local_time": _times,
}
"""Each tool's items for its nth conversation, and the unit its first turn names ('' for none)."""


# ------------------------------------------------------------------------------- the tools' results


def tool_feedback(answer: str) -> list[Message]:
    """The ``tool`` message that follows ``answer`` in a ``tool_calls`` chat: the result of the call
    it makes, or an error saying how to call (so a model that missed the format can recover)."""
    return [{"role": "tool", "content": json.dumps(tool_result(answer), separators=(", ", ": "))}]


def tool_result(answer: str) -> dict[str, Any]:
    """The synthetic result of the tool call in ``answer``, made from its name and arguments alone
    (a hash picks every number), so it is the same for every method that gave the same answer."""
    call = parse_call(answer)
    if call is None:
        return {"error": 'no tool call found; reply with one JSON object {"name": ..., "arguments": {...}}'}
    name, arguments = call
    result = _RESULTS.get(name)
    if result is None:
        return {"error": f"unknown tool {name!r}"}
    return result(arguments, _digest(name, arguments))


def parse_call(answer: str) -> tuple[str, dict[str, Any]] | None:
    """The (name, arguments) of the first JSON object in ``answer`` that has a string ``name``
    (``arguments``, or ``parameters``, as an object or a JSON string); None where there is none.
    Tolerant of text or a code fence around it, as models write."""
    decoder = json.JSONDecoder()
    start = answer.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(answer, start)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = value.get("arguments", value.get("parameters", {}))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = {}
            return value["name"], arguments if isinstance(arguments, dict) else {}
        start = answer.find("{", start + 1)
    return None


def _digest(name: str, arguments: dict[str, Any]) -> int:
    """A number fixed by the call alone (not Python's ``hash``, which changes between processes)."""
    canonical = json.dumps([name, arguments], sort_keys=True, separators=(",", ":"), default=str)
    return int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "big")


def _weather(arguments: dict[str, Any], h: int) -> dict[str, Any]:
    celsius = -5 + h % 36
    unit = arguments.get("unit", "celsius")
    temperature = round(celsius * 9 / 5 + 32) if unit == "fahrenheit" else celsius
    conditions = text.WEATHER_CONDITIONS[(h >> 8) % len(text.WEATHER_CONDITIONS)]
    return {"city": arguments.get("city"), "temperature": temperature, "unit": unit,
            "conditions": conditions, "humidity": 20 + (h >> 16) % 75}  # fmt: skip


def _currency(arguments: dict[str, Any], h: int) -> dict[str, Any]:
    try:
        amount = float(arguments.get("amount"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return {"error": "amount must be a number"}
    rate = round(0.05 + (h % 20000) / 1000, 4)
    return {"amount": amount, "from": arguments.get("from"), "to": arguments.get("to"), "rate": rate,
            "converted": round(amount * rate, 2)}  # fmt: skip


def _flights(arguments: dict[str, Any], h: int) -> dict[str, Any]:
    flights = []
    for n in range(2):
        part = h >> (16 * n)
        flights.append(
            {
                "flight": f"{text.CARRIERS[part % len(text.CARRIERS)]}{100 + (part >> 4) % 900}",
                "departs": f"{6 + (part >> 12) % 16:02d}:{5 * ((part >> 8) % 12):02d}",
                "price_usd": 90 + (part >> 3) % 900,
            }
        )
    route = {key: arguments.get(key) for key in ("origin", "destination", "date")}
    return {**route, "flights": flights}


def _stock(arguments: dict[str, Any], h: int) -> dict[str, Any]:
    return {"symbol": arguments.get("symbol"), "price": round(5 + (h % 90000) / 100, 2),
            "change_pct": ((h >> 20) % 801 - 400) / 100, "currency": "USD"}  # fmt: skip


def _local_time(arguments: dict[str, Any], h: int) -> dict[str, Any]:
    return {"city": arguments.get("city"), "local_time": f"{h % 24:02d}:{(h >> 5) % 60:02d}",
            "utc_offset": (h >> 11) % 27 - 12}  # fmt: skip


_RESULTS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "get_weather": _weather,
    "convert_currency": _currency,
    "search_flights": _flights,
    "lookup_stock": _stock,
    "get_local_time": _local_time,
}
"""Each tool's synthetic implementation: its arguments and their digest to a JSON-ready result."""

READERS: dict[str, Callable[[Path], Iterator[BenchPrompt]]] = {
    "code_edit": code_edit,
    "tool_calls": tool_calls,
    "mt_bench_6turn": mt_bench_6turn,
}
"""Each workload's generator, from the data folder (:func:`verispec.bench.datasets.load_dataset`)."""
