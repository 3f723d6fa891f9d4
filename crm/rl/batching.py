"""Many concurrent single-sample reward requests scored together, for the RL adapters.

OpenRLHF posts one sample per HTTP request and verl's reward loop calls its manager once per
sample, both many at a time in one event loop. A CRM scores a batch far faster than the same
samples one by one, so `MicroBatcher` gathers what arrives while the previous batch is scored (or
within `wait` seconds of the first) and scores it in one call, on one worker thread: the event
loop keeps accepting requests meanwhile, and the CRM (its cache and scorer) is only ever used by
that one thread.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("crm.rl")


class MicroBatcher:
    """`await batcher(items)` -> `score(items)`, scored together with other concurrent calls.

    `score(list) -> list` (one value per item) runs on the batcher's thread; when it raises, each
    call's items are scored again alone, so the call at fault gets the error and the others their
    values. The batching runs in the event loop of the latest call."""

    def __init__(self, score: Callable[[list], list], wait: float = 0.01, max_items: int = 512):
        self.score, self.wait, self.max_items = score, wait, max_items
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="crm-reward")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None

    async def __call__(self, items: list) -> list:
        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # the first call, or a new loop (each asyncio.run makes one)
            self.loop, self.queue = loop, asyncio.Queue()
            self.task = loop.create_task(self._loop())
        future = loop.create_future()
        await self.queue.put((items, future))
        return await future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            size = len(batch[0][0])
            while size < self.max_items:
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), self.wait))
                except asyncio.TimeoutError:
                    break
                size += len(batch[-1][0])
            results = await loop.run_in_executor(self.executor, self._score_all, [b[0] for b in batch])
            for (_, future), result in zip(batch, results):
                if future.done():  # its caller went away
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _score_all(self, calls: list[list]) -> list:
        """Each call's values (or its exception), from one score() when every call is good."""
        try:
            values = self.score([item for items in calls for item in items])
        except Exception as exc:
            if len(calls) == 1:  # its own error: no second pass over a large refused request
                return [exc]
            out = []
            for items in calls:  # find whose it is, call by call
                try:
                    out.append(self.score(items) if items else [])
                except Exception as exc:
                    out.append(exc)
            return out
        out, start = [], 0
        for items in calls:
            out.append(values[start:start + len(items)])
            start += len(items)
        return out

    def close(self) -> None:
        """Stop batching (from any thread); a loop that has ended has cancelled it already."""
        if self.task is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.executor.shutdown(wait=False)
