"""A thread-safe bounded mapping that forgets the least recently used entry: the verdict caches of
the leaderboard app (crm/app/cache.py) and of the RL reward (crm/inference/reward.py)."""
from __future__ import annotations

import threading
from collections import OrderedDict


class LRU:
    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
