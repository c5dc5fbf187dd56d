"""The service's settings are read from the pool's signature: every ``GraderPool`` keyword is a setting
(``STAPO_VERIFIER_<KEYWORD>``) with the pool's default, and every pool setting is a keyword.

Run: ``pytest tests/unit/test_verifier_settings.py`` (no processes start: ``GraderPool`` is only read).
"""

from __future__ import annotations

import inspect
import typing

import pytest

from stapo.verifier_service.pool import GraderPool, default_workers
from stapo.verifier_service.settings import POOL_KEYWORDS, PoolSettings, Settings

SIGNATURE = inspect.signature(GraderPool.__init__).parameters

# (environment variable, default) of the pool settings, written out by hand: a default that moves in
# the pool's signature moves the service's too, so this table is what says it moved on purpose
PINNED = {
    "STAPO_VERIFIER_DEADLINE_S": 5.0,
    "STAPO_VERIFIER_MAX_PREDICTION_CHARS": 100_000,
    "STAPO_VERIFIER_MAX_GOLD_CHARS": 10_000,
    "STAPO_VERIFIER_CACHE_SIZE": 65_536,
    "STAPO_VERIFIER_CACHE_MAX_MB": 64.0,
    "STAPO_VERIFIER_VERDICT_CACHE": True,
    "STAPO_VERIFIER_INLINE_VERDICTS": True,
    "STAPO_VERIFIER_MAX_PENDING_ITEMS": 200_000,
    "STAPO_VERIFIER_MAX_QUEUE_S": 60.0,
    "STAPO_VERIFIER_RETRY_DEADLINE_FACTOR": 2.0,
    "STAPO_VERIFIER_START_METHOD": "forkserver",
    "STAPO_VERIFIER_WORKER_MEMORY_MB": 0,
    "STAPO_VERIFIER_WORKER_MAX_ITEMS": 50_000,
    "STAPO_VERIFIER_WORKER_MAX_RSS_MB": 1024,
    "STAPO_VERIFIER_STARTUP_TIMEOUT_S": 60.0,
    "STAPO_VERIFIER_CRASH_RETRIES": 1,
    "STAPO_VERIFIER_MAX_START_FAILURES": 5,
    "STAPO_VERIFIER_WARMUP": True,
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in PINNED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("STAPO_VERIFIER_WORKERS", raising=False)


def test_every_pool_keyword_is_a_setting_and_every_pool_setting_a_keyword():
    keywords = [name for name in SIGNATURE if name != "self"]
    assert list(POOL_KEYWORDS) == keywords
    assert set(PoolSettings.model_fields) == set(keywords)
    assert set(Settings().pool_kwargs()) == set(keywords)
    # the HTTP server's own settings are not pool keywords
    service_only = set(Settings.model_fields) - set(keywords)
    assert {"host", "port", "token", "max_items", "max_body_bytes", "log_level"} <= service_only


def test_pool_defaults_and_environment_names_are_pinned():
    assert {f"STAPO_VERIFIER_{k.upper()}" for k in POOL_KEYWORDS} == set(PINNED) | {"STAPO_VERIFIER_WORKERS"}
    kwargs = Settings().pool_kwargs()
    for env, default in PINNED.items():
        name = env.removeprefix("STAPO_VERIFIER_").lower()
        assert kwargs[name] == default == SIGNATURE[name].default, name
    # the pool's None means one worker per core; the settings report that number
    assert SIGNATURE["workers"].default is None and kwargs["workers"] == default_workers()


def _other_value(name: str):
    """A valid value that is not the default, from the keyword's type."""
    default = SIGNATURE[name].default
    if isinstance(default, bool):
        return not default
    if name == "workers":
        return default_workers() + 1
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 0.5
    return next(v for v in typing.get_args(PoolSettings.model_fields[name].annotation) if v != default)


@pytest.mark.parametrize("name", POOL_KEYWORDS)
def test_each_pool_keyword_is_read_from_its_environment_variable(name, monkeypatch):
    value = _other_value(name)
    env = "true" if value is True else "false" if value is False else str(value)
    monkeypatch.setenv(f"STAPO_VERIFIER_{name.upper()}", env)
    assert Settings().pool_kwargs()[name] == value
    assert Settings(**{name: SIGNATURE[name].default}).pool_kwargs()[name] != value  # a keyword wins


def test_pool_bounds_and_descriptions_come_from_the_signature():
    """The pool's ``Field`` metadata is what the service validates: an out-of-range value is refused
    in one line naming the field, and every setting says what it changes."""
    with pytest.raises(ValueError, match="deadline_s"):
        Settings(deadline_s=0)
    with pytest.raises(ValueError, match="start_method"):
        Settings(start_method="fork")
    with pytest.raises(ValueError, match="retry_deadline_factor"):
        Settings(retry_deadline_factor=0.5)
    assert all(field.description for field in Settings.model_fields.values())
