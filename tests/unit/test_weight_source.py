"""The ``nccl`` push's ``WeightSource`` against vLLM's contract (stapo.core.rollout.vllm_server).

vLLM cannot be imported in stapo's test environment (its pins clash; docs/rollout.md), so its base
classes are restated here as each released version declares them (read from the released wheels'
``vllm/distributed/weight_transfer/base.py``), and our class is built on them the way the push builds
it on the installed one (:func:`weight_source_class`):

- vLLM 0.33: ``metadata`` is an abstract plain ``property``; ``__init_subclass__`` reads the
  subclass's own ``__dict__`` and raises ``TypeError`` when it defines ``metadata`` as anything but a
  ``functools.cached_property``; ``iter_full()`` and ``implements_iter_full()`` are new, and
  ``owned_names(rank)`` reads ``self.metadata`` as an attribute. A 0.32-style subclass (a
  ``metadata()`` method) fails it at class definition: the check bites.
- vLLM 0.32: ``metadata()`` and ``__iter__`` are abstract methods.

tests/e2e/test_vllm033_weight_source_slow.py (opt-in) builds the same class on 0.33's real module and
drives it through 0.33's real nccl trainer engine.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from stapo.core.rollout.vllm_server import weight_source_class


@dataclass(frozen=True)
class ParamMeta:  # vLLM's (name, wire dtype, full shape); 0.33 adds owners (None: every rank)
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None


class Source033(ABC):
    """vLLM 0.33's base as released: abstract plain property, the ``cls.__dict__`` check, ``iter_full``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("metadata")
        if own is not None and not isinstance(own, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not Source033.iter_full

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")


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
