"""The ``nccl`` push's ``WeightSource`` against vLLM's contract (stapo.core.rollout.vllm_server).

vLLM cannot be imported in stapo's test environment (its pins clash; docs/rollout.md), so its base
classes are restated here as each version checks a subclass, and our class is built on them the way
the push builds it on the installed one (:func:`weight_source_class`):

- vLLM 0.33's ``weight_transfer/base.py``: ``metadata`` must be a ``functools.cached_property`` and
  the stream comes from ``iter_full()``; a subclass that does otherwise is a ``TypeError`` when the
  class is defined. (The copies of vLLM's sources this project could read stop at the 0.32-era file,
  so this restates 0.33's contract as described, not from its code.) The stand-in below raises the same way,
  and a 0.32-style subclass (a ``metadata()`` method) fails it: the check bites.
- vLLM 0.32's: ``metadata()`` and ``__iter__`` are abstract methods.

What the trainer engines then read: the metadata list (full shapes, no gather) and one pass of the
learner's stream per push, fresh each time.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass

import pytest
import torch

from stapo.core.rollout.vllm_server import weight_source_class


@dataclass(frozen=True)
class ParamMeta:  # vLLM's (name, wire dtype, full shape)
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class Source033:
    """vLLM 0.33's contract: ``metadata`` a cached property, ``iter_full()``; checked at class definition."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(inspect.getattr_static(cls, "metadata", None), functools.cached_property):
            raise TypeError(f"{cls.__name__} must define `metadata` as a functools.cached_property")
        if not callable(getattr(cls, "iter_full", None)):
            raise TypeError(f"{cls.__name__} must define iter_full()")

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError


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
    assert source.metadata == META and source.metadata is source.metadata  # a cached property, not a method
    for push in (1.0, 2.0):  # every push streams that push's tensors, once
        source.stream = _stream(push)
        got = list(source.iter_full())
        assert [n for n, _ in got] == [m.name for m in META]
        assert all(t.shape == m.shape and float(t[0, 0]) == push for (_, t), m in zip(got, META, strict=True))


def test_033s_check_refuses_a_032_style_source():
    """The stand-in's check is the one 0.33 makes: the 0.32-style class (a metadata method) fails it."""
    with pytest.raises(TypeError, match="must define `metadata` as a functools.cached_property"):
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
