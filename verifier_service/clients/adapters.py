"""Reward functions for verl, TRL and OpenRLHF, grading in-process or through the service.

One file, one function per call shape (each framework loads a function by name from a file or an
import). verl routes (call shapes read from verl's source; ``make integrations`` runs each one):

=====================  ==========================  ===========================================  ========================
verl                   reward manager              how verl calls the function                  function name
=====================  ==========================  ===========================================  ========================
0.7-0.9 (reward loop)  naive, dapo                 ``fn(data_source=, solution_str=,            ``compute_score``
                                                   ground_truth=, extra_info=, **kwargs)``;
                                                   a dict result is split into score + extras
0.6.x (legacy)         naive, dapo                 same keyword call                            ``compute_score``
0.6.x (legacy)         batch                       ``fn(data_sources=, solution_strs=,          ``compute_score_batch``
                                                   ground_truths=, extra_infos=, **kwargs)``
0.6.x (legacy)         prime                       ``fn(task, completion, reference,            ``compute_score_prime``
                                                   extra_info)`` in a forked
                                                   ``ProcessPoolExecutor``, then
                                                   ``float(result[0])``: a dict breaks it
=====================  ==========================  ===========================================  ========================

verl 0.9 reads ``reward.custom_reward_function.path/name`` and ``reward.reward_manager.name`` only;
``pkg://stapo.verifier_service.clients.adapters`` loads this module by import (docs/integrations.md).

``compute_score`` returns ``{"score", "acc", "pred", "status", "verifier_failed"}``; an item that could
not be graded (``timeout``, ``error``, ``too_large``, ``undecided``) gets ``score`` = the failure value
(``failure_score=`` reward kwarg, else ``$STAPO_VERIFIER_FAILURE_SCORE``, else 0.0) and its
``status`` shows in verl's logged extra info. ``compute_score_prime`` returns ``(score, status)``.

* TRL ``GRPOTrainer(reward_funcs=[make_trl_reward("answer")])``: ``(prompts, completions, **kwargs)``
  with the gold read from the data set column ``kwargs[column]``; plain-text and conversational
  completions (a list of message dicts) both work. An item that could not be graded gets ``None``
  (TRL's "no reward for this sample"), never a number.
* OpenRLHF ``--remote_rm_url <this file>``: ``reward_func(queries, prompts, labels)`` -> ``{"rewards",
  "scores", "extra_logs"}`` (torch tensors when torch is importable, as OpenRLHF expects). Queries are
  ``prompt + response`` decoded with ``skip_special_tokens=False`` (padding, end-of-turn tokens: the
  grader strips them); the token goes in a header. Or point ``--remote_rm_url`` at the service's
  ``http://host:port/get_reward`` (a token must then be in the URL, which OpenRLHF's retry log prints).

A missing gold (``None``, NaN) raises ``ValueError`` naming the item: it is never graded against the
text "None".

Where grading happens: ``url=`` argument, else ``$STAPO_VERIFIER_URL`` (comma-separated list for
sharding/failover, token from ``$STAPO_VERIFIER_TOKEN``), else in this process through a
``GraderPool`` sized by ``$STAPO_VERIFIER_WORKERS`` / ``$STAPO_VERIFIER_DEADLINE_S``. The pool's
``forkserver`` workers run the caller's script again (multiprocessing imports the main script in
each, as ``__mp_main__``), so a script that grades in-process needs ``if __name__ == "__main__":``;
without it the pool refuses to start, in the caller and before any worker starts, naming the script's
line and the guard (``pool.UNGUARDED_MESSAGE``).
Trainers that import this module (verl, TRL, OpenRLHF's launchers) already run from a guarded main.
The service being unreachable raises ``VerifierUnavailable``: a reward that could not be computed is
never silently 0.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from stapo.verifier_service.grader import Verdict, grade

FAILED = frozenset({"timeout", "error", "too_large", "undecided"})


class Verifier(Protocol):
    def verify(self, items: Sequence[Any]) -> list[Verdict]: ...


class LocalVerifier:
    """In-process grading through a :class:`GraderPool` (hard deadlines, warm workers)."""

    def __init__(self, **overrides: Any) -> None:
        """The pool's settings from ``STAPO_VERIFIER_*`` (:class:`Settings`), ``overrides`` on top."""
        from stapo.verifier_service.server.pool import GraderPool
        from stapo.verifier_service.server.settings import Settings

        self.pool = GraderPool(Settings(), **overrides)

    def verify(self, items: Sequence[Any]) -> list[Verdict]:
        return self.pool.grade_many(items)

    def close(self) -> None:
        self.pool.close()


