"""The streamed response: SSE bytes sent as they come, the stream cancelled when the client leaves.

Starlette's StreamingResponse does the same through an anyio task group per response (on ASGI
servers older than spec 2.4, which uvicorn's httptools server is); this sends from the request's
own task and watches for the disconnect with one plain asyncio task, which costs less per stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStreamResponse(Response):
    def __init__(self, chunks: AsyncGenerator[bytes, None], status_code: int = 200,
                 headers: Mapping[str, str] | None = None, media_type: str = "text/event-stream"):
        self.chunks = chunks
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.current_task()
        left = False

        async def watch_for_disconnect() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            sender.cancel()  # type: ignore[union-attr]

        watcher = asyncio.get_running_loop().create_task(watch_for_disconnect())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            sender.uncancel()  # type: ignore[union-attr]  # the client left: the stream ends here
        finally:
            watcher.cancel()
            await self.chunks.aclose()  # runs the stream's own cleanup now, not when it is collected
