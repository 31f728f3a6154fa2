import orjson
import pytest

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import parse_request


def parse(endpoint: str, body: object):
    return parse_request(endpoint, orjson.dumps(body))  # type: ignore[arg-type]


def test_chat_fields() -> None:
    r = parse(
        "chat",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert (r.model, r.sequences_per_prompt, r.max_tokens) == ("m", 2, 7)


def test_completion_prompt_forms() -> None:
    assert parse("completions", {"prompt": "a"}).prompts == ["a"]
    assert parse("completions", {"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse("completions", {"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse("completions", {"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert parse("completions", {"prompt": "a", "n": 2, "best_of": 3}).sequences_per_prompt == 3


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"content": "x"}]}, "messages[0]"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0]"),
        ("completions", {"prompt": 5}, "prompt"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": "a", "max_tokens": "10"}, "max_tokens"),
        ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "a", "n": True}, "n"),
        ("completions", {"prompt": "a", "n": 3, "best_of": 2}, "best_of"),
        ("completions", {"prompt": "a", "stream": "yes"}, "stream"),
        ("completions", {"prompt": "a", "stream_options": []}, "stream_options"),
        (
            "chat",
            {"messages": [{"role": "user"}], "stream_options": {"include_usage": "maybe"}},
            "stream_options.include_usage",
        ),
        ("completions", {"prompt": "a", "model": 3}, "model"),
    ],
)
def test_wrong_types_are_400_with_the_param(endpoint: str, body: dict, param: str) -> None:
    with pytest.raises(GatewayError) as err:
        parse(endpoint, body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b"null", b"\xff\xfe"])
def test_malformed_json_is_400(raw: bytes) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request("chat", raw)
    assert err.value.status == 400
    assert set(orjson.loads(err.value.body())["error"]) == {"message", "type", "param", "code"}
