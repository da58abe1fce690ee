"""The one table writer of the benchmarks and scripts: Markdown tables, printed row by row as results come
(a run cut short by its time limit still shows what it measured) and kept for a results file."""

from __future__ import annotations

from collections.abc import Iterable


def row(cells: Iterable) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def markdown(header: Iterable[str], rows: Iterable[Iterable]) -> str:
    header = list(header)
    return "\n".join([row(header), "|" + "---|" * len(header), *(row(cells) for cells in rows)])


class Table:
    """``Table(header)``; ``add(*cells)`` prints the row (the header before the first) and keeps it;
    ``str(table)`` is the whole table."""

    def __init__(self, header: Iterable[str], echo: bool = True):
        self.header, self.rows, self.echo = list(header), [], echo

    def add(self, *cells) -> str:
        if self.echo and not self.rows:
            print(markdown(self.header, []), flush=True)
        self.rows.append(cells)
        if self.echo:
            print(row(cells), flush=True)
        return row(cells)

    def __str__(self) -> str:
        return markdown(self.header, self.rows)
