"""Where benchmark scripts put their figures: a JSON file, folders created as needed."""

from __future__ import annotations

import json
from pathlib import Path


def save_json(out: Path | None, data: object) -> None:
    """Write ``data`` to ``out`` as indented JSON; nothing when ``out`` is None."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
