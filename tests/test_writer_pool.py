"""The writer pool: large array arguments travel through files, which are removed; a process that
dies fails its job and is replaced; a job's failure is raised as it was raised; closing."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.io import writer_pool
from wsi_pipeline.io.writer_pool import ArrayFile, WriteJobs, WriterPool


def _echo(path, *arrays):
    """A job: the arrays it was given, with whether each is writable."""
    return path, [(a.copy(), a.flags.writeable) for a in arrays]


def _arrays():
    rng = np.random.default_rng(3)
    dets = np.zeros(70_000, dtype=[("x0", "<f4"), ("y0", "<f4"), ("score", "<f4"), ("label", "<i4")])
    dets["x0"] = rng.random(len(dets))
    dets["label"] = rng.integers(0, 5, len(dets))
    heat = rng.random((1, 600, 700), dtype=np.float32)
    strided = np.asfortranarray(rng.integers(0, 255, (800, 900, 3), dtype=np.uint8))  # not C-contiguous
    small = np.arange(10)
    return dets, heat, strided, small


@pytest.mark.parametrize("processes", [0, 2])
def test_array_arguments_arrive_equal_and_their_files_are_removed(tmp_path, monkeypatch, processes):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    arrays = _arrays()
    pool = WriterPool(processes)
    try:
        fut_jobs = []
        for k in range(3):
            j = WriteJobs()
            pool.submit(j, f"job{k}", _echo, tmp_path / f"out{k}", *arrays)
            fut_jobs.append(j)
        for j in fut_jobs:
            ((path, got),) = j.results()
            assert len(got) == len(arrays)
            for (a, writable), expected in zip(got, arrays, strict=True):
                assert a.dtype == expected.dtype and a.shape == expected.shape
                np.testing.assert_array_equal(a, expected)
                assert writable
        folders = list(tmp_path.glob("wsi-pipeline-args-*"))
        assert len(folders) == (1 if processes else 0)
        for folder in folders:
            assert sorted(p.name for p in folder.iterdir()) == ["lock"]  # every array's file removed
    finally:
        pool.close()
    assert list(tmp_path.glob("wsi-pipeline-args-*")) == []


def test_array_file_of_the_wrong_size_is_an_error(tmp_path):
    af = ArrayFile(tmp_path / "a.bin", np.arange(1000, dtype=np.float64))
    with open(af.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(WSIPipelineError, match=r"a\.bin: expected 8000 bytes of a job's array, found 100"):
        af.load()
    assert not af.path.exists()


@pytest.mark.skipif(writer_pool.fcntl is None, reason="no flock here")
def test_orphaned_argument_folders_are_removed_and_held_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    orphan = tmp_path / "wsi-pipeline-args-orphan"
    orphan.mkdir()
    (orphan / "lock").touch()
    (orphan / "3.bin").write_bytes(b"x" * 10)
    young = tmp_path / "wsi-pipeline-args-young"
    young.mkdir()
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    held_pool = WriterPool(1)
    _write_an_array_file(held_pool, tmp_path)
    (held,) = set(tmp_path.glob("wsi-pipeline-args-*")) - {orphan, young}
    os.utime(held, (old, old))
    other = WriterPool(1)
    try:
        _write_an_array_file(other, tmp_path)  # its folder, made now, looks for orphaned ones first
        assert not orphan.exists()  # nobody held its lock
        assert young.exists()  # too new to judge
        assert held.is_dir() and (held / "lock").exists()  # its pool is alive
    finally:
        other.close()
        held_pool.close()
    assert not held.exists()


FILE_BYTES = writer_pool.FILE_ARG_BYTES


def _write_an_array_file(pool: WriterPool, tmp_path) -> None:
    """Run a job whose array argument is large enough to reach its process through a file of the
    pool's folder (made with the first such job)."""
    jobs = WriteJobs()
    pool.submit(jobs, "array", _echo, tmp_path / "out", np.zeros(FILE_BYTES, np.uint8))
    jobs.wait()


def test_a_pool_left_unclosed_removes_its_folder_when_collected(tmp_path, monkeypatch):
    import gc

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    pool = WriterPool(1)
    _write_an_array_file(pool, tmp_path)
    (folder,) = tmp_path.glob("wsi-pipeline-args-*")
    del pool
    gc.collect()
    assert not folder.exists()


