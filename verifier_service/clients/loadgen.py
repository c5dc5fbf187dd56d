"""An RL-shaped grading workload and the two ways to run it: through the service, and in-process.

Shape of an RL reward stream (what a GRPO/DAPO trainer sends a verifier):

* groups of ``group`` (8) sampled responses per prompt, graded against the same gold;
* within a group the policy repeats itself: a handful of distinct final answers (the gold, an
  equivalent form of it, one or two wrong values) drawn with replacement, wrapped in reasoning
  text that differs sample to sample (so whole responses rarely repeat; final answers often do);
* prompts come back: each step draws prompts from a pool smaller than the run (epochs, replay),
  and a revisited prompt draws from the same answer set;
* a few responses are cut off before any final answer (length limit).

Golds come from MATH-500 and GSM8K (``--data``, ``$STAPO_DATA_DIR`` or the copies shipped in
``stapo/evals/data``); without them a small built-in list is used so the generator always works. ``GOLD_SOURCES["dapo17k"]`` takes them from
DAPO-Math-17k instead (all integers: what STAPO trains on), with responses that end in the DAPO
template's ``Answer: ...`` line (``style="answer_line"``). ``stream_stats`` describes a stream
(distinct answers per group, repeat rate, share of integer and LaTeX golds, cut-offs).

    from stapo.verifier_service.clients.loadgen import build_stream, run_service_load, run_baseline
    items = build_stream(n_items=2000, seed=0)
    report = run_service_load("http://127.0.0.1:8000", items, batch=64, concurrency=4)
    base = run_baseline(items)   # plain math-verify parse + verify, one process
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

Item = tuple[str, str, str]

_FALLBACK_GOLDS = (
    "18", "3", "70", "\\frac{1}{2}", "\\sqrt{2}", "2\\sqrt{3}", "(1,2)", "12", "\\frac{3}{4}", "x^2+1",
    "100", "\\pi", "5", "-1", "0.25", "\\frac{14}{3}", "1,450", "[-2,3)", "6 - 5i", "9",
)  # fmt: skip


def default_data_dir() -> Path | None:
    """``$STAPO_DATA_DIR``, else the data shipped with stapo (``stapo/evals/data``), else None.

    Found by path, not by importing ``stapo.core.task.data``: the service path stays free of heavy imports.
    """
    env = os.environ.get("STAPO_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[1] / "evals" / "data")
    for c in candidates:
        if (c / "math500.jsonl").is_file():
            return c
    return None


GOLD_SOURCES: dict[str, tuple[str, ...]] = {
    "math500+gsm8k": ("math500.jsonl", "gsm8k_test.jsonl"),
    "dapo17k": ("dapo_math_17k.jsonl",),
}
"""Named gold sets: files of the data dir whose rows carry an ``answer``."""


def load_golds(data_dir: Path | None = None, source: str = "math500+gsm8k") -> list[str]:
    """Gold answers of a ``GOLD_SOURCES`` set (all of them), or the built-in list when absent."""
    if source not in GOLD_SOURCES:
        raise ValueError(f"source: unknown gold set {source!r}; valid: {', '.join(GOLD_SOURCES)}")
    data_dir = data_dir or default_data_dir()
    golds: list[str] = []
    if data_dir is not None:
        for name in GOLD_SOURCES[source]:
            path = Path(data_dir) / name
            if path.is_file():
                with path.open(encoding="utf-8") as f:
                    golds += [str(json.loads(line)["answer"]) for line in f if line.strip()]
    return golds or list(_FALLBACK_GOLDS)


def _equivalent(gold: str, rng: random.Random) -> str:
    """Another way to write the same answer, as a model would."""
    g = gold.strip()
    if re.fullmatch(r"-?\d[\d,]*", g):
        plain = g.replace(",", "")
        return rng.choice([plain, f"{plain}.0", f"{plain}", f"\\text{{{plain}}}"])
    m = re.fullmatch(r"\\d?frac\{(\d+)\}\{(\d+)\}", g)
    if m:
        a, b = m.groups()
        return rng.choice(
            [f"{a}/{b}", f"\\dfrac{{{a}}}{{{b}}}", f"\\frac{a}{b}" if len(a) == len(b) == 1 else f"{a}/{b}"]
        )
    return rng.choice([g.replace(" ", ""), g.replace(",", ", "), g])


def _wrong(gold: str, rng: random.Random) -> str:
    """A near miss: one digit changed, or a term added."""
    digits = [i for i, ch in enumerate(gold) if ch.isdigit()]
    if digits:
        i = rng.choice(digits)
        d = str((int(gold[i]) + rng.randint(1, 8)) % 10)
        return gold[:i] + d + gold[i + 1 :]
    return gold + "+1"


_STEPS = (
    "First, note that {a} + {b} = {s}.",
    "Multiplying both sides by {c}, we get {p}.",
    "We substitute $x = {a}$ into $f(x) = x^2 - {b}x + {c}$ to get ${q}$.",
    "So the remaining quantity is ${s} - {c} = {d}$.",
    "Let me double-check: $\\frac{{{p}}}{{{c}}} = {s}$, which matches.",
    "Hmm, wait. Let me reconsider the case where $n = {a}$.",
    "By the Pythagorean theorem, $c^2 = {a}^2 + {b}^2 = {r}$.",
    "Therefore the sum of the first {a} terms is ${t}$.",
)


def _response(answer: str | None, rng: random.Random, style: str = "boxed") -> str:
    """A reasoning text ending in ``\\boxed{answer}`` or an ``Answer:`` line (None: cut off before it)."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    vals = dict(
        a=a,
        b=b,
        c=c,
        s=a + b,
        p=(a + b) * c,
        q=a * a - b * a + c,
        d=a + b - c,
        r=a * a + b * b,
        t=a * (a + 1) // 2,
    )
    lines = [rng.choice(_STEPS).format(**vals) for _ in range(rng.randint(4, 12))]
    body = "Let's solve this step by step.\n\n" + "\n".join(lines)
    if rng.random() < 0.5:
        body = "<think>\n" + body + "\n</think>\n\n" + rng.choice(lines)
    if answer is None:
        return body[: max(20, len(body) - rng.randint(5, 40))]
    if style == "answer_line":  # the DAPO template: "The last line ... of the form Answer: $Answer"
        end = rng.choice(["Answer: {x}", "Answer: ${x}$", "Answer: \\boxed{{{x}}}"])
    else:
        end = rng.choice(
            [
                "Therefore, the final answer is $\\boxed{{{x}}}$.",
                "The answer is $\\boxed{{{x}}}$.",
                "$$\\boxed{{{x}}}$$",
            ]
        )
    return body + "\n\n" + end.format(x=answer)


