"""uvicorn server that drains on SIGTERM: /readyz turns 503 at once, new requests are refused,
in-flight requests and streams finish (up to server.drain_seconds), then it exits."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

log = logging.getLogger("modelcanary.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self._drain_started: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        proxy = self.runtime.proxy
        if self._drain_started is None:
            self._drain_started = time.monotonic()
            proxy.draining = True
            log.warning("draining: %d request(s) in flight, up to %.0f s", proxy.in_flight,
                        self.runtime.config.server.drain_seconds)
            return
        if sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_started is not None and not self.should_exit:
            waited = time.monotonic() - self._drain_started
            if self.runtime.proxy.in_flight <= 0 or waited >= self.runtime.config.server.drain_seconds:
                self.should_exit = True
        return await super().on_tick(counter)
