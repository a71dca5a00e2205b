"""Installing, checking, repairing and removing Kunlun Platform on one host.

Layout (every folder configurable, for tests and for hosts with other conventions):

    PREFIX/releases/<version>/venv      the virtual environment, built offline from the wheelhouse
    PREFIX/releases/<version>/bundle    a copy of the bundle (repair and rollback need no media)
    PREFIX/current -> releases/<v>      what the units start; switched atomically by upgrade/rollback
    PREFIX/state/installed.json         roles, versions, and every file written with its SHA-256
    PREFIX/state/pristine/...           the configuration as installed, for --repair
    ETC/                                configs (0640 root:USER) and ETC/certs (keys 0640)
    UNIT_DIR/kunlun-*.service           rendered units
    DATA/                               service data (0750 USER:USER), kept by uninstall unless --purge

Every step prints one line; a step that cannot proceed raises InstallError naming it. Running the
same command twice changes nothing the second time.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun_common.i18n import localize
from kunlun_common.messages import Message, msg
from kunlun_installer.bundle import Bundle, sha256_file
from kunlun_installer.errors import InstallError
from kunlun_installer.units import ROLES, render

STATE = "state/installed.json"


def say(step: str | Message, what: str | Message) -> None:
    """One step line, `[STEP] WHAT`; a message is shown in the reader's language."""
    print(f"[{_shown(step)}] {_shown(what)}", flush=True)


def _shown(text: str | Message) -> str:
    return localize(text) if isinstance(text, Message) else text


def _check_config_step() -> Message:
    return msg("installer.step.check_config", "check config")


@dataclass(frozen=True)
class Paths:
    prefix: Path = Path("/opt/kunlun")
    """Releases, the current link and the installer's state."""
    etc: Path = Path("/etc/kunlun")
    """Configuration and certificates."""
    unit_dir: Path = Path("/etc/systemd/system")
    """Where rendered units go."""
    data: Path = Path("/var/lib/kunlun")
    """Service data (etcd members, agent state, logs in run mode)."""

    @property
    def state_file(self) -> Path:
        return self.prefix / STATE

    def release(self, version: str) -> Path:
        return self.prefix / "releases" / version


def load_state(paths: Paths) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(paths.state_file.read_text())
        return data
    except FileNotFoundError:
        return {"roles": {}, "files": {}, "current": "", "previous": ""}


def save_state(paths: Paths, state: dict[str, Any]) -> None:
    paths.state_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = paths.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, paths.state_file)


ENGINE_USER = "kunlun-engine"
"""The agent's default --engine-user: a system user with no home and no login shell."""


def ensure_user(user: str) -> tuple[int, int]:
    try:
        pw = pwd.getpwnam(user)
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        pass
    if os.geteuid() != 0:
        raise InstallError("service user", f"user {user!r} does not exist and we are not root", "run as root")
    r = subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 and "already exists" not in r.stderr:
        raise InstallError("service user", f"useradd {user}: {r.stderr.strip()}", "create the user by hand")
    say("service user", f"created system user {user}")
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


def _chown(path: Path, uid: int, gid: int) -> None:
    if os.geteuid() == 0:
        os.chown(path, uid, gid)


def _record(state: dict[str, Any], path: Path, source: str, mode: int) -> None:
    files = state.setdefault("files", {})
    assert isinstance(files, dict)
    files[str(path)] = {"sha256": sha256_file(path), "mode": mode, "source": source}


def _pristine(paths: Paths, path: Path) -> Path:
    return paths.prefix / "state" / "pristine" / str(path).lstrip("/")