_VERIFIERS: dict[str, Any] = {}
_LOCK = threading.Lock()


def _forget_verifiers_after_fork() -> None:
    """``os.fork()`` child: start with no verifiers, so each process gets its own HTTP client.

    An HTTP client's idle keep-alive connections are sockets; a forked child inherits them, and
    when several children (verl's legacy ``prime`` manager forks a ``ProcessPoolExecutor``) and the
    parent write requests on the same socket, the service receives interleaved bytes ("JSON decode
    error", "Invalid HTTP request") and those items are lost. The inherited objects are dropped,
    never closed here (closing is the parent's business); in-process pools rebuild themselves in
    the child (``pool.GraderPool``). The lock is replaced in case another thread held it at fork.
    """
    global _LOCK
    _LOCK = threading.Lock()
    _VERIFIERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_verifiers_after_fork)


def get_verifier(url: str | Sequence[str] | None = None) -> Verifier:
    """The shared verifier for ``url`` (or ``$STAPO_VERIFIER_URL``, or in-process), made once per process."""
    if url is None:
        url = os.environ.get("STAPO_VERIFIER_URL") or None
    urls = [u.strip() for u in url.split(",")] if isinstance(url, str) else list(url or [])
    key = ",".join(urls) or "local"
    with _LOCK:
        v = _VERIFIERS.get(key)
        if v is None:
            if urls:
                from stapo.verifier_service.clients.client import VerifierClient

                v = VerifierClient(urls, token=os.environ.get("STAPO_VERIFIER_TOKEN") or None)
            else:
                v = LocalVerifier()
            _VERIFIERS[key] = v
    return v


@atexit.register
def close_verifiers() -> None:
    """Close the shared pools/clients (also registered at exit)."""
    with _LOCK:
        vs = list(_VERIFIERS.values())
        _VERIFIERS.clear()
    for v in vs:
        try:
            v.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _gold_text(g: Any, i: int = 0, field: str = "ground_truth") -> str:
    """Golds arrive as str, int, float, numpy scalars/arrays or a one-element list (verl parquet, JSON).

    A missing gold is an error, never the text "None" graded as an answer.
    """
    if hasattr(g, "tolist") and not isinstance(g, (str, bytes)):
        g = g.tolist()  # numpy scalar or array (verl's non_tensor_batch is numpy object arrays)
    if isinstance(g, (list, tuple)) and len(g) == 1:
        g = g[0]
    if g is None or (isinstance(g, float) and math.isnan(g)):
        raise ValueError(
            f"{field}[{i}]: missing gold answer ({g!r}); fix the data set row (reward_model.ground_truth / "
            "label column) instead of grading against it"
        )
    if isinstance(g, float) and g.is_integer():
        g = int(g)
    return g if isinstance(g, str) else str(g)


def failure_score(value: float | None = None) -> float:
    """The score given to an item that could not be graded: ``value``, else ``$STAPO_VERIFIER_FAILURE_SCORE``, else 0.0.

    Frameworks need a number in a reward tensor; this one is a choice the user makes (0.0, or e.g.
    the wrong-answer reward of their scheme), and the item's ``status`` travels with it.
    """
    if value is not None:
        return float(value)
    env = os.environ.get("STAPO_VERIFIER_FAILURE_SCORE")
    if env:
        try:
            return float(env)
        except ValueError:
            raise ValueError(f"STAPO_VERIFIER_FAILURE_SCORE: not a number: {env!r}") from None
    return 0.0


_failure_value = failure_score  # the adapters' keyword argument of the same name shadows it


# --------------------------------------------------------------------------- verl


def _verl_dict(r: Verdict, fail_value: float) -> dict[str, Any]:
    # verl appends every key to reward_extra_info and logs them: keep the same keys for every item.
    failed = r.status in FAILED
    return {
        "score": fail_value if failed else float(r.score),
        "acc": bool(r.correct),
        "pred": r.extracted or "",
        "status": r.status,
        "verifier_failed": 1.0 if failed else 0.0,
    }


