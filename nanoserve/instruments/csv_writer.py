"""What every bench script shares: one CSV row per measurement, units in the column names."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Writes rows (floats to 6 decimals) under the union of their keys, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()} for row in rows)
