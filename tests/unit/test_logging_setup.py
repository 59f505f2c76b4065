"""The key=value log line (common/logging_setup.py): which values are quoted and how."""

from __future__ import annotations

import logging

from openengine_serve.common.logging_setup import KeyValueFormatter


def line(**fields) -> str:
    record = logging.LogRecord("t", logging.INFO, "", 0, "request ended", None, None)
    record.kv = fields
    return KeyValueFormatter("frontend").format(record)


def test_plain_values_are_bare_and_values_with_a_space_quote_equals_sign_newline_or_nothing_are_quoted():
    text = line(
        plain="node-0",
        space="a b",
        quote='say "hi"',
        equals="k=v",
        newline="a\nb",
        empty="",
        backslash_alone="a\\b",
        number=3,
    )
    assert text.startswith("ts=") and ' level=info component=frontend event="request ended" ' in text
    assert text.endswith(
        ' plain=node-0 space="a b" quote="say \\"hi\\"" equals="k=v" newline="a\\nb" empty="" '
        "backslash_alone=a\\b number=3"
    )
