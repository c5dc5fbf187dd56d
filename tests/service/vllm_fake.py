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
  shards into the model, strict on names), ``POST /reset_prefix_cache`` (``{"success": bool}``, as
  vLLM 0.32 and 0.33 answer), ``POST /update_weight_version``, ``GET /weight_info``; ``GET /health``;
- the RL routes of vLLM's nccl weight transfer as its ``HTTPVLLMWeightSyncClient`` calls them
  (``GET /get_world_size``, ``POST /init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``). The bytes travel through :class:`FakeNCCLGroup`
  (what the trainer's NCCL broadcast would deliver to the workers); ``/finish_weight_update`` loads
  them into the model by the names, dtypes and shapes of the last ``/update_weights``, strict on names.

Knobs for failure tests: ``fail_next`` (answer that many requests with 503), ``delay_s`` (sleep
before each completion), ``refuse_reload`` (503 on ``/collective_rpc``), ``prefix_busy`` (answer
that many ``/reset_prefix_cache`` calls with ``success: false``, as vLLM does while KV blocks are held).
``events`` records the order: ``("completion", seed)``, ``("reload", path)``, ``("reset", ok)``,
``("finish", names)``, ``("version", v)``.
"""

from __future__ import annotations

import json
import math
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
        self.prefix_busy = 0
        self.transfer_init: dict[str, Any] | None = None  # the init_info of /init_weight_transfer_engine
        self.update_info: dict[str, Any] = {}  # the last non-empty /update_weights
        self.received: list[torch.Tensor] = []  # broadcast chunks since /start_weight_update
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

    def finish_weight_update(self) -> list[str]:
        """Load the broadcast bytes into the model as vLLM's receiving workers do (names, dtypes and
        shapes from ``/update_weights``; packed or one tensor per broadcast, both are bytes in order)."""
        info = self.update_info
        data = torch.cat([c.reshape(-1).view(torch.uint8) for c in self.received]) if self.received else torch.empty(0, dtype=torch.uint8)
        names = dict(self.model.named_parameters())
        if missing := sorted(set(names) - set(info["names"])):
            raise ValueError(f"missing {missing[:3]}")
        offset = 0
        with torch.no_grad(), self._lock:
            for name, dtype_name, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
                dtype = getattr(torch, dtype_name)
                size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                names[name].copy_(data[offset:offset + size].view(dtype).view(shape))  # KeyError: unknown name
                offset += size
        if offset != data.numel():
            raise ValueError(f"{data.numel() - offset} bytes broadcast beyond the declared parameters")
        self.received = []
        return list(info["names"])

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
                elif self.path.startswith("/get_world_size"):
                    self._send(200, {"world_size": 1})
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
                elif self.path.startswith("/reset_prefix_cache"):
                    ok = srv.prefix_busy <= 0
                    srv.prefix_busy -= 1
                    srv.events.append(("reset", ok))
                    self._send(200, {"success": ok})
                elif self.path == "/update_weight_version":
                    srv.weight_version = body["new_version"]
                    srv.events.append(("version", srv.weight_version))
                    self._send(200, {"success": True, "new_version": srv.weight_version})
                elif self.path == "/init_weight_transfer_engine":
                    srv.transfer_init = body["init_info"]
                    self._send(200, {"message": "Weight transfer initialized"})
                elif self.path == "/start_weight_update":
                    srv.received = []
                    self._send(200, {"message": "Weight update started"})
                elif self.path == "/update_weights":
                    if body["update_info"].get("names"):  # empty: the previous round's metadata again
                        srv.update_info = body["update_info"]
                    self._send(200, {"message": "Weights updated"})
                elif self.path == "/finish_weight_update":
                    try:
                        srv.events.append(("finish", srv.finish_weight_update()))
                    except (KeyError, ValueError, RuntimeError) as err:
                        self._send(500, {"error": f"{type(err).__name__}: {err}"})
                        return
                    self._send(200, {"message": "Weight update finished"})
                else:
                    self._send(404, {"detail": "Not Found"})

        return Handler


class FakeNCCLGroup:
    """The trainer's end of vLLM's weight-transfer NCCL group, delivering to a :class:`FakeVLLMServer`:
    ``broadcast(tensor, src=0)`` hands a copy of the bytes to the server's workers."""

    def __init__(self, server: FakeVLLMServer) -> None:
        self.server = server
        self.broadcasts = 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        assert src == 0, "the trainer (rank 0) sends"
        self.server.received.append(tensor.detach().to("cpu", copy=True).contiguous())
        self.broadcasts += 1

    def destroy(self) -> None:
        pass
