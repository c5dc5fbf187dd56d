"""A rollout engine in a process of its own: the ``hf`` engine on a private copy of the policy, versioned.

Asynchronous rollouts (``stapo.core.rollout.async_rollout``) drive every engine through the same versioned
calls: :meth:`~ProcessRolloutEngine.load_weights` with a ``version``, :meth:`~ProcessRolloutEngine.reserve`
and :meth:`~ProcessRolloutEngine.generate_at`, as they drive the rollout servers
(``stapo.core.rollout.vllm_server.ServerRolloutEngine``). The ``hf`` engine shares the learner's model
and cannot generate while that model trains, so for asynchronous rollouts it runs here: a ``spawn``ed
process loads its own copy of the policy on the rank's device (``stapo.core.placement``) and builds the
``hf`` engine on it. Weights go to it as a state dict of CPU tensor copies through a
``torch.multiprocessing`` queue, one entry per version; requests (the prompts, the sampling params,
the version that must generate them) through another; completions come back through a third.

Versions: the process reads the published versions in order and generates each request with exactly
the version it names, waiting for it if the learner has not published it yet. Every version it may
still need stays on the queue, so a push never waits for older requests (the servers hold one
version at a time; this engine queues them).

Failure: if the process dies (crash, kill, out of memory, an exception while generating)
:meth:`generate_at` raises :class:`ProducerDied` with its exit code and, when it could send one, its
traceback, within a fraction of a second; it never waits on a dead process. If the learner dies, the
process notices its parent is gone and exits. :class:`FaultInjection` makes it slow or fail on
purpose (tests, benchmarks).

``spawn`` starts a fresh interpreter that imports the caller's ``__main__``: a script that trains with
asynchronous rollouts guards its entry point with ``if __name__ == "__main__":`` (docs/async.md).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from stapo.core.config import Config, config_from_dict
from stapo.core.placement import rank_placement
from stapo.core.rollout import build_rollout_engine
from stapo.core.rollout.base import Completion, SamplingParams
from stapo.core.trainer.models import load_policy

__all__ = ["FaultInjection", "ProcessRolloutEngine", "ProducerDied"]

_POLL_S = 0.2  # how often a waiting side checks that the other process is alive
_STOP = "stop"


class ProducerDied(RuntimeError):
    """The rollout producer ended before delivering the batch the learner waits for."""


@dataclass
class FaultInjection:
    """Deliberate slowness / failure of the producer process, for tests and benchmarks only. Applied
    at the first generate request of a step (a step larger than one generate call has several)."""

    delay_s: float = 0.0  # sleep before generating each step's batch (a slow producer)
    step_delays: dict[int, float] = field(default_factory=dict)  # extra sleep before these steps' batches
    die_at_step: int | None = None  # exit abruptly (os._exit(3)) while producing this step's batch
    raise_at_step: int | None = None  # raise an exception (reported with its traceback) at this step


@dataclass
class _Weights:
    version: int
    state: dict[str, torch.Tensor]


@dataclass
class _Request:
    step: int | None
    version: int
    prompts: list[list[int]]
    sampling: SamplingParams


@dataclass
class _Reply:
    step: int | None
    version: int
    groups: list[list[Completion]]
    started_at: float  # time.time() when generation began


@dataclass
class _Failure:
    step: int | None
    error: str


class ProcessRolloutEngine:
    """The ``hf`` engine in a producer process (see the module docstring). One caller at a time.

    Usage (what ``stapo.core.rollout.async_rollout.AsyncRollouts`` does)::

        engine = ProcessRolloutEngine(cfg)
        engine.load_weights(backend.named_parameters_for_sync(), version=0)
        groups = engine.generate_at(0, prompt_ids, sampling, step=1)   # [prompt][sample] Completion
        engine.close()
    """

    def __init__(self, cfg: Any, *, fault: FaultInjection | None = None, threads: int | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._weights, self._requests, self._replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
        data = cfg.model_dump(mode="json", by_alias=True) if isinstance(cfg, Config) else cfg
        self._proc = ctx.Process(
            target=producer_main,
            args=(data, self._weights, self._requests, self._replies,
                  torch.get_num_threads() if threads is None else threads, fault or FaultInjection()),
            name="stapo-rollout-producer",
            daemon=False,  # a daemon may not start processes of its own
        )
        self.weight_version: int | None = None  # the last version published
        self.started_at: dict[int, float] = {}  # step -> when its generation began (its first request)
        self._closed = False
        self._proc.start()
        atexit.register(self.close)  # before multiprocessing's exit hook joins its non-daemon children

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Publish the policy as ``version`` (default: the previous + 1; the first is 0): a copy, the
        learner keeps training its own tensors. Returns at once; the process loads it when a request
        names it."""
        new = version if version is not None else (0 if self.weight_version is None else self.weight_version + 1)
        state = {name: t.detach().to("cpu", copy=True) for name, t in named_tensors}
        self._weights.put(_Weights(new, state))
        self.weight_version = new

    def reserve(self, version: int) -> None:
        """A batch will be generated at ``version``: nothing to hold back here, every published
        version stays queued until a request moves past it."""

    def generate_at(self, version: int, prompt_token_ids: list[list[int]], sampling: SamplingParams, *,
                    stop: threading.Event | None = None, step: int | None = None) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, ``[prompt][sample]``, generated by exactly ``version``
        (waits while it is not published). Raises :class:`ProducerDied` if the process is gone;
        ``stop`` ends the wait (``RuntimeError``). ``step`` names the batch in errors and faults."""
        self._requests.put(_Request(step, version, [list(p) for p in prompt_token_ids], sampling))
        while True:
            try:
                item = self._replies.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._proc.is_alive():
                    self._raise_dead(step)
                if stop is not None and stop.is_set():
                    raise RuntimeError(f"stopped while waiting for step {step}'s batch") from None
                continue
            if isinstance(item, _Failure):
                self._proc.join(timeout=5)
                raise ProducerDied(f"rollout producer failed at step {item.step}:\n{item.error}")
            if item.step != step or item.version != version:
                raise RuntimeError(f"rollout producer sent step {item.step}'s batch of version {item.version}; "
                                   f"expected step {step} at version {version}")
            if step is not None:
                self.started_at.setdefault(step, item.started_at)
            return item.groups

    def _raise_dead(self, step: int | None) -> None:
        # a failure report may have landed between the last poll and the liveness check
        try:
            item = self._replies.get(timeout=_POLL_S)
        except queue.Empty:
            item = None
        if isinstance(item, _Failure):
            raise ProducerDied(f"rollout producer failed at step {item.step}:\n{item.error}")
        raise ProducerDied(
            f"rollout producer (pid {self._proc.pid}) exited with code {self._proc.exitcode} before delivering "
            f"step {step}'s batch (killed, out of memory, or crashed without a report); the run stops here - "
            "resume from the last checkpoint"
        )

    def sleep(self) -> None:
        pass  # the process's memory is its own

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """Stop the process (it may be waiting for weights or generating) and reap it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._proc.is_alive():
            self._requests.put(_STOP)
            self._weights.put(_STOP)
            self._proc.join(timeout=2)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        for q in (self._weights, self._requests, self._replies):
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> ProcessRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- the producer process


