import orjson
import pytest

from gateway.protocol.bodies import parse_body
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
    # as vLLM 0.32: best_of is not a field of its requests (ignored, never refused), and an echo without
    # generation (max_tokens 0) runs as one token
    assert parse("completions", {"prompt": "a", "n": 2, "best_of": 3}).sequences_per_prompt == 2
    assert parse("completions", {"prompt": "a", "n": 3, "best_of": 2}).sequences_per_prompt == 3
    assert parse("completions", {"prompt": "a", "echo": True, "max_tokens": 0}).max_tokens == 1


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"content": "x"}]}, "messages[0]"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0]"),
        ("completions", {"prompt": 5}, "prompt"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": [1, True]}, "prompt"),  # a bool is not a token id
        ("completions", {"prompt": [[1], [2, False]]}, "prompt"),
        ("completions", {"prompt": [1, 2.0]}, "prompt"),
        ("completions", {"prompt": "a", "max_tokens": "10"}, "max_tokens"),
        ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "a", "n": True}, "n"),
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


def _chat(*messages: object, **extra: object) -> dict[str, object]:
    return {"messages": list(messages), **extra}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat({"role": "user", "content": [{"type": "text", "text": None}]}), "messages[0].content[0].text"),
        (_chat({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text"),
        (_chat({"role": "user", "content": [{"type": "text", "text": 5}]}), "messages[0].content[0].text"),
        (_chat({"role": "user", "content": [{"type": "input_text", "text": []}]}), "messages[0].content[0].text"),
        (_chat({"role": "user", "content": [123]}), "messages[0].content[0]"),
        (_chat({"role": "user", "content": ["ok", None]}), "messages[0].content[1]"),
        (_chat({"role": "user", "content": [["nested"]]}), "messages[0].content[0]"),
        (_chat({"role": "user", "content": [True]}), "messages[0].content[0]"),
        (_chat({"role": "user", "content": [{"type": 7, "text": "x"}]}), "messages[0].content[0].type"),
        (_chat({"role": "user", "content": "x"}, {"role": "user", "content": "y", "name": 5}), "messages[1].name"),
        (_chat({"role": "assistant", "content": None, "tool_calls": "call"}), "messages[0].tool_calls"),
        (_chat({"role": "assistant", "content": None, "tool_calls": [1]}), "messages[0].tool_calls[0]"),
        (_chat({"role": "user", "content": "x"}, tools=[{"type": "function"}, "f"]), "tools[1]"),
        (_chat({"role": "user", "content": "x"}, tools={"type": "function"}), "tools"),
        (_chat({"role": "user", "content": "x"}, documents=["text"]), "documents[0]"),
        (_chat({"role": "user", "content": "x"}, documents={"text": "t"}), "documents"),
        (_chat({"role": "user", "content": "x"}, chat_template_kwargs=["x"]), "chat_template_kwargs"),
    ],
)
def test_tokenized_chat_fields_are_checked(body: dict[str, object], param: str) -> None:
    """Everything the tokenizer or a chat template reads: a wrong type is a 400 naming it, never a 500 later."""
    with pytest.raises(GatewayError) as err:
        parse("chat", body)
    assert (err.value.status, err.value.type, err.value.param) == (400, "invalid_request_error", param)
    assert set(orjson.loads(err.value.body())["error"]) == {"message", "type", "param", "code"}


def test_valid_content_parts_pass() -> None:
    """Bare strings are text parts to vLLM; media parts are the engine's to judge."""
    parts = [
        {"type": "text", "text": "describe"},
        "and a bare string",
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "refusal", "refusal": "no"},
    ]
    r = parse("chat", _chat({"role": "user", "content": parts, "name": "bob"}, tools=[{"type": "function"}]))
    assert r.messages is not None and r.messages[0]["content"] == parts and r.tools == [{"type": "function"}]
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert parse("chat", _chat({"role": "assistant", "content": None, "tool_calls": [tool_call]})).messages


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ("", "non-empty"),  # vLLM: "Either prompt or prompt_embeds must be provided and non-empty."
        (["a", ""], "prompt[1] is empty"),
        ([""], "prompt[0] is empty"),
        ([[1], []], "prompt[1] is empty"),
        ([[]], "prompt[0] is empty"),
        ([5, -1, 3], "Token id -1"),
        ([[1], [2, -7]], "Token id -7"),
    ],
)
def test_empty_prompts_and_negative_ids_are_400(prompt: object, fragment: str) -> None:
    with pytest.raises(GatewayError) as err:
        parse("completions", {"prompt": prompt})
    assert (err.value.status, err.value.param) == (400, "prompt") and fragment in err.value.message