def compute_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    url: str | None = None,
    mode: str = "math",
    failure_score: float | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl's custom reward: naive / dapo managers, in the reward loop (0.7+) and the legacy managers (0.6.x).

    Returns ``{"score", "acc", "pred", "status", "verifier_failed"}``; extra keyword arguments verl
    passes (``reward_model``, ``reward_router_address``, ``reward_model_tokenizer``, ...) are ignored.
    """
    r = get_verifier(url).verify([(solution_str, _gold_text(ground_truth), mode)])[0]
    return _verl_dict(r, _failure_value(failure_score))


def compute_score_batch(
    data_sources: Sequence[Any],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
    *,
    url: str | None = None,
    mode: str = "math",
    failure_score: float | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """verl's legacy ``batch`` reward manager: the whole batch in one call (one pool job / few HTTP requests)."""
    if len(solution_strs) != len(ground_truths):
        raise ValueError(
            f"ground_truths: {len(ground_truths)} for {len(solution_strs)} solution_strs; they must match"
        )
    items = [
        (s, _gold_text(g, i, "ground_truths"), mode)
        for i, (s, g) in enumerate(zip(solution_strs, ground_truths, strict=True))
    ]
    fail = _failure_value(failure_score)
    return [_verl_dict(r, fail) for r in get_verifier(url).verify(items)]


class _Deadline(Exception):
    pass


def _grade_here(prediction: str, gold: str, mode: str, deadline_s: float, max_chars: int) -> Verdict:
    """Grade in this process under a SIGALRM deadline (main thread only; else through the pool)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return get_verifier(None).verify([(prediction, gold, mode)])[0]

    def on_alarm(signum: int, frame: Any) -> None:
        raise _Deadline

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, deadline_s)
    try:
        return grade(prediction, gold, mode, max_chars=max_chars)
    except _Deadline:
        return Verdict(False, 0.0, "timeout", None, deadline_s * 1e3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _grade_here_within_limits(prediction: str, gold: str, mode: str) -> Verdict:
    """In-process grading with the limits every other route applies (the service's and the pool's):
    ``$STAPO_VERIFIER_MAX_PREDICTION_CHARS`` / ``..._MAX_GOLD_CHARS`` (``too_large``) and
    ``$STAPO_VERIFIER_DEADLINE_S``, read through the same ``Settings``."""
    from stapo.verifier_service.server.pool import status_result
    from stapo.verifier_service.server.settings import Settings

    s = Settings()
    if len(prediction) > s.max_prediction_chars or len(gold) > s.max_gold_chars:
        return status_result("too_large")
    # the pool's workers grade with the larger of the two limits as grade()'s own size check
    return _grade_here(prediction, gold, mode, s.deadline_s, max(s.max_prediction_chars, s.max_gold_chars))


def compute_score_prime(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    url: str | None = None,
    mode: str = "math",
    failure_score: float | None = None,
    **kwargs: Any,
) -> tuple[float, str]:
    """verl's legacy ``prime`` reward manager: ``(score, status)``.

    That manager calls ``fn(task, completion, reference, extra_info)`` positionally inside its own
    ``ProcessPoolExecutor`` and reads ``float(result[0])``: the dict of :func:`compute_score` raises
    ``KeyError`` there and the manager sets the whole batch to 0. Its executor already isolates each
    call, so without a service URL this grades in the calling process under a SIGALRM deadline of
    ``$STAPO_VERIFIER_DEADLINE_S`` (default 5 s), with the same size limits as every other route,
    instead of starting a grader pool in every executor process. A failed item returns the failure value with its status (and a warning in the log).
    """
    gold = _gold_text(ground_truth)
    if url or os.environ.get("STAPO_VERIFIER_URL"):
        r = get_verifier(url).verify([(solution_str, gold, mode)])[0]
    else:
        r = _grade_here_within_limits(solution_str, gold, mode)
    if r.status in FAILED:
        import logging

        logging.getLogger(__name__).warning(
            "verifier item failed: status=%s (data_source=%s)", r.status, data_source
        )
        return _failure_value(failure_score), r.status
    return float(r.score), r.status


# --------------------------------------------------------------------------- TRL


def completion_text(c: Any) -> str:
    """Text of a TRL completion: a string, or a conversation (list of ``{"role", "content"}`` dicts).

    For a conversation the assistant turns are joined (usually there is exactly one); content given
    as a list of parts (``[{"type": "text", "text": ...}]``) is joined too.
    """
    if isinstance(c, str):
        return c
    if isinstance(c, dict):
        c = [c]
    if isinstance(c, (list, tuple)):
        msgs = [m for m in c if isinstance(m, dict)]
        chosen = [m for m in msgs if m.get("role", "assistant") == "assistant"] or msgs
        parts = []
        for m in chosen:
            content = m.get("content", "")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(content if isinstance(content, str) else str(content))
        return "\n".join(parts)
    raise TypeError(f"completions: expected str or a list of message dicts, got {type(c).__name__}")


def make_trl_reward(
    column: str = "answer", *, url: str | None = None, mode: str = "math"
) -> Callable[..., list[float | None]]:
    """A TRL reward function that grades each completion against ``kwargs[column]``.

    TRL passes every extra data set column to reward functions as a keyword argument, one value
    per completion (already repeated for the ``num_generations`` samples of a prompt). An item that
    could not be graded (``timeout``, ``error``, ``too_large``) gets ``None``: TRL then leaves that
    sample out of this reward instead of training on a made-up 0 (``no_answer`` is a wrong answer: 0.0).
    """

    def reward(
        prompts: Sequence[Any] | None = None, completions: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        if completions is None:
            raise TypeError("completions: TRL passes completions=...; none given")
        if column not in kwargs:
            cols = sorted(k for k in kwargs if k not in ("completion_ids", "trainer_state"))
            raise KeyError(f"{column!r}: no such data set column among the reward kwargs; available: {cols}")
        golds = kwargs[column]
        if len(golds) != len(completions):
            raise ValueError(
                f"{column}: {len(golds)} golds for {len(completions)} completions; they must match"
            )
        items = [
            (completion_text(c), _gold_text(g, i, column), mode)
            for i, (c, g) in enumerate(zip(completions, golds, strict=True))
        ]
        return [None if r.status in FAILED else float(r.score) for r in get_verifier(url).verify(items)]

    reward.__name__ = f"stapo_math_{column}"  # TRL logs each reward function under its __name__
    return reward


trl_reward = make_trl_reward("answer")
"""Ready-made TRL reward for data sets whose gold column is ``answer``."""


# --------------------------------------------------------------------------- OpenRLHF


def response_of(query: str, prompt: str | None) -> str:
    """The response part of an OpenRLHF query (prompt + response, decoded with special tokens kept):
    the same rule as the service's ``/get_reward`` (``schemas.strip_prompt``)."""
    from stapo.verifier_service.server.schemas import strip_prompt

    return strip_prompt(query, prompt)


