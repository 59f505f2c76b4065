"""A request's attempt id: what a node and its engine know one submission of a request by.

A client may send a request_id again as soon as its stream ended, while the node still has the cancel of the
first request, or events the engine produced for it, on their way. Each submission therefore gets an id of its
own, `<internal request id>#<nonce>`: a late cancel or event can reach only the submission it was meant for. The
coordinator reserves, releases and aborts by the request id (`request_id_of` an attempt id).
"""

from __future__ import annotations

import itertools
import os

SEPARATOR = "#"


class AttemptIds:
    """Attempt ids unique to this process: a random prefix (another frontend's attempts at the same node stay
    apart) and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(3).hex()
        self._counter = itertools.count()

    def next(self, request_id: str) -> str:
        return f"{request_id}{SEPARATOR}{self._prefix}{next(self._counter):x}"


def request_id_of(attempt_id: str) -> str:
    """The request id an attempt id was made from (the nonce holds no separator; the request id may)."""
    request_id, separator, _ = attempt_id.rpartition(SEPARATOR)
    return request_id if separator else attempt_id
