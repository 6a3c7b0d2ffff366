"""The default batch executor: each model a process on this machine, `jobs` at a time."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Iterator

from qprep.pipeline.batch_worker import Outcome, RunSpec, Task, run_one, stop_all


class LocalPool:
    name = "local"

    def __init__(self, jobs: int):
        self.slots = jobs  # models running at once
        self.where = f"this machine, {jobs} model{'s' if jobs > 1 else ''} at a time"
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: dict[concurrent.futures.Future, Task] = {}

    def results(self, spec: RunSpec, tasks: Iterable[Task]) -> Iterator[tuple[Task, Outcome]]:
        """Each task with its outcome, in the order they finish."""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.slots)
        self._futures = {self._pool.submit(run_one, spec, task.model, task.run_dir): task for task in tasks}
        for future in concurrent.futures.as_completed(self._futures):
            yield self._futures[future], Outcome(*future.result())

    def cancel(self) -> list[tuple[Task, Outcome]]:
        """Interrupted: queued models never start, running ones get SIGTERM and write their report; returns the
        outcomes of the models that ended meanwhile."""
        if not self._pool:
            return []
        self._pool.shutdown(wait=False, cancel_futures=True)
        stop_all()
        running = [f for f in self._futures if not f.cancelled()]
        concurrent.futures.wait(running)
        return [(self._futures[f], Outcome(*f.result())) for f in running]

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True)
