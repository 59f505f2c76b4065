"""RecentIds (node/engine_link.py): the node's memory of ended requests and of aborts that came first."""

from __future__ import annotations

from openengine_serve.node import engine_link
from openengine_serve.node.engine_link import RecentIds


def test_an_id_is_remembered_until_popped():
    ids = RecentIds()
    ids.add("a")
    assert "a" in ids and "b" not in ids
    assert ids.pop("a") is True
    assert "a" not in ids and ids.pop("a") is False


def test_the_oldest_ids_are_forgotten_beyond_the_limit():
    ids = RecentIds(limit=3)
    for request_id in "abcd":
        ids.add(request_id)
    assert len(ids) == 3
    assert "a" not in ids and all(request_id in ids for request_id in "bcd")


def test_ids_are_forgotten_after_the_keep_time(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(engine_link.time, "monotonic", lambda: now[0])
    ids = RecentIds(keep_s=60)
    ids.add("old")
    now[0] += 30
    ids.add("newer")
    now[0] += 31  # "old" is 61 s old, "newer" 31 s
    assert "old" not in ids and "newer" in ids
    assert ids.pop("old") is False
    ids.add("newest")  # adding drops what expired
    assert len(ids) == 2
