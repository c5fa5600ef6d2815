"""JSON files in and out: atomic writes, canonical hashing, one-line errors on bad input."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pfcompile.formats.errors import InputError


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """A binary file that appears at `path` whole or not at all.

    Written beside `path` under a temporary name, fsynced, then renamed over it; on any
    error the temporary file is removed and `path` keeps its old content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; outputs are ordinary files
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: readers never see half a file."""
    with atomic_file(path) as f:
        f.write(text.encode() if isinstance(text, str) else text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def canonical_hash(obj: Any) -> str:
    """sha256 of the canonical JSON form (sorted keys, no spaces): stable across writers."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a missing or corrupt file is an InputError naming the file."""
    p = str(path)
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise InputError(p, None, "no such file") from None
    except IsADirectoryError:
        raise InputError(p, None, "is a directory, expected a JSON file") from None
    except OSError as e:
        raise InputError(p, None, f"cannot read: {e.strerror}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        line = getattr(e, "lineno", None)
        at = f" (line {line})" if line else ""
        raise InputError(p, None, f"not valid JSON{at}: {getattr(e, 'msg', str(e))}") from None


class Fields:
    """Typed access to a parsed JSON object that turns every problem into an InputError.

    `Fields(obj, path, "ranks[0]").req("rank", int)` raises
    `path: ranks[0].rank: expected int, got str`.
    """

    def __init__(self, obj: Any, where: str, prefix: str = ""):
        if not isinstance(obj, dict):
            raise InputError(where, prefix or None, f"expected an object, got {type(obj).__name__}")
        self.obj, self.where, self.prefix = obj, where, prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str | None, message: str) -> InputError:
        return InputError(self.where, self.name(key) if key else (self.prefix or None), message)

    def req(self, key: str, typ: type | tuple[type, ...], *, check=None, why: str = "") -> Any:
        if key not in self.obj:
            raise self.fail(key, "missing")
        return self._typed(key, self.obj[key], typ, check, why)

    def opt(self, key: str, typ: type | tuple[type, ...], default: Any = None, *, check=None, why: str = "") -> Any:
        if key not in self.obj or self.obj[key] is None:
            return default
        return self._typed(key, self.obj[key], typ, check, why)

    def schema(self, schema: str, version: int, what: str) -> None:
        """The file's `schema` and `schema_version` must be ours: a foreign file fails here."""
        got = self.req("schema", str)
        if got != schema:
            raise self.fail("schema", f"expected {schema!r}, got {got!r} (is this a {what}?)")
        v = self.req("schema_version", int)
        if v != version:
            raise self.fail("schema_version", f"unsupported version {v} (this pfcompile reads {version})")

    def sub(self, key: str) -> "Fields":
        if key not in self.obj:
            raise self.fail(key, "missing")
        return Fields(self.obj[key], self.where, self.name(key))

    def _typed(self, key, value, typ, check, why):
        types = typ if isinstance(typ, tuple) else (typ,)
        if float in types and int not in types:
            types = types + (int,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            names = "/".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
            raise self.fail(key, f"expected {names}, got {type(value).__name__} {value!r:.40}")
        if check is not None and not check(value):
            raise self.fail(key, why or f"invalid value {value!r:.40}")
        return value
