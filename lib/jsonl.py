"""JSON Lines: one object per line, UTF-8, '\\n' endings."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator


def dumps(obj: object) -> str:
    """One compact line (no trailing newline); NaN/inf are refused, not written."""
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


def read(path: os.PathLike | str) -> Iterator[dict]:
    """Yield each object of a JSONL file; a bad line (or one that is not an object) raises naming file and
    line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON: {e.msg}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: a JSON {type(obj).__name__}, not an object: each line is one "
                                 "record ({...}); re-export the dataset")
            yield obj


def write(f, records: Iterable[object]) -> None:
    """Write records to an open text file, one line each."""
    f.writelines(dumps(r) + "\n" for r in records)
