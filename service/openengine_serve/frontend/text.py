"""Text on the frontend: incremental detokenization, stop strings (prompts are encoded by common/tokenizers.py).

The detokenizer and the stop-string matcher run once per generated token, so
both keep only a small amount of state and never rescan what they already
emitted.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    A token can end in the middle of a multi-byte UTF-8 character; those bytes
    are held back until the character is complete. The concatenation of every
    ``push`` and the final ``flush`` equals the tokenizer's decode of all ids,
    invalid bytes included (each becomes U+FFFD, as with ``errors="replace"``).
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Bytes of an incomplete character are held back. While none are, a token whose bytes are
        # complete UTF-8 on their own decodes to exactly its own text (the streaming fast path).
        self.pending = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens and returns only the text they complete."""
        text = self._decoder.decode(self._tokenizer.decode_bytes(token_ids))
        self.pending = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        """Ends the stream: a trailing incomplete character becomes U+FFFD."""
        self.pending = False
        return self._decoder.decode(b"", final=True)


class StopStringMatcher:
    """Finds stop strings in streamed text, also across ``feed`` boundaries.

    Text that could still be the start of a stop string is held back until it
    either completes a stop string or can no longer do so. The match that wins
    is the one that completes first in the text (a stop string found inside a
    longer one stops the stream before the longer one could complete); among
    matches completing at the same place, the one starting earliest. Because
    this is decided character by character, how the text is split into feeds
    never changes the result.
    """

    def __init__(self, stops: Iterable[str], include_stop: bool) -> None:
        self._stops = list(dict.fromkeys(stops))
        if "" in self._stops:
            raise ValueError("stop strings must not be empty")
        self._include_stop = include_stop
        self._held = ""
        self._stopped = False

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns the text that is safe to emit now and the stop string matched, if any.

        After a match, the stream is over: later feeds and ``flush`` return nothing.
        """
        if self._stopped:
            return "", None
        if not self._stops:
            return text, None
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self._stopped = True
            end = start + len(stop) if self._include_stop else start
            return buffer[:end], stop
        hold_from = self._held_suffix_start(buffer)
        self._held = buffer[hold_from:]
        return buffer[:hold_from], None

    def flush(self) -> str:
        """Ends a stream without a match: releases the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start == -1:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _held_suffix_start(self, buffer: str) -> int:
        """Where the longest suffix of ``buffer`` that begins some stop string starts."""
        hold_from = len(buffer)
        for stop in self._stops:
            # Only suffixes shorter than the stop string and longer than the
            # best one found so far are worth checking.
            position = max(len(buffer) - len(stop) + 1, 0)
            while (position := buffer.find(stop[0], position, hold_from)) != -1:
                if stop.startswith(buffer[position:]):
                    hold_from = position
                    break
                position += 1
        return hold_from
