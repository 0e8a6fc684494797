"""Where `tandem simulate` and `tandem plan --slo` write their report: standard output, one
call a line (the report is the command's output, not a log)."""

from __future__ import annotations

import sys


def say(text: str) -> None:
    """Write ``text`` and a newline to standard output (sys.stdout as it is now: tests capture it)."""
    sys.stdout.write(text + "\n")
