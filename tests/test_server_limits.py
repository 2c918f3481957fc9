"""The server against a hostile client (issue 29): slow prompts off the event loop, connections
that never finish a request, bodies that used to give 500, the API key's edge cases, counters of
refused requests. Loopback only; every loop bounded in count, every wait a guard against a hang."""
from __future__ import annotations

import argparse
import http.client
import json
import pathlib
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from pysmoe.cli.serve import Background  # noqa: E402

CONTEXT = 512


def _args(vault, **over):
    base = dict(vault=str(vault), host="127.0.0.1", port=0, api_key=None, model_name="tiny", max_batch=2,
                batching=True, cache_mb=16, kv_mb=None, threads=1, chunk=16, context=CONTEXT,
                max_tokens_limit=64, max_request_kb=64, buffered=False, device="cpu", gpu_cache_mb=None,
                request_timeout=30.0, max_connections=None)
    base.update(over)
    return argparse.Namespace(**base)


def _raw(port, method, path, body=None, headers=None, timeout=30):
    """(status, parsed JSON) of one plain HTTP request; body bytes are sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    try:
        conn.putrequest(method, path)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data or b"")),
                     **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(data)
        r = conn.getresponse()
        payload = r.read()
        return r.status, json.loads(payload) if payload else None
    finally:
        conn.close()


@pytest.fixture(scope="module")
def served(tiny_vault):
    with Background(_args(tiny_vault)) as bg:
        yield bg


def _still_serves(served):
    status, body = _raw(served.port, "POST", "/v1/completions", {"prompt": "still there?", "max_tokens": 2,
                                                                  "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ item 1: off the event loop
def test_tokenising_does_not_hold_the_event_loop(served, monkeypatch):
    """While one prompt is being tokenised (held here until /health has answered), /health
    answers: the tokenizer runs on the prompt threads, not the loop."""
    tok = served.server.tokenizer
    entered, release = threading.Event(), threading.Event()
    encode = tok.encode

    def slow_encode(text):
        if "hold me" in text:
            entered.set()
            release.wait(60)
        return encode(text)

    monkeypatch.setattr(tok, "encode", slow_encode)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_raw(served.port, "POST", "/v1/completions",
                                                               {"prompt": "hold me", "max_tokens": 1})))
    t.start()
    try:
        assert entered.wait(30)
        assert _raw(served.port, "GET", "/health", timeout=10)[0] == 200  # a blocked loop: a timeout here
    finally:
        release.set()
        t.join(60)
    assert result["r"][0] == 200


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_prompt_that_cannot_fit_is_refused_before_tokenising(served, monkeypatch, kind):
    tok = served.server.tokenizer
    seen = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: seen.append(len(text)) or encode(text))
    text = "many words " * 5000  # 55 KB: well over 512 tokens of any BPE of this vocabulary
    if kind == "chat":
        status, body = _raw(served.port, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    else:
        status, body = _raw(served.port, "POST", "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "at least" in body["error"]["message"]
    assert max(seen, default=0) < len(text)  # never tokenised


def test_min_tokens_is_a_lower_bound(tiny_vault):
    import pysmoe
    with pysmoe.open_vault(tiny_vault) as v:
        tok = v.tokenizer
        for text in ["", "a", "hello world", "the quick brown fox " * 50, "ünïcödé ✓ 漢字 " * 20,
                     "<|im_start|>user\nhi<|im_end|>" * 10, "\n\n\t  " * 30]:
            assert tok.min_tokens(text) <= len(tok.encode(text))
        assert tok.min_tokens("abc " * 10000) > 512


# ------------------------------------------------------------------ item 5: 4xx, not 500
@pytest.mark.parametrize("body", [
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",          # over Python's int digit limit
    b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",     # past the parser's recursion
    b'{"prompt": "hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}",       # past MAX_JSON_DEPTH
    b'{"prompt": "a\\ud800b", "max_tokens": 1}',                        # a lone surrogate
    b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 1}',
])
def test_hostile_json_is_a_400(served, body):
    status, payload = _raw(served.port, "POST", "/v1/completions", body)
    assert status == 400, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    _still_serves(served)


def test_a_lone_surrogate_in_a_chat_message_is_a_400(served):
    body = b'{"messages": [{"role": "user", "content": "x\\udc00"}], "max_tokens": 1}'
    status, payload = _raw(served.port, "POST", "/v1/chat/completions", body)
    assert status == 400 and payload["error"]["code"] == "invalid_unicode"


def test_tool_call_arguments_nested_past_the_recursion_limit(served):
    deep = "[" * 20000 + "]" * 20000
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "content": "ok"}]
    status, _ = _raw(served.port, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert status in (200, 400)  # the template decides; never a 500


@pytest.fixture(scope="module")
def served_bad_template(tiny_vault, tmp_path_factory):
    """The tiny vault under a template whose arithmetic fails on what the client sends."""
    d = tmp_path_factory.mktemp("bad_template")
    for f in pathlib.Path(tiny_vault).iterdir():
        (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content == 'type' %}{{ 1 + m.content }}"
        "{% elif m.content == 'overflow' %}{{ 10.0 ** 400 }}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    with Background(_args(d)) as bg:
        yield bg


@pytest.mark.parametrize("content, name", [("type", "TypeError"), ("overflow", "OverflowError")])
def test_a_template_that_raises_is_a_400(served_bad_template, content, name):
    status, body = _raw(served_bad_template.port, "POST", "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert status == 400 and name in body["error"]["message"], body
    _still_serves(served_bad_template)


def test_a_500_does_not_show_the_vault_path(served, monkeypatch):
    where = str(served.vault.path.resolve())

    def broken(job):
        raise RuntimeError(f"cannot read {where}/vault.bin")

    monkeypatch.setattr(served.sched, "submit", broken)
    status, body = _raw(served.port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 500 and body["error"]["type"] == "server_error"
    assert where not in json.dumps(body) and "RuntimeError" in body["error"]["message"]


# ------------------------------------------------------------------ item 8: refusals counted, tools
def test_metrics_count_refused_requests(served):
    before = _raw(served.port, "GET", "/metrics")[1]["rejected"]
    assert _raw(served.port, "POST", "/v1/completions", b"{not json")[0] == 400
    assert _raw(served.port, "POST", "/v1/nothing", {})[0] == 404
    after = _raw(served.port, "GET", "/metrics")[1]["rejected"]
    assert after.get("400", 0) == before.get("400", 0) + 1
    assert after.get("404", 0) == before.get("404", 0) + 1


def test_tools_to_a_template_that_ignores_them_are_refused(served):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    status, body = _raw(served.port, "POST", "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 1})
    assert status == 400 and "does not use tools" in body["error"]["message"]


# ------------------------------------------------------------------ item 7: the API key
def test_an_empty_api_key_is_refused():
    from pysmoe.server.app import Server
    with pytest.raises(ValueError, match="empty API key"):
        Server(None, None, model="m", vocab_size=1, context=8, api_key="")
    r = subprocess.run([sys.executable, "-m", "pysmoe", "serve", "--api-key", "", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key" in r.stderr and "Traceback" not in r.stderr


def test_a_non_ascii_key_is_compared_as_utf8(served):
    served.server.api_key = "clé-ü"
    try:
        def status(raw: bytes):
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
            conn.putrequest("GET", "/v1/models")
            conn.putheader("Authorization", raw)  # bytes go out as they are
            conn.endheaders()
            code = conn.getresponse().status
            conn.close()
            return code

        assert status(b"Bearer " + "clé-ü".encode("utf-8")) == 200
        assert status(b"Bearer " + "clé-ü".encode("latin-1")) == 401
        assert status(b"Bearer") == 401 and status(b"Bearer ") == 401
    finally:
        served.server.api_key = None


# ------------------------------------------------------------------ item 2: connections
_FD_LIMIT = 64


def _limited():
    resource.setrlimit(resource.RLIMIT_NOFILE, (_FD_LIMIT, _FD_LIMIT))


def test_idle_and_half_sent_connections_cannot_starve_the_server(tiny_vault, tmp_path):
    """The server's file limit at 64: 80 connections that send nothing and 10 that send half a
    request head do not stop /health from answering, and a half-sent request is closed after
    --request-timeout."""
    import re
    log = tmp_path / "serve.log"  # a file, not a pipe: a server that logs a lot must not block on it
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "pysmoe", "serve", "--vault", str(tiny_vault), "--port", "0",
                              "--cache-mb", "8", "--max-batch", "1", "--threads", "1", "--request-timeout", "2"],
                             stderr=err, preexec_fn=_limited)
    socks = []
    try:
        for _ in range(1200):  # the vault opens in a second or two; a guard of two minutes
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
            if m or p.poll() is not None:
                break
            time.sleep(0.1)
        assert m, log.read_text()
        port = int(m.group(1))
        for i in range(90):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            if i >= 80:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        status, body = _raw(port, "GET", "/health", timeout=20)
        assert status == 200 and body["status"] == "ok"
        # the last half-sent one is closed by the server: an end of file, not the guard's timeout
        assert socks[-1].recv(1024) == b""
        assert _raw(port, "GET", "/health", timeout=20)[0] == 200
        assert p.poll() is None
    finally:
        for s in socks:
            s.close()
        p.terminate()
        p.wait(60)
    assert "Traceback" not in log.read_text()


def test_a_body_that_never_arrives_is_a_408(tiny_vault):
    with Background(_args(tiny_vault, request_timeout=1.0)) as bg:
        s = socket.create_connection(("127.0.0.1", bg.port), timeout=30)
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\":")
            head = s.recv(4096)
        finally:
            s.close()
        assert head.startswith(b"HTTP/1.1 408"), head[:100]
        assert _raw(bg.port, "GET", "/health")[0] == 200
