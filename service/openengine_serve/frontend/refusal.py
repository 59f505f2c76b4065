"""Why a Generate request is refused before it is accepted.

One base type for every refusal, by validation or by the deployment; the
subclass says what kind of wrong it is and the message names what was wrong and
what is allowed. No gRPC here: the public server maps each kind to its status
code at the edge (`inference.REFUSAL_CODES`), as the coordinator does.
"""

from __future__ import annotations


class Refusal(Exception):
    """A request refused before acceptance; `message` is what the client is told."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(Refusal):
    """A field or header is malformed or out of range."""


class NotServed(Refusal):
    """The request names a model or a routing target this deployment does not have."""


class Unsupported(Refusal):
    """The request asks for a feature this deployment does not offer."""


class DuplicateRequest(Refusal):
    """The request id is already in flight."""


class Unavailable(Refusal):
    """Nothing can take the request now (draining, no ready node, the node did not take it); retry."""


class Overloaded(Refusal):
    """The chosen node is at capacity; retry later."""


class KeyAtLimit(Refusal):
    """The caller's API key has its maximum of streams open; retry later."""


class NotPermitted(Refusal):
    """The caller's API key does not have the right the request asks for (a priority above its max_priority)."""
