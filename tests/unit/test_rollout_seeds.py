"""Request seeds (stapo.core.rollout.base): 63-bit call seeds, request seeds that stay int64.

vLLM 0.33's ``CompletionRequest`` takes ``seed`` in [-2^63, 2^63 - 1] and its V2 sampler hashes both
32-bit halves with the position; sample ``i`` of a request seeded ``s`` uses ``s + i``. What can fail
here: a call seed that is still 31 bits, a request seed whose samples run past int64, prompts of one
call sharing a stream, the calls of a long run on many ranks overlapping their seed ranges (31-bit
call seeds overlap 31 times in the run below), or the 31-bit seeds everything else uses changing value.
"""

from __future__ import annotations

import hashlib

from stapo.core.batch import derive_seed
from stapo.core.rollout.base import SEED_BITS, call_seed, request_seeds

INT64_MAX = 2**63 - 1


def test_call_seeds_take_63_bits_and_the_31_bit_seeds_keep_their_values():
    seeds = [call_seed(0, step, 0, rank) for step in range(50) for rank in range(8)]
    assert all(0 <= s <= INT64_MAX for s in seeds) and max(seeds) > 2**62  # the high bits are used
    for parts in ((0, 1), (7, 3, 0, 2), (1234,)):
        digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
        assert derive_seed(*parts) == int.from_bytes(digest[:4], "little") & 0x7FFFFFFF  # the 31-bit form, unchanged
        assert call_seed(*parts) == int.from_bytes(digest[:8], "little") & INT64_MAX


def test_request_seeds_step_n_apart_and_every_sample_stays_int64():
    assert request_seeds(100, 3, 8) == [100, 108, 116]
    assert request_seeds(None, 2, 4) == [None, None]
    top = 2**SEED_BITS - 6  # prompt 0's samples end at 2^63 - 3; prompt 1 wraps below the top
    got = request_seeds(top, 3, 4)
    samples = [s + i for s in got for i in range(4)]  # what vLLM seeds each sample with
    assert got[0] == top and max(samples) <= INT64_MAX and len(set(samples)) == 12


def test_the_calls_of_a_long_run_on_many_ranks_never_share_a_seed():
    """200 steps x 64 ranks, 64 prompts x 8 samples per call: every sample's seed is distinct (with
    31-bit call seeds, derive_seed's default, 31 pairs of these calls overlap; about 39 expected:
    12800^2 / 2 pairs x 2 x 512 / 2^31)."""
    prompts, n = 64, 8
    starts = sorted(call_seed(0, step, 0, rank) for step in range(1, 201) for rank in range(64))
    spans = [request_seeds(s, prompts, n) for s in starts]
    assert all(b - a == n for sp in spans for a, b in zip(sp, sp[1:], strict=False))  # no wrap in this run
    assert all(nxt[0] >= cur[-1] + n for cur, nxt in zip(spans, spans[1:], strict=False))  # ranges disjoint