def _place(
    paths: Paths, state: dict[str, Any], src_bytes: bytes, dest: Path, mode: int, uid: int, gid: int
) -> bool:
    """Write dest (keeping a pristine copy for repair); True when it changed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    changed = not dest.exists() or dest.read_bytes() != src_bytes
    if changed:
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(src_bytes)
        os.replace(tmp, dest)
    os.chmod(dest, mode)
    _chown(dest, uid, gid)
    keep = _pristine(paths, dest)
    keep.parent.mkdir(parents=True, exist_ok=True)
    keep.write_bytes(src_bytes)
    os.chmod(keep, 0o600)
    _record(state, dest, "pristine", mode)
    return changed


def _venv_files(venv: Path) -> list[Path]:
    return sorted(
        p for p in venv.rglob("*") if p.is_file() and "__pycache__" not in p.parts and not p.is_symlink()
    )


def build_release(paths: Paths, bundle: Bundle, state: dict[str, Any]) -> Path:
    """The release folder for the bundle's version: a bundle copy and a venv (idempotent)."""
    rel = paths.release(bundle.version)
    ready = rel / ".complete"
    if ready.exists():
        say("release", f"{rel} already present")
        return rel
    if rel.exists():
        shutil.rmtree(rel)  # a half-built release from an interrupted run
    rel.mkdir(parents=True)
    say("release", f"copying the bundle to {rel / 'bundle'}")
    shutil.copytree(bundle.root, rel / "bundle", symlinks=False)
    make_venv(rel, bundle.version)
    ready.write_text(bundle.version + "\n")
    return rel