def reward_func(
    queries: Sequence[str],
    prompts: Sequence[str],
    labels: Sequence[Any],
    *,
    url: str | None = None,
    failure_score: float | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """OpenRLHF ``--remote_rm_url this_file.py``: queries are prompt + response; labels are golds.

    OpenRLHF needs a number per sample: an item that could not be graded gets the failure value and
    ``extra_logs["verifier_failed"] = 1``.
    """
    if len(labels) != len(queries) or (prompts is not None and len(prompts) != len(queries)):
        raise ValueError(
            f"labels/prompts: {len(labels)} labels and {len(prompts or [])} prompts for {len(queries)} queries"
        )
    prompts = prompts if prompts is not None else [None] * len(queries)
    items = [
        (response_of(q, p), _gold_text(lbl, i, "labels"), kwargs.get("mode", "math"))
        for i, (q, p, lbl) in enumerate(zip(queries, prompts, labels, strict=True))
    ]
    results = get_verifier(url).verify(items)
    fail = _failure_value(failure_score)
    rewards = [fail if r.status in FAILED else float(r.score) for r in results]
    logs = {
        "accuracy": [float(r.correct) for r in results],
        "verifier_failed": [1.0 if r.status in FAILED else 0.0 for r in results],
    }
    try:
        import torch  # OpenRLHF runs with torch; it expects tensors here
    except ImportError:
        return {"rewards": rewards, "scores": rewards, "extra_logs": logs}
    t = torch.tensor(rewards, dtype=torch.float32)
    return {"rewards": t, "scores": t.clone(), "extra_logs": {k: torch.tensor(v) for k, v in logs.items()}}


# --------------------------------------------------------------------------- loaded by file path

if __name__ != "stapo.verifier_service.clients.adapters":
    # Frameworks load this file by path under a name of their own (verl >= 0.7:
    # ``custom_module_<hash>``, absent from ``sys.modules``; OpenRLHF's ``--remote_rm_url`` file). A
    # function of such a module cannot be pickled, and verl's legacy prime manager pickles it into
    # its process pool (every score then silently 0.0). Hand out the installed package's objects
    # instead: they pickle by reference, and the file and the package share one verifier per process.
    import importlib

    _installed = importlib.import_module("stapo.verifier_service.clients.adapters")
    globals().update({k: v for k, v in vars(_installed).items() if not k.startswith("_")})
