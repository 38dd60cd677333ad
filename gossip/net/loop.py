"""One asyncio event loop per process, running in a background thread (uvloop when installed).

Users' training loops are ordinary synchronous PyTorch; the loop owns every socket and does the network
work while the training thread computes. The two threads meet only through ``submit``/``call_soon``
(training -> loop) and thread-safe mailboxes (loop -> training).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gossip.errors import PeerTimeout

try:  # uvloop is a dependency except on Windows
    import uvloop
except ImportError:  # pragma: no cover - platform dependent
    uvloop = None

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one event loop until ``stop``."""

    def __init__(self, name: str) -> None:
        self.loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Run ``coro`` on the loop and wait for it from another thread; ``what`` names the wait."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise PeerTimeout(f"{what} did not finish within {timeout:g} s") from exc

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self, timeout: float) -> None:
        """Cancel every task, stop the loop and join the thread (at most ``timeout`` seconds)."""
        if not self._thread.is_alive():
            return
        try:
            self.submit(self._cancel_all()).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # a stuck task must not keep the process alive: the thread is a daemon
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    @staticmethod
    async def _cancel_all() -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
