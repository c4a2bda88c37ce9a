"""Results files written whole or not at all.

A file is written under a temporary name in its own folder and renamed over
the final name (`os.replace`, atomic on one file system) only once it is
complete; an interrupted or failing write removes the temporary file and
leaves any earlier file of that name as it was.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def temporary_name(path: Path) -> Path:
  """A hidden, unused-looking name next to ``path`` (``.NAME.XXXXXXXX.tmp``)."""
  return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
  """Opens a temporary file for writing; on success it replaces ``path``.

  ``mode`` is ``"w"`` (text) or ``"wb"`` (bytes). When the block raises
  (`KeyboardInterrupt` included) the temporary file is removed and ``path``
  is untouched.
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"mode must be 'w' or 'wb', not {mode!r}")
  tmp = temporary_name(path)
  try:
    with tmp.open(mode.replace("w", "x")) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def write_text(path: Path, text: str) -> None:
  """Writes ``text`` to ``path`` atomically."""
  with atomic_open(path) as f:
    f.write(text)
