"""Concurrent reward requests scored together, in fair turns, for the RL adapters.

OpenRLHF posts one sample per HTTP request and verl's reward loop calls its manager once per
sample, both many at a time in one event loop. A CRM scores a batch far faster than the same
samples one by one, so `MicroBatcher` gathers what arrives while the previous slice is scored (or
within `wait` seconds of the first) and scores it in one call, on one worker thread: the event
loop keeps accepting requests meanwhile, and the CRM (its cache and scorer) is only ever used by
that one thread.

A call is scored in slices, never whole: each slice takes one item from each waiting call in
turn until it holds `max_items` items or `max_cost` of their cost (characters, for the OpenRLHF
server), so a call of many samples shares the scorer with every call that arrives while it is
scored, and a small call waits at most for the slice in progress and its own.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("crm.rl")


class _Call:
    """One caller's items, how far they are scored, and the values so far."""

    def __init__(self, items: list, future: asyncio.Future):
        self.items, self.future, self.taken, self.values = items, future, 0, []

    def receive(self, result) -> None:
        if self.future.done():  # its caller went away, or an earlier slice failed it
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
            return
        self.values += result
        if len(self.values) == len(self.items):
            self.future.set_result(self.values)


class MicroBatcher:
    """`await batcher(items)` -> `score(items)`, scored in slices shared with other concurrent
    calls (the module doc).

    `score(list) -> list` (one value per item) runs on the batcher's thread; when it raises, each
    call's part of the slice is scored again alone, so the call at fault gets the error (and no
    more of it is scored) and the others their values. The batching runs in the event loop of
    the latest call."""

    def __init__(self, score: Callable[[list], list], wait: float = 0.01, max_items: int = 512,
                 max_cost: float = math.inf, cost: Callable[[object], float] | None = None):
        self.score, self.wait, self.max_items = score, wait, max_items
        self.max_cost, self.cost = max_cost, cost or (lambda item: 0)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="crm-reward")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.calls: deque[_Call] = deque()  # waiting, in turn order

    async def __call__(self, items: list) -> list:
        if not items:
            return []
        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # the first call, or a new loop (each asyncio.run makes one)
            self.loop, self.queue, self.calls = loop, asyncio.Queue(), deque()
            self.task = loop.create_task(self._loop())
        future = loop.create_future()
        await self.queue.put(_Call(items, future))
        return await future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.calls:
                self.calls.append(await self.queue.get())
            await self._gather()
            part = self._slice()
            if not part:
                continue
            results = await loop.run_in_executor(self.executor, self._score_all,
                                                 [items for _, items in part])
            for (call, _), result in zip(part, results):
                call.receive(result)

    async def _gather(self) -> None:
        """Every call that has arrived, and while fewer than `max_items` items wait, those that
        arrive within `wait` seconds of each other."""
        while not self.queue.empty():
            self.calls.append(self.queue.get_nowait())
        waiting = sum(len(c.items) - c.taken for c in self.calls)
        while waiting < self.max_items:
            try:
                call = await asyncio.wait_for(self.queue.get(), self.wait)
            except asyncio.TimeoutError:
                break
            self.calls.append(call)
            waiting += len(call.items)

    def _slice(self) -> list[tuple[_Call, list]]:
        """The next slice: one item from each waiting call in turn, within the bounds; a call
        not finished goes to the back of the line, so the next slice starts with the next one."""
        parts: dict[int, tuple[_Call, list]] = {}
        count, cost = 0, 0.0
        while self.calls and count < self.max_items and cost < self.max_cost:
            call = self.calls.popleft()
            if call.future.done():  # its caller went away, or it failed: score no more of it
                continue
            item = call.items[call.taken]
            call.taken += 1
            parts.setdefault(id(call), (call, []))[1].append(item)
            count, cost = count + 1, cost + self.cost(item)
            if call.taken < len(call.items):
                self.calls.append(call)
        return list(parts.values())

    def _score_all(self, calls: list[list]) -> list:
        """Each call's values (or its exception), from one score() when every call is good."""
        try:
            values = self.score([item for items in calls for item in items])
        except Exception as exc:
            if len(calls) == 1:  # its own error: no second pass
                return [exc]
            out = []
            for items in calls:  # find whose it is, call by call
                try:
                    out.append(self.score(items))
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
