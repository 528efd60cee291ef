"""Structured output through the server: OpenAI's ``response_format`` and vLLM's ``structured_outputs``
on a tiny model with a real tokenizer, read by the openai client, whole and streamed, with
speculation on and off (greedy: the same text)."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "animal": {"enum": ["fox", "dog"]}},
    "required": ["n", "animal"],
    "additionalProperties": False,
}
HI = [{"role": "user", "content": "Name an animal."}]


def chat(client: openai.OpenAI, enabled: bool = True, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=60, extra_body={"speculation": {"enabled": enabled}}, **kwargs
    )


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    on, off = chat(client, response_format=fmt), chat(client, enabled=False, response_format=fmt)
    text = on.choices[0].message.content
    value = json.loads(text)
    assert set(value) == {"n", "animal"} and 0 <= value["n"] <= 99 and value["animal"] in ("fox", "dog")
    assert off.choices[0].message.content == text and on.choices[0].finish_reason == "stop"
    assert on.model_extra["verispec"]["stats"]["drafted"] > 0
    chunks = list(chat(client, response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_response_format_json_object(client):
    text = chat(client, response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("wanted", "fits"),
    [
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"regex": r"[a-z]{2,6}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", t) is not None),
        (
            {"grammar": 'start: "fox" | "dog" " " NUM\nNUM: /[0-9]/'},
            lambda t: t == "fox" or re.fullmatch("dog [0-9]", t),
        ),
    ],
    ids=["choice", "regex", "grammar"],
)
def test_structured_outputs_on_completions(client, wanted, fits):
    out = client.completions.create(
        model="tiny", prompt="The quick", max_tokens=30, extra_body={"structured_outputs": wanted}
    )
    assert fits(out.choices[0].text), out.choices[0].text
    streamed = client.completions.create(
        model="tiny",
        prompt="The quick",
        max_tokens=30,
        stream=True,
        extra_body={"structured_outputs": wanted},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
