"""Credentials the agent holds (the etcd password, the join token): read from files, never printed.

`read_secret_file` reads one from a file (`--rdzv-conf password_file=`, `join_token_file=`), so it
never has to be on the command line, where `ps` shows it to every user of the machine. `protect`
registers a secret: from then on every log record that passes through the root logger's handlers,
and every message built with `redact`, shows `***` in its place.
"""

from __future__ import annotations

import logging
import os
import stat
import threading

MASK = "***"
MAX_SECRET_BYTES = 64 * 1024
"""A secret file larger than this is the wrong file."""
MIN_MASKED_LENGTH = 4
"""Shorter values are not masked: hiding every 'a' would garble the logs and protect nothing."""

_secrets: set[str] = set()
_lock = threading.Lock()


def read_secret_file(path: str, *, key: str) -> str:
    """The contents of the secret file `path` (given as `--rdzv-conf key=path`), without its final newline.

    Raises ValueError naming the key and the path: a missing or unreadable file, a directory, a
    FIFO (which would block), an empty or oversized file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"{key}={path}: cannot open it ({exc.strerror}); pass the path of a readable file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{key}={path}: not a regular file; pass the path of the file that holds the secret")
        if info.st_size > MAX_SECRET_BYTES:
            raise ValueError(
                f"{key}={path}: {info.st_size} bytes is too large for a secret (at most {MAX_SECRET_BYTES})"
            )
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{key}={path}: not UTF-8 text") from None
    text = text.rstrip("\r\n")
    if not text:
        raise ValueError(f"{key}={path}: the file is empty")
    return text


def protect(secret: str | bytes | None) -> None:
    """Mask `secret` in every log line from now on (and in `redact`)."""
    if secret is None:
        return
    text = secret.decode(errors="replace") if isinstance(secret, bytes) else secret
    if len(text) < MIN_MASKED_LENGTH:
        return
    with _lock:
        _secrets.add(text)
    _install_filter()


def redact(text: str) -> str:
    """`text` with every protected secret replaced by `***`."""
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)  # a secret inside a longer one: mask the longer first
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


class _RedactFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not _secrets:
            return True
        message = record.getMessage()
        masked = redact(message)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if masked != message:
            record.msg, record.args = masked, None
        return True


_FILTER = _RedactFilter()


def _install_filter() -> None:
    # On the handlers, not the loggers: a logger's filters see only that logger's own records,
    # a handler's see every record that reaches it, from torch's loggers and ours alike.
    root = logging.getLogger()
    for handler in [*root.handlers, logging.lastResort]:
        if handler is not None and _FILTER not in handler.filters:
            handler.addFilter(_FILTER)


def mask_conf(conf: str) -> str:
    """A `--rdzv-conf` string as it may be shown: the value of every `password=` replaced by `***`."""
    return ",".join(f"{item.partition('=')[0]}={MASK}" if item.strip().startswith("password=") else item
                    for item in conf.split(","))
