"""The ``nccl`` push's ``WeightSource`` against vLLM's contract (stapo.core.rollout.vllm_server).

vLLM cannot be imported in stapo's test environment (its pins clash; docs/rollout.md), so its base
classes are restated as each released version declares them (read from the released wheels'
``vllm/distributed/weight_transfer/base.py``; 0.33's in tests/service/vllm_weight_transfer.py), and our
class is built on them the way the push builds it on the installed one (:func:`weight_source_class`):

- vLLM 0.33: ``metadata`` is an abstract plain ``property``; ``__init_subclass__`` reads the
  subclass's own ``__dict__`` and raises ``TypeError`` when it defines ``metadata`` as anything but a
  ``functools.cached_property``; ``iter_full()`` and ``implements_iter_full()`` are new, and
  ``owned_names(rank)`` reads ``self.metadata`` as an attribute. A 0.32-style subclass (a
  ``metadata()`` method) fails it at class definition: the check bites.
- vLLM 0.32: ``metadata()`` and ``__iter__`` are abstract methods.

tests/e2e/test_vllm_weight_source_slow.py (opt-in) builds the same class on 0.33's real module and
drives it through 0.33's real nccl trainer engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import pytest
import torch

from stapo.core.rollout.vllm_server import weight_source_class
from tests.service.vllm_weight_transfer import ParamMeta
from tests.service.vllm_weight_transfer import WeightSource as Source033


class Source032(ABC):
    """vLLM 0.32's contract: abstract ``metadata()`` and ``__iter__``."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    @abstractmethod
    def __iter__(self): ...


META = [ParamMeta("model.embed_tokens.weight", torch.bfloat16, (8, 4)), ParamMeta("lm_head.weight", torch.bfloat16, (8, 4))]


def _stream(scale: float):
    return iter([(m.name, torch.full(m.shape, scale, dtype=m.dtype)) for m in META])


def test_our_source_meets_033s_contract():
    source = weight_source_class(Source033)(META)
    assert source.implements_iter_full()
    assert source.metadata == META and source.metadata is source.metadata  # an attribute, computed once
    assert source.owned_names(0) == source.owned_names(3) == [m.name for m in META]
    for push in (1.0, 2.0):  # every push streams that push's tensors, once
        source.stream = _stream(push)
        got = list(source.iter_full())
        assert [n for n, _ in got] == [m.name for m in META]
        assert all(t.shape == m.shape and float(t[0, 0]) == push for (_, t), m in zip(got, META, strict=True))


def test_033s_check_refuses_a_032_style_source():
    """The stand-in's check is the one 0.33 makes: a metadata method fails it when the class is defined."""
    with pytest.raises(TypeError, match="metadata must be a functools.cached_property"):
        class Old(Source033):
            def metadata(self):
                return META

            def iter_full(self):
                return iter(())


def test_our_source_meets_032s_contract():
    source = weight_source_class(Source032)(META)  # no abstract method left: it instantiates
    assert source.metadata() == META
    source.stream = _stream(3.0)
    assert [n for n, _ in source] == [m.name for m in META]
