"""Connection limits on uvicorn's h11 protocol: what a production server bounds.

uvicorn closes a kept-alive connection that stays silent for timeout_keep_alive seconds, but not
one that never completes a request: a client that connects and sends nothing, or half a request
head, or trickles a byte now and then, holds a file descriptor for ever, and a few dozen of them
exhaust the process's file limit (accept() fails, and /health stops answering). `guarded_h11`
makes uvicorn's H11Protocol bound both:

  request_timeout   a connection must deliver a complete request head within this many seconds
                    of opening, or of its previous response ending; else it is closed. Data
                    that trickles in does not restart the clock. (The body's own bound is the
                    app's: Server.read_json answers 408.)
  max_connections   past this many open connections, a new one closes the connection that has
                    waited longest without a request in progress (idle, or half-sent); when every
                    connection is busy with a request, the new one is closed at once.
                    connection_limits() sizes it, and the listen backlog, to leave room under
                    RLIMIT_NOFILE for the files the process already holds.
"""
from __future__ import annotations

import os

# files a serving process opens after it starts listening (the event loop, the prompt threads'
# and the engine's descriptors, a log file), kept free of connections
_FD_RESERVE = 32
_MAX_CONNECTIONS = 1024
_MAX_BACKLOG = 2048


def connection_limits(max_connections: int | None = None) -> tuple[int, int]:
    """(max_connections, backlog) that fit under this process's soft RLIMIT_NOFILE beside the
    files it holds now. The backlog is also how many connections asyncio accepts in one go before
    any of them is seen (and, past the file limit, it logs and retries EMFILE once per slot of the
    backlog): open connections plus one such batch stay under the limit. max_connections, when
    given, is kept; by default it is half of what is free (at most 1024, at least 4)."""
    free = _free_fds()
    if max_connections is None:
        max_connections = max(4, min(_MAX_CONNECTIONS, free // 2))
    return max_connections, max(8, min(_MAX_BACKLOG, free - max_connections))


def _free_fds() -> int:
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 2 * _MAX_BACKLOG
    if soft == resource.RLIM_INFINITY:
        return 2 * _MAX_BACKLOG
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:
        held = 64
    return soft - held - _FD_RESERVE


def guarded_h11(request_timeout: float, max_connections: int):
    """A uvicorn H11Protocol class with these bounds (uvicorn.Config(http=...))."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _waiting_since = 0.0
        _request_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._wait_for_request()
            live = sum(1 for c in self.connections if not c.transport.is_closing())
            if live > max_connections and not self._evict_one():
                transport.close()

        def connection_lost(self, exc) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._wait_for_request()

        def _idle(self) -> bool:
            """No request in progress: waiting for one, or half-way through its head."""
            return self.cycle is None or self.cycle.response_complete

        def _wait_for_request(self) -> None:
            self._waiting_since = self.loop.time()
            if self._request_timer is not None:
                self._request_timer.cancel()
            self._request_timer = self.loop.call_later(request_timeout, self._request_timed_out)

        def _request_timed_out(self) -> None:
            self._request_timer = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

        def _evict_one(self) -> bool:
            idle = [c for c in self.connections
                    if c is not self and not c.transport.is_closing() and isinstance(c, GuardedH11Protocol)
                    and c._idle()]
            if not idle:
                return False
            min(idle, key=lambda c: c._waiting_since).transport.close()
            return True

    return GuardedH11Protocol
