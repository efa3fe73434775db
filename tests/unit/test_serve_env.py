"""`python -m runtime serve` hands granian its flags as RINGSERVE_* variables: a setting's
variable left in the environment is dropped (the flags say it all), the others pass on."""

from __future__ import annotations

import pytest

from runtime.__main__ import server_env
from runtime.config import ServerArgs


def test_settings_come_from_the_flags_and_other_variables_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_PORT", "1234")  # a setting, not given as a flag
    monkeypatch.setenv("RINGSERVE_MAX_MODEL_LEN", "77")  # an alias of one
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", "/somewhere/cache")  # not settings
    monkeypatch.setenv("RINGSERVE_IPC_NATIVE", "0")
    env = server_env(ServerArgs.from_cli(["--workers", "2"]))
    assert env["RINGSERVE_WORKERS"] == "2"
    assert env["RINGSERVE_PORT"] == str(ServerArgs().port)
    assert "RINGSERVE_MAX_MODEL_LEN" not in env and "RINGSERVE_CONTEXT_LENGTH" not in env
    assert env["RINGSERVE_CACHE_DIR"] == "/somewhere/cache"
    assert env["RINGSERVE_IPC_NATIVE"] == "0"
    assert ServerArgs.from_env(env) == ServerArgs.from_cli(["--workers", "2"])
