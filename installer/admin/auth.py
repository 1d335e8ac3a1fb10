"""The admin page's secrets: the admin token (stored only as a salted scrypt hash), sessions, CSRF, login backoff.

The admin token is separate from the OpenAI API key: it is created once (at install, or by `envex admin` when
the prefix has none), shown once, and only its hash is kept, in `<prefix>/admin/token.json` (0600). A login
trades it for a server-side session: a random id in an HttpOnly, SameSite=Strict cookie scoped to /admin, with
an idle and an absolute expiry, and a per-session CSRF token that every form posts back.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from envex.bundles.files import read_regular_file
from envex.installer.fsutil import atomic_write

ADMIN_DIR = "admin"
TOKEN_FILE = "token.json"
TOKEN_PREFIX = "envex-admin-"
# scrypt at N=2**14, r=8, p=1 costs ~16 MiB and tens of milliseconds: cheap for one login, dear for a guesser.
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}
SESSION_IDLE_S = 60 * 60
SESSION_MAX_S = 12 * 60 * 60
MAX_SESSIONS = 64
MAX_TOKEN_FILE_BYTES = 64 * 1024  # the record is about 250 bytes


class AdminTokenError(RuntimeError):
    """The admin token file is missing, unreadable or invalid; the message says what to do."""


def token_path(prefix: Path) -> Path:
    return Path(prefix) / ADMIN_DIR / TOKEN_FILE


def _hash(token: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(token.encode(), salt=salt, n=n, r=r, p=p, maxmem=64 * 1024 * 1024, dklen=32)


def create_admin_token(prefix: Path, *, replace: bool = False) -> str:
    """Create the prefix's admin token; returns it (show it to the operator once: only its hash is stored).

    Refuses to replace an existing token unless `replace` (which logs out nobody by itself: sessions live in the
    running server, which re-reads the hash at each login).
    """
    path = token_path(prefix)
    if path.exists() and not replace:
        raise AdminTokenError(f"{path} exists: this prefix already has an admin token; use --reset-token to replace it")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    record = {
        "schema_version": 1,
        "scheme": "scrypt",
        **_SCRYPT,
        "salt": salt.hex(),
        "hash": _hash(token, salt, **_SCRYPT).hex(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    atomic_write(path, json.dumps(record).encode(), mode=0o600)
    return token


def has_admin_token(prefix: Path) -> bool:
    return token_path(prefix).is_file()


def verify_admin_token(prefix: Path, token: str) -> bool:
    """True when `token` is the prefix's admin token (constant-time comparison of the scrypt hashes)."""
    path = token_path(prefix)
    try:
        if not os.path.lexists(path):
            raise FileNotFoundError(path)
        record = json.loads(read_regular_file(path, max_bytes=MAX_TOKEN_FILE_BYTES, what="admin token file"))
        salt = bytes.fromhex(record["salt"])
        expected = bytes.fromhex(record["hash"])
        n, r, p = int(record["n"]), int(record["r"]), int(record["p"])
    except FileNotFoundError:
        raise AdminTokenError(f"{path}: no admin token; run envex admin --prefix {prefix} to create one") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdminTokenError(
            f"{path}: unreadable or invalid ({exc}); recreate it with envex admin --reset-token"
        ) from None
    if record.get("scheme") != "scrypt" or not (2 <= n <= 1 << 20 and 1 <= r <= 32 and 1 <= p <= 16):
        raise AdminTokenError(f"{path}: unknown hash parameters; recreate it with envex admin --reset-token")
    if len(token) > 256:  # nothing legitimate is this long; do not spend scrypt on it
        return False
    return hmac.compare_digest(_hash(token, salt, n, r, p), expected)


@dataclass
class Session:
    id: str
    csrf: str
    created: float
    last_seen: float
    flash: list[tuple[str, str]] = field(default_factory=list)  # (kind, message) shown once on the next page


@dataclass
class SessionStore:
    """Server-side sessions, in memory: a restart logs everyone out, which is what an appliance wants."""

    idle_s: float = SESSION_IDLE_S
    max_s: float = SESSION_MAX_S
    _sessions: dict[str, Session] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def create(self) -> Session:
        now = time.monotonic()
        session = Session(id=secrets.token_urlsafe(32), csrf=secrets.token_urlsafe(32), created=now, last_seen=now)
        with self._lock:
            self._expire(now)
            if len(self._sessions) >= MAX_SESSIONS:  # drop the oldest rather than grow without bound
                oldest = min(self._sessions.values(), key=lambda s: s.last_seen)
                del self._sessions[oldest.id]
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            session = self._sessions.get(session_id)
            if session is not None:
                session.last_seen = now
            return session

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def _expire(self, now: float) -> None:
        dead = [k for k, s in self._sessions.items() if now - s.last_seen > self.idle_s or now - s.created > self.max_s]
        for key in dead:
            del self._sessions[key]


def csrf_ok(session: Session, submitted: str | None) -> bool:
    return bool(submitted) and hmac.compare_digest(session.csrf.encode(), str(submitted).encode())


@dataclass
class LoginThrottle:
    """Backoff after failed logins: from the `free`-th failure on, each attempt must wait 2, 4, 8 ... 60 s.

    Global rather than per address: the page is for a handful of operators on loopback or a management network,
    and a guesser must not escape the backoff by changing its source port or address.
    """

    free: int = 3
    cap_s: float = 60.0
    failures: int = 0
    not_before: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_s(self) -> float:
        with self._lock:
            return max(0.0, self.not_before - time.monotonic())

    def failed(self) -> None:
        with self._lock:
            self.failures += 1
            if self.failures >= self.free:
                delay = min(self.cap_s, 2.0 ** (self.failures - self.free + 1))
                self.not_before = time.monotonic() + delay

    def succeeded(self) -> None:
        with self._lock:
            self.failures = 0
            self.not_before = 0.0
