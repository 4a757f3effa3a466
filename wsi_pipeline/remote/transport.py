"""One range request to a remote slide: HTTP(S) with urllib3, S3 with boto3.

A transport makes a single attempt and says whether its failure is worth another
(:class:`Problem`); :mod:`.remote_file` retries with backoff and counts the requests. Why these
libraries: boto3 is the AWS credential chain and endpoint variables themselves; urllib3, which
botocore already brings, is a thread-safe connection pool with separate connect and read
timeouts, and both check a body against its Content-Length (a short one is an error, not short
pixels). Concurrency comes from a pool of threads making blocking requests: the readers spend
their time in decoding and the model, not in Python's I/O, and 16 requests in flight fill a
20 ms link for a CPU or GPU run (benchmarks/bench_remote.py). fsspec's s3fs was not taken: its
aiobotocore pins botocore to a few releases, which another package's boto3 soon breaks.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from typing import NamedTuple, Protocol

from ..extras import require
from .address import Parts
from .credentials import http_headers

# Range requests a slide has in flight at most (the connection pool's size).
MAX_CONCURRENT = 16
# Seconds a request may wait for a connection, and then for each part of its answer.
DEFAULT_TIMEOUT_S = 30.0
TIMEOUT_VARIABLE = "WSI_PIPELINE_REMOTE_TIMEOUT"
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


class Problem(Exception):
    """A request that failed: ``reason`` (no address, no credential) and whether a retry may help."""

    def __init__(self, reason: str, transient: bool):
        super().__init__(reason)
        self.reason = reason
        self.transient = transient


class Reply(NamedTuple):
    """A range request's answer: its bytes, the object's size, ETag and Last-Modified."""

    data: bytes
    size: int | None
    etag: str | None
    last_modified: str | None


class Transport(Protocol):
    def get(self, start: int, end: int) -> Reply:
        """Bytes ``[start, end)`` of the object (one attempt; :class:`Problem` where it fails)."""


def request_timeout() -> float:
    """Seconds a request waits at most for a connection and for each read (``$WSI_PIPELINE_REMOTE_TIMEOUT``)."""
    try:
        return max(0.05, float(os.environ.get(TIMEOUT_VARIABLE, DEFAULT_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def total_size(content_range: str | None) -> int | None:
    """The object's size from a ``Content-Range: bytes a-b/total`` header, or None."""
    m = _CONTENT_RANGE.match(content_range or "")
    return int(m.group(3)) if m and m.group(3) != "*" else None


def status_problem(status: int, what: str) -> Problem:
    """The :class:`Problem` of an HTTP status that is no answer to a range request."""
    if status in (401, 403):
        return Problem(f"access refused ({status}): {what}", False)
    if status in (404, 410):
        return Problem(f"not found ({status})", False)
    if status == 416:
        return Problem("the range asked for lies past the end of the object (416)", False)
    if status in (408, 425, 429) or status >= 500:
        return Problem(f"the server answered {status}", True)
    return Problem(f"unexpected answer {status} to a range request", False)


def checked_length(data: bytes, start: int, end: int, size: int | None) -> bytes:
    """``data`` where it is all of ``[start, end)`` (clipped to ``size``); a :class:`Problem` otherwise."""
    expected = (min(end, size) if size is not None else end) - start
    if len(data) != expected:
        raise Problem(f"the answer holds {len(data)} of the {expected} bytes asked for (a truncated body)", True)
    return data


