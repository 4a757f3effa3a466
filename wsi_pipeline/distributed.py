"""Slides as tasks on a dask.distributed cluster.

``address``: ``local:N`` starts a cluster on this machine (loopback only):
N worker processes of one thread each; where CUDA GPUs are present, one
worker per GPU, each seeing only its own GPU through ``CUDA_VISIBLE_DEVICES``
(dask-cuda's LocalCUDACluster where dask-cuda is installed, the same layout
built from plain dask Nannies otherwise). Any other address
(``tcp://host:8786``, a scheduler file path ending in ``.json``) connects to
a running cluster. Workers must see the same file system as the client: the
slides and the output folder are paths.

Each worker process builds its pipeline once (the first task it runs) and
keeps it for the tasks after; a task writes the slide's folder exactly as a
local run does (:func:`~.batch.process_slide`), and the client records each
outcome in the manifest as it arrives.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .batch import SlideOutcome, process_slide
from .config import RunConfig
from .errors import UsageError
from .pipeline import default_reader_workers

log = logging.getLogger("wsi_pipeline")

_worker_lock = threading.Lock()
_worker_pipelines: dict[str, Any] = {}


def _cuda_device_count() -> int:
    from .inference.backend import cuda_may_be_present

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

        return LocalCUDACluster(n_workers=n, threads_per_worker=1, host="127.0.0.1",
                                CUDA_VISIBLE_DEVICES=list(range(n)), env=env, **common)
    except ImportError:
        pass
    # dask-cuda's layout from plain dask: one Nanny per GPU, each with its own CUDA_VISIBLE_DEVICES.
    from dask.distributed import Nanny, Scheduler, SpecCluster

    workers = {f"gpu-{i}": {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", "memory_limit": 0,
                                                       "env": {**env, "CUDA_VISIBLE_DEVICES": str(i)}}}
               for i in range(n)}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR)


def connect(address: str):
    """(client, cluster or None) for ``address`` (see the module docstring)."""
    try:
        from dask.distributed import Client
    except ImportError as exc:
        raise UsageError("--dask needs dask.distributed: pip install 'wsi-pipeline[dask]'") from exc
    if address.startswith("local:"):
        try:
            n = int(address.split(":", 1)[1])
        except ValueError:
            raise UsageError(f"--dask {address}: expected local:N with N a number of workers") from None
        cluster = start_local_cluster(n)
        return Client(cluster), cluster
    try:
        if address.endswith(".json"):
            return Client(scheduler_file=address, timeout="20s"), None
        return Client(address, timeout="20s"), None
    except (OSError, TimeoutError) as exc:
        raise UsageError(f"--dask {address}: cannot reach the scheduler: {exc}") from exc


def _worker_pipeline(config_doc: dict[str, Any]) -> Any:
    """This worker process's pipeline for ``config_doc`` (built on first use)."""
    import json

    from .pipeline import Pipeline

    key = json.dumps(config_doc, sort_keys=True)
    with _worker_lock:
        pipe = _worker_pipelines.get(key)
        if pipe is None:
            config = RunConfig.from_mapping(config_doc, "task")
            pipe = Pipeline(config.model, backend=config.backend, config=config)
            _worker_pipelines[key] = pipe
        return pipe


def slide_task(path: str, name: str, out_dir: str, config_doc: dict[str, Any], key: str) -> dict[str, Any]:
    """One slide on a worker; returns the outcome as a plain dict (never raises for a bad slide)."""
    import socket

    try:
        pipe = _worker_pipeline(config_doc)
    except Exception as exc:
        return {**SlideOutcome(name, path, "failed", error=f"worker could not build the pipeline: {exc}")
                .as_record(), "name": name}
    outcome = process_slide(pipe, path, name, out_dir, key)
    outcome.worker = f"{socket.gethostname()}:{os.getpid()}"
    return {**outcome.as_record(), "name": name}


def run_on_dask(connection: tuple[Any, Any], todo: list[tuple[Path, str]], out_dir: Path, config: RunConfig,
                key: str) -> Iterator[SlideOutcome]:
    """Submit every slide as a task on ``connection`` (:func:`connect`'s, closed at the end);
    yield outcomes as they finish."""
    from dask.distributed import as_completed

    client, cluster = connection
    try:
        if cluster is not None and config.workers is None:
            # Worker processes on this host share its cores: split the tile readers between them.
            n = max(1, len(cluster.workers))
            config = config.replace(workers=default_reader_workers((os.cpu_count() or 2) // n))
        doc = config.as_dict()
        futures = []
        where: dict[str, tuple[Path, str]] = {}
        for path, name in todo:
            fut = client.submit(slide_task, str(path), name, str(out_dir), doc, key, pure=False,
                                key=f"slide-{name}-{key}")
            futures.append(fut)
            where[fut.key] = (path, name)
        for fut in as_completed(futures):
            path, name = where[fut.key]
            try:
                rec = fut.result()
            except Exception as exc:  # the worker died (KilledWorker) or the task could not run
                yield SlideOutcome(name, str(path), "failed", error=f"{path}: task failed on the cluster: {exc}")
                continue
            yield SlideOutcome(rec["name"], str(path), rec["status"], rec["seconds"], rec["counts"] or {},
                               rec["error"], rec.get("worker"), rec.get("tiles"))
    finally:
        client.close()
        if cluster is not None:
            cluster.close()

