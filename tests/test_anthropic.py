"""POST /v1/messages driven over loopback by the official `anthropic` client (and raw HTTP for
the exact event stream): a real uvicorn on a free port, the tiny vault."""
from __future__ import annotations

import http.client
import json

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("uvicorn")

from test_server import SCRIPT, Running, _scripted  # noqa: E402

GREEDY = {"temperature": 0}  # the SDK no longer sends sampling fields itself; the server reads them
WEATHER = [{"name": "get_weather", "description": "the weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}]


def _client(served, **kw):
    return anthropic.Anthropic(base_url=served.base_url.rsplit("/v1", 1)[0], api_key=kw.pop("api_key", "unused"),
                               max_retries=0, **kw)


@pytest.fixture(scope="module")
def served(tiny_vault):
    s = Running(tiny_vault, max_batch=2)
    yield s
    s.close()


@pytest.fixture(scope="module")
def served_qwen3(tiny_qwen3_vault):
    """The tiny vault under Qwen3's chat template (tools, thinking)."""
    s = Running(tiny_qwen3_vault, max_batch=2, context=1024)  # room for the tools' descriptions and a reply
    yield s
    s.close()


def _events(served, body, headers=None):
    """(event name, data) of a streamed /v1/messages, read off the wire."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/messages", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    raw = r.read().decode()
    conn.close()
    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def test_a_reply_is_the_chat_completions_reply(served):
    """The same conversation through both APIs: the same greedy text and token counts."""
    c = _client(served)
    r = c.messages.create(model="tiny", max_tokens=12, system="You are terse.",
                          messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
                          extra_body=GREEDY)
    o = served.client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}])
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == o.choices[0].message.content
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (o.usage.prompt_tokens, o.usage.completion_tokens)
    counted = c.messages.count_tokens(model="tiny", system="You are terse.",
                                      messages=[{"role": "user", "content": "Say hi."}])
    assert counted.input_tokens == r.usage.input_tokens


def test_streaming_events_are_anthropics(served):
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}], **GREEDY}
    events = _events(served, body)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8
    whole = _client(served).messages.create(**{k: v for k, v in body.items() if k != "temperature"},
                                            extra_body=GREEDY)
    assert whole.content[0].text == text
    with _client(served).messages.stream(**{k: v for k, v in body.items() if k != "temperature"},
                                         extra_body=GREEDY) as st:
        final = st.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"


def test_thinking_and_tool_use(served_qwen3, monkeypatch):
    _scripted(monkeypatch, served_qwen3, SCRIPT)
    c = _client(served_qwen3)
    kw = dict(model="tiny", max_tokens=100, tools=WEATHER, messages=[{"role": "user", "content": "weather in Paris?"}])
    r = c.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    assert r.content[0].thinking == "The user wants weather."
    assert (r.content[1].name, r.content[1].input) == ("get_weather", {"city": "Paris"})
    assert r.content[1].id.startswith("toolu_") and r.stop_reason == "tool_use"
    with c.messages.stream(**kw) as st:
        kinds = [e.type for e in st]
        final = st.get_final_message()
    assert "thinking" in kinds and "input_json" in kinds
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_tool_results_reach_the_template(served_qwen3):
    """A tool_use / tool_result round renders as the OpenAI tool_calls / tool messages do."""
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "look it up", "signature": ""},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                   {"type": "text", "text": "and tomorrow?"}]}]
    a = _client(served_qwen3).messages.count_tokens(model="tiny", tools=WEATHER, messages=history)
    o = served_qwen3.client.chat.completions.create(model="tiny", max_tokens=1, temperature=0, tools=[
        {"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                          "parameters": WEATHER[0]["input_schema"]}}], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"}])
    assert a.input_tokens == o.usage.prompt_tokens


def test_stop_sequence(served, monkeypatch):
    _scripted(monkeypatch, served, "one two STOP three")
    r = _client(served).messages.create(model="tiny", max_tokens=50, stop_sequences=["STOP"],
                                        messages=[{"role": "user", "content": "count"}])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP"
    assert r.content[0].text == "one two "
    events = _events(served, {"model": "tiny", "max_tokens": 50, "stop_sequences": ["STOP"],
                              "messages": [{"role": "user", "content": "count"}]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


def test_forced_tool_and_json_output_are_enforced(served_qwen3):
    # under a template that shows the model its tools (one that ignores them is refused: test_server_limits)
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    c = _client(served_qwen3)
    for seed in range(3):
        r = c.messages.create(model="tiny", max_tokens=80, tools=WEATHER, messages=[{"role": "user", "content": "?"}],
                              tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                              extra_body={"temperature": 1, "seed": seed})
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
        jsonschema.validate(r.content[0].input, WEATHER[0]["input_schema"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = c.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "?"}],
                          extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}}, "tools"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
])
def test_errors_are_anthropic_shaped(served, body, message):
    status, r = served.raw("POST", "/v1/messages", {"model": "tiny", **body})
    assert status == 400 and r["type"] == "error" and r["error"]["type"] == "invalid_request_error"
    assert message in r["error"]["message"]
    if "max_tokens" in body and body["max_tokens"] < 1000:  # the client checks the others itself
        with pytest.raises(anthropic.BadRequestError) as e:
            _client(served).messages.create(model="tiny", **body)
        assert e.value.body["error"]["type"] == "invalid_request_error"


def test_api_key_by_x_api_key_or_bearer(tiny_vault):
    s = Running(tiny_vault, api_key="sekrit", max_batch=1)
    try:
        ok = _client(s, api_key="sekrit").messages.create(model="tiny", max_tokens=2,
                                                          messages=[{"role": "user", "content": "hi"}])
        assert ok.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as e:
            _client(s, api_key="wrong").messages.create(model="tiny", max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        status, _ = s.raw("POST", "/v1/messages", {"model": "tiny", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]},
                          headers={"Authorization": "Bearer sekrit"})
        assert status == 200
    finally:
        s.close()


def test_a_disconnect_without_streaming_frees_the_slot(served):
    """A non-streamed /v1/messages writes nothing until its end: the server learns of a client that
    went away from the receive channel alone, and must cancel the job. The tiny vault may end a
    reply (end of sequence) before the close reaches the server: such an attempt is retried."""
    import socket
    import time

    body = json.dumps({"model": "tiny", "max_tokens": 250, "temperature": 1.0,
                       "messages": [{"role": "user", "content": "Tell a long story " * 20}]}).encode()
    for _ in range(8):
        served.wait_idle()
        before = served.raw("GET", "/metrics")[1]["requests"]
        with socket.create_connection(("127.0.0.1", served.port)) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 60
            while served.raw("GET", "/health")[1]["running"] == 0:  # until it runs, or has run
                if served.raw("GET", "/metrics")[1]["requests"] != before:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.002)
        served.wait_idle()
        after = served.raw("GET", "/metrics")[1]["requests"]
        if after.get("cancelled", 0) == before.get("cancelled", 0) + 1:
            return
        ended = lambda r: sum(v for k, v in r.items() if k != "admitted")  # outcomes; "admitted" counts starts
        assert ended(after) == ended(before) + 1, (before, after)  # it ended on its own first
    pytest.fail("every attempt's reply ended before the client could disconnect")
