"""python -m pysmoe serve: an OpenAI-compatible server over one vault (starlette + uvicorn).

The server itself is pysmoe/server/ (the app, the scheduler, the session pool); this module
turns the options into one, binds the socket and runs uvicorn, or runs it in the background
for tests and benchmarks (Background)."""
from __future__ import annotations

import argparse
import os
import sys

from .args import add_device_args, device_kwargs, mebibytes, positive_float, positive_int


def add_parser(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--vault", help="vault directory (default: the built-in demo vault, a small trained model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--api-key", default=os.environ.get("PYSMOE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics; not empty (default: "
                        "$PYSMOE_API_KEY when set and not empty)")
    p.add_argument("--model-name", default=None, help="the model id /v1/models reports (default: the vault's name)")
    p.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another model name requests may use (repeatable); any other name is answered 404 "
                        "model_not_found")
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="requests decoding at once (one session each); more wait in a queue (default 8)")
    p.add_argument("--no-batching", dest="batching", action="store_false",
                   help="advance running requests one Session.decode_next after another instead of one "
                        "decode_batch pass (the benchmark's baseline; the same ids either way)")
    p.add_argument("--cache-mb", type=mebibytes, default=None,
                   help="retention cache budget in MiB, shared by all requests (default: chosen from "
                        "available memory and the vault, printed at start)")
    p.add_argument("--kv-mb", type=mebibytes, default=None,
                   help="KV cache budget in MiB over all sessions, kept ones included (default: the pool's)")
    p.add_argument("--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--chunk", type=positive_int, default=256,
                   help="prompt tokens prefilled per scheduler step, between decode steps of the running requests")
    p.add_argument("--context", type=positive_int, default=4096,
                   help="KV length per request in tokens (capped by the model's max_position_embeddings)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=4096,
                   help="the largest max_tokens a request may ask for")
    p.add_argument("--max-request-kb", type=positive_int, default=1024, help="the largest request body in KiB (413 over it)")
    p.add_argument("--request-timeout", type=positive_float, default=30.0,
                   help="seconds a client has to send a request's head (else the connection is closed) and, "
                        "again, its body (else 408) (default 30)")
    p.add_argument("--max-connections", type=positive_int, default=None,
                   help="open connections at most; past it a new one closes the longest-idle one (default: "
                        "what the process's file limit leaves room for, at most 1024)")
    p.add_argument("--buffered", action="store_true", help="buffered reads instead of Direct I/O")
    add_device_args(p)


def open_server(args, log=None):
    """Vault, pool, scheduler and Server of the parsed arguments (the scheduler not started); its
    notes to log (default: the sys.stderr of the moment)."""
    log = log or sys.stderr
    from ..demo import ensure_demo_vault
    from ..engine import open_vault
    from ..memory import choose_cache
    from ..server.app import Server
    from ..server.pool import SessionPool
    from ..server.scheduler import Scheduler

    vault = open_vault(args.vault or ensure_demo_vault())
    gpu = device_kwargs(vault, args)
    max_batch = args.max_batch or 8
    if args.cache_mb is None:
        choice = choose_cache(vault, args.context, args.chunk)
        cache_bytes = choice.bytes
        print(f"pysmoe serve: {choice.describe()}", file=log)
    else:
        cache_bytes = int(args.cache_mb * (1 << 20))
    kv = None if args.kv_mb is None else int(args.kv_mb * (1 << 20))
    try:
        pool = SessionPool(vault, max_sessions=max_batch, cache_bytes=cache_bytes, threads=args.threads,
                           kv_budget_bytes=kv, context=args.context, chunk=args.chunk, direct_io=not args.buffered,
                           **gpu)
    except BaseException:
        vault.close()
        raise
    if gpu:
        print(f"pysmoe serve: {pool.sessions[0].backend}", file=log)
    context = min(args.context, vault.config["max_position_embeddings"])
    sched = Scheduler(pool, max_batch=max_batch, context=context, chunk=args.chunk, batching=args.batching)
    model = args.model_name or vault.path.name
    server = Server(sched, vault.tokenizer, model=model, vocab_size=vault.config["vocab_size"], context=context,
                    api_key=args.api_key, max_request_bytes=args.max_request_kb * 1024,
                    max_tokens_limit=args.max_tokens_limit, aliases=getattr(args, "alias", None) or (),
                    request_timeout=_request_timeout(args), model_type=vault.config.get("model_type"))
    return vault, pool, sched, server


def _bind(host: str, port: int):
    import socket
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # listening before the address is printed: a client that connects at once waits in the backlog
    # until uvicorn accepts, rather than being refused (uvicorn listens on it again, harmlessly)
    sock.listen(2048)
    return sock


def _request_timeout(args) -> float:
    return getattr(args, "request_timeout", None) or 30.0  # a Namespace made by hand may lack it


def _uvicorn_config(app, args):
    """uvicorn's settings with the connection bounds of pysmoe.server.http."""
    import uvicorn

    from ..server.http import connection_limits, guarded_h11
    max_connections, backlog = connection_limits(getattr(args, "max_connections", None))
    http = guarded_h11(_request_timeout(args), max_connections)
    return uvicorn.Config(app, log_level="warning", http=http, timeout_keep_alive=5, backlog=backlog), max_connections


def run(args) -> int:
    try:
        import uvicorn

        from ..server.app import build_app
    except ImportError as e:
        print(f"pysmoe serve: needs the 'serve' extra (pip install '.[serve]' in pysmoe's checkout, or "
              f"starlette and uvicorn): {e}", file=sys.stderr)
        return 2
    if args.device != "cuda" and args.gpu_cache_mb is not None:
        print("pysmoe serve: error: --gpu-cache-mb is for --device cuda", file=sys.stderr)
        return 2
    if args.api_key == "":
        print("pysmoe serve: error: --api-key is empty (it would accept 'Authorization: Bearer' with no key); "
              "leave it out to serve without a key", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"pysmoe serve: error: --port {args.port} is out of range", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"pysmoe serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    vault, pool, sched, server = open_server(args)
    sched.start()
    try:
        if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
            print(f"pysmoe serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
        config, max_connections = _uvicorn_config(build_app(server), args)
        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"http://{host}:{sock.getsockname()[1]}"
        print(f"pysmoe serve: {server.model} on {url}/v1 (max batch {sched.max_batch}, context {server.context}, "
              f"{max_connections} connections); chat page {url}/; Ctrl-C stops", file=sys.stderr, flush=True)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        server.close()
        sched.stop()
        pool.close()
        vault.close()
    return 0


class Background:
    """A server of parsed arguments running on threads of this process (tests, benchmarks):
    `with Background(args) as bg: ... bg.port ...`. args.port 0 picks a free port."""

    def __init__(self, args, log=None):
        import threading
        import time

        import uvicorn

        from ..server.app import build_app

        self.vault, self.pool, self.sched, self.server = open_server(args, log=log or open(os.devnull, "w"))
        self.sched.start()
        sock = _bind(args.host, args.port)
        self.host, self.port = args.host, sock.getsockname()[1]
        self.uv = uvicorn.Server(_uvicorn_config(build_app(self.server), args)[0])
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, name="pysmoe-http",
                                       daemon=True)
        self.thread.start()
        while not self.uv.started and self.thread.is_alive():
            time.sleep(0.01)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join()
        self.server.close()
        self.sched.stop()
        self.pool.close()
        self.vault.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