@pytest.mark.parametrize("problem", ["full", "no folder"])
def test_arrays_go_in_the_pickle_where_the_temporary_folder_cannot_take_them(tmp_path, monkeypatch, problem):
    if problem == "full":
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

        def disk_full(self, path, array):
            path.write_bytes(b"x")  # a partial file, as a failed write leaves
            raise OSError(28, "No space left on device", str(path))

        monkeypatch.setattr(ArrayFile, "__init__", disk_full)
    else:
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "gone"))
    arrays = _arrays()
    pool = WriterPool(1)
    try:
        jobs = WriteJobs()
        pool.submit(jobs, "job", _echo, tmp_path / "out", *arrays)
        ((_, got),) = jobs.results()
        for (a, _), expected in zip(got, arrays, strict=True):
            np.testing.assert_array_equal(a, expected)
        if problem == "full":
            (folder,) = tmp_path.glob("wsi-pipeline-args-*")
            assert sorted(p.name for p in folder.iterdir()) == ["lock"]  # the partial files removed
    finally:
        pool.close()


def _die():
    """A job that kills its writer process."""
    os.kill(os.getpid(), signal.SIGKILL)


def _fail():
    raise ValueError("row 7: no such class")


def _pid(seconds: float = 0.0):
    time.sleep(seconds)
    return os.getpid()


def test_a_writer_process_that_dies_fails_its_job_and_a_new_one_takes_the_next(tmp_path):
    pool = WriterPool(1)
    try:
        first = WriteJobs()
        pool.submit(first, "before", _pid)
        first.wait()
        doomed, after = WriteJobs(), WriteJobs()
        pool.submit(doomed, "doomed.csv", _die)
        pool.submit(after, "after", _pid)
        with pytest.raises(WSIPipelineError, match=r"writing doomed\.csv: the writer process died \(exit code -9\)"):
            doomed.wait()
        after.wait()
        assert first.results() != after.results()  # a new process
    finally:
        pool.close()


def test_a_jobs_failure_is_raised_as_it_was_raised_there():
    pool = WriterPool(2)
    try:
        jobs = WriteJobs()
        pool.submit(jobs, "a.csv", _fail)
        pool.submit(jobs, "b", _pid)
        with pytest.raises(ValueError, match="row 7: no such class"):
            jobs.wait()
        assert jobs.done()
    finally:
        pool.close()


def _pid_when_released(started: Path, release: Path) -> int:
    """A job that says it has begun (file ``started``), then waits (at most a minute) for file ``release``."""
    started.touch()
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


def _wait_until(condition, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_closing_lets_begun_jobs_end_and_cancels_the_others(tmp_path):
    pool = WriterPool(1)
    begun, queued = WriteJobs(), WriteJobs()
    started, release = tmp_path / "started", tmp_path / "release"
    pool.submit(begun, "begun", _pid_when_released, started, release)
    assert _wait_until(started.exists)  # the job has reached its process
    pool.submit(queued, "queued", _pid)
    closing = threading.Thread(target=pool.close)
    closing.start()
    try:
        assert _wait_until(queued.done)  # cancelled by close, which now waits for the begun job
        assert not begun.done()
    finally:
        release.touch()
        closing.join(60)
    assert not closing.is_alive()
    assert isinstance(begun.results()[0], int)
    with pytest.raises(CancelledError):
        queued.wait()


def test_jobs_run_in_the_caller_where_processes_cannot_be_handed_pipes(monkeypatch):
    monkeypatch.setattr(writer_pool, "_POSIX", False)
    pool = WriterPool(3)
    try:
        jobs = WriteJobs()
        pool.submit(jobs, "here", _pid)
        assert jobs.results() == [os.getpid()]
        assert pool.parts(10**6) == 1
    finally:
        pool.close()


def _hold(mb: int) -> int:
    block = np.ones(mb << 20, np.uint8)  # resident: every page written
    return int(block[::4096].sum())


def test_each_writer_processs_peak_memory_during_a_slides_jobs_is_reported():
    from wsi_pipeline.io.writer_pool import writer_peak_memory_mb

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the peak resident memory cannot be reset on this system")
    pool = WriterPool(1)
    try:
        big, small = WriteJobs(), WriteJobs()
        pool.submit(big, "big", _hold, 300)
        big.wait()
        pool.submit(small, "small", _hold, 1)  # the same process, its peak counted afresh
        small.wait()
    finally:
        pool.close()
    assert writer_peak_memory_mb([big]) >= 300
    assert writer_peak_memory_mb([small]) < 200
    assert writer_peak_memory_mb([WriteJobs()]) is None
