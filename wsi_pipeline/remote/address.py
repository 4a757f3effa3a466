"""Remote slide addresses: ``https://host/path``, ``http://host/path`` and ``s3://bucket/key``.

An address is kept as the string the user gave (a path would fold its ``//``); :class:`RemoteAddress`
answers the few questions a batch asks of a slide path (its name, stem and suffix).
"""

from __future__ import annotations

import os
import posixpath
from typing import NamedTuple
from urllib.parse import urlsplit

from ..errors import SlideOpenError

SCHEMES = ("http", "https", "s3")


def is_remote(path: object) -> bool:
    """Whether ``path`` is a remote slide address (``http://``, ``https://``, ``s3://``)."""
    if not isinstance(path, str):  # a pathlib.Path has folded the address's "//" already
        return False
    head, sep, _ = path.partition("://")
    return bool(sep) and head.lower() in SCHEMES


class Parts(NamedTuple):
    """An address taken apart: ``scheme`` (lower case), ``host`` (an S3 bucket) and ``key`` (the path
    on the server, without its leading ``/``; an S3 object's key)."""

    scheme: str
    host: str
    key: str


def address_parts(address: str) -> Parts:
    """The parts of a remote ``address``; :class:`SlideOpenError` where it names no object or holds
    credentials (``user:password@``: they belong in ``~/.netrc`` or the environment, not in an
    address that logs and outputs show)."""
    split = urlsplit(address)
    shown = shown_address(address)
    if split.username is not None or split.password is not None:
        raise SlideOpenError(
            shown,
            "the address holds credentials (user@ or user:password@); give them in ~/.netrc, "
            "WSI_PIPELINE_HTTP_TOKEN or the AWS environment instead",
        )
    scheme = split.scheme.lower()
    host = split.netloc  # an S3 bucket's name as given; a server's host and port
    key = split.path.lstrip("/")
    if not host or not key or key.endswith("/"):
        raise SlideOpenError(
            shown, f"expected {scheme}://{'BUCKET/KEY' if scheme == 's3' else 'HOST/PATH'} of one slide"
        )
    return Parts(scheme, host, key)


def shown_address(address: str) -> str:
    """``address`` as messages, logs and outputs show it: without ``user:password@`` and without
    its query string and fragment (a pre-signed address's signature)."""
    split = urlsplit(address)
    netloc = split.netloc.rpartition("@")[2]
    return f"{split.scheme}://{netloc}{split.path}"


class RemoteAddress(str):
    """A remote slide address among a batch's slide paths: the address itself, with the parts of a
    path's answers a batch asks for (``name``, ``stem``, ``suffix``)."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return posixpath.basename(urlsplit(self).path)

    @property
    def suffix(self) -> str:
        return os.path.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return os.path.splitext(self.name)[0]

    def is_file(self) -> bool:
        return False

    def is_dir(self) -> bool:
        return False

    def exists(self) -> bool:
        return False
