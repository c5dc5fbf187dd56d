"""The pool's and the service's settings are declared in ``server/settings.py``: every pool setting is
read from ``STAPO_VERIFIER_<NAME>`` by the service's ``Settings``, with the defaults pinned below, and
the pool takes them (``GraderPool(settings)``); the settings module imports no other part of the service.

Run: ``pytest tests/unit/verifier_service/server/test_verifier_settings.py`` (no grading process starts).
"""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest

from stapo.verifier_service.server.pool import GraderPool
from stapo.verifier_service.server.settings import PoolSettings, Settings, default_workers

POOL = tuple(PoolSettings.model_fields)

# (environment variable, default) of the pool settings, written out by hand: a default that moves in
# settings.py moves the pool's and the service's, so this table is what says it moved on purpose
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


def test_the_service_settings_are_the_pool_settings_and_the_servers_own():
    assert issubclass(Settings, PoolSettings)
    service_only = set(Settings.model_fields) - set(POOL)
    assert {"host", "port", "token", "max_items", "max_body_bytes", "log_level"} <= service_only


def test_pool_defaults_and_environment_names_are_pinned():
    assert {f"STAPO_VERIFIER_{k.upper()}" for k in POOL} == set(PINNED) | {"STAPO_VERIFIER_WORKERS"}
    settings, pool_only = Settings(), PoolSettings()
    for env, default in PINNED.items():
        name = env.removeprefix("STAPO_VERIFIER_").lower()
        assert getattr(settings, name) == default == getattr(pool_only, name), name
    # no value means one worker per core; the settings report that number
    assert settings.workers == pool_only.workers == default_workers()


def _other_value(name: str):
    """A valid value that is not the default, from the field's type."""
    default = PoolSettings.model_fields[name].default
    if isinstance(default, bool):
        return not default
    if name == "workers":
        return default_workers() + 1
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 0.5
    return next(v for v in typing.get_args(PoolSettings.model_fields[name].annotation) if v != default)


@pytest.mark.parametrize("name", POOL)
def test_each_pool_setting_is_read_from_its_environment_variable_by_the_service_only(name, monkeypatch):
    value = _other_value(name)
    env = "true" if value is True else "false" if value is False else str(value)
    monkeypatch.setenv(f"STAPO_VERIFIER_{name.upper()}", env)
    assert getattr(Settings(), name) == value
    assert getattr(Settings(**{name: PINNED.get(f"STAPO_VERIFIER_{name.upper()}", 1)}), name) != value  # a keyword wins
    assert getattr(PoolSettings(), name) != value  # a pool built in code reads no environment


def test_bounds_are_refused_naming_the_field_and_every_setting_is_described():
    with pytest.raises(ValueError, match="deadline_s"):
        Settings(deadline_s=0)
    with pytest.raises(ValueError, match="start_method"):
        Settings(start_method="fork")
    with pytest.raises(ValueError, match="retry_deadline_factor"):
        PoolSettings(retry_deadline_factor=0.5)
    with pytest.raises(ValueError, match="no_such_knob"):
        PoolSettings(no_such_knob=1)
    assert all(field.description for field in Settings.model_fields.values())


def test_the_pool_refuses_a_bad_setting_before_any_process_starts():
    """``GraderPool`` validates through ``PoolSettings``: keywords on top of a settings object too."""
    with pytest.raises(ValueError, match="workers"):
        GraderPool(workers=0)
    with pytest.raises(ValueError, match="deadline_s"):
        GraderPool(PoolSettings(workers=1), deadline_s=-1)
    with pytest.raises(ValueError, match="port"):  # a service-only field is no pool keyword
        GraderPool(port=1)


def test_the_settings_import_no_other_part_of_the_service():
    """Declared, not read from the pool: ``settings`` is the bottom of the service's imports."""
    code = "import sys, stapo.verifier_service.server.settings; print(*sorted(m for m in sys.modules if m.startswith('stapo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["stapo", "stapo.moved", "stapo.verifier_service", "stapo.verifier_service.server",
                                "stapo.verifier_service.server.settings"]
