"""Errors and exit codes: one place where a run's failures become what the shell sees.

    0  EXIT_PASS        every criterion held
    1  EXIT_FAIL        the numerics failed (a criterion, a backend error, an unhealthy backend)
    2  EXIT_USAGE       bad input or usage: one line naming the file/argument and field
    3  EXIT_INCOMPLETE  the harness could not finish: a time limit, a report it could not write
"""
from __future__ import annotations

import argparse

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3
EXIT_CODES = {EXIT_PASS: "pass", EXIT_FAIL: "numerics failed", EXIT_USAGE: "bad input or usage",
              EXIT_INCOMPLETE: "the harness could not finish (time limit, report write failure)"}
EXIT_HELP = ("exit codes: 0 pass, 1 numerics failed, 2 bad input or usage, "
             "3 the harness could not finish (a time limit, a report that could not be written)")


class InputError(Exception):
    """Bad input: `where` names the file (or argument), `field` the offending field."""

    def __init__(self, field: str, msg: str, where: str | None = None):
        self.field, self.msg, self.where = field, msg, where
        super().__init__(f"{where}: {field}: {msg}" if where else f"{field}: {msg}")


class Incomplete(Exception):
    """The harness could not finish its job (exit 3): `what` names what was left undone."""


class ArgParser(argparse.ArgumentParser):
    """argparse that raises InputError (one line, exit 2 from the CLI) instead of printing usage."""

    def error(self, message):
        raise InputError("arguments", message)
