"""The one error type users see: a one-line message naming the file and the field; and
the rules for text a file brings to the screen (`printable`, `echo`, `printable_table`)."""

from __future__ import annotations

import re
import unicodedata

# An echoed value is cut to this many characters (a file's string may be 100,000 long);
# an error line as a whole to MAX_ERROR_CHARS, a backstop for messages that list values;
# a word of a table to MAX_TABLE_WORD.
ECHO_CHARS = 40
MAX_ERROR_CHARS = 2000
MAX_TABLE_WORD = 120


def printable(text: str) -> str:
    """`text` with every character a terminal would not show as itself escaped: lone
    surrogates (which no encoder writes: `print` fails on them), control characters (a
    newline would break the one-line rule, an ESC rewrites the screen) and format
    characters such as right-to-left marks (they reorder the rest of the line). Escapes
    are Python's (\\x1b, \\u200f, \\ud800); everything else is kept as is."""
    if text.isprintable():  # the common case, one C-level scan
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        elif unicodedata.category(ch) == "Zs":  # a no-break space and its kin show as spaces
            out.append(ch)
        else:
            n = ord(ch)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
    return "".join(out)


def printable_table(text: str, max_word: int = MAX_TABLE_WORD) -> str:
    """A table for the screen: each line printable, each word (a run without spaces) cut
    to `max_word` characters with a marker: a name a file brings may be 100,000
    characters long, an op list is many short words."""
    lines = (printable(line) for line in text.split("\n"))
    return "\n".join(re.sub(rf"\S{{{max_word + 1},}}", lambda m: cut(m.group(), max_word), line) for line in lines)


def cut(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` cut to `limit` characters, with a marker saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more chars]"


def echo(value, limit: int = ECHO_CHARS) -> str:
    """A value from a file as a message shows it: its repr, cut to `limit` characters
    with a marker, printable."""
    return printable(cut(repr(value), limit))


class InputError(Exception):
    """Bad input (a file, a field, a flag). The CLI prints `error: <message>` and exits 2.

    `where` is the file (or flag) and `field` the dotted path inside it, so every message
    reads `plans/x.json: ranks[1].steps[0][4].op: unknown op 'fwdd'`. The text is made
    printable and cut to MAX_ERROR_CHARS: a file's strings reach it, and it must print on
    one line whatever they hold.
    """

    def __init__(self, where: str | None, field: str | None, message: str):
        self.where, self.field, self.message = where, field, message
        head = ": ".join(p for p in (where, field) if p)
        super().__init__(printable(cut(f"{head}: {message}" if head else message, MAX_ERROR_CHARS)))