def _get(q: Any) -> Any:
    """The next item of ``q`` (``_STOP`` once the learner is gone: nobody will ever send again)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return _STOP


def _weights_of(q: Any, want: int) -> _Weights | None:
    """Read published versions in order up to ``want`` (None: asked to stop, or the learner is gone)."""
    while True:
        item = _get(q)
        if item == _STOP:
            return None
        if item.version > want:
            raise RuntimeError(f"producer expected version {want}, the learner published {item.version}")
        if item.version == want:
            return item


def producer_main(cfg_data: dict[str, Any], weights_q: Any, requests_q: Any, replies_q: Any, threads: int,
                  fault: FaultInjection) -> None:
    """The producer process: its own policy copy and ``hf`` engine; for each request, load the version
    it names (reading the published ones in order), generate, send the completions back."""
    step: int | None = None
    try:
        torch.set_num_threads(threads)
        cfg = config_from_dict(cfg_data)
        # the rank's variables are inherited: the producer shares its rank's device
        model, tokenizer = load_policy(cfg.model, device=rank_placement(cfg.trainer.device).device)
        engine = build_rollout_engine(cfg, model=model, tokenizer=tokenizer)
        version: int | None = None
        started: set[int | None] = set()
        while True:
            req = _get(requests_q)
            if req == _STOP:
                return
            step = req.step
            if version != req.version:
                w = _weights_of(weights_q, req.version)
                if w is None:
                    return
                engine.load_weights(w.state.items())
                version = req.version
            first = step not in started
            started.add(step)
            t0 = time.time()
            if first and (fault.delay_s or step in fault.step_delays):
                time.sleep(fault.delay_s + fault.step_delays.get(step, 0.0))
            if first and fault.raise_at_step == step:
                raise RuntimeError(f"fault injected at step {step}")
            if first and fault.die_at_step == step:
                os._exit(3)
            groups = engine.generate(req.prompts, req.sampling)
            replies_q.put(_Reply(step, version, groups, t0))
    except BaseException:  # report everything, then exit non-zero
        try:
            replies_q.put(_Failure(step, traceback.format_exc()))
        finally:
            raise
