"""Measured before the node search: a backend setting chosen by its outputs (`choose_setting`), and the memo of
builds every phase shares (`Remembered`): the range trial, the op-type phase and the search's base ask for the
same build on the same samples."""

from __future__ import annotations

import logging
from typing import Callable

from qprep.quantize.search.acceptance import MIN_GAIN, judge, score_of

log = logging.getLogger("qprep")


class Remembered:
    """`evaluate` remembered per (backend setting, float set, samples): the range trial, the op-type phase and
    the search's base all ask for the same build on the same samples. Samples are a prefix of the samples the
    search chooses on, or those kept apart: their first sample and number name them. A backend that reaches the
    same outputs another way (ORT: a model derived to equal the build) passes that way as `measure`, or `store`s
    what it measured: one memo, whichever way a result was made."""

    def __init__(self, evaluate: Callable[[set[str], list[dict]], dict], setting: Callable[[], object]):
        self.evaluate, self.setting, self.results = evaluate, setting, {}

    def _key(self, float_nodes: set[str], samples: list[dict]) -> tuple:
        return self.setting(), frozenset(float_nodes), id(samples[0]) if samples else None, len(samples)

    def __call__(self, float_nodes: set[str], samples: list[dict], measure: Callable[[], dict] | None = None) -> dict:
        key = self._key(float_nodes, samples)
        if key not in self.results:
            self.results[key] = measure() if measure is not None else self.evaluate(float_nodes, samples)
        return self.results[key]

    def store(self, float_nodes: set[str], samples: list[dict], outputs: dict) -> None:
        self.results[self._key(float_nodes, samples)] = outputs


def choose_setting(setting: str, configured: str, alternatives: list[str], use: Callable[[str], None],
                   evaluate: Callable[[set[str], list[dict]], dict], base_float: set[str], samples: list[dict],
                   target: dict, progress=None, min_gain: float = MIN_GAIN,
                   affordable: Callable[[str], bool] = lambda alternative: True,
                   acceptance: list[dict] | None = None) -> dict:
    """A backend setting (e.g. how activation ranges are chosen) measured at the outputs before any node is
    made float: the configured value first and, if the target is missed, each alternative. An alternative is
    kept if it meets the target, or if it removes at least `min_gain` of the configured value's error
    (1 - score) and scores best; a backend whose alternative makes every later trial slower asks for more.
    An alternative that is not `affordable` (its trial would not end within the time budget) is not tried, nor one
    `use` refuses (returns False: the backend could not switch to it).
    Meeting the target means on `samples` and on those kept apart (`acceptance`, judge())."""
    outputs = evaluate(base_float, samples)
    scores = {configured: score_of(outputs, target)}
    passed = judge(target, outputs, base_float, evaluate, acceptance or [])["passed"]
    chosen = configured
    for alternative in [] if passed else alternatives:
        if not affordable(alternative):
            continue
        if progress is not None:
            progress.note(f"fallback: trying {setting}: {alternative}")
        if use(alternative) is False:
            continue
        outputs = evaluate(base_float, samples)
        scores[alternative] = score = score_of(outputs, target)
        if judge(target, outputs, base_float, evaluate, acceptance or [])["passed"]:
            chosen = alternative
            break
        if score - scores[configured] >= min_gain * (1.0 - scores[configured]) and score > scores[chosen]:
            chosen = alternative
    use(chosen)
    message = f"{setting}: {chosen} kept ({', '.join(f'{k} {v:.5f}' for k, v in scores.items())})"
    log.info("fallback: %s", message)
    if progress is not None and len(scores) > 1:
        progress.note(f"fallback: {message}")
    return {"setting": setting, "configured": configured, "chosen": chosen, "scores": scores}
