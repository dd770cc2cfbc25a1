"""A bounded LRU cache of prompt encodings.

A GRPO group sends one prompt many times; encoding it once at batch 1 and stacking the cached rows
is also exactly what the stock pipeline computes for ``num_images_per_prompt`` outputs, so the cache
never changes a bit of the result. It must be cleared whenever a text encoder's weights change.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any


class PromptCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return self._data[key]
        value = compute()
        self.misses += 1
        if self.capacity > 0:
            with self._lock:
                self._data[key] = value
                while len(self._data) > self.capacity:
                    self._data.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
