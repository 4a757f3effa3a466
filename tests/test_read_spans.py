"""read_spans: a batch's stored-tile byte ranges read as a few spans, against one read per range."""

from __future__ import annotations

import os

import numpy as np
import pytest

from wsi_pipeline.slide import stored_jpeg
from wsi_pipeline.slide.stored_jpeg import READ_GAP_BYTES, ReadBuffer, read_spans


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 4 * READ_GAP_BYTES, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("reuse", [None, ReadBuffer()], ids=["fresh", "reused"])
def test_every_range_reads_as_a_read_of_its_own(data_file, seed, reuse):
    fd, data = data_file
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    offsets = rng.integers(0, len(data) - 5000, n)
    counts = rng.integers(0, 5000, n)
    counts[rng.random(n) < 0.2] = 0  # tiles without data
    if n > 2:
        offsets[1] = offsets[0]  # the same range twice, and one inside another
        offsets[2], counts[2] = offsets[0] + 1, max(0, counts[0] - 2)
    buf, starts = read_spans(fd, offsets, counts, reuse)
    for o, n_, s in zip(offsets.tolist(), counts.tolist(), starts.tolist(), strict=True):
        assert buf[s : s + n_].tobytes() == data[o : o + n_]
        if not n_:
            assert s == 0
    assert len(buf) <= len(data)  # the union of the ranges and the gaps between them, never more


def test_ranges_far_apart_are_read_apart_and_near_ones_together(data_file, monkeypatch):
    fd, _ = data_file
    calls = []
    real = os.preadv

    def counted(fd_, buffers, offset):
        calls.append(offset)
        return real(fd_, buffers, offset)

    monkeypatch.setattr(stored_jpeg.os, "preadv", counted)
    near = READ_GAP_BYTES // 2
    offsets = np.array([0, 1000 + near, 3 * READ_GAP_BYTES], np.int64)
    counts = np.array([1000, 1000, 1000], np.int64)
    buf, starts = read_spans(fd, offsets, counts)
    assert calls == [0, 3 * READ_GAP_BYTES]
    assert len(buf) == 2000 + near + 1000
    assert starts.tolist() == [0, 1000 + near, 2000 + near]


def test_a_range_past_the_end_of_the_file_is_refused(data_file):
    fd, data = data_file
    with pytest.raises(EOFError):
        read_spans(fd, np.array([len(data) - 10], np.int64), np.array([20], np.int64))


def test_the_batch_eoi_check_agrees_with_the_one_stream_check():
    """``ends_with_eoi`` (many streams in one array) and ``stream_ends_with_eoi`` (one stream) are
    the same rule: EOI, or EOI and DICOM's pad byte."""
    from wsi_pipeline.slide.jpeg_kind import ends_with_eoi, stream_ends_with_eoi

    endings = [b"", b"\xd9", b"\xff", b"\xff\xd9", b"\xff\xd9\x00", b"\xff\xd9\x01", b"\xd9\x00", b"\x00\xff\xd9"]
    streams = [head + end for end in endings for head in (b"", b"\xff\xd8\x12")]
    buf = np.frombuffer(b"".join(streams), np.uint8)
    counts = np.array([len(s) for s in streams], np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    got = ends_with_eoi(buf, starts, counts).tolist()
    assert got == [stream_ends_with_eoi(s) for s in streams]
    assert sum(got) == 6  # FF D9, FF D9 00 and 00 FF D9, each bare and after a head
