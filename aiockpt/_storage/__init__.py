"""Where checkpoints live: a local directory, or a prefix of an S3-compatible object store.

A path is resolved once, at the API boundary (:func:`resolve`): ``s3://bucket/prefix`` becomes an
:class:`S3Path`, anything else an absolute :class:`~pathlib.Path`. The pipelines then dispatch on that
type at their few storage-facing steps (write, commit, discard, manifest and data reads, listing); the
local code paths are untouched. The S3 backend (``_s3``) imports its client lazily, so the ``s3`` extra
is needed only by those who use ``s3://`` URLs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .._errors import CheckpointError
from .._fs import absolute
from .._options import _is_int

SCHEME = "s3://"

# Upper bounds of S3Options' fields, far past any useful setting: the client holds a timeout as a
# timedelta (under 10**14 s) and a count in a 64-bit integer.
_MAX_SECONDS = 10**9  # 31 years
_MAX_COUNT = 2**32
_MAX_PART = 1 << 40


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """How aiockpt talks to an S3-compatible object store (the ``s3`` extra, ``aiockpt[s3]``).

    Every field left ``None`` comes from the standard AWS environment (``AWS_ENDPOINT_URL``,
    ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``); plain ``http://`` is allowed only for an endpoint given that way.

    Attributes:
        endpoint: The endpoint URL of a non-AWS store (MinIO, Ceph, a test server).
        region: The bucket's region.
        part_size: Bytes per multipart-upload part; smaller data objects go up in one request. Stores
            require at least 5 MiB for every part but the last (AWS S3; others let it be configured): a
            store refuses smaller parts when the save uploads them, with a
            :class:`~aiockpt.StorageError`. They are not refused here, for stores that take them.
        concurrency: Requests in flight at once per rank: parts of an upload, ranged reads of a load.
        max_retries: Retries of a failed request (5xx, throttling, dropped connections), with
            exponential backoff and jitter.
        retry_timeout: Seconds after which a request is no longer retried.
        request_timeout: Seconds one request may take, from connecting to its last byte, before it fails
            (and is retried). Parts go up ``concurrency`` at a time: the link must carry ``concurrency *
            part_size`` bytes in this long (with the defaults, 128 MiB in 120 s: 9 Mbit/s); on a slower
            one, raise it or lower the others. (The client's own default, 30 s, failed every save over
            a link slower than about 36 Mbit/s.)
        stale_after: Seconds after which the objects of an uncommitted save that holds no lease (written
            by releases that took none) count as abandoned: a :class:`~aiockpt.Checkpointer` deletes them
            when it opens, and a save to their prefix deletes them first. Saves of this release are judged
            by their lease instead (see ``lease_timeout``).
        lease_timeout: Seconds a save's lease object may go unrenewed before other processes count the save
            as abandoned and delete its objects. A running save renews it every ``lease_timeout / 8``, and
            fails rather than commit once it could not renew it for ``lease_timeout / 2``; the event loop
            that runs a save must never stall that long. A save whose process is gone from this host (the
            same boot and PID namespace) counts as abandoned at once. The save's own value is written into
            its lease and is the one others go by.
    """

    endpoint: str | None = None
    region: str | None = None
    part_size: int = 16 << 20
    concurrency: int = 8
    max_retries: int = 10
    retry_timeout: float = 180.0
    request_timeout: float = 120.0
    stale_after: float = 3600.0
    lease_timeout: float = 120.0

    def __post_init__(self) -> None:
        # Types are checked too: values often come from a config file ("8MB", "60"), and a float where
        # the client wants an int (or nan, inf) made the save fail with a bare TypeError or ValueError.
        for name in ("endpoint", "region"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise CheckpointError(f"S3Options.{name} must be a non-empty str or None, not {value!r}")
        for name, low, high, said in (
            ("part_size", 1, _MAX_PART, "2**40"),
            ("concurrency", 1, _MAX_COUNT, "2**32"),
            ("max_retries", 0, _MAX_COUNT, "2**32"),
        ):
            value = getattr(self, name)
            if not (_is_int(value) and low <= value <= high):
                raise CheckpointError(f"S3Options.{name} must be an int from {low} to {said}, not {value!r}")
        for name, positive in (
            ("retry_timeout", False),
            ("request_timeout", True),
            ("stale_after", False),
            ("lease_timeout", True),
        ):
            value = getattr(self, name)
            if not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and (value > 0 if positive else value >= 0)  # (nan is neither)
                and value <= _MAX_SECONDS
            ):
                least = "positive" if positive else "non-negative"
                raise CheckpointError(
                    f"S3Options.{name} must be a {least} number of seconds, at most 10**9, not {value!r}"
                )


@dataclass(frozen=True)
class S3Path:
    """A checkpoint location in a bucket: the objects under ``key + "/"``.

    It behaves like the few :class:`~pathlib.PurePath` operations the pipelines use (``/``, ``name``,
    ``parent``, ``with_name``) and prints as its URL.
    """

    bucket: str
    key: str
    options: S3Options = field(default_factory=S3Options, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def __truediv__(self, name: str) -> S3Path:
        return S3Path(self.bucket, f"{self.key}/{name}" if self.key else name, self.options)

    @property
    def name(self) -> str:
        """The last segment of the key."""
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> S3Path:
        """The location one segment up."""
        return S3Path(self.bucket, self.key.rpartition("/")[0], self.options)

    def with_name(self, name: str) -> S3Path:
        """A sibling location."""
        return self.parent / name


Location = Path | S3Path


def is_url(path: object) -> bool:
    """Whether ``path`` is an ``s3://`` URL (as a str)."""
    return isinstance(path, str) and path.startswith(SCHEME)


