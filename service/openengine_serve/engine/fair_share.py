"""Fair share of the batch between API keys, for both engines' admission (docs/engines.md, "Fair share").

Admission order is priority, then each owner's share of the batch, then arrival. An owner is the API key that
started a request (EngineRequest.owner; "" when keys are off, so one owner and today's order). While requests
of several owners are running or waiting, an owner's share is `max_batch * weight / total weight` sequences
(rounded up; EngineRequest.share_weight, the key file's `share_weight=N`, 1 by default: equal shares):

- Among the waiting requests of the highest waiting priority, the first (by arrival) whose owner stays within
  its share is admitted first; only when none does, the head of the queue (the batch is never left idle).
- When the batch is full and such a request waits, the request admitted last by an owner above its share
  goes back to the queue (preempted: it resumes later where it stopped), as long as that owner keeps its share.
- Before that, when the batch is full and any request waits, a request paused longer than PAUSED_SLOT_GRACE_S
  (its client reads nothing) leaves the batch until resumed.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

# A request paused this long (its client reads nothing) gives its batch slot to a waiting request; resumed, it
# rejoins the queue in its place.
PAUSED_SLOT_GRACE_S = 2.0


def share(max_batch: int, weight: int, total_weight: int) -> int:
    """An owner's share of the batch's sequences."""
    return -(-max_batch * weight // max(1, total_weight))


class FairQueue:
    """Fair picks over an engine's queue heap. `state_of(entry)`: a heap entry's request; `priority_of(entry)`:
    its priority key (lower first); `owner_of(state)`, `sequences_of(state)`, `weight_of(state)`: its owner, open
    sequences and its owner's weight."""

    def __init__(
        self,
        max_batch: int,
        state_of: Callable[[Any], Any],
        priority_of: Callable[[Any], Any],
        owner_of: Callable[[Any], str],
        sequences_of: Callable[[Any], int],
        weight_of: Callable[[Any], int],
    ) -> None:
        self.max_batch = max_batch
        self.state_of, self.priority_of = state_of, priority_of
        self.owner_of, self.sequences_of, self.weight_of = owner_of, sequences_of, weight_of

    def running_by_owner(self, running: Iterable[Any]) -> Counter:
        counts: Counter = Counter()
        for state in running:
            counts[self.owner_of(state)] += self.sequences_of(state)
        return counts

    def weights(self, states: Iterable[Any]) -> dict[str, int]:
        """The weight of every owner with a request among `states` (the running and the waiting ones)."""
        weights: dict[str, int] = {}
        for state in states:
            owner = self.owner_of(state)
            weights[owner] = max(weights.get(owner, 1), self.weight_of(state))
        return weights

    def limit(self, owner: str, weights: dict[str, int]) -> int:
        return share(self.max_batch, weights.get(owner, 1), sum(weights.values()))

    def pick(self, heap: list, live: Callable[[Any], bool], running: Counter, weights: dict[str, int]) -> Any:
        """Pops and returns the entry to admit next (None when the heap holds no live entry). `live(state)`: not
        cancelled while queued (dead entries met on the way are dropped); `weights`: `weights()` of the running
        and queued requests."""
        if len(weights) <= 1:
            while heap:
                entry = heapq.heappop(heap)
                if live(self.state_of(entry)):
                    return entry
            return None
        skipped: list = []
        picked = None
        while heap:
            entry = heapq.heappop(heap)
            state = self.state_of(entry)
            if not live(state):
                continue
            if skipped and self.priority_of(entry) != self.priority_of(skipped[0]):
                skipped.append(entry)  # a lower priority: not before the head's
                break
            owner = self.owner_of(state)
            if running[owner] + self.sequences_of(state) <= self.limit(owner, weights):
                picked = entry
                break
            skipped.append(entry)
        if picked is None and skipped:
            picked = skipped.pop(0)  # nobody within its share waits: the head
        for entry in skipped:
            heapq.heappush(heap, entry)
        return picked

    def victim(self, state: Any, running_states: list[Any], running: Counter, weights: dict[str, int]) -> Any:
        """A running request to preempt so that `state` (within its owner's share) gets in: the one admitted last
        (`running_states` in admission order) by the owner furthest above its share, if that owner keeps its share
        without it; else None."""
        owner = self.owner_of(state)
        if running[owner] + self.sequences_of(state) > self.limit(owner, weights):
            return None
        over = [
            (count - self.limit(name, weights), name)
            for name, count in running.items()
            if name != owner and count > self.limit(name, weights)
        ]
        if not over:
            return None
        _, greedy = max(over)
        for candidate in reversed(running_states):
            if self.owner_of(candidate) == greedy and running[greedy] - self.sequences_of(candidate) >= self.limit(
                greedy, weights
            ):
                return candidate
        return None