def test_token_id_zero_is_a_prompt() -> None:
    assert parse("completions", {"prompt": [0]}).prompts == [[0]]


def test_completions_default_to_vllms_16_tokens_and_chat_stays_open() -> None:
    """vLLM's CompletionRequest defaults max_tokens to 16; a chat without one may use the context's rest."""
    assert parse_request("completions", b'{"prompt": "a"}').max_tokens == 16
    assert parse_request("completions", b'{"prompt": "a", "max_tokens": 99}').max_tokens == 99
    assert parse_request("chat", b'{"messages": [{"role": "user", "content": "a"}]}').max_tokens is None
    assert parse_request("completions", b'{"prompt": "a", "min_tokens": 7}').min_tokens == 7


_JSON_ROUTES = [
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}),
    ("completions", {"prompt": "hi"}),
    ("responses", {"input": "hi"}),
    ("messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("pooling", {"input": "hi"}),
    ("score", {"query": "q", "documents": ["d"]}),
    ("invocations", {"prompt": "hi"}),
]


@pytest.mark.parametrize(("kind", "body"), _JSON_ROUTES)
def test_a_priority_of_the_clients_own_is_refused_on_every_json_route(kind: str, body: dict[str, object]) -> None:
    """vLLM's priority scheduling orders its queue and preempts by the body's ``priority``: a client's own
    value would overrule the classes kvgate admits by. vLLM's default (0, or none) passes."""
    for allowed in ({}, {"priority": 0}, {"priority": None}, {"priority": 0.0}, {"priority": False}):
        parse_body(kind, orjson.dumps({**body, **allowed}))  # type: ignore[arg-type]
    for refused in (-5, 3, "1", "0", True, 0.5):
        with pytest.raises(GatewayError) as err:
            parse_body(kind, orjson.dumps({**body, "priority": refused}))  # type: ignore[arg-type]
        assert err.value.status == 400 and err.value.param == "priority"


@pytest.mark.parametrize(("kind", "body"), _JSON_ROUTES)
@pytest.mark.parametrize(
    ("refused", "param", "passes"),
    [
        (
            {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3]}},
            "kv_transfer_params",
            {"kv_transfer_params": None},
        ),
        ({"kv_transfer_params": {}}, "kv_transfer_params", {}),
        ({"ec_transfer_params": {"do_remote_encode": True}}, "ec_transfer_params", {"ec_transfer_params": None}),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds", {"prompt_embeds": None}),
        ({"prompt_embeds": []}, "prompt_embeds", {}),
        (
            {"vllm_xargs": {"kv_transfer_params": "x"}},
            "vllm_xargs.kv_transfer_params",
            {"vllm_xargs": {"kv_transfer_params": None}},
        ),
        ({"vllm_xargs": {"ec_transfer_params": [1]}}, "vllm_xargs.ec_transfer_params", {"vllm_xargs": {"a": 1}}),
    ],
)
def test_engine_controls_are_refused_on_every_json_route(
    kind: str, body: dict[str, object], refused: dict[str, object], param: str, passes: dict[str, object]
) -> None:
    """KV/EC connectors pin blocks and move caches between engines from the transfer parameters (vLLM also reads
    them from ``vllm_xargs``), and prompt embeddings run as tokens kvgate cannot count: a 400 naming the field.
    A null is vLLM's default and passes."""
    with pytest.raises(GatewayError) as err:
        parse_body(kind, orjson.dumps({**body, **refused}))  # type: ignore[arg-type]
    assert (err.value.status, err.value.type, err.value.param) == (400, "invalid_request_error", param)
    assert set(orjson.loads(err.value.body())["error"]) == {"message", "type", "param", "code"}
    parse_body(kind, orjson.dumps({**body, **passes}))  # type: ignore[arg-type]


def test_other_vllm_xargs_pass() -> None:
    assert parse("completions", {"prompt": "a", "vllm_xargs": {"my_extension": 1}}).prompts == ["a"]
    assert parse("completions", {"prompt": "a", "vllm_xargs": None}).prompts == ["a"]


def test_an_empty_prompt_is_400_even_with_prompt_embeds() -> None:
    """vLLM would run the embeddings instead: refused before the prompt is read."""
    with pytest.raises(GatewayError) as err:
        parse("completions", {"prompt": "", "prompt_embeds": "AAAA"})
    assert err.value.param == "prompt_embeds"


_CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # the reviewer's case: chat validation fails on logprobs 5 and vLLM runs the completions batch
        ({"messages": _CHAT, "logprobs": 5, "max_tokens": 1, "prompt": [[1, 2, 3]] * 64}, "messages, prompt"),
        ({"messages": _CHAT, "input": "x"}, "messages, input"),
        ({"prompt": "x", "input": "x"}, "prompt, input"),
        ({"prompt": "x", "query": "q", "documents": ["d"] * 100}, "prompt, query"),
        ({"input": "x", "text_1": "a", "text_2": "b"}, "input, text_1, text_2"),
        ({"input": "x", "data": {"image": "..."}}, "input, data"),
        ({"messages": _CHAT, "prompt": None}, "messages, prompt"),  # present is enough: deny by default
    ],
)
def test_an_invocation_with_the_fields_of_two_request_types_is_400(body: dict[str, object], param: str) -> None:
    """vLLM's /invocations runs the first request type that validates (chat, completions, then the pooling
    types), each allowing extra fields: kvgate would price one type and the engine run another."""
    with pytest.raises(GatewayError) as err:
        parse_body("invocations", orjson.dumps(body))
    assert (err.value.status, err.value.type, err.value.param) == (400, "invalid_request_error", param)
    assert set(orjson.loads(err.value.body())["error"]) == {"message", "type", "param", "code"}


def test_an_invocation_of_one_request_type_is_read_as_that_type() -> None:
    chat = parse_body("invocations", orjson.dumps({"messages": _CHAT, "max_tokens": 3}))
    assert (chat.endpoint, chat.messages, chat.max_tokens) == ("chat", _CHAT, 3)
    rag = parse_body("invocations", orjson.dumps({"messages": _CHAT, "documents": [{"text": "a doc"}]}))
    assert rag.endpoint == "chat"  # a chat's documents (RAG templates): no scoring field
    completions = parse_body("invocations", orjson.dumps({"prompt": [[1, 2], [3]], "max_tokens": 2}))
    assert (completions.endpoint, completions.prompts, completions.max_tokens) == ("completions", [[1, 2], [3]], 2)
    pooling = parse_body("invocations", orjson.dumps({"input": ["a", "b"]}))
    assert (pooling.prompts, pooling.max_tokens) == (["a", "b"], 0)
    with pytest.raises(GatewayError) as err:  # scoring through /invocations is not priced: refused
        parse_body("invocations", orjson.dumps({"query": "q", "documents": ["d"]}))
    assert err.value.status == 400


def test_stream_interval_is_read_as_vllm_reads_it() -> None:
    """Tokens per streamed event (vLLM's ``stream_interval``, at least 1): kvgate counts a stream's progress by
    its events."""
    assert parse("completions", {"prompt": "a"}).stream_interval == 1
    assert parse("chat", {"messages": [{"role": "user", "content": "a"}], "stream_interval": 8}).stream_interval == 8
    for bad in (0, -1, "8", 2.5):
        with pytest.raises(GatewayError) as err:
            parse("completions", {"prompt": "a", "stream_interval": bad})
        assert err.value.param == "stream_interval"


def test_a_pooling_body_with_both_input_and_messages_is_400() -> None:
    """vLLM 0.32 runs ``{"input": "hi", "messages": [<a long chat>]}`` on /v1/embeddings or /pooling as the
    chat (its union of request types picks the one with more fields set): priced by ``input``, the long chat
    went to the engine as a two-token prompt."""
    chat = [{"role": "user", "content": "long " * 500}]
    with pytest.raises(GatewayError) as err:
        parse_body("pooling", orjson.dumps({"model": "m", "input": "hi", "messages": chat}))
    assert (err.value.status, err.value.param) == (400, "input, messages")
    assert parse_body("pooling", orjson.dumps({"model": "m", "messages": chat})).messages == chat
    assert parse_body("pooling", orjson.dumps({"model": "m", "input": "hi"})).prompts == ["hi"]


@pytest.mark.parametrize(
    "body",
    [
        {"text_1": "a", "text_2": "b", "queries": ["q"] * 3, "documents": ["d"] * 3},
        {"queries": ["q"], "documents": ["d"], "items": ["i"] * 5},
        {"query": "q", "items": ["i"]},
    ],
)
def test_a_score_body_with_the_fields_of_two_pairs_is_400(body: dict[str, object]) -> None:
    """vLLM 0.32 runs the first of these as queries x documents: priced as text_1 against the documents, the
    queries' size went unpriced."""
    with pytest.raises(GatewayError) as err:
        parse_body("score", orjson.dumps({"model": "m", **body}))
    assert err.value.status == 400 and err.value.param == ", ".join(sorted(k for k in body))


