"""The fault tests' report: each test that injects a fault adds a row, and the session ends
by printing them as one table (``pytest tests/cluster -m slow -k "faults or hung or storm"``
shows it; so does every ``make test``)."""

from __future__ import annotations

from dataclasses import dataclass, field

HEADER = ("fault", "injected", "requests affected", "clear status", "blocks leaked", "recovery s")


@dataclass(frozen=True)
class FaultRow:
    fault: str
    injected: int
    affected: int
    """Requests the fault reached (failed, cancelled or re-run)."""
    clear: int
    """Of those, how many ended with a clear gRPC status (or, re-run, with their full output)."""
    leaked: int
    """Blocks still held by any worker once the dust settled (asserted 0 by the test)."""
    recovery_s: float | None
    """From the fault to serving normally again; None where nothing had to recover."""
    note: str = ""


@dataclass
class FaultReport:
    rows: list[FaultRow] = field(default_factory=list)

    def add(self, fault: str, *, injected: int, affected: int, clear: int, leaked: int,
            recovery_s: float | None, note: str = "") -> None:
        self.rows.append(FaultRow(fault, injected, affected, clear, leaked, recovery_s, note))

    def table(self) -> list[str]:
        """The rows as an aligned text table, then each row's note."""
        cells = [HEADER] + [(r.fault, str(r.injected), str(r.affected), str(r.clear), str(r.leaked),
                             "-" if r.recovery_s is None else f"{r.recovery_s:.1f}") for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(HEADER))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return lines + [f"{r.fault}: {r.note}" for r in self.rows if r.note]
