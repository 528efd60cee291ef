"""One definition of every setting: the config dataclasses make the CLI's flags, ``verispec.load``'s
keywords, bench's settings and the server's per-request fields, and a refused value names its field
in each of them (the flag, the keyword, OpenAI's ``param``)."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from typing import Any, get_args, get_type_hints

import httpx
import pytest

from verispec.bench.settings import BenchSettings
from verispec.cli import main
from verispec.config import (
    AUTO,
    MAX_SPECULATIVE_TOKENS,
    DraftModelConfig,
    ModelLoadConfig,
    NgramConfig,
    SamplingConfig,
    SchedulerConfig,
    SpecConfig,
)
from verispec.errors import ConfigError
from verispec.settings import (
    LOAD_FLAGS,
    LOAD_SETTINGS,
    SAMPLING_FLAGS,
    SCHEDULER_FLAGS,
    SPEC_FLAGS,
    field_docs,
    setting,
    settings,
)


def shown(value: Any) -> str:
    """A default as ``--help`` writes it."""
    return "none" if value is None else str(value)


def help_defaults(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Each option of ``verispec <argv> --help`` with the default its help states (``default: X``)."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    out: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", text.split("options:", 1)[1]):
        invocation = re.split(r"\s{2,}", block.strip().split("\n")[0])[0]
        stated = re.findall(r"default: ([^)]*)\)", " ".join(block.split()))
        for flag in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", invocation):
            out[flag] = stated[-1] if stated else ""
    return out


# ----------------------------------------------------------------------------------- one definition


def test_every_setting_has_a_flag_and_help_from_its_field() -> None:
    flags = [flag for s in settings().values() for flag in s.flags]
    assert len(flags) == len(set(flags))
    for s in settings().values():
        assert s.help and s.help == field_docs(s.owner)[s.field]
    assert setting("ngram_max").flags == ("--ngram-max",) and setting("ngram_max").owner is NgramConfig
    assert setting("num_speculative_tokens").flags == ("-k", "--num-speculative-tokens")
    assert setting("num_speculative_tokens").bounds.le == MAX_SPECULATIVE_TOKENS  # type: ignore[union-attr]
    assert setting("method").default is None and setting("method").user_default == AUTO


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    """A running server over tiny models."""
    from tests.server.harness import live_server, make_engine, tiny_pair

    target, draft = tiny_pair()
    with live_server(make_engine(target, draft, "draft", k=3)) as live:
        yield live


@pytest.fixture(scope="module")
def openapi(server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/openapi.json", timeout=30).json()


def schema_settings(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every request property of the schema that sets a setting, by the setting's name."""
    out: dict[str, dict[str, Any]] = {}
    for model in openapi["components"]["schemas"].values():
        for prop in model.get("properties", {}).values():
            if "x-verispec-setting" in prop:
                out[prop["x-verispec-setting"]] = prop
    return out


def test_help_and_the_server_schema_list_the_same_settings_with_the_same_defaults(openapi, capsys):
    generate = help_defaults(["generate"], capsys)
    serve = help_defaults(["serve"], capsys)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert {"generate", "serve", "bench", "models"} <= set(re.findall(r"\b[a-z]+\b", capsys.readouterr().out))

    for name in (*SPEC_FLAGS, *LOAD_FLAGS, *SAMPLING_FLAGS):
        s = setting(name)
        assert generate[s.flag()] == shown(s.user_default), name
    for name in (*SPEC_FLAGS, *LOAD_FLAGS, *SCHEDULER_FLAGS):
        s = setting(name)
        assert serve[s.flag()] == shown(s.user_default), name

    served = schema_settings(openapi)
    assert set(served) == {"temperature", "top_k", "top_p", "seed", "num_speculative_tokens"}
    for name, prop in served.items():
        s = setting(name)
        # A server-wide setting's field defaults to null, the server's own value; the schema says which.
        default = prop.get("default", prop.get("x-verispec-default"))
        assert shown(default) == generate[s.flag()] == shown(s.default), name
        assert prop["description"].startswith(s.help.replace("None", "null")[:40]), name
        bounds = next(alt for alt in prop["anyOf"] if alt["type"] != "null")
        assert bounds["type"] == {int: "integer", float: "number"}[s.kind]
        if s.bounds is not None and s.bounds.le is not None:
            assert bounds["maximum"] == s.bounds.le, name
    # The protocol's own deliberate extensions, and nothing else, widen a setting's bounds.
    assert next(a for a in served["top_k"]["anyOf"] if a["type"] == "integer")["minimum"] == -1
    per_request_k = next(a for a in served["num_speculative_tokens"]["anyOf"] if a["type"] == "integer")
    assert per_request_k["minimum"] == 0  # 0 decodes one request plainly
    assert next(a for a in served["top_p"]["anyOf"] if a["type"] == "number")["exclusiveMinimum"] == 0