def test_each_score_pair_alone_is_read() -> None:
    for body in (
        {"query": "q", "documents": ["d", "e"]},
        {"queries": ["q", "r"], "documents": ["d", "e"]},
        {"queries": "q", "items": ["i", "j"]},
        {"text_1": "q", "text_2": ["d", "e"]},
        {"data_1": "q", "data_2": ["d", "e"]},
    ):
        assert len(parse_body("score", orjson.dumps({"model": "m", **body})).prompts) == 2


def test_what_a_chat_template_reads_beyond_the_messages_is_kept_for_the_count() -> None:
    """vLLM hands a chat's template its documents and chat_template_kwargs: they are prompt, so counted. The
    variables kvgate's count sets itself are not the client's to replace."""
    plain = parse("chat", _chat({"role": "user", "content": "x"}))
    assert plain.template_kwargs is None
    docs = [{"title": "a", "text": "b"}]
    body = _chat({"role": "user", "content": "x"}, documents=docs)
    body["chat_template_kwargs"] = {"persona": "p", "messages": [], "add_generation_prompt": False, "documents": []}
    assert parse("chat", body).template_kwargs == {"persona": "p", "documents": docs}


def _audio_form(**fields: str) -> bytes:
    """A transcription request as a client library writes it: multipart, the audio file and form fields."""
    import httpx

    files = {"file": ("a.wav", b"RIFF....WAVEfmt " + bytes(range(256)), "audio/wav")}
    return httpx.Request("POST", "http://x/v1/audio/transcriptions", data=fields, files=files).read()


def test_an_audio_form_that_names_vllm_xargs_is_refused_whatever_its_layout() -> None:
    """vLLM copies an audio request's ``vllm_xargs`` form field into its extra args, where the KV connectors
    read their transfer parameters. kvgate does not parse the form (a parser not vLLM's own reads some layouts
    differently: spaces around '=', a bare LF in a part header, JSON only the stdlib accepts), so the name
    anywhere is refused, and a charset in which it would be other bytes too. Linear in the body."""
    assert parse_body("audio", _audio_form(model="w", language="en")).min_tokens > 0
    for body in (
        _audio_form(model="w", vllm_xargs=orjson.dumps({"kv_transfer_params": {"remote": "x"}}).decode()),
        _audio_form(vllm_xargs='{"my_plugin": 1}'),
        _audio_form(vllm_xargs="not json"),
        b'--b\r\nContent-Disposition: form-data; name = "vllm_xargs"\r\nX-Pad: a\nb\r\n\r\n{"x": NaN}\r\n--b--\r\n',
    ):
        with pytest.raises(GatewayError) as err:
            parse_body("audio", body)
        assert err.value.status == 400 and err.value.param == "vllm_xargs"
    # RFC 2231's encoded name: not the bytes searched for, and some multipart parsers decode it
    for body in (
        b"--b\r\nContent-Disposition: form-data; name*=UTF-8''vllm%5Fxargs\r\n\r\n{\"kv_transfer_params\": 1}\r\n--b--",
        b"--b\r\nContent-Disposition: form-data;NAME *= utf-8''vllm%5fxargs\r\n\r\n{}\r\n--b--",
        # in numbered pieces, which python-multipart (through the stdlib's email parser) joins into one name
        b'--b\r\nContent-Disposition: form-data; name*0="vllm_"; name*1="xargs"\r\n\r\n{}\r\n--b--',
        b"--b\r\nContent-Disposition: form-data; name*0*=UTF-8''vllm%5F; name*1=xargs\r\n\r\n{}\r\n--b--",
    ):
        with pytest.raises(GatewayError) as err:
            parse_body("audio", body)
        assert err.value.status == 400 and err.value.param == "content-disposition"
    # but a file's encoded name (.NET's HttpClient sends filename*= with every file), or a prompt that says
    # "name *", is no field name
    dotnet = (
        b"--b\r\nContent-Disposition: form-data; name=file; filename=a.wav; filename*=utf-8''a.wav\r\n\r\n"
        b"RIFF\r\n--b\r\nContent-Disposition: form-data; name=prompt\r\n\r\nthe name * is a glob\r\n--b--"
    )
    assert parse_body("audio", dotnet).min_tokens > 0
    form = _audio_form(model="w")
    for charset in (b"utf-7", b'"UTF-16"', b"cp500"):
        with pytest.raises(GatewayError) as err:
            parse_body("audio", form, b"multipart/form-data; boundary=x; charset=" + charset)
        assert err.value.param == "content-type"
    assert parse_body("audio", form, b"multipart/form-data; boundary=x; charset=UTF-8").min_tokens > 0
    # 7 MB that almost names it at every turn: one pass (a backtracking search of such a body took hours)
    assert parse_body("audio", b"name=vllm_xarg\r\n\r\n" * 400_000).min_tokens > 0