def resolve(path: str | os.PathLike[str] | S3Path, s3: S3Options | None = None) -> Location:
    """``s3://bucket/prefix`` as an :class:`S3Path`; any other path made absolute.

    Raises:
        CheckpointError: ``path`` is empty, the URL names no bucket or no prefix (or one with ``.``,
            ``..`` or a control character in it), or ``s3`` options come with a local path.
    """
    if isinstance(path, S3Path):
        return path if s3 is None else S3Path(path.bucket, path.key, s3)
    if not is_url(path):
        _check_not_empty(path)
        if s3 is not None:
            raise CheckpointError(f"s3= options were given for the local path {os.fspath(path)!r}")
        return absolute(path)
    assert isinstance(path, str)
    bucket, _, key = path[len(SCHEME) :].partition("/")
    key = "/".join(part for part in key.split("/") if part)
    if not bucket or not key:
        raise CheckpointError(f"{path!r} is not a checkpoint URL: use s3://bucket/prefix")
    if any(part in (".", "..") for part in key.split("/")):
        raise CheckpointError(f"{path!r}: '.' and '..' are not allowed in an object key")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):  # (the client refuses them, with a ValueError)
        raise CheckpointError(f"{path!r}: control characters are not allowed in an object key")
    return S3Path(bucket, key, s3 or S3Options())


def local(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` made absolute, for operations that work on the local file system only.

    Raises:
        CheckpointError: ``path`` is empty, or an ``s3://`` URL; the message names ``what`` refused it.
    """
    _check_not_empty(path, what)
    if is_url(path):
        raise CheckpointError(
            f"{what} works on local paths only, not on {os.fspath(path)!r}: use aiockpt.load, "
            "aiockpt.read or a Checkpointer for s3:// checkpoints"
        )
    return absolute(path)


def _check_not_empty(path: str | os.PathLike[str], what: str | None = None) -> None:
    """Refuse the empty path, which ``os.path.abspath`` would take for the working directory.

    Raises:
        CheckpointError: ``path`` is empty (``what``, where given, is named as refusing it).
    """
    if not os.fspath(path):
        said = "the path is empty" if what is None else f"{what} was given an empty path"
        raise CheckpointError(f"{said}: name a directory or file ('.' is the working directory)")
