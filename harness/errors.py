"""Errors the CLI turns into one line and exit code 2 (bad input or usage)."""
from __future__ import annotations


class InputError(Exception):
    """Bad input: `where` names the file (or argument), `field` the offending field."""

    def __init__(self, field: str, msg: str, where: str | None = None):
        self.field, self.msg, self.where = field, msg, where
        super().__init__(f"{where}: {field}: {msg}" if where else f"{field}: {msg}")
