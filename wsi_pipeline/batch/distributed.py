"""Slides as tasks on a dask.distributed cluster.

``address``: ``local:N`` starts a cluster on this machine (loopback only):
N worker processes of one thread each; where CUDA GPUs are present, one
worker per GPU, each seeing only its own GPU through ``CUDA_VISIBLE_DEVICES``
(dask-cuda's LocalCUDACluster where dask-cuda is installed, the same layout
built from plain dask Nannies otherwise). Any other address
(``tcp://host:8786``, a scheduler file path ending in ``.json``) connects to
a running cluster. Workers must see the same file system as the client: the
slides and the output folder are paths.

Each worker process runs its slides as a local run does: in a child process
that builds the pipeline once (the first task it runs) and keeps it for the
tasks after, each slide under its time limit (:mod:`.slide_runners`); a task
writes the slide's folder exactly as a local run does
(:func:`~.jobs.process_slide`), and the client records each outcome in the
manifest as it arrives.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import UsageError
from ..inference.choice import default_reader_workers
from .jobs import PipelineFactory, SlideOutcome
from .resume import RunKey
from .slide_runners import make_runner, slide_time_limit

log = logging.getLogger("wsi_pipeline")

_worker_lock = threading.Lock()
_worker_runners: dict[str, Any] = {}


def _cuda_device_count() -> int:
    from ..inference.backend import cuda_may_be_present

    if not cuda_may_be_present():
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def start_local_cluster(n_workers: int, gpus: int | None = None):
    """A cluster on loopback with ``n_workers`` single-threaded worker processes.

    ``gpus``: how many CUDA devices to use (default: all there are, at most
    ``n_workers``); with GPUs, worker i sees only GPU i.
    """
    from dask.distributed import LocalCluster

    if n_workers < 1:
        raise UsageError(f"--dask local:N: expected N >= 1, found {n_workers}")
    n_gpus = _cuda_device_count() if gpus is None else gpus
    n = n_workers if n_gpus <= 0 else min(n_workers, n_gpus)
    # dask pins worker processes to one OpenMP/BLAS thread; a slide task is a whole
    # pipeline (OpenCV, ONNX Runtime, torch), so give each worker its share of the cores.
    threads = str(max(1, (os.cpu_count() or 1) // n))
    env = {k: threads for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    # A worker's statistical profiler samples every thread's stack every 10 ms: a tax on a task
    # that is one long GIL-bound pipeline. No memory limit: a slide's memory is bounded by design,
    # and dask pausing or restarting a worker midway would only lose the slide.
    env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"
    common = {"dashboard_address": None, "silence_logs": logging.ERROR, "memory_limit": 0}
    if n_gpus <= 0:
        return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1", env=env, **common)
    try:
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(
            n_workers=n, threads_per_worker=1, host="127.0.0.1", CUDA_VISIBLE_DEVICES=list(range(n)), env=env, **common
        )
    except ImportError:
        pass
    # dask-cuda's layout from plain dask: one Nanny per GPU, each with its own CUDA_VISIBLE_DEVICES.
    from dask.distributed import Nanny, Scheduler, SpecCluster

    workers = {
        f"gpu-{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "host": "127.0.0.1",
                "memory_limit": 0,
                "env": {**env, "CUDA_VISIBLE_DEVICES": str(i)},
            },
        }
        for i in range(n)
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR)


def check_address(address: str) -> int | None:
    """UsageError unless dask.distributed is installed and ``address`` is usable; N of ``local:N``."""
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        raise UsageError(
            f"--dask {address}: dask.distributed is not installed: pip install 'wsi-pipeline[dask]'"
        ) from None
    if not address.startswith("local:"):
        return None
    try:
        n = int(address.split(":", 1)[1])
    except ValueError:
        raise UsageError(f"--dask {address}: expected local:N with N a number of workers") from None
    if n < 1:
        raise UsageError(f"--dask local:N: expected N >= 1, found {n}")
    return n


def connect(address: str):
    """(client, cluster or None) for ``address`` (see the module docstring)."""
    from dask.distributed import Client

    n = check_address(address)
    if n is not None:
        cluster = start_local_cluster(n)
        return Client(cluster), cluster
    try:
        if address.endswith(".json"):
            return Client(scheduler_file=address, timeout="20s"), None
        return Client(address, timeout="20s"), None
    except (OSError, TimeoutError) as exc:
        raise UsageError(f"--dask {address}: cannot reach the scheduler: {exc}") from exc


def _worker_runner(config_doc: dict[str, Any]) -> Any:
    """This worker process's slide runner for ``config_doc`` (its pipeline is built on first use)."""
    key = json.dumps(config_doc, sort_keys=True)
    with _worker_lock:
        runner = _worker_runners.get(key)
        if runner is None:
            config = RunConfig.from_mapping(config_doc, "task")
            runner = make_runner(PipelineFactory(config), config, progress=False)
            _worker_runners[key] = runner
        return runner


def slide_task(path: str, name: str, out_dir: str, config_doc: dict[str, Any], key: RunKey) -> dict[str, Any]:
    """One slide on a worker, under the same time limit as a local run; returns the outcome as a plain
    dict (never raises for a bad slide)."""
    import socket

    config = RunConfig.from_mapping(config_doc, "task")
    try:
        outcome = _worker_runner(config_doc).run(Path(path), name, Path(out_dir), key, slide_time_limit(config, path))
    except Exception as exc:
        with _worker_lock:
            runner = _worker_runners.pop(json.dumps(config_doc, sort_keys=True), None)
        if runner is not None:
            runner.close()
        return {
            **SlideOutcome(name, path, "failed", error=f"worker could not build the pipeline: {exc}").as_record(),
            "name": name,
        }
    outcome.worker = f"{socket.gethostname()}:{os.getpid()}"
    return {**outcome.as_record(), "name": name}


def run_on_dask(
    address: str, todo: list[tuple[Path, str]], out_dir: Path, config: RunConfig, key: RunKey
) -> Iterator[SlideOutcome]:
    """Submit every slide as a task; yield outcomes as they finish."""
    from dask.distributed import as_completed

    client, cluster = connect(address)
    try:
        if cluster is not None and config.workers is None:
            # Worker processes on this host share its cores: split the tile readers between them.
            n = max(1, len(cluster.workers))
            config = config.replace(workers=default_reader_workers((os.cpu_count() or 2) // n))
        doc = config.as_dict()
        futures = []
        where: dict[str, tuple[Path, str]] = {}
        for path, name in todo:
            fut = client.submit(
                slide_task, str(path), name, str(out_dir), doc, key, pure=False, key=f"slide-{name}-{key.value}"
            )
            futures.append(fut)
            where[fut.key] = (path, name)
        for fut in as_completed(futures):
            path, name = where[fut.key]
            try:
                rec = fut.result()
            except Exception as exc:  # the worker died (KilledWorker) or the task could not run
                yield SlideOutcome(name, str(path), "failed", error=f"{path}: task failed on the cluster: {exc}")
                continue
            yield SlideOutcome(
                rec["name"],
                str(path),
                rec["status"],
                rec["seconds"],
                rec["counts"] or {},
                rec["error"],
                rec.get("worker"),
                rec.get("tiles"),
                rec.get("warnings") or [],
            )
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
