"""Upgrade and rollback: versioned release folders beside each other, `current` switched atomically.

The previous release stays on disk, so rollback needs neither the old bundle nor the network.
"""

from __future__ import annotations

from kunlun_installer.bundle import Bundle
from kunlun_installer.errors import InstallError
from kunlun_installer.host import (
    Paths,
    build_release,
    check_config,
    load_state,
    record_release,
    render_units,
    save_state,
    say,
    switch_current,
)
from kunlun_installer.units import ROLES


def upgrade(paths: Paths, bundle: Bundle, stage: bool = False) -> str:
    """Install the bundle's release beside the current one and switch to it; returns the old version.

    With `stage`, only build and check the release (the slow part: its virtual environment) and
    leave `current` as it is: staged on every host first, the rolling part (switch, restart) then
    takes each host seconds. A later `upgrade` finds the release present and only switches."""
    state = load_state(paths)
    old = str(state.get("current") or "")
    if not old:
        raise InstallError("upgrade", "nothing installed here", "run kunlun-installer install first")
    if old == bundle.version:
        say("upgrade", f"version {old} is already current")
        return old
    problems = bundle.verify()
    if problems:
        raise InstallError(
            "bundle", f"{len(problems)} file(s) differ: {problems[0]}", "copy the bundle again"
        )
    rel = build_release(paths, bundle, state)
    roles = state.get("roles") or {}
    assert isinstance(roles, dict)
    for role in roles:
        _, config_name = ROLES[role]
        if role != "etcd":
            check_config(rel, role, paths.etc / config_name)
    record_release(state, rel)
    if stage:
        save_state(paths, state)
        say("upgrade", f"{bundle.version} staged beside {old}; `upgrade` without --stage switches to it")
        return old
    render_units(paths, state, rel, sorted(roles), str(state.get("user", "kunlun")))
    state["previous"], state["current"] = old, bundle.version
    switch_current(paths, bundle.version)
    save_state(paths, state)
    say("upgrade", f"{old} -> {bundle.version}; restart the services one host at a time")
    return old


def rollback(paths: Paths) -> str:
    """Switch back to the previous release (kept on disk); returns the version now current."""
    state = load_state(paths)
    prev, cur = str(state.get("previous") or ""), str(state.get("current") or "")
    if not prev or not (paths.release(prev) / ".complete").exists():
        raise InstallError("rollback", "no previous release on this host", "rollback works after an upgrade")
    rel = paths.release(prev)
    roles = state.get("roles") or {}
    assert isinstance(roles, dict)
    render_units(paths, state, rel, sorted(roles), str(state.get("user", "kunlun")))
    state["previous"], state["current"] = cur, prev
    switch_current(paths, prev)
    save_state(paths, state)
    say("rollback", f"{cur} -> {prev}")
    return prev
