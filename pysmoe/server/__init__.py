"""An OpenAI-compatible HTTP server over one vault (`python -m pysmoe serve`), which also speaks
Anthropic's Messages API and serves a chat page.

    schemas.py    request bodies → checked GenerationRequest records; OpenAI error bodies
    pool.py       SessionPool: sessions of the vault sharing one cache, with prefix reuse
    scheduler.py  the engine thread: continuous batching over a SessionPool (decode_batch); each
                  request's session draws its ids with the engine's one sampler, set from the
                  request's fields, so a seeded request gets Session.generate's ids
    text.py       a request's text side (textgen's Generation) and OpenAI's choice shapes
    grammar.py    structured output: a request's llguidance grammar and the token mask it hands
                  the session's sampler before each draw (Session.set_mask)
    app.py        the starlette app: routes, auth, size limits, SSE streaming, metrics
    anthropic.py  POST /v1/messages (and count_tokens) onto the same scheduler, Anthropic's shapes
    page.py       GET / and /static/: the chat page (static/, shipped in the package)
    http.py       uvicorn's h11 protocol with connection bounds (request-head timeout, connection cap)

The `serve` subcommand that builds and runs it (uvicorn) is pysmoe/cli/serve.py; nothing here is
imported by `python -m pysmoe --help`, and starlette, uvicorn and llguidance (the `serve` extra)
are imported when the server starts (llguidance at the first constrained request)."""
