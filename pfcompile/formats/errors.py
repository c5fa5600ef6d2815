"""The one error type users see: a one-line message naming the file and the field."""

from __future__ import annotations


class InputError(Exception):
    """Bad input (a file, a field, a flag). The CLI prints `error: <message>` and exits 2.

    `where` is the file (or flag) and `field` the dotted path inside it, so every message
    reads `plans/x.json: ranks[1].steps[0][4].op: unknown op 'fwdd'`.
    """

    def __init__(self, where: str | None, field: str | None, message: str):
        self.where, self.field, self.message = where, field, message
        head = ": ".join(p for p in (where, field) if p)
        super().__init__(f"{head}: {message}" if head else message)
