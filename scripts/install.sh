#!/usr/bin/env bash
# One idempotent install step shared by `make demo` and `make test`:
# Python 3.11+ with venv, the package and its pinned dependencies in .venv, and an etcd server.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
apt_install() {
  echo "installing $* with apt-get ..."
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

PY=""
for cand in python3.13 python3.12 python3.11 python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    PY=$(command -v "$cand"); break
  fi
done
if [ -z "$PY" ]; then
  apt_install python3 python3-venv
  PY=$(command -v python3)
fi
if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  apt_install python3-venv
fi

if ! command -v etcd >/dev/null 2>&1 && [ ! -x /usr/bin/etcd ]; then
  # Debian/Ubuntu package; its own system service (port 2379) is never used: the launcher runs
  # its own members on their own ports and data dirs.
  apt_install etcd-server
fi

# Prometheus and promtool (the telemetry tests and `promtool check` use them): Debian's package,
# unpacked into .tools/prometheus without installing it, so no service is started, no
# recommended exporter comes along and nothing outside the project changes. Skipped when both
# binaries are on PATH already, or were unpacked before.
if ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1 \
  && [ ! -x .tools/prometheus/usr/bin/promtool ]; then
  echo "unpacking Debian's prometheus package into .tools/prometheus ..."
  mkdir -p .tools/download
  if ! (cd .tools/download && apt-get download -qq prometheus >/dev/null 2>&1); then
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    (cd .tools/download && apt-get download -qq prometheus >/dev/null 2>&1)
  fi
  dpkg -x .tools/download/prometheus_*.deb .tools/prometheus
  rm -rf .tools/download
fi

# the chaos suite's hosts are network namespaces joined by veth pairs, its network faults nftables rules
if ! command -v ip >/dev/null 2>&1 && [ ! -x /usr/sbin/ip ] && [ ! -x /sbin/ip ]; then
  apt_install iproute2
fi
if ! command -v nft >/dev/null 2>&1 && [ ! -x /usr/sbin/nft ]; then
  apt_install nftables
fi

# etcdctl (Debian's etcd-client): `make demo-check` tries etcd with every non-replica certificate
if ! command -v etcdctl >/dev/null 2>&1; then
  apt_install --no-install-recommends etcd-client
fi

# libfaketime: the control-plane fault tests run replicas with skewed wall clocks (LD_PRELOAD)
if ! command -v faketime >/dev/null 2>&1; then
  apt_install --no-install-recommends faketime
fi

# the engines' seccomp filter (pyseccomp) loads the system's libseccomp.so.2
if ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  apt_install libseccomp2
fi

# engines run as this dedicated unprivileged system user (the agent's --engine-user default);
# without root the agent cannot switch users and engines run as the agent's own user
if [ "$(id -u)" = "0" ] && ! getent passwd kunlun-engine >/dev/null; then
  useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kunlun-engine
  echo "created system user kunlun-engine (engines run as it)"
fi

if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $PY ..."
  "$PY" -m venv .venv
fi
stamp=.venv/.kunlun-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c 'import controlplane' 2>/dev/null; then
  echo "installing kunlun-platform and its pinned dependencies into .venv ..."
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
# the message catalogs (kunlun_common/locale/*/LC_MESSAGES/kunlun.po -> .mo): build output, never committed
.venv/bin/python scripts/i18n.py compile

echo "install: ok ($(.venv/bin/python --version), $(etcd --version 2>/dev/null | sed -n 1p))"
