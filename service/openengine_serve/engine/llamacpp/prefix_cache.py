"""The prefix cache: KV cells of ended sequences, kept so that a new prompt starting with the same tokens
reuses them instead of reading them again.

An entry is a llama.cpp sequence that no request runs any more, with the tokens its cells hold (a prompt
and the output read after it), under a salt: a new request looks only at entries of its own salt
(`kv.cache_salt`; none is a salt too), so tenants with different salts never share KV. The best entry is
the one sharing the longest prefix with the new prompt; its cells are shared with the new sequence
(`llama_memory_seq_cp`, no copy in a unified cache) and the request reads only the rest of its prompt.
Entries are kept in least-recently-used order within `max_tokens` cells and `max_entries` sequences; the
engine evicts them first when running requests need the cells. An entry is shared only where the model can go on
from it (runtime.py: not past a sliding window's reused cells, never for recurrent state).

The blocks the entries cover are counted in `blocks` (common/kv_blocks.py), which records the KV events a
subscriber reads (`SubscribeKvEvents`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from openengine_serve.common.kv_blocks import BlockLedger

MIN_REUSE_TOKENS = 16  # a shorter common prefix is read again: sharing it saves less than it costs to track


@dataclass
class Entry:
    seq_id: int
    salt: str
    tokens: np.ndarray  # int32
    block_hashes: list[bytes]


class PrefixCache:
    def __init__(self, model, max_tokens: int, max_entries: int, ledger: BlockLedger | None = None) -> None:
        self._model = model
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # seq id -> entry, least recently used first
        self.tokens = 0  # cells the entries hold
        self.blocks = ledger if ledger is not None else BlockLedger()  # another cache's: blocks held by either

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 and self.max_entries > 0

    def lookup(self, salt: str, prompt: list[int], reusable: int) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` under `salt`, and how many tokens can be reused:
        at most `reusable` (the tokens before the first whose logits are needed)."""
        best, best_length = None, 0
        prompt_array = np.asarray(prompt, np.int32)
        for entry in self._entries.values():
            if entry.salt != salt:
                continue
            length = common_prefix(entry.tokens, prompt_array, reusable)
            if length > best_length and self._model.can_share_prefix(entry.seq_id, length):
                best, best_length = entry, length
        if best is None or best_length < MIN_REUSE_TOKENS:
            return None, 0
        self._entries.move_to_end(best.seq_id)
        return best, best_length

    def keep(self, seq_id: int, salt: str, tokens: list[int], lora_name: str = "") -> list[int]:
        """Takes an ended sequence's cells (holding `tokens`); returns the sequence ids it frees: an entry
        this one covers, then the least recently used ones beyond the bounds (their cells already removed).
        A sequence too large for the cache is returned at once."""
        if not self.enabled or len(tokens) > self.max_tokens:
            self._model.forget(seq_id)
            return [seq_id]
        # Stored before the entries it covers are dropped: their blocks stay held (no removal, then storage).
        entry = Entry(seq_id, salt, np.asarray(tokens, np.int32), self.blocks.store(salt, tokens, lora_name))
        freed = [
            other.seq_id
            for other in self._entries.values()
            if other.salt == salt and common_prefix(other.tokens, entry.tokens, len(entry.tokens)) == len(other.tokens)
        ]
        for other_id in freed:  # everything it holds is a prefix of the new entry
            self._drop(other_id)
        self._entries[seq_id] = entry
        self.tokens += len(entry.tokens)
        while self.tokens > self.max_tokens or len(self._entries) > self.max_entries:
            freed.append(self.evict_one())
        return freed

    def evictable(self, keep: int = -1) -> bool:
        """Whether an entry other than `keep` is there to evict."""
        return any(seq_id != keep for seq_id in self._entries)

    def evict_one(self, keep: int = -1) -> int:
        """Drops the least recently used entry other than `keep`; returns its sequence id (its cells are removed,
        but for those a running sequence shares)."""
        seq_id = next(s for s in self._entries if s != keep)
        self._drop(seq_id)
        return seq_id

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, seq_id: int) -> None:
        entry = self._entries.pop(seq_id)
        self.tokens -= len(entry.tokens)
        self.blocks.remove(entry.block_hashes)
        self._model.forget(seq_id)


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many leading tokens the two share, at most `limit`."""
    n = min(len(a), len(b), limit)
    different = np.flatnonzero(a[:n] != b[:n])
    return int(different[0]) if different.size else n
