"""JSON files in and out: atomic writes, canonical hashing, one-line errors on bad input."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from pfcompile.formats.errors import InputError, echo
from pfcompile.formats.limits import MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_JSON_INT_DIGITS


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
    """Read a JSON file; a missing, corrupt or unbounded file is an InputError naming the file.

    Bounded (pfcompile.formats.limits): the file's size, its nesting depth, the digits of an
    integer; NaN and Infinity (which Python's reader accepts) are not JSON and refused."""
    p = str(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise InputError(p, None, "no such file") from None
    except IsADirectoryError:
        raise InputError(p, None, "is a directory, expected a JSON file") from None
    except OSError as e:
        raise InputError(p, None, f"cannot read: {e.strerror}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise InputError(p, None, f"larger than {MAX_JSON_BYTES} bytes, the most pfcompile reads")
    return parse_json(raw, p)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits ({text[:12]}...), more than the "
                       f"{MAX_JSON_INT_DIGITS} any field of pfcompile holds")
    return int(text)


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _Refused(f"{text[:24]} overflows a float")
    return v


def _no_constant(text: str):
    raise _Refused(f"{text} is not a JSON number")


class _Refused(ValueError):
    pass


def parse_json(raw: bytes | str, where: str) -> Any:
    """json.loads with pfcompile's bounds; every failure is one InputError line."""
    try:
        obj = json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except _Refused as e:
        raise InputError(where, None, f"not accepted: {e}") from None
    except RecursionError:
        raise InputError(where, None, f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        line = getattr(e, "lineno", None)
        at = f" (line {line})" if line else ""
        raise InputError(where, None, f"not valid JSON{at}: {getattr(e, 'msg', str(e))}") from None
    except ValueError as e:  # e.g. a float or int the reader itself cannot convert
        raise InputError(where, None, f"not valid JSON: {str(e).splitlines()[0] if str(e) else 'bad value'}") from None
    _check_depth(obj, where)
    return obj


def _check_depth(obj: Any, where: str) -> None:
    """Iteratively (a recursive walk would itself overflow on what it is meant to refuse)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            items = o.values()
        elif isinstance(o, list):
            items = o
        else:
            continue
        if d > MAX_JSON_DEPTH:
            raise InputError(where, None, f"nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((v, d + 1) for v in items if isinstance(v, (dict, list)))


def check_output_path(path: str | os.PathLike, flag: str) -> None:
    """An output file named on the command line: refused before any work if it is a
    directory, or if its folder is not writable (the nearest existing one decides)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(flag, None, f"{str(p)!r} is a directory; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise InputError(flag, None, f"{str(p)!r} is not writable")
    parent = p.parent if str(p.parent) else Path(".")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(flag, None, f"{str(parent)!r} is not a directory, {str(p)!r} cannot be made")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(flag, None, f"cannot write into {str(parent)!r} (permission denied)")


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """An output folder named on the command line: must be a folder (or creatable) and writable."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(flag, None, f"{str(p)!r} is a file, expected a directory")
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(flag, None, f"{str(probe)!r} is not a directory, {str(p)!r} cannot be made")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(flag, None, f"cannot write into {str(probe)!r} (permission denied)")


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
            raise self.fail("schema", f"expected {schema!r}, got {echo(got)} (is this a {what}?)")
        v = self.req("schema_version", int)
        if v != version:
            raise self.fail("schema_version", f"unsupported version {v} (this pfcompile reads {version})")

    def sub(self, key: str) -> Fields:
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
            raise self.fail(key, f"expected {names}, got {type(value).__name__} {echo(value)}")
        if check is not None and not check(value):
            raise self.fail(key, why or f"invalid value {echo(value)}")
        return value
