"""A remote slide's identity for a batch's resume: its size and ETag (else its Last-Modified).

One request of one byte asks for them; the fingerprint a resume compares is a hash of the ETag (or of
the Last-Modified and size), so a slide replaced on the server is run again and one left as it was is
skipped.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import SlideError


def remote_identity(address: str) -> dict[str, Any] | None:
    """``{"size", "fingerprint", "etag" | "last_modified"}`` of the object at ``address``; None where
    it cannot be had (the run then fails the slide, saying why)."""
    from .remote_file import RangeClient

    try:
        reply = RangeClient(address).fetch(0, 1, "its size and ETag")
    except SlideError:
        return None
    if reply.size is None or not (reply.etag or reply.last_modified):
        return None
    stamp = {"etag": reply.etag} if reply.etag else {"last_modified": reply.last_modified}
    seen = f"etag {reply.etag}" if reply.etag else f"last-modified {reply.last_modified} size {reply.size}"
    return {"size": reply.size, "fingerprint": hashlib.sha256(seen.encode()).hexdigest()[:32], **stamp}
