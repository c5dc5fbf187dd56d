"""A stand-in for ``vllm serve``, for the tests of ``rollout.engine: vllm_server``.

A real vLLM server cannot run in the default suite (vLLM is not installable beside stapo's test
environment, and a CPU build takes minutes to start; tests/e2e/test_vllm_server_slow.py runs the
real one, opt-in). This stand-in is a real HTTP server (stdlib ``ThreadingHTTPServer`` on
127.0.0.1) that speaks the subset of vLLM 0.32's API the engine uses, with the shapes vLLM returns:

- ``POST /v1/completions`` (token-id prompt, ``n``, ``seed``, ``logprobs: 0``, ``return_token_ids``,
  ``stop_token_ids``): sampled from a real tiny model by full forward passes, sample i of a seeded
  request with ``seed + i`` as vLLM does; log-probs are ``log_softmax(logits / T)`` of the sampled
  tokens, as vLLM's ``processed_logprobs`` with ``top_p == 1`` (the only ``top_p`` it takes);
- dev-mode ``POST /collective_rpc`` (``reload_weights`` with ``weights_path``: reads the safetensors
  shards into the model, strict on names), ``POST /reset_prefix_cache``,
  ``POST /update_weight_version``, ``GET /weight_info``; ``GET /health``.

Knobs for failure tests: ``fail_next`` (answer that many requests with 503), ``delay_s`` (sleep
before each completion), ``refuse_reload`` (503 on ``/collective_rpc``).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch


class FakeVLLMServer:
    """``with FakeVLLMServer(model, tokenizer) as srv: srv.url``; ``srv.stop()`` kills it mid-run."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.weight_version: str | None = None
        self.requests: list[dict[str, Any]] = []
        self.reloads: list[str] = []
        self.events: list[tuple[str, Any]] = []  # ("completion", seed) when a request arrives, ("reload", path)
        self.fail_next = 0
        self.delay_s = 0.0
        self.refuse_reload = False
        self._lock = threading.Lock()  # one generate at a time (the model is shared)
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def __enter__(self) -> FakeVLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    # ----------------------------------------------------------------------------- the API

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = body["prompt"]
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return 400, {"error": {"message": "prompt must be a list of token ids here"}}
        if len(prompt) > 512:
            return 400, {"error": {"message": f"prompt of {len(prompt)} tokens is longer than max_model_len 512"}}
        if float(body.get("top_p", 1.0)) != 1.0:
            return 400, {"error": {"message": "this stand-in samples with top_p=1 only"}}
        n, seed = int(body.get("n", 1)), body.get("seed")
        stops = set() if body.get("ignore_eos") else set(body.get("stop_token_ids") or [])
        with self._lock:
            choices = [self._sample(prompt, float(body["temperature"]), int(body["max_tokens"]),
                                    None if seed is None else int(seed) + i, stops) | {"index": i} for i in range(n)]
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": "fake", "choices": choices}

    @torch.no_grad()
    def _sample(self, prompt: list[int], temperature: float, max_tokens: int, seed: int | None,
                stops: set[int]) -> dict[str, Any]:
        """One sample as vLLM draws it: sample i of a seeded request uses ``seed + i``, from a generator
        of its own (never the process's global one: the learner trains in this process meanwhile);
        log-probs of the distribution sampled from, ``log_softmax(logits / T)`` (greedy: T = 1)."""
        gen = torch.Generator()
        if seed is None:
            gen.seed()  # non-deterministic, as an unseeded vLLM request
        else:
            gen.manual_seed(seed)
        ids, out, lps, finish = list(prompt), [], [], "length"
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()  # [V]
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            tok = int(logp.argmax()) if temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
            out.append(tok)
            lps.append(float(logp[tok]))
            ids.append(tok)
            if tok in stops:
                finish = "stop"
                break
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        return {"text": text, "token_ids": out, "finish_reason": finish, "stop_reason": None,
                "logprobs": {"token_logprobs": lps, "tokens": [], "top_logprobs": []}}

    def reload(self, path: str) -> None:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(str(f)))
        names = dict(self.model.named_parameters())
        unknown = sorted(set(state) - set(names))
        missing = sorted(set(names) - set(state))
        if unknown or missing:
            raise KeyError(f"unknown {unknown[:3]}, missing {missing[:3]}")
        with torch.no_grad(), self._lock:
            for name, t in state.items():
                names[name].copy_(t)
        self.reloads.append(path)
        self.events.append(("reload", path))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/weight_info":
                    self._send(200, {"weight_version": srv.weight_version})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null")
                if self.path == "/v1/completions":
                    srv.requests.append(body)
                    srv.events.append(("completion", body.get("seed")))
                    if srv.fail_next > 0:
                        srv.fail_next -= 1
                        self._send(503, {"error": {"message": "engine busy"}})
                        return
                    time.sleep(srv.delay_s)
                    self._send(*srv.complete(body))
                elif self.path == "/collective_rpc":
                    if srv.refuse_reload or body.get("method") != "reload_weights":
                        self._send(503, {"error": "reload refused"})
                        return
                    try:
                        srv.reload(body["kwargs"]["weights_path"])
                    except (KeyError, RuntimeError) as err:
                        self._send(500, {"error": str(err)})
                        return
                    self._send(200, {"results": [None]})
                elif self.path == "/reset_prefix_cache":
                    self._send(200, {})
                elif self.path == "/update_weight_version":
                    srv.weight_version = body["new_version"]
                    self._send(200, {"success": True, "new_version": srv.weight_version})
                else:
                    self._send(404, {"detail": "Not Found"})

        return Handler
