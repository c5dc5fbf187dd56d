"""Rewards for rollouts: one grader, in a local worker pool or behind the verifier service.

The trainer does not know which: :class:`RewardFunction` takes responses and golds and returns
rewards plus, per item, whether the reward could be computed. A reward that could not be computed
(grader ``timeout`` / ``error``, service unreachable) is never silently a 0:

1. failed items are retried up to ``reward.retries`` times;
2. items that still fail are reported as ``valid=False`` and the loop drops their whole group
   from the update (its advantages would be wrong), counting them in ``reward/failed``;
3. when the failed share of a step exceeds ``reward.max_failure_frac``, or the service stays
   unreachable, :class:`RewardError` stops the run with the reason.

``undecided`` (the grader found an answer but could not compare it with the gold: a gold it cannot
read) is not retried (grading it again gives the same), but it is no verdict either: the item is
``valid=False`` like a failure (its group is dropped; it counts in ``reward/failed`` and toward
``reward.max_failure_frac``),
a warning names the gold, and ``reward/rule/undecided`` logs its share of the step.

``no_answer`` and ``too_large`` are computed outcomes (the model gave no usable answer): they
score ``reward.scale.wrong``. Rewards are ``reward.scale.correct`` / ``reward.scale.wrong``
(DAPO: +1 / -1; default 1 / 0).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stapo.core.config import RewardConfig
from stapo.verifier_service.clients.client import VerifierClient
from stapo.verifier_service.server.pool import GraderPool
from stapo.verifier_service.server.settings import default_workers

__all__ = ["RewardError", "RewardBatch", "RewardFunction", "rule_shares", "scale_reward"]

_FAILED = {"timeout", "error"}
"""Statuses of a grade that did not run to the end: retried."""
_NO_VERDICT = _FAILED | {"undecided"}
"""Statuses that carry no verdict: the item's reward could not be computed (``valid=False``)."""
logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """Rewards could not be computed for enough items: the run must stop."""


@dataclass
class RewardBatch:
    rewards: list[float]  # [N] reward per response (reward.scale.wrong where invalid)
    valid: list[bool]  # [N] False where the reward could not be computed
    correct: list[bool]  # [N]
    extracted: list[str | None]  # [N]
    status: list[str]  # [N] grader status per item: ok | no_answer | undecided | timeout | error | too_large
    statuses: Counter = field(default_factory=Counter)
    retried: int = 0
    rules: Counter = field(default_factory=Counter)  # items per deciding grader rule (Verdict.rule)