def build_stream(
    n_items: int = 2000,
    *,
    group: int = 8,
    prompt_pool: int | None = None,
    golds: Sequence[str] | None = None,
    seed: int = 0,
    cutoff_frac: float = 0.04,
    style: str = "boxed",
    revisit: bool = True,
) -> list[Item]:
    """``n_items`` (prediction, gold, "math") items in groups of ``group`` per gold; see the module doc.

    ``style``: "boxed" (responses end in ``\\boxed{...}``) or "answer_line" (``Answer: ...``).
    ``revisit``: prompts are drawn with replacement from a pool of ``prompt_pool`` (epochs, replay);
    False: every group is a new prompt (only the repeats inside a group remain).
    """
    if style not in ("boxed", "answer_line"):
        raise ValueError(f"style: 'boxed' or 'answer_line', got {style!r}")
    rng = random.Random(seed)
    golds = list(golds) if golds is not None else load_golds()
    n_groups = max(1, n_items // group)
    pool_n = prompt_pool or (max(4, n_groups // 2) if revisit else n_groups)  # revisit: each prompt ~twice
    chosen = rng.sample(golds, k=min(pool_n, len(golds)))
    answer_sets: dict[int, list[tuple[str, float]]] = {}
    items: list[Item] = []
    while len(items) < n_items:
        k = rng.randrange(len(chosen)) if revisit else len(answer_sets) % len(chosen)
        gold = chosen[k]
        if k not in answer_sets:
            p_right = rng.random()  # per-prompt difficulty
            answer_sets[k] = [(gold, p_right * 0.7), (_equivalent(gold, rng), p_right * 0.3)] + [
                (_wrong(gold, rng), (1 - p_right) / 2) for _ in range(2)
            ]
        answers, weights = zip(*answer_sets[k], strict=False)
        for _ in range(group):
            ans = None if rng.random() < cutoff_frac else rng.choices(answers, weights=weights)[0]
            items.append((_response(ans, rng, style), gold, "math"))
    return items[:n_items]


def stream_stats(items: Sequence[Item], group: int = 8) -> dict[str, float]:
    """What a stream looks like: the numbers the benchmark reports next to its throughput.

    ``distinct_per_group``: distinct extracted final answers per group of ``group`` items;
    ``answer_repeat``: share of items whose (gold, final answer) pair came earlier in the stream;
    ``response_repeat``: share of items whose whole (prediction, gold) came earlier;
    ``integer_golds`` / ``latex_golds``: share of items whose gold is an integer / has a backslash;
    ``no_marker``: share of responses with no final-answer marker (cut off).
    """
    from stapo.verifier_service.grader.extraction import extract_answer

    answers = [extract_answer(p) for p, _, _ in items]
    seen_pairs: set[tuple[str, str | None]] = set()
    seen_items: set[tuple[str, str]] = set()
    rep_ans = rep_item = 0
    for (p, g, _), a in zip(items, answers, strict=True):
        rep_ans += (g, a) in seen_pairs
        rep_item += (p, g) in seen_items
        seen_pairs.add((g, a))
        seen_items.add((p, g))
    groups = [answers[i : i + group] for i in range(0, len(answers), group)]
    n = max(1, len(items))
    golds = [g for _, g, _ in items]
    return {
        "items": len(items),
        "distinct_golds": len(set(golds)),
        "distinct_per_group": statistics.fmean(len(set(x)) for x in groups) if groups else 0.0,
        "answer_repeat": rep_ans / n,
        "response_repeat": rep_item / n,
        "integer_golds": sum(bool(re.fullmatch(r"-?\d+", g.strip())) for g in golds) / n,
        "latex_golds": sum("\\" in g for g in golds) / n,
        "no_marker": sum(a is None for a in answers) / n,
        "mean_chars": statistics.fmean(len(p) for p, _, _ in items) if items else 0.0,
    }


# --------------------------------------------------------------------------- runners


@dataclass
class LoadReport:
    """What one run measured; ``latencies_s`` are per request (service) or per item (baseline)."""

    items: int
    seconds: float
    latencies_s: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    correct: list[bool] = field(default_factory=list)
    errors: int = 0
    grade_ms: float = 0.0  # sum of the per-item grading times the service reported (0 for cache hits)

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("inf")

    def pct(self, q: float) -> float:
        """Latency percentile in seconds (q in [0, 100])."""
        if not self.latencies_s:
            return float("nan")
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.latencies_s) if self.latencies_s else float("nan")


CLIENTS = ("raw", "httpx")
"""How ``run_service_load`` talks HTTP: ``raw`` = keep-alive HTTP/1.1 over asyncio streams (~0.2 ms of
client CPU per 64-item request), ``httpx`` = ``httpx.AsyncClient`` (~1.5 ms: on a 2-core benchmark
machine that CPU is taken from the service; a trainer runs its client on its own machine)."""


async def _raw_post(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    host: str,
    path: str,
    body: bytes,
    headers: str,
) -> tuple[int, bytes]:
    """One HTTP/1.1 POST on an open keep-alive connection: (status, body). Needs Content-Length replies."""
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" not in fields:
        raise ValueError(f"reply without Content-Length ({fields.get('transfer-encoding', 'no length')})")
    return status, await reader.readexactly(int(fields["content-length"]))


def run_service_load(
    url: str,
    items: Sequence[Item],
    *,
    batch: int = 64,
    concurrency: int = 4,
    token: str | None = None,
    timeout_s: float = 120.0,
    client: str = "httpx",
) -> LoadReport:
    """POST ``items`` to ``url``/v1/verify in requests of ``batch`` items, ``concurrency`` at a time.

    ``client``: one of ``CLIENTS`` (``raw`` for benchmarks on a machine the service shares; it speaks
    plain ``http://`` only)."""
    if client not in CLIENTS:
        raise ValueError(f"client: one of {', '.join(CLIENTS)}, got {client!r}")
    chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
    # Request bodies are encoded before the clock starts: a trainer does that on its own machine,
    # and on a small benchmark machine the client's CPU would otherwise be taken from the service.
    bodies = [
        json.dumps({"items": [{"prediction": p, "gold": g, "mode": m} for p, g, m in chunk]}).encode()
        for chunk in chunks
    ]
    out: list[list[dict] | None] = [None] * len(chunks)
    lat: list[float] = []
    errors = 0
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers["Content-Type"] = "application/json"

    async def main_raw() -> None:
        nonlocal errors
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"client='raw' speaks plain http://host:port only, got {url!r}")
        path = parts.path.rstrip("/") + "/v1/verify"
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        todo = list(range(len(chunks)))[::-1]

        async def connection() -> None:
            nonlocal errors
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
            try:
                while todo:
                    i = todo.pop()
                    t0 = time.perf_counter()
                    try:
                        status, body = await asyncio.wait_for(
                            _raw_post(reader, writer, parts.netloc, path, bodies[i], head), timeout_s
                        )
                        if status != 200:
                            raise ValueError(f"HTTP {status}")
                        out[i] = json.loads(body)["results"]
                    except (OSError, ValueError, KeyError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                        errors += 1
                        writer.close()  # the connection's state is unknown now: a fresh one
                        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
                    lat.append(time.perf_counter() - t0)
            finally:
                writer.close()

        await asyncio.gather(*(connection() for _ in range(min(concurrency, len(chunks)))))

    async def main() -> None:
        nonlocal errors
        import httpx

        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(
            base_url=url.rstrip("/"), timeout=timeout_s, limits=limits, headers=headers
        ) as c:

            async def one(i: int) -> None:
                nonlocal errors
                async with sem:
                    t0 = time.perf_counter()
                    try:
                        r = await c.post("/v1/verify", content=bodies[i])
                        r.raise_for_status()
                        out[i] = r.json()["results"]
                    except (httpx.HTTPError, KeyError, ValueError):
                        errors += 1
                    lat.append(time.perf_counter() - t0)

            await asyncio.gather(*(one(i) for i in range(len(chunks))))

    t0 = time.perf_counter()
    asyncio.run(main_raw() if client == "raw" else main())
    seconds = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    correct: list[bool] = []
    grade_ms = 0.0
    for res in out:
        for r in res or []:
            statuses[r["status"]] = statuses.get(r["status"], 0) + 1
            correct.append(bool(r["correct"]))
            grade_ms += float(r.get("ms") or 0.0)
    return LoadReport(len(items), seconds, lat, statuses, correct, errors, grade_ms)


def run_baseline(items: Sequence[Item], *, limit: int | None = None) -> LoadReport:
    """Plain math-verify in this process: ``verify(parse(gold), parse(prediction))`` per item.

    The gold is parsed as ``$gold$`` (math-verify's documented way to pass a bare LaTeX answer);
    math-verify's own signal timeouts stay on (this runs on the main thread).
    """
    from math_verify import parse, verify

    items = items[:limit] if limit else items
    lat: list[float] = []
    correct: list[bool] = []
    statuses: dict[str, int] = {}
    t0 = time.perf_counter()
    for pred, gold, _ in items:
        t = time.perf_counter()
        try:
            g = parse(f"${gold}$")
            p = parse(pred)
            ok = bool(verify(g, p)) if p else False
            st = "ok" if p else "no_answer"
        except BaseException as err:  # math-verify's TimeoutException is a BaseException
            if isinstance(err, KeyboardInterrupt):
                raise
            ok, st = False, "error"
        lat.append(time.perf_counter() - t)
        correct.append(ok)
        statuses[st] = statuses.get(st, 0) + 1
    return LoadReport(len(items), time.perf_counter() - t0, lat, statuses, correct)
