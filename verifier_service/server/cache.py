"""What the grader pool remembers: keys of items and of verdicts, and a byte-bounded LRU.

Keys are blake2b-128 digests of *length-prefixed* fields: each field is preceded by its length in
bytes, so no choice of field contents can make two different items share a key (fields joined
with a separator collide as soon as a field contains the separator: gold ``"3\\x00x"`` with
prediction ``"\\boxed{3}"`` and gold ``"3"`` with prediction ``"x\\x00\\boxed{3}"`` are one string
once joined with NUL). Long predictions stay out of the caches' memory: only the 16-byte digest is kept.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from typing import NamedTuple

from stapo.verifier_service.grader import Answer, Verdict, compare, extract

Item = tuple[str, str, str]
"""(prediction, gold, mode): what travels to a worker."""

def digest(*fields: str) -> bytes:
    """blake2b-128 of the fields, each preceded by its UTF-8 length: distinct tuples, distinct digests."""
    parts = []
    for f in fields:
        b = f.encode("utf-8", "surrogatepass")
        parts += (len(b).to_bytes(8, "little"), b)
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def cache_key(item: Item) -> bytes:
    """The whole item's key (mode, gold, prediction)."""
    pred, gold, mode = item
    return digest(mode, gold, pred)


class VerdictKey(NamedTuple):
    """What the server process knows about an item's final answer (``verdict_key``)."""

    digest: bytes
    """of mode + gold + the answer the verdict reads: equal digests, equal verdicts"""
    answer: Answer
    """the final answer as ``grader.extract`` finds it under budget ``cheap``"""

    @property
    def extracted(self) -> str | None:
        return self.answer.extracted


VERDICT_MAX_GOLD = 2_000
"""Longest gold the verdict cache keys on (the key's memory; a gold this long is rare)."""


def cheap_answer(item: Item) -> Answer | None:
    """The item's final answer when ``grader.extract`` finds it under budget ``cheap`` (markers only,
    bounded texts), else None: only a worker can tell. The grader's own extraction, so a key and a
    grade cannot drift apart."""
    pred, gold, mode = item
    if len(gold) > VERDICT_MAX_GOLD:
        return None
    try:
        return extract(pred, mode, budget="cheap")
    except Exception:  # the worker will say what went wrong
        return None


def verdict_key(gold: str, answer: Answer) -> VerdictKey:
    """The key of a verdict: it depends on the mode, the gold and the answer's text only."""
    return VerdictKey(digest("verdict", answer.mode, gold, answer.text or ""), answer)


def untimed(r: Verdict) -> Verdict:
    """The result as a cache serves it: same verdict (and every other field), ``ms`` 0."""
    return dataclasses.replace(r, ms=0.0)


class ByteLRU:
    """An LRU map bounded in (estimated) bytes as well as entries; thread-safe."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.data: collections.OrderedDict[bytes, tuple[Verdict, int]] = collections.OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    @staticmethod
    def size_of(r: Verdict) -> int:
        # key (16 B digest object ~49 B) + result object + dict slot; the extracted text dominates
        return 260 + (len(r.extracted) * 4 if r.extracted else 0)

    def get(self, key: bytes) -> Verdict | None:
        if self.max_bytes <= 0 or self.max_entries <= 0:
            return None
        with self.lock:
            hit = self.data.get(key)
            if hit is None:
                return None
            self.data.move_to_end(key)
            return hit[0]

    def put(self, key: bytes, r: Verdict) -> None:
        if self.max_bytes <= 0 or self.max_entries <= 0:
            return
        n = self.size_of(r)
        if n > self.max_bytes:
            return
        with self.lock:
            old = self.data.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self.data[key] = (r, n)
            self.bytes += n
            while self.bytes > self.max_bytes or len(self.data) > self.max_entries:
                _, (_, m) = self.data.popitem(last=False)
                self.bytes -= m

    def __len__(self) -> int:
        return len(self.data)

    def reset_lock(self) -> None:
        """After ``os.fork()`` in the child: the parent's lock may have been held by another thread."""
        self.lock = threading.Lock()