def grader_workers_per_rank(environ: Mapping[str, str] = os.environ) -> int:
    """The default size of a rank's grading pool: the cores this process may use divided by the ranks
    on its node (``LOCAL_WORLD_SIZE`` from torchrun, ``LOCAL_SIZE`` from the deepspeed launcher; 1
    without a launcher), at least 1. Without the division 8 ranks each start a pool of every core."""
    local = environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE") or "1"
    return max(1, default_workers() // max(1, int(local)))


class RewardFunction:
    """Grades responses against golds through a local pool or a remote verifier."""

    def __init__(self, cfg: RewardConfig, *, grader: Any | None = None) -> None:
        self.cfg = cfg
        if grader is not None:
            self._grader = grader  # anything with grade_many(list[dict]) -> list[result]
        elif cfg.urls:
            # No token in the config: the environment's (compose hands STAPO_VERIFIER_TOKEN to the trainer).
            token = cfg.token or os.environ.get("STAPO_VERIFIER_TOKEN") or None
            self._grader = _ClientGrader(VerifierClient(cfg.urls, token=token))
        else:
            self._grader = GraderPool(workers=cfg.workers or grader_workers_per_rank(), deadline_s=cfg.deadline_s)

    def _grade(self, items: list[dict[str, str]]) -> list[Any]:
        try:
            return list(self._grader.grade_many(items))
        except Exception as err:  # transport failures: the service is down or refusing
            raise RewardError(
                f"reward computation failed: {type(err).__name__}: {err}. "
                f"Check the verifier (reward.urls={self.cfg.urls or 'local pool'})."
            ) from err

    def __call__(self, responses: Sequence[str], golds: Sequence[str]) -> RewardBatch:
        items = [
            {"prediction": r, "gold": g, "mode": self.cfg.mode} for r, g in zip(responses, golds, strict=True)
        ]
        results = self._grade(items)
        pending = [i for i, r in enumerate(results) if _status(r) in _FAILED]
        retried = 0
        for _ in range(self.cfg.retries):
            if not pending:
                break
            retried += len(pending)
            again = self._grade([items[i] for i in pending])
            for i, r in zip(pending, again, strict=True):
                results[i] = r
            pending = [i for i in pending if _status(results[i]) in _FAILED]
        n = len(items)
        undecided = [i for i, r in enumerate(results) if _status(r) == "undecided"]
        if undecided:
            logger.warning(
                "%d/%d rewards undecided: the grader could not compare the answer with the gold "
                "(e.g. gold %r, answer %r); their groups are dropped",
                len(undecided),
                n,
                items[undecided[0]]["gold"][:80],
                _get(results[undecided[0]], "extracted"),
            )
        pending = pending + undecided
        if n and len(pending) / n > self.cfg.max_failure_frac:
            counts = Counter(_status(results[i]) for i in pending)
            raise RewardError(
                f"{len(pending)}/{n} rewards could not be computed after {self.cfg.retries} retries "
                f"({dict(counts)}); above reward.max_failure_frac={self.cfg.max_failure_frac}"
            )
        valid = [_status(r) not in _NO_VERDICT for r in results]
        correct = [bool(_get(r, "correct")) and v for r, v in zip(results, valid, strict=True)]
        rewards = [scale_reward(c, self.cfg.scale.correct, self.cfg.scale.wrong) for c in correct]
        return RewardBatch(
            rewards=rewards,
            valid=valid,
            correct=correct,
            extracted=[_get(r, "extracted") for r in results],
            status=[_status(r) for r in results],
            statuses=Counter(_status(r) for r in results),
            retried=retried,
            rules=Counter(_rule(r) for r in results),
        )

    def close(self) -> None:
        close = getattr(self._grader, "close", None)
        if close is not None:
            close()


def scale_reward(correct: bool, correct_value: float, wrong_value: float) -> float:
    """The outcome reward of one response: ``correct_value`` if right, else ``wrong_value``."""
    return float(correct_value if correct else wrong_value)


def rule_shares(batches: Sequence[RewardBatch]) -> dict[str, float]:
    """``reward/rule/<name>``: the share of this step's items whose verdict each grader rule decided.

    So a researcher sees when a rule starts paying out (a jump in ``reward/rule/rounded-gold`` or
    ``reward/rule/math-verify``). ``undecided``: no rule could compare (those items are invalid).
    ``none``: no rule ran (timeouts, errors) or the result does not say (the HTTP client's plain
    results carry no rule). Shares of this rank's items.
    """
    total: Counter = Counter()
    for b in batches:
        total.update(b.rules)
    n = sum(total.values())
    return {f"reward/rule/{name}": count / n for name, count in sorted(total.items())} if n else {}


def _get(result: Any, key: str) -> Any:
    return result[key] if isinstance(result, dict) else getattr(result, key)


def _rule(result: Any) -> str:
    """The deciding rule's name, "none" when the result has none (old service, cache, failure)."""
    rule = result.get("rule") if isinstance(result, dict) else getattr(result, "rule", None)
    return str(rule) if rule else "none"


def _status(result: Any) -> str:
    return str(_get(result, "status"))


class _ClientGrader:
    """Adapts the HTTP client to the pool's ``grade_many`` shape."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def grade_many(self, items: list[dict[str, str]]) -> list[Any]:
        return self.client.verify(items)

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
