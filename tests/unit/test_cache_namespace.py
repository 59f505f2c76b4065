"""The prefix cache's namespace of a request follows the caller's API key (frontend/inference.py `plan`): the salt
the engine and the prefix routing key on is the key's namespace before the client's own salt."""

from __future__ import annotations

import contextvars
from types import SimpleNamespace

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.frontend import auth
from openengine_serve.frontend.inference import Inference
from openengine_serve.frontend.validation import ModelLimits, RequestMetadata

LIMITS = ModelLimits("m", (), 4096, 64, 1, 1000, prefix_cache=True)
KEYS = {
    "alice": auth.ApiKey("user", "alice", b"a" * 32),
    "bob": auth.ApiKey("user", "bob", b"b" * 32),
    "carol": auth.ApiKey("user", "carol", b"c" * 32, cache_group="team"),
    "dave": auth.ApiKey("user", "dave", b"d" * 32, cache_group="team"),
}


def planned(key: str | None, salt: str | None = None) -> tuple[str, str]:
    """(cache salt, prefix routing key) of one long prompt planned as `key`'s call."""
    inference = Inference.__new__(Inference)
    tokenizer = SimpleNamespace(encode=lambda text: [ord(c) % 1000 for c in text])
    loaded = SimpleNamespace(limits=LIMITS, tokenizer=tokenizer, card=SimpleNamespace(name="m"))
    inference.model = SimpleNamespace(loaded=loaded, for_name=lambda name: loaded, names=lambda: ["m"])
    request = G.GenerateRequest(request_id="r", model="m", prompt="a shared system prompt " * 8)
    if salt is not None:
        request.kv.cache_salt = salt

    def run():
        if key is not None:
            auth._CALLER.set(KEYS[key])
        plan = inference.plan(request, RequestMetadata())
        return plan.cache_salt, plan.prefix_key

    return contextvars.copy_context().run(run)


def test_each_key_has_its_own_namespace_and_a_group_shares_one():
    alice, bob, carol, dave = (planned(name) for name in KEYS)
    assert len({alice, bob, carol}) == 3, "salts and prefix routing keys differ per key"
    assert alice[1] != bob[1] and alice[1], "prefix routing follows the namespace"
    assert carol == dave


def test_the_clients_salt_narrows_its_namespace_and_never_widens_it():
    assert planned("alice", "x") != planned("alice")
    assert planned("alice", "x")[0].startswith(planned("alice")[0])
    assert planned("bob", planned("alice")[0]) != planned("alice")


def test_without_keys_the_clients_salt_is_the_namespace_as_before():
    assert planned(None) == ("", planned(None)[1])
    assert planned(None, "x")[0] == "x"
