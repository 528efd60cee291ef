"""The text the generated workloads are made of: tool schemas, the items users ask about, edit
requests and follow-up questions. Written for this project (Apache-2.0, as verispec).

:mod:`verispec.bench.workloads` turns these into conversations, choosing from each list by a
conversation's index, so the same prompts come out on every machine and nothing here is tuned to a
model. It is a Python module rather than a JSON file so that it ships wherever the package does.

Nothing in here may change without renaming the workload it feeds: results measured on different
text are not comparable.
"""

from __future__ import annotations

from typing import Any

TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money from one currency to another at today's rate.",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "description": "Amount in the source currency"},
                    "from": {"type": "string", "description": "ISO 4217 code of the source currency"},
                    "to": {"type": "string", "description": "ISO 4217 code of the target currency"},
                },
                "required": ["amount", "from", "to"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Direct flights between two airports on a date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string", "description": "IATA code of the departure airport"},
                    "destination": {"type": "string", "description": "IATA code of the arrival airport"},
                    "date": {"type": "string", "description": "Departure date, YYYY-MM-DD"},
                },
                "required": ["origin", "destination", "date"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_stock",
            "description": "Latest price of a stock.",
            "parameters": {
                "type": "object",
                "properties": {"symbol": {"type": "string", "description": "Ticker symbol, e.g. AAPL"}},
                "required": ["symbol"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_local_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Tokyo"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
)
"""The tools every ``tool_calls`` conversation is offered, in OpenAI's function format."""

TOOL_SYSTEM_PROMPT = (
    "You are an assistant that answers by calling tools. These are the tools, one JSON schema per "
    "line (OpenAI function format):\n{tools}\n\n"
    'To call a tool, reply with only one JSON object, {{"name": "<tool name>", "arguments": '
    "{{<arguments>}}}}, and nothing else. The tool's result comes back in the next message."
)
"""The system message of ``tool_calls``; ``{tools}`` becomes :data:`TOOLS`, one compact JSON line each."""

CITIES: tuple[str, ...] = (
    "Paris", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Cairo", "Hanoi", "Lisbon", "Denver",
    "Warsaw", "Perth", "Bogota", "Dublin", "Seoul", "Accra", "Vienna", "Austin", "Manila", "Quito",
    "Helsinki", "Chennai", "Zurich", "Havana",
)  # fmt: skip

CURRENCIES: tuple[str, ...] = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "INR", "BRL")

AMOUNTS: tuple[float, ...] = (120, 75.5, 1999, 42, 310, 8.25, 560, 13.9, 2500, 99.99, 47, 730.4)  # fmt: skip

AIRPORTS: tuple[str, ...] = (
    "JFK",
    "LHR",
    "CDG",
    "NRT",
    "SFO",
    "FRA",
    "AMS",
    "SIN",
    "DXB",
    "SYD",
    "YYZ",
    "MAD",
)

STOCKS: tuple[str, ...] = (
    "AAPL", "MSFT", "GOOGL", "AMZN", "NVDA", "META", "TSLA", "IBM", "ORCL", "INTC", "AMD", "NFLX",
    "ADBE", "CSCO", "QCOM", "SAP",
)  # fmt: skip

WEATHER_CONDITIONS: tuple[str, ...] = ("sunny", "cloudy", "light rain", "heavy rain", "snow", "fog", "windy")

CARRIERS: tuple[str, ...] = ("AF", "BA", "LH", "JL", "UA", "KL", "SQ", "EK")

TOOL_TASKS: dict[str, dict[str, str]] = {
    "get_weather": {
        "first": "Get the current weather in {unit_name} for these {count} cities: {items}. Call "
        "get_weather for one city per reply, in this order, starting with {first}.",
        "next": "Next city: {item}.",
    },
    "convert_currency": {
        "first": "Convert these {count} amounts with convert_currency: {items}. One conversion per "
        "reply, in this order, starting with {first}.",
        "next": "Next: {item}.",
    },
    "search_flights": {
        "first": "Find direct flights for these {count} trips with search_flights: {items}. One "
        "search per reply, in this order, starting with {first}.",
        "next": "Next trip: {item}.",
    },
    "lookup_stock": {
        "first": "Look up the latest price of these {count} stocks with lookup_stock: {items}. One "
        "lookup per reply, in this order, starting with {first}.",
        "next": "Next stock: {item}.",
    },
    "get_local_time": {
        "first": "What time is it now in these {count} cities? Use get_local_time for one city per "
        "reply, in this order: {items}. Start with {first}.",
        "next": "Next city: {item}.",
    },
}
"""What the user says in a ``tool_calls`` conversation: the first turn lists every item, each later
turn names the next one (after the tool's result for the previous one)."""

CODE_EDIT_FIRST = (
    "Implement this function:\n```python\n{prompt}```\nReply with the complete function in one code block."
)
"""The first turn of a ``code_edit`` conversation; ``{prompt}`` is HumanEval's signature and docstring."""

CODE_EDIT_REPLY = " Reply with the whole function again, in one code block."

CODE_EDITS: tuple[str, ...] = (
    "Add type checks at the top that raise TypeError when an argument has the wrong type.",
    "Add an example call and its result to the docstring, in doctest format.",
    "Make it handle empty input (an empty list, string or zero) without raising.",
    "Add logging: log the arguments at DEBUG level on entry, with logging.getLogger(__name__).",
    "Rename the function to `{name}_v2` and update the docstring to match.",
    "Add a short comment above each step saying what it does.",
    "Use more descriptive names for the local variables.",
    "Add a keyword-only argument `strict: bool = False`; when it is true, raise ValueError on invalid input.",
    "Add an early return for the simplest case at the top of the function.",
    "Replace loops with comprehensions or built-in functions where that keeps it readable.",
)
"""The changes a ``code_edit`` conversation asks for, each followed by :data:`CODE_EDIT_REPLY`;
``{name}`` is the function's name."""

FOLLOW_UPS: tuple[str, ...] = (
    "Make it shorter.",
    "Now give a concrete example.",
    "Summarize your answer in three bullet points.",
    "Explain it as you would to a ten-year-old.",
    "What is the weakest point of your answer?",
    "Rewrite your last answer in a more formal tone.",
    "Add one practical tip.",
    "Give the same answer as a numbered list.",
)
"""The generic follow-ups of ``mt_bench_6turn``, after MT-bench's own two turns."""