def clean_env() -> dict[str, str]:
    """The environment for the release's own Python: without PYTHONPATH (the installer may run from
    a wheel or a checkout on PYTHONPATH, which pip would take for an installed kunlun-platform)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def make_venv(rel: Path, version: str) -> None:
    """(Re)create rel/venv offline from the release's own copy of the wheelhouse.

    With pip's own wheel in the wheelhouse (bundles from `make dist` carry it), the venv is made
    without pip and pip runs straight from its wheel inside the venv's interpreter: the same
    install, without ensurepip copying pip into every release first (most of a venv's build time)."""
    venv = rel / "venv"
    wheels = rel / "bundle" / "wheelhouse"
    if venv.exists():
        shutil.rmtree(venv)
    pip_wheel = sorted(wheels.glob("pip-*.whl"))
    say("virtualenv", f"creating {venv} from the wheelhouse (offline)")
    make = [sys.executable, "-m", "venv", *(["--without-pip"] if pip_wheel else []), str(venv)]
    r = subprocess.run(make, capture_output=True, text=True, env=clean_env())
    if r.returncode != 0:
        raise InstallError(
            "virtualenv", r.stderr.strip(), "install python3-venv (Debian: apt-get install python3-venv)"
        )
    say("virtualenv", f"pip install --no-index kunlun-platform=={version} from {wheels}")
    py = str(venv / "bin" / "python")
    pip = [py, f"{pip_wheel[-1]}/pip"] if pip_wheel else [py, "-m", "pip"]
    pip += ["install", "-q", "--no-index", "--no-compile", "--disable-pip-version-check"]
    r = subprocess.run(
        [*pip, "--find-links", str(wheels), f"kunlun-platform=={version}"],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    if r.returncode != 0:
        raise InstallError(
            "virtualenv", f"pip: {r.stderr.strip()[-1500:]}", "the wheelhouse may not match this Python"
        )


def record_release(state: dict[str, Any], rel: Path) -> None:
    files = state.setdefault("files", {})
    assert isinstance(files, dict)
    for key in [
        k for k, v in files.items() if v.get("source") in ("venv", "bundle") and k.startswith(str(rel) + "/")
    ]:
        del files[key]
    for p in _venv_files(rel / "venv"):
        _record(state, p, "venv", p.stat().st_mode & 0o7777)
    for p in sorted((rel / "bundle").rglob("*")):
        if p.is_file():
            _record(state, p, "bundle", p.stat().st_mode & 0o7777)


def switch_current(paths: Paths, version: str) -> None:
    link = paths.prefix / "current"
    tmp = paths.prefix / ".current.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(f"releases/{version}", tmp)
    os.replace(tmp, link)
    say("current", f"{link} -> releases/{version}")


def etcd_binary() -> str:
    return shutil.which("etcd") or "/usr/bin/etcd"


def render_units(paths: Paths, state: dict[str, Any], rel: Path, roles: list[str], user: str) -> list[str]:
    values = {"PREFIX": str(paths.prefix), "ETC": str(paths.etc), "DATA": str(paths.data), "USER": user}
    values["ETCD"] = etcd_binary()
    written = []
    for role in roles:
        unit, _ = ROLES[role]
        text = render((rel / "bundle" / "units" / unit).read_text(), values)
        if _place(paths, state, text.encode(), paths.unit_dir / unit, 0o644, 0, 0):
            written.append(unit)
    return written


def check_config(rel: Path, role: str, path: Path) -> None:
    """Let the installed release's own loader read the config (file, line and field in its errors)."""
    code = {
        "control-plane": "from controlplane.main import build_settings as b; b(['--config', sys.argv[1]])",
        "gateway": "from gateway.main import build_settings as b; b(['--config', sys.argv[1]])",
        "worker": "from node_agent.plugins.config import load_config as l; l(sys.argv[1])",
    }.get(role)
    if code is None:
        return
    say(
        _check_config_step(),
        msg("installer.config_read", "{path}: read by the release's own loader", path=str(path)),
    )
    py = rel / "venv" / "bin" / "python"
    r = subprocess.run(
        [str(py), "-c", _LOADER.format(code=code), str(path)], capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()
        raise InstallError(
            _check_config_step(),
            msg(
                "installer.config_refused",
                "{path}: {error}",
                path=str(path),
                error=last[-1] if last else msg("installer.no_message", "(no message)"),
            ),
            msg("installer.config_fix", "fix the file and run install again"),
        )


_LOADER = """\
import sys
try:
    {code}
except Exception as e:
    from kunlun_common.i18n import error_text
    kind, where = type(e).__qualname__, type(e).__module__
    kind = kind if where in ("builtins", "__main__") else where + "." + kind
    text = error_text(e)
    print(kind + ": " + text if text else kind, file=sys.stderr)
    sys.exit(1)
"""
"""How the installer runs a check with the release's own code: an error's last line as a traceback
would end (`module.Class: text`), its text in the reader's language (the release's catalog)."""


def _certificates_step() -> Message:
    return msg("installer.step.certificates", "certificates")


ETCD_REQUIRED = ("ETCD_NAME", "ETCD_DATA_DIR", "ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS")


def check_etcd_env(path: Path) -> None:
    from kunlun_installer.units import _parse_env_file

    env = _parse_env_file(path)
    missing = [k for k in ETCD_REQUIRED if k not in env]
    if missing:
        raise InstallError(
            _check_config_step(),
            msg("installer.etcd_missing", "{path}: missing {keys}", path=str(path), keys=", ".join(missing)),
            msg("installer.etcd_example", "see examples/etcd.env"),
        )
    if env.get("ETCD_CLIENT_CERT_AUTH", "").lower() != "true":
        raise InstallError(
            _check_config_step(),
            msg("installer.etcd_cert_auth", "{path}: ETCD_CLIENT_CERT_AUTH must be true", path=str(path)),
            msg("installer.etcd_cert_auth_why", "etcd accepts only certificate-holding clients"),
        )


ETCD_CRL = "crl/etcd.crl"
"""In the certificate folder: the CRL the etcd unit passes as `--client-crl-file` (`certs init`
writes an empty one signed by the etcd CA; `certs revoke --dir` rewrites it)."""


def check_etcd_crl(rel: Path, certs: Path) -> None:
    """etcd starts with `--client-crl-file=ETC/certs/crl/etcd.crl`: the host's certificate folder
    must hold that CRL, signed by its etcd CA (checked with the release's own code; a host never
    holds the CA key, so the installer cannot sign one itself)."""
    crl, ca = certs / ETCD_CRL, certs / "etcd-ca.crt"
    if not crl.is_file():
        raise InstallError(
            _certificates_step(),
            msg("installer.crl_missing", "{crl}: missing (etcd's --client-crl-file)", crl=str(crl)),
            msg(
                "installer.crl_copy",
                "copy DIR/crl/etcd.crl from the `kunlun-cli certs init DIR` folder with the member's certs",
            ),
        )
    py = rel / "venv" / "bin" / "python"
    code = "import sys; from kunlun_common.pki import check_crl as c; print(c(sys.argv[1], sys.argv[2]))"
    r = subprocess.run(
        [str(py), "-c", _LOADER.format(code=code), str(crl), str(ca)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()
        raise InstallError(
            _certificates_step(),
            last[-1] if last else msg("installer.no_message", "(no message)"),
            msg("installer.crl_give", "give the CRL written by this cluster's etcd CA"),
        )
    say(
        _certificates_step(),
        msg(
            "installer.crl_ok",
            "{crl}: CRL signed by the etcd CA, {count} revoked serial(s)",
            crl=str(crl),
            count=r.stdout.strip(),
        ),
    )


@dataclass(frozen=True)
class InstallRequest:
    role: str
    config: Path
    certs: Path
    user: str = "kunlun"
    replicas: str = ""
    """Worker only: the replica addresses for the agent (KUNLUN_REPLICAS)."""


def install(paths: Paths, bundle: Bundle, req: InstallRequest) -> None:
    if req.role not in ROLES:
        raise InstallError("arguments", f"--role {req.role!r}", f"choose one of {', '.join(ROLES)}")
    say("bundle", f"checking {bundle.root} against its manifest (version {bundle.version})")
    problems = bundle.verify()
    if problems:
        raise InstallError(
            "bundle", f"{len(problems)} file(s) differ: {problems[0]}", "copy the bundle again"
        )
    for what, p in (("--config", req.config), ("--certs", req.certs)):
        if not p.exists():
            raise InstallError("arguments", f"{what} {p}: not found", f"give the {what[2:]} for this host")
    if req.role == "worker" and not req.replicas:
        raise InstallError(
            "arguments", "--replicas missing", "give the replica addresses host:port,host:port"
        )
    state = load_state(paths)
    if state.get("current") and state["current"] != bundle.version:
        raise InstallError(
            "release",
            f"version {state['current']} is installed, the bundle is {bundle.version}",
            "use upgrade",
        )
    ca_keys = [p for p in req.certs.rglob("*.key") if p.name.endswith("ca.key")]
    if ca_keys:
        raise InstallError(
            "certificates",
            f"{ca_keys[0]}: a CA private key",
            "never copy a CA key to a host; give only its certs",
        )
    uid, gid = ensure_user(req.user)
    if req.role == "worker":
        ensure_user(ENGINE_USER)  # the agent runs every engine as this unprivileged user
    for d, mode, owner in (
        (paths.prefix, 0o755, (0, 0)),
        (paths.etc, 0o750, (0, gid)),
        (paths.data, 0o750, (uid, gid)),
    ):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, mode)
        _chown(d, *owner)
    rel = build_release(paths, bundle, state)
    if req.role == "etcd":
        check_etcd_env(req.config)
        check_etcd_crl(rel, req.certs)
    else:
        check_config(rel, req.role, req.config)
    _, config_name = ROLES[req.role]
    say("config", f"{paths.etc / config_name}")
    _place(paths, state, req.config.read_bytes(), paths.etc / config_name, 0o640, 0, gid)
    if req.role == "worker":
        env = f"KUNLUN_REPLICAS={req.replicas}\n".encode()
        _place(paths, state, env, paths.etc / "agent.env", 0o640, 0, gid)
    certs_dest = paths.etc / "certs"
    certs_dest.mkdir(exist_ok=True)
    os.chmod(certs_dest, 0o750)
    _chown(certs_dest, 0, gid)
    n = 0
    for src in sorted(req.certs.rglob("*")):
        if src.is_file():
            if src.name.startswith("ca") and src.suffix == ".key":
                raise InstallError(
                    "certificates",
                    f"{src}: a CA private key",
                    "never copy a CA key to a host; give only its certs",
                )
            dest = certs_dest / src.relative_to(req.certs)
            for parent in reversed(dest.relative_to(certs_dest).parents):
                (certs_dest / parent).mkdir(exist_ok=True)
                os.chmod(certs_dest / parent, 0o750)
                _chown(certs_dest / parent, 0, gid)
            _place(paths, state, src.read_bytes(), dest, 0o640 if src.suffix == ".key" else 0o644, 0, gid)
            n += 1
    say("certificates", f"{n} files in {certs_dest} (keys 0640 root:{req.user})")
    crl_meta = state["files"].get(str(certs_dest / ETCD_CRL))
    if crl_meta is not None:  # rewritten by the operator after each `certs revoke --dir`
        crl_meta["source"] = "crl"
    roles = state.setdefault("roles", {})
    assert isinstance(roles, dict)
    roles[req.role] = {"user": req.user}
    for sub in ("agent", "etcd", "log", "run"):
        (paths.data / sub).mkdir(exist_ok=True)
        _chown(paths.data / sub, uid, gid)
    if state.get("current") != bundle.version:
        switch_current(paths, bundle.version)
    state["current"] = bundle.version
    state["user"] = req.user
    state["paths"] = {k: str(getattr(paths, k)) for k in ("prefix", "etc", "unit_dir", "data")}
    written = render_units(paths, state, rel, sorted(roles), req.user)
    say("units", f"{', '.join(written) or 'unchanged'} in {paths.unit_dir}")
    record_release(state, rel)
    save_state(paths, state)
    say(
        "done",
        f"role {req.role} installed (version {bundle.version}); start: systemctl enable --now {ROLES[req.role][0]}",
    )


def verify(paths: Paths) -> list[str]:
    """Every installed file that is missing or differs from what was installed."""
    state = load_state(paths)
    files = state.get("files") or {}
    assert isinstance(files, dict)
    if not files:
        raise InstallError(
            "verify", f"{paths.state_file}: nothing installed here", "run kunlun-installer install"
        )
    problems = []
    for name, meta in sorted(files.items()):
        p = Path(name)
        if not p.is_file():
            problems.append(f"missing: {p}")
        elif meta["source"] != "crl" and sha256_file(p) != meta["sha256"]:  # a newer CRL is fine
            problems.append(f"changed: {p}")
        elif p.stat().st_mode & 0o7777 != meta["mode"]:
            problems.append(f"mode: {p} is {oct(p.stat().st_mode & 0o7777)}, expected {oct(meta['mode'])}")
    link = paths.prefix / "current"
    target = os.readlink(link) if link.is_symlink() else ""
    if target != f"releases/{state.get('current')}":
        problems.append(f"link: {link} does not point to releases/{state.get('current')}")
    return problems


def repair(paths: Paths, bundle: Bundle | None) -> list[str]:
    """Restore what verify finds; returns what was fixed."""
    state = load_state(paths)
    problems = verify(paths)
    if not problems:
        return []
    files = state["files"]
    assert isinstance(files, dict)
    version = str(state["current"])
    rel = paths.release(version)
    source = bundle if bundle is not None else Bundle.open(rel / "bundle")
    if source.version != version:
        raise InstallError(
            "repair", f"the bundle is {source.version}, the host runs {version}", "give the right bundle"
        )
    fixed = []
    venv_broken = False
    user = str(state.get("user", "kunlun"))
    _, gid = ensure_user(user)
    for line in problems:
        kind, _, name = line.partition(": ")
        name = name.split(" is ")[0]
        meta = files.get(name)
        if meta is None:
            if kind == "link":
                switch_current(paths, version)
                fixed.append(f"relinked {paths.prefix / 'current'}")
            continue
        p = Path(name)
        if meta["source"] == "venv":
            venv_broken = True
            continue
        if meta["source"] == "bundle":
            rel_name = p.relative_to(rel / "bundle")
            src = source.root / rel_name
            if src.resolve() == p.resolve():
                raise InstallError(
                    "repair",
                    f"{p}: the release's own bundle copy is damaged",
                    "give the bundle: --bundle DIR",
                )
            p.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, p)
        else:
            keep = _pristine(paths, p)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(keep.read_bytes())
        os.chmod(p, meta["mode"])
        if str(p).startswith(str(paths.etc)):
            _chown(p, 0, gid)
        fixed.append(f"restored {p} ({kind})")
    if venv_broken:
        say("repair", f"rebuilding {rel / 'venv'} from the wheelhouse")
        make_venv(rel, version)
        record_release(state, rel)
        fixed.append(f"rebuilt {rel / 'venv'}")
    save_state(paths, state)
    for f in fixed:
        say("repair", f)
    return fixed


def uninstall(paths: Paths, purge: bool) -> None:
    state = load_state(paths)
    roles = state.get("roles") or {}
    assert isinstance(roles, dict)
    for role in roles:
        unit = paths.unit_dir / ROLES[role][0]
        if unit.exists():
            unit.unlink()
            say("units", f"removed {unit}")
    for name in state.get("files") or {}:
        p = Path(name)
        if str(p).startswith(str(paths.etc)) and p.exists() and purge:
            p.unlink()
    if paths.prefix.exists():
        shutil.rmtree(paths.prefix)
        say("release", f"removed {paths.prefix}")
    if purge:
        for d in (paths.etc, paths.data):
            shutil.rmtree(d, ignore_errors=True)
            say("purge", f"removed {d}")
    else:
        say("keep", f"kept {paths.etc} and {paths.data} (use --purge to remove them)")