class HttpTransport:
    """Range requests to an ``http(s)://`` address, through one pool of connections."""

    def __init__(self, address: str, parts: Parts):
        import urllib3

        self.url = address
        timeout = request_timeout()
        host = parts.host.rpartition(":")[0] if parts.host.rpartition(":")[2].isdigit() else parts.host
        self.headers = {"Accept-Encoding": "identity", **http_headers(host)}
        # Redirects followed (urllib3 drops Authorization for another host), nothing else retried here.
        retries = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5)
        self.pool = urllib3.PoolManager(
            num_pools=4, maxsize=MAX_CONCURRENT, retries=retries, timeout=urllib3.Timeout(timeout, timeout)
        )
        self.timeout = timeout

    def get(self, start: int, end: int) -> Reply:
        import urllib3.exceptions as ue

        headers = {**self.headers, "Range": f"bytes={start}-{end - 1}"}
        try:
            r = self.pool.request("GET", self.url, headers=headers, preload_content=False)
            try:
                if r.status != 206:
                    raise (
                        Problem("the server does not answer range requests (200 to a Range request)", False)
                        if r.status == 200
                        else status_problem(r.status, "check ~/.netrc or WSI_PIPELINE_HTTP_TOKEN")
                    )
                size = total_size(r.headers.get("Content-Range"))
                data = r.read()
            finally:
                r.close()
        except Problem:
            raise
        except ue.TimeoutError:
            raise Problem(f"no answer within {self.timeout:g} s", True) from None
        except ue.MaxRetryError as exc:
            if isinstance(exc.reason, ue.TimeoutError):
                raise Problem(f"no answer within {self.timeout:g} s", True) from None
            if isinstance(exc.reason, ue.ProtocolError):
                raise Problem("the server closed the connection without an answer", True) from None
            raise Problem(f"cannot connect ({type(exc.reason).__name__})", True) from None
        except ue.ProtocolError:
            raise Problem("the connection broke before the answer ended", True) from None
        except (ue.HTTPError, OSError) as exc:
            raise Problem(f"the request failed ({type(exc).__name__})", True) from None
        return Reply(
            checked_length(data, start, end, size), size, r.headers.get("ETag"), r.headers.get("Last-Modified")
        )


class S3Transport:
    """Range requests (GetObject) to an ``s3://bucket/key`` address with boto3: the AWS credential
    chain, ``AWS_ENDPOINT_URL`` and the region from the environment (us-east-1 where none is set)."""

    def __init__(self, parts: Parts):
        require("reading s3:// slides", "boto3")
        import boto3
        from botocore.config import Config

        self.bucket, self.key = parts.host, parts.key
        self.timeout = request_timeout()
        session = boto3.session.Session()
        config = Config(
            connect_timeout=self.timeout,
            read_timeout=self.timeout,
            retries={"total_max_attempts": 1},  # the caller retries, counting each request
            max_pool_connections=MAX_CONCURRENT,
        )
        self.client = session.client("s3", region_name=session.region_name or "us-east-1", config=config)

    def get(self, start: int, end: int) -> Reply:
        import botocore.exceptions as be

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end - 1}")
            data = r["Body"].read()
        except be.ClientError as exc:
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            code = str(exc.response.get("Error", {}).get("Code") or "")
            if code in ("NoSuchKey", "NoSuchBucket") or status == 404:
                raise Problem(f"not found ({code or status})", False) from None
            problem = status_problem(status, "check the AWS credentials")
            raise Problem(f"{problem.reason} [{code}]" if code else problem.reason, problem.transient) from None
        except (be.NoCredentialsError, be.PartialCredentialsError):
            raise Problem(
                "no AWS credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws/credentials)", False
            ) from None
        except (be.ReadTimeoutError, be.ConnectTimeoutError):
            raise Problem(f"no answer within {self.timeout:g} s", True) from None
        except (be.IncompleteReadError, be.ResponseStreamingError, be.ConnectionClosedError):
            raise Problem("the connection broke before the answer ended", True) from None
        except (be.BotoCoreError, OSError) as exc:
            raise Problem(f"the request failed ({type(exc).__name__})", True) from None
        modified = r.get("LastModified")
        return Reply(
            checked_length(data, start, end, total_size(r.get("ContentRange"))),
            total_size(r.get("ContentRange")),
            r.get("ETag"),
            modified.isoformat() if isinstance(modified, datetime) else modified,
        )


def make_transport(address: str, parts: Parts) -> Transport:
    """The transport of ``address`` (its ``parts`` from :func:`~.address.address_parts`)."""
    return S3Transport(parts) if parts.scheme == "s3" else HttpTransport(address, parts)
