"""The persistent cache: what one process learned about a config, kept on disk for
the next one.

Two things are stored: cuDNN's serialized execution plans (so a known config's
graphs load without cuDNN's heuristics and kernel compilation, see
`backends/cudnn.py`), and the backend a measurement chose (`backend_choice.py`).

Where: ``$FUSEDATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/fusedattn``, else
``~/.cache/fusedattn``. ``FUSEDATTN_PLAN_CACHE=0`` turns it off (`set_enabled`
does too, for this process).

Every entry has an *identity*: a JSON-able dict naming everything its content
depends on (GPU model, cuDNN and cudnn-frontend versions, the config's key, what
the entry is). The file name is the identity's SHA-256; the file repeats the
identity and carries its payload's length and SHA-256, so a truncated, corrupt,
stale or colliding file is detected, ignored and later overwritten, never
trusted. Writes go to a temporary file renamed into place, so concurrent
processes never read half an entry. A cache directory that cannot be written
costs a warning, never an error.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Optional

log = logging.getLogger("fusedattn")

ENV_DIR = "FUSEDATTN_CACHE_DIR"
ENV_ENABLED = "FUSEDATTN_PLAN_CACHE"
# Bumped when the file layout or the meaning of a payload changes: older entries
# then differ in identity and are never read.
FORMAT = 1
_MAGIC = b"fusedattn-cache 1\n"

_enabled_override: Optional[bool] = None
_warned = threading.Event()


def set_enabled(enabled: Optional[bool]) -> None:
    """Turn the persistent cache on or off for this process (None: follow the
    environment)."""
    global _enabled_override
    _enabled_override = enabled


def directory() -> Optional[Path]:
    """The cache directory, or None when the cache is off."""
    enabled = _enabled_override
    if enabled is None:
        enabled = os.environ.get(ENV_ENABLED, "1").strip().lower() not in ("0", "false", "off", "no")
    if not enabled:
        return None
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusedattn"


def _canonical(identity: Dict[str, Any]) -> bytes:
    return json.dumps({"format": FORMAT, **identity}, sort_keys=True,
                      separators=(",", ":")).encode()


def path_of(identity: Dict[str, Any]) -> Optional[Path]:
    """Where the entry of `identity` lives (None when the cache is off)."""
    root = directory()
    if root is None:
        return None
    return root / f"{hashlib.sha256(_canonical(identity)).hexdigest()}.entry"


def load(identity: Dict[str, Any]) -> Optional[bytes]:
    """The payload stored for `identity`, or None (absent, off, or not to be trusted)."""
    path = path_of(identity)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    why = None
    if not data.startswith(_MAGIC):
        why = "not a fusedattn cache file"
    else:
        head, sep, payload = data[len(_MAGIC):].partition(b"\n")
        try:
            header = json.loads(head) if sep else None
        except ValueError:
            header = None
        if not isinstance(header, dict):
            why = "unreadable header"
        elif header.get("identity") != json.loads(_canonical(identity)):
            why = "written for another identity"
        elif header.get("size") != len(payload):
            why = f"truncated ({len(payload)} of {header.get('size')} bytes)"
        elif header.get("sha256") != hashlib.sha256(payload).hexdigest():
            why = "checksum mismatch"
    if why is not None:
        log.info("fusedattn: ignoring cache entry %s: %s", path, why)
        return None
    return payload


def store(identity: Dict[str, Any], payload: bytes) -> bool:
    """Write `payload` for `identity` atomically; False (with one warning per process)
    when the cache is off or cannot be written."""
    path = path_of(identity)
    if path is None:
        return False
    header = json.dumps({"identity": json.loads(_canonical(identity)), "size": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + header.encode() + b"\n" + payload)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        if not _warned.is_set():
            _warned.set()
            log.warning("fusedattn: persistent cache %s not writable (%s); continuing without "
                        "it (set %s, or %s=0)", path.parent, e, ENV_DIR, ENV_ENABLED)
        return False
    return True


def load_json(identity: Dict[str, Any]) -> Optional[Any]:
    payload = load(identity)
    if payload is None:
        return None
    try:
        return json.loads(payload)
    except ValueError:
        return None


def store_json(identity: Dict[str, Any], value: Any) -> bool:
    return store(identity, json.dumps(value, sort_keys=True).encode())
