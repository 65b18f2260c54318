"""Where sweep tasks run: in this process, in local worker processes, or on a Ray cluster.

Every executor takes a *work function* `work(task) -> Iterator[event]` (a module-level function,
so it pickles by reference) and a list of tasks, and yields the events back to the caller *as
each one is produced*, from whichever worker produced it. The caller (the sweep driver) is the
only writer of results, so a part is on disk as soon as its analysis finishes, whatever the
executor; a worker never needs the output folder, which suits Ray nodes without a shared disk.

A task is one checkpoint with all its pending analyses: a worker loads a model once, runs every
analysis of it, yields one event per analysis, and drops the model before its next task, so each
worker holds at most one model at a time.

executors:
  local, workers=1   `InlineExecutor`: in this process (debuggable, no start-up cost).
  local, workers=N   `ProcessExecutor`: N spawned processes (spawn, not fork: torch's thread
                     pools and CUDA do not survive fork); events come back through a queue.
  ray                `RayExecutor`: one Ray generator task per checkpoint (`num_cpus=1`, plus
                     `num_gpus=1` when the cluster has GPUs), events streamed back with `ray.wait`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal

Work = Callable[[object], Iterable[object]]
ExecutorKind = Literal["local", "ray"]
EXECUTOR_KINDS = ("local", "ray")


@dataclass(frozen=True)
class ExecutorSettings:
    kind: ExecutorKind = "local"
    # local: processes (None or 1 = in this process); ray: CPUs of a cluster we start (None: all cores)
    workers: int | None = None
    ray_address: str | None = None  # "auto", "host:port", "ray://host:port"; None starts a local cluster

    def __post_init__(self) -> None:
        if self.kind not in EXECUTOR_KINDS:
            raise ValueError(f"unknown executor {self.kind!r}; choose one of {EXECUTOR_KINDS}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.ray_address is not None and self.kind != "ray":
            raise ValueError("--ray-address only applies to --executor ray")


def make_executor(settings: ExecutorSettings):
    if settings.kind == "ray":
        return RayExecutor(settings.ray_address, settings.workers or os.cpu_count() or 1)
    return InlineExecutor() if (settings.workers or 1) == 1 else ProcessExecutor(settings.workers)


class InlineExecutor:
    """Runs every task in this process, in order."""

    description = "local (in-process)"

    def run(self, work: Work, tasks: list) -> Iterator[object]:
        for task in tasks:
            yield from work(task)

    def close(self) -> None:
        pass


# ---- local processes -----------------------------------------------------------------------
_events: "mp.Queue | None" = None  # set in each worker process by _init_worker


def _init_worker(events, threads: int) -> None:
    global _events
    _events = events
    import torch  # in the worker process only: the driver's `--help` and planning never pay for it

    torch.set_num_threads(threads)  # N workers share the cores instead of each claiming all of them


def _drain(work: Work, task) -> None:
    for event in work(task):
        _events.put(event)


class ProcessExecutor:
    """Runs tasks in `workers` spawned processes; events come back through a queue as they happen."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.description = f"local ({workers} processes)"

    def run(self, work: Work, tasks: list) -> Iterator[object]:
        if not tasks:
            return
        ctx = mp.get_context("spawn")
        events = ctx.Queue()
        threads = max(1, (os.cpu_count() or 1) // self.workers)
        with ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker, initargs=(events, threads)) as pool:
            futures = [pool.submit(_drain, work, t) for t in tasks]
            try:
                while True:
                    try:
                        yield events.get(timeout=0.2)
                        continue
                    except queue_module.Empty:
                        pass
                    if all(f.done() for f in futures):
                        for f in futures:
                            f.result()  # re-raise a worker's crash here, in the driver
                        while True:  # events put just before the last task finished
                            try:
                                yield events.get(timeout=0.2)
                            except queue_module.Empty:
                                return
            finally:
                for f in futures:
                    f.cancel()

    def close(self) -> None:
        pass


# ---- Ray --------------------------------------------------------------------------------------
def _ray_generator(work: Work, task):
    yield from work(task)


class RayExecutor:
    """One Ray generator task per checkpoint task; events stream back as each analysis finishes.

    `address=None` starts a local cluster with `num_cpus` CPUs (shut down again by `close`);
    "auto" or "host:port" joins a running one (`ray start --head` / a KubeRay cluster). Workers
    must be able to import `interp` (installed on every node, or a `runtime_env`).
    """

    def __init__(self, address: str | None, num_cpus: int) -> None:
        try:
            import ray
        except ImportError as e:
            raise RuntimeError("--executor ray needs Ray: pip install 'interp[ray]'") from e
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            if address is None:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
            self.started = True
        gpus = ray.cluster_resources().get("GPU", 0)
        self.num_gpus = 1 if gpus >= 1 else 0
        cpus = int(ray.cluster_resources().get("CPU", 0))
        self.description = f"ray ({address or 'local cluster'}, {cpus} CPUs, {int(gpus)} GPUs)"

    def run(self, work: Work, tasks: list) -> Iterator[object]:
        remote = self.ray.remote(num_cpus=1, num_gpus=self.num_gpus, max_retries=0)(_ray_generator)
        pending = [remote.remote(work, t) for t in tasks]
        try:
            while pending:
                ready, _ = self.ray.wait(pending, num_returns=1)
                for gen in ready:
                    try:
                        ref = next(gen)
                    except StopIteration:
                        pending.remove(gen)
                        continue
                    yield self.ray.get(ref)
        finally:
            for gen in pending:
                self.ray.cancel(gen, force=True)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
