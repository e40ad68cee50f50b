"""The execution policy file of a service: read at start (strict), watched for changes (lenient).

File I/O lives here, at the edge; :mod:`nexuskv.policy` parses and validates the bytes. Start-up
is strict (an invalid file raises PolicyError naming every bad field); a reload is not (the last
known good policy stays in force and the outcome carries the error).

Only a whole file goes into force: a TOML policy file must end with
:data:`nexuskv.policy.POLICY_END_MARKER` (a truncated one is refused like any invalid edit), and
a file that changes while it is read is read again at the next poll. Write a new policy beside
the old file and rename it into place. :meth:`PolicyFile.poll` never raises: whatever goes
wrong (a file nested so deeply that the parser recurses too far, one that cannot be read) is a
refused edit with its reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from nexuskv.errors import PolicyError
from nexuskv.policy import ExecutionPolicy, PolicyHolder, ReloadOutcome, check_complete, parse_policy

__all__ = ["PolicyFile", "load_policy"]


def _format_of(path: Path) -> Literal["toml", "json"]:
    return "json" if path.suffix.lower() == ".json" else "toml"


def load_policy(path: Path) -> ExecutionPolicy:
    """Read and validate a policy file (``.json`` as JSON, anything else as TOML)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PolicyError(str(path), [("<file>", f"cannot read: {exc.strerror or exc}")]) from None
    check_complete(raw, fmt=_format_of(Path(path)), origin=str(path))
    return parse_policy(raw, fmt=_format_of(Path(path)), origin=str(path))


class PolicyFile:
    """A policy file watched for changes: :meth:`poll` reloads it when its stat changes.

    Start-up is strict (an invalid file raises PolicyError naming the field); a reload is not
    (the last known good policy stays in force and the outcome carries the error).
    """

    __slots__ = ("path", "holder", "_stamp")

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._stamp = self._stat()
        self.holder = PolicyHolder(load_policy(self.path))

    @property
    def current(self) -> ExecutionPolicy:
        return self.holder.current

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self) -> ReloadOutcome | None:
        """Reload if the file changed since the last look; None when it did not (or is changing now)."""
        stamp = self._stat()
        if stamp == self._stamp:
            return None
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            self._stamp = stamp
            err = PolicyError(str(self.path), [("<file>", f"cannot read: {exc.strerror or exc}")])
            return ReloadOutcome(self.holder.current, changed=False, error=err)
        if self._stat() != stamp:
            return None  # written while we read: look again at the next poll
        self._stamp = stamp
        try:
            return self.holder.offer(raw, fmt=_format_of(self.path), origin=str(self.path), whole_file=True)
        except Exception as exc:  # noqa: BLE001 - a reload must never stop its caller's loop
            err = PolicyError(str(self.path), [("<document>", f"cannot be read as a policy: {type(exc).__name__}")])
            return ReloadOutcome(self.holder.current, changed=False, error=err)
