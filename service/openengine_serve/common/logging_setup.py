"""One line per event, key=value, with the component name: `ts=... level=... component=... event=... k=v`."""

from __future__ import annotations

import logging
import re
import sys
import time


class KeyValueFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component
        # The frontend logs a line per request: the timestamp's date-and-seconds part is formatted once a second.
        self._second = -1
        self._second_text = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        fields = getattr(record, "kv", None) or {}
        parts = [
            f"ts={self._second_text}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"component={self.component}",
            f"event={_quote(record.getMessage())}",
        ]
        parts += [f"{k}={_quote(str(v))}" for k, v in fields.items()]
        if record.exc_info:
            parts.append(f"error={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


_NEEDS_QUOTES = re.compile('[ "=\n]')  # one regex scan: a generator over the characters cost a third of a line


def _quote(value: str) -> str:
    if value and _NEEDS_QUOTES.search(value) is None:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def setup_logging(component: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The formatter uses none of the caller's file/line, thread or process fields; not collecting them per
    # record (the logging module's documented optimization) saves most of a log line's cost.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields) -> None:
    logger.log(level, event, extra={"kv": fields})
