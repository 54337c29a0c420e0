"""The tables of `make bench`: what a section returns, how it is printed, how it is saved as JSON.

    .venv/bin/python scripts/bench.py --list                # the sections
    .venv/bin/python scripts/bench.py --only comm --json bench.json

A section is one function `run(opts: Options) -> Table | list[Table]`, registered with one line in
scripts/bench.py's SECTIONS. Each table carries its own title, columns, rows (plain dicts: they go to the
JSON report unchanged), notes, and `setup`: how the work was spread over the machine when it is not
"one process, every core" (e.g. '2 ranks x 1 thread'), printed in the machine line next to the figures.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

from course_lib.observability.timing import machine_line
from course_lib.runtime.launch import launch


@dataclass(frozen=True)
class Options:
    quick: bool = False
    """Fewer samples and variants: a smoke run that checks every section still works."""


@dataclass
class Column:
    key: str
    header: str
    fmt: str | Callable[[dict], str] = "{}"
    """A format string for row[key], or a function from the whole row to its text."""


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    setup: str = ""
    """How the work was spread over the machine, e.g. '2 ranks x 1 thread' (default: one process, all cores)."""
    name: str = ""
    """The table's key in the JSON report; empty: the section's name (fine for a section with one table)."""


@dataclass(frozen=True)
class Section:
    name: str
    description: str
    run: Callable[[Options], Table | list[Table]]


def as_tables(result: Table | list[Table], section_name: str) -> list[Table]:
    """A section's result as a list of tables with distinct names."""
    tables = [result] if isinstance(result, Table) else list(result)
    if not tables or not all(isinstance(t, Table) for t in tables):
        raise TypeError(f"section {section_name!r} must return a Table or a non-empty list of Tables")
    names = [t.name or section_name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"section {section_name!r} returned tables with the same name: {names}")
    for table, name in zip(tables, names):
        table.name = name
    return tables


def _cell(row: dict, column: Column) -> str:
    if callable(column.fmt):
        return column.fmt(row)
    value = row.get(column.key)
    return "-" if value is None else column.fmt.format(value)


def format_table(table: Table) -> str:
    """Header, rule and rows; numeric columns right-aligned, text left-aligned; a missing value prints '-'."""
    cells = [[c.header for c in table.columns]] + [[_cell(r, c) for c in table.columns] for r in table.rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(table.columns))]
    numeric = [all(isinstance(r.get(c.key), (int, float, type(None))) and not isinstance(r.get(c.key), bool)
                   for r in table.rows) for c in table.columns]

    def fmt(line):
        return "  ".join(s.rjust(w) if num else s.ljust(w) for s, w, num in zip(line, widths, numeric)).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(line) for line in cells[1:]]
    return "\n".join(lines)


def format_section(section_name: str, tables: list[Table], machine: dict, wall_s: float) -> str:
    """Every table of a section with its title, machine line and notes; the section's wall time last."""
    blocks = []
    for table in tables:
        lines = [f"== {section_name}: {table.title}", f"   machine: {machine_line(machine, table.setup or None)}",
                 format_table(table)]
        lines += [textwrap.fill(note, width=110, initial_indent="   ", subsequent_indent="   ")
                  for note in table.notes]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + f"\n   ({section_name}: {wall_s:.0f} s)"


def section_json(tables: list[Table], machine: dict, wall_s: float) -> dict:
    """A section in the JSON report: the machine when it started, its wall time, its tables by name."""
    return {"machine": machine, "wall_s": wall_s,
            "tables": {t.name: {"title": t.title, "setup": t.setup, "rows": t.rows, "notes": t.notes}
                       for t in tables}}


def strategy_rows(worker, world_sizes, opts: Options, workloads: dict, strategies, rows_of, *, log_prefix: str,
                  timeout_s: float = 180) -> tuple[dict, list[dict]]:
    """(workload, rows): `worker` run on the quick or full workload for `strategies` at each world size (1 thread
    per rank, logs discarded); rows_of(ranks, cores=, workload=) turns one launch's results into table rows."""
    workload, cores, rows = workloads["quick" if opts.quick else "full"], os.cpu_count() or 1, []
    kwargs = {"strategies": tuple(strategies), **workload}
    with tempfile.TemporaryDirectory(prefix=log_prefix) as log_dir:
        for world_size in world_sizes:
            ranks = launch(worker, world_size, kwargs=kwargs, threads_per_rank=1, log_dir=log_dir, echo=False,
                           timeout_s=timeout_s)
            rows += rows_of(ranks, cores=cores, workload=workload)
    return workload, rows


def add_ratios(rows: list[dict], baseline: str, ratios: dict[str, str]) -> list[dict]:
    """For each name: key of ratios, row[name] = row[key] / the `baseline` strategy's row[key] (None without one)."""
    base = next((r for r in rows if r["strategy"] == baseline), None)
    for row in rows:
        for name, key in ratios.items():
            row[name] = row[key] / base[key] if base else None
    return rows


def megabytes(key: str):
    """Column format: row[key] bytes in MB (10^6), or '-' where the row has none."""
    def fmt(row: dict) -> str:
        return "-" if row.get(key) is None else f"{row[key] / 1e6:.3f}"
    return fmt


def agreement(measured: str, expected: str):
    """Column format: 'yes' where row["agrees"], else NO and the byte difference measured - expected."""
    def fmt(row: dict) -> str:
        return "yes" if row["agrees"] else f"NO ({row[measured] - row[expected]:+,} B)"
    return fmt


def oversubscribed_note(world_sizes, cores: int, waiting: str = "") -> list[str]:
    """[a note on the world sizes with more ranks than cores], or [] when every size fits."""
    crowded = [n for n in world_sizes if n > cores]
    if not crowded:
        return []
    return [f"{' and '.join(map(str, crowded))} ranks on {cores} cores are oversubscribed: the ranks take turns "
            f"on the cores, so those step times include waiting for a CPU{waiting} and compare only with each other."]


def ranks_setup(world_sizes, cores: int) -> str:
    """The machine line's setup for runs of 1-thread ranks, flagging the sizes that oversubscribe the cores."""
    return ", then ".join(f"{n} ranks x 1 thread" + (f" ({n} processes on {cores} cores: oversubscribed)"
                                                     if n > cores else "") for n in world_sizes)