def test_load_keywords_are_the_settings_with_their_defaults() -> None:
    """``verispec.load`` keeps a written-out signature (readable by IDEs, type checkers and the API
    reference); this holds it to the settings, name by name, default by default."""
    from verispec.api import load

    parameters = dict(inspect.signature(load).parameters)
    assert parameters.pop("target").default is inspect.Parameter.empty
    assert set(parameters) == set(LOAD_SETTINGS)
    hints = get_type_hints(load)
    for name, parameter in parameters.items():
        s = setting(name)
        assert parameter.default == s.user_default, name
        allowed = {a for arg in get_args(hints[name]) or (hints[name],) for a in get_args(arg) or (arg,)}
        if s.choices is not None:
            assert set(s.choices) <= allowed, name
        else:
            assert s.kind in allowed, name
        assert (type(None) in allowed) == s.optional, name


def test_bench_restates_the_settings_with_their_defaults_unless_it_says_why(capsys) -> None:
    bench_fields = {f.name: f for f in BenchSettings.__dataclass_fields__.values()}
    restated = [name for name in bench_fields if name in settings()]
    assert {"num_speculative_tokens", "depth", "heads", "tree_nodes", "tree_width", "draft"} <= set(restated)
    docs = field_docs(BenchSettings)
    for name in restated:
        own, served = bench_fields[name].default, setting(name).default
        if name in BenchSettings.OWN_DEFAULTS:
            assert own != served and str(own) in docs[name] and str(served) in docs[name], name
        else:
            assert own == served, name
    bench = help_defaults(["bench"], capsys)
    assert bench["--depth-policy"] == "fixed" and bench["--num-speculative-tokens"] == "5"
    assert bench["--ngram-max"] == str(NgramConfig().max_ngram)


# ------------------------------------------------------------------------- refusals name the field


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: NgramConfig(max_ngram=0), "ngram_max"),
        (lambda: NgramConfig(max_ngram=2, min_ngram=3), "ngram_min"),
        (lambda: DraftModelConfig(p_min=1.0), "draft_p_min"),
        (lambda: SpecConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1), "num_speculative_tokens"),
        (lambda: SpecConfig(depth="deep"), "depth"),  # type: ignore[arg-type]
        (lambda: SpecConfig(method="lookahead"), "method"),  # type: ignore[arg-type]
        (lambda: SpecConfig(tree_width=0), "tree_width"),
        (lambda: SamplingConfig(temperature=float("nan")), "temperature"),
        (lambda: SamplingConfig(top_p=0.0), "top_p"),
        (lambda: SamplingConfig(top_k="5"), "top_k"),  # type: ignore[arg-type]
        (lambda: ModelLoadConfig(quantization="int3"), "quantization"),  # type: ignore[arg-type]
        (lambda: ModelLoadConfig(threads=0), "threads"),
        (lambda: SchedulerConfig(max_waiting=0), "max_waiting"),
        (lambda: BenchSettings(target="x", num_speculative_tokens=0), "num_speculative_tokens"),
    ],
)
def test_a_refused_value_names_its_setting(build, field) -> None:
    with pytest.raises(ConfigError) as refused:
        build()
    assert refused.value.field == field and str(refused.value).startswith(f"{field} ")


def test_load_refuses_a_setting_by_its_keyword_before_any_model_loads() -> None:
    import verispec

    with pytest.raises(ConfigError) as refused:
        verispec.load("no-such-model", ngram_max=0)
    assert refused.value.field == "ngram_max"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "x", "--ngram-max", "0"], "--ngram-max must be >= 1, got 0"),
        (["generate", "--prompt", "x", "--tree-width", "0"], "--tree-width must be >= 1, got 0"),
        (["generate", "--prompt", "x", "--top-k", "-3"], "--top-k must be >= 0, got -3"),
        (["serve", "--max-waiting", "0"], "--max-waiting must be >= 1, got 0"),
        (["bench", "-k", "0"], "--num-speculative-tokens must be between 1 and 64, got 0"),
        (["bench", "--tree-nodes", "0"], "--tree-nodes must be >= 1, got 0"),
    ],
)
def test_the_cli_names_the_flag_of_a_refused_setting(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"verispec: error: {message}"


def test_the_server_answers_a_refused_setting_with_its_field_as_param() -> None:
    from verispec.server.errors import from_verispec_error

    refused = from_verispec_error(ConfigError("num_speculative_tokens", "must be between 1 and 64, got 0"))
    assert (refused.status, refused.param) == (400, "speculation.num_speculative_tokens")
    assert refused.message == "speculation.num_speculative_tokens must be between 1 and 64, got 0"
    assert from_verispec_error(ConfigError("max_new_tokens", "must be >= 1, got 0")).param == "max_tokens"
    assert from_verispec_error(ConfigError("logit_bias", "names token id 9")).param == "logit_bias"
    assert from_verispec_error(ConfigError("prefill_chunk", "must be >= 1")).param is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),  # the schema passes it, the engine not
        ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
        ({"prompt": "hi", "speculation": {"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}},
         "speculation.num_speculative_tokens"),
    ],
)  # fmt: skip
def test_a_live_server_names_the_field_of_a_refused_setting(server, body, param) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"]
