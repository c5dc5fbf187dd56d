"""``rollout.engine: vllm_server`` against stand-ins of ``vllm serve`` on 127.0.0.1.

A real vLLM server cannot run in the default suite (see tests/service/vllm_fake.py: the stand-in is
a real HTTP server speaking vLLM 0.32's completions and dev-mode weight API shapes, sampling with a
real tiny model). What can fail here: requests spread to the least busy server, a dead or failing
server costs a retry and not the run, no answer anywhere names every URL, a bad request is not
retried, every push carries a version that the servers report and every completion records, the
weights a server holds after a push are the learner's (log-probs equal the learner's own), and a
whole `stapo train` run goes through the servers.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import socket
import threading
from pathlib import Path

import pytest
import torch
import yaml
from hook_driver import train_keeping_run

from stapo.core.config import TinyModel
from stapo.core.rollout import SamplingParams
from stapo.core.rollout.vllm_server import (
    RolloutRequestError,
    RolloutServersUnavailable,
    ServerPool,
    ServerRolloutEngine,
    write_safetensors_shards,
)
from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer
from tests.service.vllm_fake import FakeVLLMServer

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture
def model(tok):
    return build_tiny_model(TinyModel(), tok)


def _perturbed(model, seed: int):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return other


def _dead_url() -> str:
    """A loopback port with nothing listening (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _engine(urls, tok, **kw) -> ServerRolloutEngine:
    kw.setdefault("retries", 2)
    kw.setdefault("backoff_s", 0.01)
    return ServerRolloutEngine(urls, tokenizer=tok, **kw)


# ----------------------------------------------------------------------------- spreading


def test_pool_picks_least_outstanding_then_first_url():
    pool = ServerPool(["http://a", "http://b", "http://c"])
    # outstanding a=0 b=0 c=0 -> a; then a=1 -> b; then c; then all at 1 -> a
    assert [pool.pick() for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    pool.done("http://b", ok=True)  # b=0
    assert pool.pick() == "http://b"
    assert pool.pick({"http://b", "http://c"}) == "http://a"  # excluded URLs are skipped
    pool.done("http://c", ok=False)  # c failed: benched, even with fewer in flight (c=0 < a=3)
    assert pool.pick({"http://b"}) == "http://a"
    assert pool.pick({"http://a", "http://b"}) == "http://c"  # a benched server is still the last resort


def test_pool_rejects_no_urls_and_duplicates():
    with pytest.raises(ValueError, match="at least one"):
        ServerPool([])
    with pytest.raises(ValueError, match="twice"):
        ServerPool(["http://a:1", "http://a:1/"])


def test_requests_spread_over_servers(model, tok):
    with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
        s1.delay_s = s2.delay_s = 0.05  # requests overlap, so least-outstanding must use both
        eng = _engine([s1.url, s2.url], tok, concurrency=4)
        groups = eng.generate([PROMPT] * 8, SamplingParams(n=3, max_new_tokens=4, seed=1))
        assert len(groups) == 8 and all(len(g) == 3 for g in groups)
        assert len(s1.requests) + len(s2.requests) == 8
        assert len(s1.requests) >= 2 and len(s2.requests) >= 2
        assert eng.pool.served == {s1.url: len(s1.requests), s2.url: len(s2.requests)}
        # the request is the colocated engine's: token ids in, n samples, sampled log-probs, eos as stop
        body = s1.requests[0]
        assert body["prompt"] == PROMPT and body["n"] == 3 and body["logprobs"] == 0
        assert body["return_token_ids"] is True and body["top_k"] == 0
        assert body["stop_token_ids"] == [tok.eos_token_id]
        # every request its own seed, n apart (vLLM takes seed + i for sample i): 24 distinct streams,
        # so the 8 groups of one prompt differ
        assert sorted(r["seed"] for r in s1.requests + s2.requests) == [1 + 3 * p for p in range(8)]
        assert len({tuple(tuple(c.token_ids) for c in g) for g in groups}) > 1
        eng.close()


def test_completions_come_through_unchanged(model, tok):
    """Token ids, log-probs and finish reasons as the server sampled them: log-probs equal a
    teacher-forced forward of the same weights, greedy tokens equal the hf engine's, a seed
    reproduces, greedy n > 1 is sampled once and copied."""
    from stapo.core.rollout.hf import HFRolloutEngine

    eos = tok.eos_token_id
    with FakeVLLMServer(copy.deepcopy(model), tok) as srv:
        eng = _engine([srv.url], tok)
        sampled = eng.generate([PROMPT, [9, 10]], SamplingParams(n=4, max_new_tokens=6, seed=3))
        assert eng.generate([PROMPT, [9, 10]], SamplingParams(n=4, max_new_tokens=6, seed=3)) == sampled
        for prompt, group in zip([PROMPT, [9, 10]], sampled, strict=True):
            assert len(group) == 4 and len({tuple(c.token_ids) for c in group}) > 1
            for c in group:
                assert c.logprobs == pytest.approx(_learner_logprobs(model, prompt, c.token_ids), abs=1e-5)
                assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
                assert c.finish_reason == "stop" or len(c.token_ids) == 6
        greedy = eng.generate([PROMPT], SamplingParams(n=3, temperature=0, max_new_tokens=6))
        assert srv.requests[-1]["n"] == 1  # sampled once, copied to n
        ref = HFRolloutEngine(copy.deepcopy(model).eval(), tok, share_prefix=False)
        want = ref.generate([PROMPT], SamplingParams(n=1, temperature=0, max_new_tokens=6))[0][0]
        assert [c.token_ids for c in greedy[0]] == [want.token_ids] * 3
        assert greedy[0][0].logprobs == pytest.approx(want.logprobs, abs=1e-5)
        eng.close()


# ----------------------------------------------------------------------------- failures


def test_dead_server_costs_a_retry_not_the_run(model, tok):
    dead = _dead_url()
    with FakeVLLMServer(copy.deepcopy(model), tok) as srv:
        eng = _engine([dead, srv.url], tok, concurrency=1)
        groups = eng.generate([PROMPT] * 4, SamplingParams(n=2, max_new_tokens=3, seed=0))
        assert len(groups) == 4 and all(c.url == srv.url for g in groups for c in g)
        assert eng.pool.served[srv.url] == 4 and eng.pool.served[dead] == 0
        eng.close()


def test_a_503_is_retried_on_another_server(model, tok):
    with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
        s1.fail_next = 1
        eng = _engine([s1.url, s2.url], tok, concurrency=1)
        (group,) = eng.generate([PROMPT], SamplingParams(n=2, max_new_tokens=3, seed=0))
        assert len(s1.requests) == 1 and len(s2.requests) == 1 and group[0].url == s2.url
        eng.close()


def test_no_server_answers_names_every_url(tok):
    a, b = _dead_url(), _dead_url()
    eng = _engine([a, b], tok, retries=1)
    with pytest.raises(RolloutServersUnavailable) as err:
        eng.generate([PROMPT], SamplingParams(n=2, max_new_tokens=3))
    msg = str(err.value)
    assert a in msg and b in msg and "ConnectError" in msg and "after 2 attempts" in msg
    eng.close()


def test_server_killed_mid_run_next_url_takes_over(model, tok):
    s1, s2 = FakeVLLMServer(copy.deepcopy(model), tok), FakeVLLMServer(copy.deepcopy(model), tok)
    eng = _engine([s1.url, s2.url], tok)
    eng.generate([PROMPT] * 2, SamplingParams(n=2, max_new_tokens=3, seed=0))
    s1.stop()
    groups = eng.generate([PROMPT] * 3, SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert all(c.url == s2.url for g in groups for c in g)
    s2.stop()
    with pytest.raises(RolloutServersUnavailable, match=s2.url.replace(".", r"\.")):
        eng.generate([PROMPT], SamplingParams(n=2, max_new_tokens=3, seed=0))
    eng.close()


def test_bad_request_is_not_retried(model, tok):
    with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
        eng = _engine([s1.url, s2.url], tok)
        with pytest.raises(RolloutRequestError, match="HTTP 400: prompt of 600 tokens"):
            eng.generate([[5] * 600], SamplingParams(n=2, max_new_tokens=3))
        assert len(s1.requests) + len(s2.requests) == 1
        eng.close()


# ----------------------------------------------------------------------------- weights and versions


def test_shards_hold_one_bucket_and_round_trip(tmp_path, model):
    from safetensors.torch import load_file

    named = list(model.named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in named)
    # a 1-byte bucket: every tensor overfills it, one shard each; a bucket of the whole model: one shard
    assert write_safetensors_shards(iter(named), tmp_path / "one", bucket_bytes=total)["shards"] == 1
    stats = write_safetensors_shards(iter(named), tmp_path, bucket_bytes=1)
    assert stats["shards"] == stats["tensors"] == len(named)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in named}
    assert index["metadata"]["total_size"] == total
    back = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        back.update(load_file(str(f)))
    for n, p in named:
        assert torch.equal(back[n], p.detach())
    with pytest.raises(ValueError, match="given twice"):
        write_safetensors_shards(iter(named[:1] * 2), tmp_path / "dup", bucket_bytes=1 << 30)


def _learner_logprobs(learner, prompt: list[int], response: list[int]) -> list[float]:
    """log pi(response_t | prompt, response_<t) under the learner, by one forward (T = 1)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(learner(ids).logits[0].float(), dim=-1)  # [L, V]
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)].tolist()


def test_push_carries_a_version_and_the_weights_arrive(tmp_path, model, tok):
    learner = _perturbed(model, seed=1)
    with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
        eng = _engine([s1.url, s2.url], tok, weights_dir=tmp_path, bucket_mb=1)
        before = eng.generate([PROMPT], SamplingParams(n=2, max_new_tokens=5, seed=4))
        assert eng.weight_version is None and {c.version for c in before[0]} == {None}

        eng.load_weights(learner.named_parameters())
        assert eng.weight_version == 0 and s1.weight_version == s2.weight_version == "0"
        assert eng.last_sync["tensors"] == len(list(learner.parameters())) and eng.last_sync["shards"] >= 1
        for srv in (s1, s2):
            for (n, p), q in zip(learner.named_parameters(), srv.model.parameters(), strict=True):
                assert torch.equal(p, q), n
        groups = eng.generate([PROMPT] * 2, SamplingParams(n=2, max_new_tokens=5, seed=4))
        for c in (c for g in groups for c in g):
            assert c.version == 0
            assert c.logprobs == pytest.approx(_learner_logprobs(learner, PROMPT, c.token_ids), abs=1e-5)

        learner2 = _perturbed(model, seed=2)
        eng.load_weights(learner2.named_parameters(), version=7)
        assert s1.weight_version == s2.weight_version == "7"
        (g,) = eng.generate([PROMPT], SamplingParams(n=1, max_new_tokens=5, seed=4))
        assert g[0].version == 7
        assert g[0].logprobs == pytest.approx(_learner_logprobs(learner2, PROMPT, g[0].token_ids), abs=1e-5)
        eng.load_weights(learner.named_parameters())  # previous + 1
        assert eng.weight_version == 8 and s1.weight_version == "8"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v000007", "v000008"]  # older versions removed
        eng.close()


def test_server_that_misses_a_push_leaves_the_rotation(tmp_path, model, tok):
    learner = _perturbed(model, seed=1)
    with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
        eng = _engine([s1.url, s2.url], tok, weights_dir=tmp_path)
        s1.refuse_reload = True
        eng.load_weights(learner.named_parameters())
        assert eng.pool.in_rotation() == [s2.url] and s1.weight_version is None
        groups = eng.generate([PROMPT] * 4, SamplingParams(n=2, max_new_tokens=3, seed=0))
        assert {c.url for g in groups for c in g} == {s2.url} and not s1.requests
        s1.refuse_reload = False
        eng.load_weights(learner.named_parameters())  # the next push brings it back
        assert eng.pool.in_rotation() == [s1.url, s2.url] and s1.weight_version == "1"
        s1.refuse_reload = s2.refuse_reload = True
        with pytest.raises(RolloutServersUnavailable, match="weight version 2 reached no rollout server"):
            eng.load_weights(learner.named_parameters())
        eng.close()


def test_a_push_waits_for_requests_in_flight(model, tok):
    """No completion straddles two versions: the push starts only after the generate call returns."""
    learner = _perturbed(model, seed=1)
    with FakeVLLMServer(copy.deepcopy(model), tok) as srv:
        srv.delay_s = 0.3
        eng = _engine([srv.url], tok)
        out: list = []
        t = threading.Thread(target=lambda: out.extend(eng.generate([PROMPT] * 2, SamplingParams(n=2, max_new_tokens=3, seed=0))))
        t.start()
        while not srv.requests:
            pass
        eng.load_weights(learner.named_parameters())
        t.join()
        assert {c.version for g in out for c in g} == {None} and srv.weight_version == "0"
        assert not any(math.isnan(x) for g in out for c in g for x in c.logprobs)
        eng.close()


# ----------------------------------------------------------------------------- the loop


def test_train_runs_through_the_servers(tmp_path):
    """Two `stapo train` steps with rollout.engine=vllm_server: every step's rollouts come from the
    servers, a push after each step (versions 0, 1, 2), and the servers end with the learner's weights."""
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.trainer.models import load_policy

    base = ["logging.live=false", "logging.tensorboard=false", "trainer.max_steps=2", "eval.every=0"]
    model, tok = load_policy(load_config(preset_path("tiny"), base).model)  # what the learner starts from
    with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
        cfg = load_config(preset_path("tiny"), [
            *base, "rollout.engine=vllm_server", f"rollout.server.urls=[{s1.url},{s2.url}]",
            f"rollout.server.weights_dir={tmp_path / 'weights'}",
        ])
        _result, run = train_keeping_run(cfg, tmp_path / "run")
        assert s1.weight_version == s2.weight_version == "2"  # pushes: start, after step 1, after step 2
        assert len(s1.requests) + len(s2.requests) >= 2 * cfg.rollout.prompts_per_step
        for srv in (s1, s2):
            for (n, p), q in zip(run.backend.model.named_parameters(), srv.model.parameters(), strict=True):
                assert torch.equal(p.detach(), q), n


# ----------------------------------------------------------------------------- documented commands

REPO = Path(__file__).resolve().parents[2]


def _servers_section_lines() -> list[str]:
    """The command lines in docs/rollout.md's "Servers" section (```bash blocks)."""
    text = (REPO / "docs" / "rollout.md").read_text()
    section = text[text.index("## Servers"):]
    return [ln.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S) for ln in block.splitlines() if ln.strip()]


def _stapo_args(line: str) -> list[str]:
    """``[ENV=x ...] stapo ARGS [&]`` -> ARGS."""
    words = shlex.split(line.removesuffix("&").strip())
    return words[words.index("stapo") + 1:]


def test_documented_serve_lines_build_the_vllm_command():
    from typer.testing import CliRunner

    from stapo.cli.main import app

    lines = [ln for ln in _servers_section_lines() if "stapo rollout serve" in ln]
    assert len(lines) >= 3
    for line in lines:
        args = _stapo_args(line)
        res = CliRunner().invoke(app, [*args, *([] if "--print" in args else ["--print"])])
        assert res.exit_code == 0, (line, res.output)
        printed = shlex.split(res.output)
        assert printed[:3] == ["VLLM_SERVER_DEV_MODE=1", "vllm", "serve"] and printed[3] == args[2]
        for flag in ("--logprobs-mode", "--generation-config"):
            assert flag in printed
        for word in args[3:]:  # every flag the line gives reaches vLLM
            if word != "--print":
                assert word in printed, (line, word)
    # the printed example in the docs is exactly what the command prints
    text = (REPO / "docs" / "rollout.md").read_text()
    shown = re.search(r"prints\n\n```\n(.*?)\n```", text, re.S).group(1)
    res = CliRunner().invoke(app, _stapo_args(lines[0]))
    assert res.output.strip() == shown


def test_documented_train_lines_run_through_two_servers(tmp_path):
    """Each documented `stapo train` line, one step on CPU: `--config tiny` (the model a CPU runs)
    and the URLs of two loopback stand-ins; everything else as written."""
    from typer.testing import CliRunner

    from stapo.cli.main import app
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.trainer.models import load_policy

    lines = [ln for ln in _servers_section_lines() if ln.startswith("stapo train")]
    assert len(lines) == 2
    model, tok = load_policy(load_config(preset_path("tiny")).model)
    for i, line in enumerate(lines):
        with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
            args = _stapo_args(line)
            args[args.index("--config") + 1] = "tiny"
            args = [re.sub(r"urls=\[.*\]", f"urls=[{s1.url},{s2.url}]", a) for a in args]
            args = [re.sub(r"weights_dir=.*", f"weights_dir={tmp_path / f'w{i}'}", a) for a in args]
            args += ["--set", "trainer.max_steps=1", "--set", "logging.live=false", "--run-dir", str(tmp_path / f"r{i}")]
            res = CliRunner().invoke(app, args)
            assert res.exit_code == 0, (line, res.output)
            assert s1.weight_version == s2.weight_version == "1"
            assert s1.requests and s2.requests


def test_compose_rollout_service_builds_the_documented_server():
    from typer.testing import CliRunner

    from stapo.cli.main import app

    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    svc = services["rollout"]
    assert svc["profiles"] == ["fleet"] and "ports" not in svc  # dev-mode endpoints stay on compose's network
    res = CliRunner().invoke(app, [*svc["command"], "--print"])
    assert res.exit_code == 0, res.output
    printed = shlex.split(res.output)
    port = printed[printed.index("--port") + 1]
    assert printed[printed.index("--host") + 1] == "0.0.0.0"
    assert f"127.0.0.1:{port}/health" in " ".join(svc["healthcheck"]["test"])
    assert "./runs:/runs" in svc["volumes"] and "./runs:/runs" in services["trainer"]["volumes"]  # weights_dir


# ----------------------------------------------------------------------------- asynchronous training on the fleet

TIMING = ("time/", "perf/", "async/")


def _fleet_run(tmp_path, name: str, model, tok, *overrides: str):
    """A 3-step tiny run through two stand-in servers; (metrics rows without timings, final params, servers)."""
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.tracking import read_jsonl

    s1, s2 = FakeVLLMServer(copy.deepcopy(model), tok), FakeVLLMServer(copy.deepcopy(model), tok)
    try:
        cfg = load_config(preset_path("tiny"), [
            "logging.live=false", "logging.tensorboard=false", "trainer.max_steps=3", "eval.every=0",
            "rollout.engine=vllm_server", f"rollout.server.urls=[{s1.url},{s2.url}]",
            f"rollout.server.weights_dir={tmp_path / name / 'weights'}", *overrides,
        ])
        _result, run = train_keeping_run(cfg, tmp_path / name / "run")
        rows = read_jsonl(tmp_path / name / "run" / "metrics.jsonl")
        params = torch.cat([p.detach().flatten() for p in run.backend.model.parameters()])
        return rows, params, (s1, s2)
    finally:
        s1.stop()
        s2.stop()


def _deterministic(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.fixture(scope="module")
def tiny_policy():
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.trainer.models import load_policy

    return load_policy(load_config(preset_path("tiny")).model)


def test_async_staleness_0_on_the_fleet_equals_the_synchronous_loop(tmp_path, tiny_policy):
    model, tok = tiny_policy
    sync_rows, sync_params, _ = _fleet_run(tmp_path, "sync", model, tok)
    async_rows, async_params, servers = _fleet_run(
        tmp_path, "async0", model, tok, "rollout.async.enabled=true", "rollout.async.max_staleness=0")
    assert [r["async/staleness"] for r in async_rows] == [0.0, 0.0, 0.0]
    assert [r["async/version"] for r in async_rows] == [0.0, 1.0, 2.0]
    a, b = _deterministic(sync_rows), _deterministic(async_rows)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert ra[key] == pytest.approx(rb[key], abs=1e-6, nan_ok=True), key
    assert torch.allclose(sync_params, async_params, atol=1e-6)
    assert {s.weight_version for s in servers} == {"3"}


def test_async_staleness_1_overlaps_generation_with_the_update(tmp_path, tiny_policy):
    """k = 1: step t+1's requests reach the servers before the weights of step t do (they were in
    flight during step t's update), the versions are the fixed schedule, VCPO reads the servers' log-probs."""
    from stapo.core.rollout.base import call_seed

    model, tok = tiny_policy
    rows, _, (s1, s2) = _fleet_run(
        tmp_path, "async1", model, tok, "rollout.async.enabled=true", "rollout.async.max_staleness=1",
        "algorithm.off_policy.ess_lr_scaling=true")
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["async/version"] for r in rows] == [0.0, 0.0, 1.0]
    for r in rows[1:]:  # stale rows: the ESS of the servers' log-probs against the proximal pass
        assert 0 < r["offpolicy/ess_ratio"] <= 1 and 0 < r["offpolicy/lr_scale"] <= 1
    assert s1.weight_version == s2.weight_version == "3"
    seed2 = call_seed(0, 2, 0, 0)
    checked = 0
    for ev in (s1.events, s2.events):
        if ("completion", seed2) in ev:
            first_v1 = next(i for i, e in enumerate(ev) if e[0] == "reload" and e[1].endswith("v000001"))
            assert ev.index(("completion", seed2)) < first_v1  # step 2 was generated while step 1 trained
            checked += 1
    assert checked >= 1
