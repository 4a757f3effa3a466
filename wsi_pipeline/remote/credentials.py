"""Credentials for remote slides, from the standard places, and the texts they must never reach.

HTTP(S): a bearer token from ``WSI_PIPELINE_HTTP_TOKEN``, else the host's entry of ``~/.netrc``
(``$NETRC`` where set), sent as basic authentication. S3: boto3's credential chain (the
``AWS_*`` environment, ``~/.aws/credentials`` and ``~/.aws/config``, instance roles) and
``AWS_ENDPOINT_URL`` for another endpoint than AWS's. None of them is written anywhere:
:func:`redact` takes any that a message might still hold out of it.
"""

from __future__ import annotations

import base64
import netrc
import os

TOKEN_VARIABLE = "WSI_PIPELINE_HTTP_TOKEN"
_AWS_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _netrc_path() -> str:
    return os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")


def _netrc_entry(host: str) -> tuple[str, str] | None:
    """(login, password) of ``host`` in the netrc file, or None (no file, no entry, unreadable)."""
    path = _netrc_path()
    if not os.path.isfile(path):
        return None
    try:
        found = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):  # a broken file is no credential; the server then refuses
        return None
    if not found or found[2] is None:
        return None
    return found[0] or "", found[2]


def http_headers(host: str) -> dict[str, str]:
    """The ``Authorization`` header for ``host`` (no port), or none."""
    token = os.environ.get(TOKEN_VARIABLE)
    if token:
        return {"Authorization": f"Bearer {token}"}
    entry = _netrc_entry(host)
    if entry is None:
        return {}
    pair = base64.b64encode(f"{entry[0]}:{entry[1]}".encode()).decode()
    return {"Authorization": f"Basic {pair}"}


def known_secrets(host: str | None = None) -> list[str]:
    """The secrets this process may send: the token, ``host``'s netrc password and its basic
    authentication, the AWS secret key and session token."""
    found = [os.environ.get(name, "") for name in (TOKEN_VARIABLE, *_AWS_SECRETS)]
    if host is not None:
        entry = _netrc_entry(host)
        if entry is not None:
            found.append(entry[1])
            found.append(base64.b64encode(f"{entry[0]}:{entry[1]}".encode()).decode())
    return [s for s in found if len(s) >= 4]


def redact(text: str, host: str | None = None) -> str:
    """``text`` with every secret of :func:`known_secrets` replaced by ``***``."""
    for secret in known_secrets(host):
        text = text.replace(secret, "***")
    return text
