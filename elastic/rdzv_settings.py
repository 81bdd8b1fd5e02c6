"""`--rdzv-conf` of the `etcd-v3` backend: the one list of known keys and the one parser.

`elastic-run` parses the flag with it before anything starts (a bad value exits 2, argparse-style),
and the handler parses the same keys again when torch creates it, so stock `torchrun
--rdzv-backend etcd-v3` rejects the same mistakes. Values come as strings from the command line
(or as numbers from Python's `LaunchConfig(rdzv_configs=...)`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta

MAX_SECONDS = 30 * 24 * 3600
"""Longest duration accepted: longer ones are typos, and overflow waits and timers."""

TORCH_KEYS = frozenset({"timeout", "rank"})
"""Keys torch's launcher adds to every backend's config by itself (`timeout` always, `rank` for
`static`); etcd-v3 does not use them, so the handler drops them before parsing."""


@dataclass(frozen=True, kw_only=True)
class RendezvousSettings:
    """The parsed `--rdzv-conf` (defaults for keys not given)."""

    node_id: str | None = None
    """This agent's id in the run; None: `<hostname>-<pid>-<random>`."""
    prefix: str = "elastic-train"
    """etcd key prefix shared by all runs."""
    lease_ttl: timedelta = timedelta(seconds=3)
    """Membership lease TTL: how soon peers learn that this node's machine is gone."""
    join_timeout: timedelta = timedelta(seconds=600)
    """Deadline of one rendezvous (also how long a spare waits for a place)."""
    last_call_timeout: timedelta = timedelta(seconds=30)
    """How long a round with >= min nodes waits for a live node that does not join."""
    etcd_timeout: timedelta = timedelta(seconds=15)
    """How long each etcd call retries transient failures."""
    ca_cert: str | None = None
    """CA bundle (PEM) of the etcd servers; enables TLS (`cacert=` or `ca_cert=`)."""
    cert: str | None = None
    """Client certificate (PEM) for mutual TLS."""
    key: str | None = None
    """Client private key (PEM) for mutual TLS."""
    user: str | None = None
    """etcd user for password authentication."""
    password: str | None = field(default=None, repr=False)
    """etcd password (visible in `ps`: prefer `password_file`)."""
    password_file: str | None = None
    """File holding the etcd password."""
    join_token_file: str | None = None
    """File holding the run's join token (run admission)."""

    def __post_init__(self) -> None:
        if self.node_id is not None and (not self.node_id or "/" in self.node_id):
            raise ValueError(f"node_id={self.node_id!r}: must be non-empty and contain no '/'")
        if not self.prefix.strip("/"):
            raise ValueError(f"prefix={self.prefix!r}: must name a key prefix, e.g. prefix=elastic-train")
        for name in ("lease_ttl", "join_timeout", "last_call_timeout", "etcd_timeout"):
            value: timedelta = getattr(self, name)
            if not timedelta(0) < value <= timedelta(seconds=MAX_SECONDS):
                raise ValueError(
                    f"{name}={value.total_seconds():g}: must be positive and at most {MAX_SECONDS} seconds"
                )
        if self.lease_ttl < timedelta(seconds=1):
            raise ValueError(f"lease_ttl={self.lease_ttl.total_seconds():g}: must be at least 1 second "
                             "(etcd leases count whole seconds)")
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert= and key= go together (mutual TLS needs both the certificate and its key)")
        if self.password is not None and self.password_file is not None:
            raise ValueError("password= and password_file= contradict each other; pass one of them")


_DURATIONS = frozenset({"lease_ttl", "join_timeout", "last_call_timeout", "etcd_timeout"})
_ALIASES = {"cacert": "ca_cert"}
KNOWN_KEYS = frozenset({f.name for f in fields(RendezvousSettings)} | set(_ALIASES))
"""Every key `--rdzv-conf` accepts for the etcd-v3 backend."""


def parse_conf(conf: Mapping[str, object]) -> RendezvousSettings:
    """Parse `--rdzv-conf` key=value pairs. Raises ValueError naming the key and the value."""
    values: dict[str, object] = {}
    for raw_key, value in conf.items():
        key = str(raw_key)
        if key not in KNOWN_KEYS:
            raise ValueError(_unknown(key))
        name = _ALIASES.get(key, key)
        if name in values:
            raise ValueError(f"{key}= repeats {name}= (cacert and ca_cert are one setting); pass one of them")
        values[name] = _seconds(key, value) if name in _DURATIONS else _text(key, value)
    return RendezvousSettings(**values)  # type: ignore[arg-type]


def _seconds(key: str, value: object) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{key}={value!r}: must be a number of seconds")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{key}={value!r}: must be a number of seconds, e.g. {key}=30") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{key}={value!r}: must be a positive, finite number of seconds")
    if seconds > MAX_SECONDS:
        raise ValueError(f"{key}={value!r}: must be at most {MAX_SECONDS} seconds (30 days)")
    return timedelta(seconds=seconds)


def _text(key: str, value: object) -> str:
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if not text:
        raise ValueError(f"{key}={value!r}: must be a non-empty string")
    return text


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    if key in TORCH_KEYS:
        hint = (
            " (torchrun's generic rendezvous timeout is not used by etcd-v3; use join_timeout)"
            if key == "timeout"
            else " (only the static backend reads it)"
        )
    return f"unknown key {key!r}{hint}; the etcd-v3 backend knows: {', '.join(sorted(KNOWN_KEYS))}"
