"""The chat page at `/`: static files shipped in the package (pysmoe/server/static/: index.html,
chat.css, chat.js), no build step, nothing fetched from elsewhere. The page talks to this server's
own /v1/chat/completions (streamed), shows the model's reasoning apart from its answer, stops a
reply (the request is aborted; the server cancels the job), starts a new conversation, and asks
for the API key when /v1/models answers 401 (kept in the browser's localStorage)."""
from __future__ import annotations

import pathlib

from starlette.responses import FileResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = pathlib.Path(__file__).resolve().parent / "static"


def routes(server) -> list:
    async def index(request):
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    return [Route("/", index, methods=["GET"]), Mount("/static", StaticFiles(directory=STATIC), name="static")]
