"""What to do about an OSError of a checkpoint write: advice per errno, naming the directory.

A full disk, a read-only mount, a missing permission and a file where a directory belongs need
different fixes; one generic "free disk space or fix permissions" sends the user the wrong way.
"""

from __future__ import annotations

import errno
from pathlib import Path

from ckpt.durable import strerror


def advice(exc: OSError, root: Path) -> str:
    """One sentence: how to make writes under the checkpoint directory `root` work again."""
    code = exc.errno
    # A rename's error (a temp file put in place) is about its target, filename2, when the target is what is wrong.
    where = (exc.filename2 if code in (errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY) and exc.filename2 else
             exc.filename) or root
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on the file system of {root} (or lower keep_last), then save again"
    if code == errno.EROFS:
        return (
            f"{root} is on a read-only file system: remount it read-write or choose another "
            f"checkpoint directory"
        )
    if code in (errno.EACCES, errno.EPERM):
        return f"give this user ({_user()}) write permission on {root}, or choose another directory"
    if code == errno.ENOTDIR:
        return (
            f"a component of {where} is a regular file, not a directory: move that file away "
            f"or choose another checkpoint directory"
        )
    if code in (errno.EEXIST, errno.EISDIR):
        return (
            f"{where} exists and is not what a checkpoint expects there (a file where a "
            f"directory belongs, or the reverse): move it away, then save again"
        )
    if code == errno.ELOOP:
        return (
            f"{where} is a symbolic link, and a checkpoint never follows a link inside its directory: replace the "
            f"link with what it points to, or remove it"
        )
    if code == errno.EIO:
        return f"the device under {root} reports I/O errors: check the disk (dmesg) before saving again"
    if code == errno.ENAMETOOLONG:
        return f"the path {where} is too long for its file system: choose a shorter directory"
    return f"check that {root} is a writable directory on a healthy file system"


def describe(exc: OSError, root: Path) -> str:
    """`strerror(exc)` followed by the advice, e.g. "Not a directory (ENOTDIR); a component ..."."""
    return f"{strerror(exc)}; {advice(exc, root)}"


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "the current user"
