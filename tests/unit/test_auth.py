"""The API key file: parsing, hashing, reload (the interceptor itself runs in tests/integration/test_api_keys.py)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from openengine_serve.common.config import ConfigError
from openengine_serve.frontend import auth


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_parses_plain_and_hashed_secrets_comments_and_blank_lines(tmp_path):
    digest = hashlib.sha256(b"s3cret-admin").hexdigest()
    path = write(
        tmp_path / "keys", f"# team keys\n\nuser alice alice-key   # trailing comment\nadmin ops sha256:{digest}\n"
    )
    store = auth.KeyStore(path)
    assert [(k.role, k.name) for k in store.keys] == [("user", "alice"), ("admin", "ops")]
    assert store.authenticate("alice-key").name == "alice"
    assert store.authenticate("s3cret-admin").admin
    assert store.authenticate("alice-key ") is None
    assert store.authenticate("") is None
    # only digests are kept
    assert all(len(k.digest) == 32 for k in store.keys)
    assert b"alice-key" not in repr(store.keys).encode()


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            "user alice\n",
            1,
            "expected `ROLE NAME SECRET [max_in_flight=N] [max_priority=N] [cache_group=NAME] [share_weight=N]`",
        ),
        ("# c\nroot alice k\n", 2, "role must be one of user, admin, got 'root'"),
        ("user a k1\n\nadmin b sha256:abc\n", 3, "a sha256: secret must be 64 hexadecimal digits"),
        ("user a same\nadmin b same\n", 2, "the same secret is already the key 'a'"),
        (
            "user a k same\n",
            1,
            "field 4 must be one of max_in_flight=..., max_priority=..., cache_group=..., share_weight=...",
        ),
        ("user a k max_in_flight=0\n", 1, "max_in_flight=N needs N an integer in [1, 2147483647]"),
        ("user a k max_in_flight=-3\n", 1, "max_in_flight=N needs N an integer"),
        ("user a k max_in_flight=２\n", 1, "max_in_flight=N needs N an integer"),
        ("user a k max_in_flight=2 same\n", 1, "field 5 must be one of"),
        ("user a k max_priority=2147483648\n", 1, "max_priority=N needs N an integer in [0, 2147483647]"),
        ("user a k max_priority=1 max_priority=2\n", 1, "max_priority= is given more than once"),
        ("user a k cache_group=a/b\n", 1, "cache_group= must be 1 to 64 of"),
        ("user a k share_weight=0\n", 1, "share_weight=N needs N an integer in [1, 1000]"),
        ("user a k share_weight=1001\n", 1, "share_weight=N needs N an integer in [1, 1000]"),
        ("user a k max_in_flight=1 max_priority=1 cache_group=g share_weight=2 same\n", 1, "found 8"),
    ],
)
def test_malformed_line_names_file_and_line_never_the_secret(tmp_path, text, line, message):
    path = write(tmp_path / "keys", text)
    with pytest.raises(ConfigError) as err:
        auth.parse_keys(path)
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert message in str(err.value)
    assert "same" not in str(err.value).replace("the same secret", "")


def test_an_optional_max_in_flight_per_key(tmp_path):
    path = write(tmp_path / "keys", "user alice k-a max_in_flight=3\nadmin ops k-o  # no limit of its own\n")
    assert [(k.name, k.max_in_flight) for k in auth.parse_keys(path)] == [("alice", 3), ("ops", 0)]


def test_share_weight_is_one_unless_the_line_gives_it(tmp_path):
    path = write(tmp_path / "keys", "user alice k-a share_weight=3\nuser bob k-b\n")
    assert [(k.name, k.share_weight) for k in auth.parse_keys(path)] == [("alice", 3), ("bob", 1)]


def test_priority_is_a_right_of_the_key(tmp_path):
    lines = "user alice k-a\nuser bob k-b max_priority=5\nadmin ops k-o\nadmin low k-l max_priority=1\n"
    path = write(tmp_path / "keys", lines)
    limits = {k.name: k.priority_limit for k in auth.parse_keys(path)}
    assert limits == {"alice": 0, "bob": 5, "ops": 2**31 - 1, "low": 1}


def test_cache_namespaces_are_per_key_unless_grouped(tmp_path):
    path = write(
        tmp_path / "keys",
        "user alice k-a\nuser bob k-b\nuser carol k-c cache_group=team\nadmin dave k-d cache_group=team\n",
    )
    alice, bob, carol, dave = (auth.cache_namespace(k) for k in auth.parse_keys(path))
    assert len({alice, bob, carol}) == 3 and carol == dave
    assert auth.cache_namespace(None) == ""
    # a fixed function of the key file: every frontend and worker derives the same one
    again = auth.parse_keys(path)
    assert auth.cache_namespace(again[0]) == alice
    # the client's salt narrows the namespace; it can never name another key's
    assert auth.scoped_cache_salt("", "s") == "s"
    assert auth.scoped_cache_salt(alice, "s") != auth.scoped_cache_salt(bob, "s")
    assert not auth.scoped_cache_salt(bob, alice).startswith(alice)


def test_empty_or_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no key"):
        auth.parse_keys(write(tmp_path / "keys", "# nothing\n"))
    with pytest.raises(ConfigError, match="cannot be read"):
        auth.parse_keys(str(tmp_path / "absent"))


def test_reload_on_change_keeps_old_keys_when_the_new_file_is_malformed(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "RELOAD_CHECK_S", 0.0)
    path = write(tmp_path / "keys", "user alice k-alice\nuser bob k-bob\n")
    store = auth.KeyStore(path)
    assert store.authenticate("k-bob").name == "bob"
    write(tmp_path / "keys", "user alice k-alice\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert store.authenticate("k-bob") is None
    assert store.authenticate("k-alice").name == "alice"
    write(tmp_path / "keys", "user alice\n")  # half-written: the previous keys stay
    assert store.authenticate("k-alice").name == "alice"
    write(tmp_path / "keys", "user alice k-alice max_in_flight=2\n")  # a limit added: applies from the reload
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2_000_000))
    assert store.authenticate("k-alice").max_in_flight == 2


def test_bearer_token():
    assert auth.bearer_token((("x", "1"), ("authorization", "Bearer abc"))) == "abc"
    assert auth.bearer_token((("authorization", "bearer  abc "),)) == "abc"
    assert auth.bearer_token((("authorization", "Basic abc"),)) is None
    assert auth.bearer_token(()) is None
