"""The builds kept with their simulator runtimes: the last one and a pinned one.

Why: with `mmse` one build takes minutes, and the fallback evaluates, ranks (accuracy_analysis) and finally
exports builds it has made already (its best, pinned); every other build is released as the next one is made,
since each holds a simulator runtime in the toolkit worker.
"""

from __future__ import annotations

from typing import NamedTuple

from qprep.quantize.rknn.runner import Runner
from qprep.quantize.rknn.toolkit import Toolkit


class Session(NamedTuple):
    rknn: int  # the RKNN object's handle in the toolkit worker
    runner: Runner
    float16_layers: dict | None  # the record of its float16 layers (None: a plain build)


class Sessions:
    """Kept builds by key (a setting and a float16 set, as the builder makes it); one of them may be pinned,
    which stays however many builds come after it."""

    def __init__(self, toolkit: Toolkit):
        self.toolkit = toolkit
        self._kept: dict[tuple, Session] = {}
        self.pinned: tuple | None = None

    def __contains__(self, key: tuple) -> bool:
        return key in self._kept

    def __getitem__(self, key: tuple) -> Session:
        return self._kept[key]

    def get(self, key: tuple) -> Session | None:
        return self._kept.get(key)

    def keys(self) -> list[tuple]:
        return list(self._kept)

    def pin(self, key: tuple) -> None:
        self.pinned = key

    def add(self, key: tuple, session: Session) -> None:
        self._kept[key] = session

    def release(self, keep: Runner | None = None) -> None:
        """Free the simulator runtimes of the kept builds (all but `keep`)."""
        for key, session in list(self._kept.items()):
            if session.runner is not keep:
                self.toolkit.release(session.rknn)
                del self._kept[key]

    def release_unpinned(self) -> None:
        """Free every kept build but the pinned one (before a new build, or when the setting changes: a trial of
        another setting that is not kept leaves the search's best exportable without building it again)."""
        pinned = self._kept.get(self.pinned)
        self.release(keep=pinned.runner if pinned else None)

    def forget(self) -> None:
        """Drop every handle without a call to the worker (it is being stopped, its objects with it)."""
        self._kept.clear()
