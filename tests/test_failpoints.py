"""The replica's test-only failpoints are refused without their flag, and the watch hold holds only
while its file exists. The lagging replica they make: tests/test_cp_faults.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.failpoints import ALLOW_FLAG, WATCH_HOLD_ENV, Failpoints, from_env, watch_hold
from kunlun_common.errors import ConfigError


def test_a_failpoint_without_the_flag_is_refused(tmp_path: Path) -> None:
    hold = str(tmp_path / "hold")
    with pytest.raises(ConfigError) as err:
        from_env({WATCH_HOLD_ENV: hold}, allowed=False)
    assert WATCH_HOLD_ENV in str(err.value) and ALLOW_FLAG in str(err.value)
    assert from_env({WATCH_HOLD_ENV: hold}, allowed=True) == Failpoints(watch_hold_file=hold)
    assert from_env({}, allowed=True).active() == {}
    with pytest.raises(ConfigError, match="absolute"):
        from_env({WATCH_HOLD_ENV: "hold"}, allowed=True)


def test_the_replica_refuses_to_start_with_a_failpoint_but_no_flag(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "controlplane.main", "--name=r", "--etcd-endpoints=https://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, WATCH_HOLD_ENV: str(tmp_path / "hold")},
    )
    assert r.returncode == 2 and f"{WATCH_HOLD_ENV} is set but {ALLOW_FLAG} is not" in r.stderr, r.stderr


async def test_the_watch_hold_waits_while_its_file_exists(tmp_path: Path) -> None:
    path = tmp_path / "hold"
    gate = watch_hold(path)
    await asyncio.wait_for(gate(), 5)  # no file: passes at once
    path.touch()

    async def held() -> None:
        await gate()

    task = asyncio.create_task(held())
    await asyncio.sleep(0.3)
    assert not task.done()
    path.unlink()
    await asyncio.wait_for(task, 5)
