"""The one CSV writer every bench and instrument uses: one row per measurement, units in the column names."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _header(path: Path) -> list[str] | None:
    """The existing file's column names, or None when it is missing or empty."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]], *, append: bool = False) -> None:
    """Writes rows (floats rounded to 6 decimals) under the union of their keys, creating the folder.

    Args:
        path: the CSV file.
        rows: one dict per row, column name -> value; a column a row lacks is left empty.
        append: add the rows after those already in the file, under its header (written first when
            the file is missing or empty), instead of replacing the file.
    Raises:
        ValueError: appending rows with a column the existing header does not have.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    header = _header(path) if append else None
    if header is not None:
        extra = [k for k in fields if k not in header]
        if extra:
            raise ValueError(f"{path} has columns {header}; cannot append rows with columns {extra} it lacks")
        fields = header
    with path.open("a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        if header is None:
            writer.writeheader()
        writer.writerows({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()} for row in rows)