@dataclasses.dataclass(eq=False)
class Plan:
    """One request after the caches answered what they could (``Memo.plan``)."""

    results: list[Verdict | None]
    leaders: list[int] = dataclasses.field(default_factory=list)  # items to grade, first of their kind
    dups: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # leader -> the same item again
    vdups: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # leader -> same (mode, gold, answer)
    keys: dict[int, bytes] = dataclasses.field(default_factory=dict)
    vkeys: dict[int, VerdictKey] = dataclasses.field(default_factory=dict)
    retried: set[int] = dataclasses.field(default_factory=set)  # leaders that timed out before
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class Memo:
    """Whole results by item, verdicts by (mode, gold, extracted answer), keys of items that timed out.

    The two result caches share ``max_bytes``. 'timeout' and 'error' are never remembered as
    results (a retry re-grades); a timed-out item's key is, so that its retry gets a longer deadline.
    ``inline``: verdicts ``grader.compare`` decides under budget ``cheap`` (among them the 'no_answer'
    of a response cut off before any marker) are given in this process (no round trip): most first
    sights on an RL stream are integers against an integer gold (DAPO-Math-17k, GSM8K), an answer
    equal to the gold up to markup, or a cut-off response; a worker would take microseconds to grade
    them, after a round trip that costs more than the grading."""

    def __init__(self, max_bytes: int, max_entries: int, *, verdicts: bool = True, inline: bool = True) -> None:
        self.verdict_cache, self.inline = verdicts, inline and verdicts
        self.results = ByteLRU(max_bytes // 2 if verdicts else max_bytes, max_entries)
        self.verdicts = ByteLRU(max_bytes // 2 if verdicts else 0, max_entries)
        self.timed_out = ByteLRU(1 << 20, 4096)

    def __len__(self) -> int:
        return len(self.results) + len(self.verdicts)

    @property
    def bytes(self) -> int:
        return self.results.bytes + self.verdicts.bytes

    def reset_locks(self) -> None:
        for lru in (self.results, self.verdicts, self.timed_out):
            lru.reset_lock()

    def plan(self, items: list[Item], *, max_chars: tuple[int, int]) -> Plan:
        """Answer what the caches know; the rest are leaders (first of their key) with followers."""
        p = Plan([None] * len(items))
        leaders: dict[bytes, int] = {}
        vleaders: dict[bytes, int] = {}
        for i, item in enumerate(items):
            pred, gold, mode = item
            if len(pred) > max_chars[0] or len(gold) > max_chars[1]:
                p.results[i] = Verdict(False, 0.0, "too_large", None, 0.0)
                p.counts["too_large"] += 1
                continue
            key = cache_key(item)
            if (lead := leaders.get(key)) is not None:
                p.dups.setdefault(lead, []).append(i)
                p.counts["cache_hits"] += 1
                continue
            if (r := self.results.get(key)) is not None:
                p.results[i] = r
                p.counts["cache_hits"] += 1
                continue
            answer = cheap_answer(item) if self.verdict_cache else None
            if answer is not None and answer.text is not None:
                vk = verdict_key(gold, answer)
                if (v := self.verdicts.get(vk.digest)) is not None:
                    p.results[i] = v
                    self.results.put(key, v)  # the same item again skips the extraction too
                    p.counts["verdict_hits"] += 1
                    continue
                if (vl := vleaders.get(vk.digest)) is not None:  # same gold and answer as an item above
                    p.vdups.setdefault(vl, []).append(i)
                    p.keys[i] = key
                    p.counts["verdict_hits"] += 1
                    continue
                if self.inline and (r := compare(gold, answer, budget="cheap")) is not None:
                    p.results[i] = r
                    self.verdicts.put(vk.digest, untimed(r))
                    self.results.put(key, untimed(r))
                    p.counts["inline_verdicts"] += 1
                    continue
                vleaders[vk.digest] = i
                p.vkeys[i] = vk
            elif answer is not None and self.inline and (r := compare(gold, answer, budget="cheap")) is not None:
                p.results[i] = r  # no answer: a response cut off before any
                self.results.put(key, untimed(r))
                p.counts["inline_verdicts"] += 1
                continue
            leaders[key] = i
            p.keys[i] = key
            if self.timed_out.get(key) is not None:
                p.retried.add(i)
        p.leaders = list(leaders.values())
        return p

    def settle(self, p: Plan, leader: int, r: Verdict, *, remember: bool = True) -> list[int]:
        """A leader's result: into the plan (its duplicates too) and the caches. Returns the followers
        whose verdict it does not decide (a timeout, an error, another answer): they are graded too.
        ``remember`` False: a 'timeout' that was not graded (a spent budget) marks nothing."""
        p.results[leader] = r
        for d in p.dups.get(leader, ()):
            p.results[d] = r
        key, vk = p.keys.get(leader), p.vkeys.get(leader)
        same_answer = vk is not None and r.status == "ok" and r.extracted == vk.extracted
        if r.status in ("ok", "no_answer"):  # never 'timeout' (a retry may succeed) nor 'error'
            if key is not None:
                self.results.put(key, untimed(r))
            if same_answer:
                self.verdicts.put(vk.digest, untimed(r))
        elif r.status == "timeout" and remember and key is not None:
            self.timed_out.put(key, r)
        followers = p.vdups.pop(leader, [])
        if not same_answer:
            return followers
        for f in followers:
            p.results[f] = untimed(r)
            self.results.put(p.keys[f], untimed(r))
        return []
