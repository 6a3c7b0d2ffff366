"""A step of the toolkit made again with one of its graph rules disabled, when the toolkit failed inside that
rule and named it (ToolkitError.rule; basic-pitch's CQT: `remove_concat_slice` raised IndexError).

Why: a rule is an optimization of the toolkit's own graph; without it the model is the same, perhaps slower, so a
build that fails inside one can pass without it. The rules go into the build's config (`disable_rules`), which
every later RKNN object is configured with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from qprep.errors import ToolkitError

log = logging.getLogger("qprep")

MAX_RULES_DISABLED = 4  # toolkit graph rules a build may switch off after they failed
T = TypeVar("T")


class FailingRules:
    """Owns `disable_rules` in the build's `config` and records in `details` (the build's record) the rules a
    build passed without. `on_disable` is told when a rule goes off: what was made with it on (hybrid step1's
    kept outputs) has to be made again."""

    def __init__(self, config: dict, details: dict, on_disable: Callable[[], None]):
        self.config, self.details, self.on_disable = config, details, on_disable

    @property
    def disabled(self) -> list[str]:
        return list(self.config.get("disable_rules", []))

    def retry(self, step: Callable[[], T]) -> T:
        """`step()`, made again with a graph rule disabled each time it fails inside a rule it names. Each rule is
        disabled once (a few at most); the record names those a build then passed with, and rules that did not
        make it pass are on again."""
        added: list[tuple[str, str]] = []
        while True:
            try:
                result = step()
            except ToolkitError as exc:
                disabled = self.disabled
                if exc.crashed or not exc.rule or exc.rule in disabled or len(disabled) >= MAX_RULES_DISABLED:
                    tried = {rule for rule, _ in added}
                    self._set([rule for rule in disabled if rule not in tried])
                    raise
                self._set([*disabled, exc.rule])
                added.append((exc.rule, str(exc)))
                self.on_disable()
                log.warning("rknn: the toolkit's graph rule %s failed on this model; building again without it "
                            "(disable_rules)", exc.rule)
                continue
            for rule, error in added:
                self.details.setdefault("rules_disabled", []).append({"rule": rule, "error": error})
            return result

    def _set(self, rules: list[str]) -> None:
        if rules:
            self.config["disable_rules"] = rules
        else:
            self.config.pop("disable_rules", None)
