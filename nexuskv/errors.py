"""The one exception root of NexusKV and its tree.

::

    NexusKVError
    ├── ConfigError            a setting or policy field is invalid; ``.field`` names it
    │   └── PolicyError        an execution policy file is invalid; ``.errors`` lists every field
    ├── ContractError          a wire payload or descriptor does not satisfy its contract
    │   ├── SchemaVersionError the payload's schema version is not one this build reads
    │   └── UnauthenticatedError a record's signature is missing or not its publisher's
    │       └── ReplayedError  a genuinely signed record taken before, or too old to be taken
    ├── IdentityError          tokens or scope cannot produce a canonical block key
    ├── IncompatibleStateError state exists but may not be reused; ``.reason`` says why
    ├── BrokerError            the event bus could not be reached, started or stopped
    ├── JaegerError            a local Jaeger (tests' and users' trace backend) could not be built, started or asked
    └── DataPlaneError         a tier or transfer could not do what was asked
        ├── TierFullError      the tier has no room for the payload (nothing was stored)
        ├── IntegrityError     payload bytes or header do not match their checksum or address
        ├── ObjectConflictError a store holds another object under a payload's name (nothing saved)
        └── TierUnavailableError a tier's backing store (remote process, folder) cannot be reached
            └── TierLockedError a tier folder is held by another authority (names folder and holder)

"Not found" is ``None``, never an exception and never ``-1``.
"""

from __future__ import annotations

__all__ = [
    "NexusKVError",
    "ConfigError",
    "PolicyError",
    "ContractError",
    "SchemaVersionError",
    "UnauthenticatedError",
    "ReplayedError",
    "IdentityError",
    "IncompatibleStateError",
    "BrokerError",
    "JaegerError",
    "DataPlaneError",
    "TierFullError",
    "IntegrityError",
    "ObjectConflictError",
    "TierUnavailableError",
    "TierLockedError",
]


class NexusKVError(Exception):
    """Root of every error NexusKV raises on purpose."""


class ConfigError(NexusKVError, ValueError):
    """A configuration or policy value is invalid.

    ``field`` is the dotted name of the offending setting (for environment settings, the
    variable name), so the one-line message an operator sees always names what to fix.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PolicyError(ConfigError):
    """An execution policy is invalid. ``errors`` holds one ``(field path, message)`` per defect;
    ``field`` and ``message`` are the first of them, so one line still names what to fix."""

    def __init__(self, origin: str, errors: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> None:
        self.errors = tuple(errors) or (("<root>", "invalid policy"),)
        self.origin = origin
        first_field, first_message = self.errors[0]
        super().__init__(first_field, first_message)
        more = f" (+{len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        self.args = (f"{origin}: {first_field}: {first_message}{more}",)

    def __str__(self) -> str:
        return str(self.args[0])

    def describe(self) -> str:
        """Every defect, one ``path: message`` per line."""
        return "\n".join(f"{path}: {message}" for path, message in self.errors)


class ContractError(NexusKVError, ValueError):
    """A payload or descriptor violates its versioned contract; ``path`` locates the field."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message if path is None else f"{message} (at {path})")
        self.path = path
        self.message = message


class SchemaVersionError(ContractError):
    """The payload declares a schema version this build does not read."""


class UnauthenticatedError(ContractError):
    """A record that must be signed is unsigned, or signed with another key than its publisher's."""


class ReplayedError(UnauthenticatedError):
    """A validly signed record that was taken already (its producer's sequence number was seen), or
    that falls outside the window in which a consumer can tell (too old, too far behind)."""


class IdentityError(NexusKVError, ValueError):
    """Tokens, extra keys or scope cannot be turned into canonical block keys."""


class IncompatibleStateError(NexusKVError):
    """Reuse was requested for state that the compatibility predicate rejects."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BrokerError(NexusKVError, RuntimeError):
    """The Kafka-protocol bus could not be reached, started or stopped."""


class JaegerError(NexusKVError, RuntimeError):
    """A local Jaeger could not be built (Go missing, the build failed), started or queried."""


class DataPlaneError(NexusKVError):
    """A tier or a transfer could not do what was asked; the caller falls back to recompute."""


class TierFullError(DataPlaneError):
    """The tier lacks room for a payload. Nothing was stored: a full tier rejects, it never truncates."""


class IntegrityError(DataPlaneError):
    """Payload bytes or header do not match their checksum, or the header names another payload."""


class ObjectConflictError(DataPlaneError):
    """A save found the store already holding an object under the payload's name that is not this
    payload (squatted, or a stale write): nothing was acknowledged, and the reason names what is there."""


class TierUnavailableError(DataPlaneError):
    """A tier's backing store (the remote tier process, the disk folder) cannot be reached."""


class TierLockedError(TierUnavailableError):
    """A tier folder is held by another authority (a second tier manager on one worker's disk): the
    message names the folder and the holder's pid where it is known."""
