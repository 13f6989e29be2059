"""Reading the trainer's data one update ahead: the next batch's prompts are needed before this optimizer step."""

from __future__ import annotations

import itertools


class NextBatchPeek:
    """Reads the trainer's epoch iterator one item ahead, and gives the item back at the next read.

    ``read(iterator)`` returns an iterator that yields the held-back item first (when it came from this same
    iterator: a new epoch's iterator drops it) and then ``iterator`` itself.
    """

    def __init__(self):
        self._source = None
        self._item = None

    def read(self, iterator):
        source, item, self._source, self._item = self._source, self._item, None, None
        if source is iterator:
            return itertools.chain([item], iterator)
        return iterator

    def peek(self, iterator):
        """The next item of ``iterator`` (kept for the next ``read``), or ``None`` at its end."""
        try:
            item = next(iterator)
        except StopIteration:
            return None
        self._source, self._item = iterator, item
        return item
