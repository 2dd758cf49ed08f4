"""A user's table file as a ``pyarrow.Table``: parquet, JSON lines (or one JSON array), CSV or TSV,
chosen by the file's suffix. Anything unreadable is one ``ValueError`` naming the file, the format
tried and why, which the CLI prints as a one-line data error before anything is made.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "JSONL", ".ndjson": "JSONL", ".json": "JSON",
           ".csv": "CSV", ".tsv": "TSV"}
"""Suffix -> format; any other suffix is read as parquet (the error then lists these)."""


def column_values(table, name: str, path) -> list:
    """A column as Python values; text that is not UTF-8 is a ``ValueError`` naming the file, the row and
    the byte (pyarrow reads such a CSV column as bytes, and a JSON one as strings that fail later)."""
    import pyarrow as pa

    col = table.column(name)
    text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
    if not (text or pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
        return col.to_pylist()
    values = col.cast(pa.large_binary()).to_pylist() if text else col.to_pylist()
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: row {i + 1}: column {name} is not UTF-8 text (byte 0x{v[e.start]:02x} at "
                                 f"position {e.start}); save the file as UTF-8") from None
        out.append(v)
    return out


def _utf8(p: Path) -> str:
    """A JSON file's text; bytes that are not UTF-8 are a ``ValueError`` naming the line (as ``column_values``
    names the row of other formats), not characters replaced unsaid."""
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{p}: line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                         "save it as UTF-8") from None


def read_table(path, text_columns=()):
    """The whole table of a parquet/JSONL/JSON/CSV/TSV file. ``text_columns``: read as text from a CSV/TSV,
    which has no types (a summary column of numbers, "250", stays the text it is); as bytes, which
    ``column_values`` decodes, naming a row that is not UTF-8."""
    import pyarrow as pa

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: {'a folder, not a table file' if p.is_dir() else 'no such file'}")
    kind = FORMATS.get(p.suffix.lower(), "parquet")
    text = _utf8(p) if kind == "JSON" else ""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(p)
        if text.lstrip()[:1] == "[":
            rows = json.loads(text)  # one JSON array of records (what pandas' to_json writes)
            if not all(isinstance(r, dict) for r in rows):
                raise ValueError("a JSON array must hold one object per row")
            return pa.Table.from_pylist(rows)
        if kind in ("JSON", "JSONL"):
            import pyarrow.json as pj

            return pj.read_json(p)
        import pyarrow.csv as pcsv

        return pcsv.read_csv(p, parse_options=pcsv.ParseOptions(delimiter="\t" if kind == "TSV" else ","),
                             convert_options=pcsv.ConvertOptions(column_types={c: pa.binary() for c in text_columns}))
    except Exception as e:  # a corrupt or mislabelled file: say which and why, in one line
        known = "" if p.suffix.lower() in FORMATS else f"; known suffixes: {', '.join(sorted(FORMATS))}"
        why = (str(e).strip().splitlines() or [""])[0][:200]
        if kind in ("JSON", "JSONL"):  # pyarrow counts rows from 0; raysys's own lines, and editors, from 1
            why = re.sub(r"\bin row (\d+)", lambda m: f"in row {int(m.group(1)) + 1}", why)
        raise ValueError(f"{path}: not readable as {kind} ({type(e).__name__}: {why}){known}") from None
