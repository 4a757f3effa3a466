"""Text from outside (file names above all) made safe to show on one line of a log or terminal.

A file name may hold any byte but ``/`` and NUL: a newline in one would forge a log line
(``evil\\nERROR done.svs``), an escape sequence would repaint the terminal, and undecodable
bytes (surrogates) cannot be written to a UTF-8 stream at all.
"""

from __future__ import annotations

import logging

# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators -> an escape.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def printable(text: str) -> str:
    """``text`` on one line: control characters escaped (``\\n``, ``\\x1b`` ...), undecodable
    file-name bytes shown as escapes; safe to print on any stream.

    >>> printable("evil\\nERROR done.svs")
    'evil\\\\nERROR done.svs'
    """
    return text.translate(_ESCAPES).encode("utf-8", "backslashreplace").decode("utf-8")


class OneLineFormatter(logging.Formatter):
    """Log records as timestamped lines whose message is :func:`printable`: a name in it cannot
    start a line of its own (a traceback added to a record still follows on its own lines)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


__all__ = ["OneLineFormatter", "printable"]
