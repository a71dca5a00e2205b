"""The CLI's client config file: `$KUNLUN_CONFIG`, default ~/.config/kunlun/config.yaml.

endpoints: [127.0.0.1:50051, 127.0.0.1:50052, 127.0.0.1:50053]
ca: /path/certs/ca.crt
cert: /path/certs/operator/admin.crt
key: /path/certs/operator/admin.key
replica_ca: /path/certs/replica-ca.crt   # optional: default replica-ca.crt beside ca
crl: /path/certs/crl/etcd.crl            # optional: default crl/etcd.crl beside ca, when present
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from kunlun_common.settings import from_mapping, load_yaml_mapping


@dataclass(frozen=True)
class ClientConfig:
    """Where the CLI finds the replicas and its operator/viewer certificate."""

    endpoints: tuple[str, ...]
    """Replica addresses host:port, tried in turn."""
    ca: str
    """Cluster CA certificate."""
    cert: str
    """The operator's (or viewer's) certificate."""
    key: str
    """Its private key."""
    replica_ca: str = ""
    """The replica CA: the only issuer trusted for replicas (default: replica-ca.crt beside `ca`).
    Each replica's certificate must carry the host of its endpoint."""
    crl: str = ""
    """A certificate revocation list (DER or PEM; `kunlun-cli certs revoke --dir` rewrites
    DIR/crl/etcd.crl): a replica presenting a listed certificate is refused and the next one is
    tried. Default: crl/etcd.crl beside `ca` when that file exists; none otherwise."""


def default_path() -> Path:
    return Path(os.environ.get("KUNLUN_CONFIG") or Path.home() / ".config" / "kunlun" / "config.yaml")


def load_client_config(path: Path | None = None) -> ClientConfig:
    p = path or default_path()
    return from_mapping(ClientConfig, load_yaml_mapping(p), str(p))


def write_client_config(path: Path, cfg: ClientConfig) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "endpoints": list(cfg.endpoints),
        "ca": cfg.ca,
        "cert": cfg.cert,
        "key": cfg.key,
        **({"replica_ca": cfg.replica_ca} if cfg.replica_ca else {}),
        **({"crl": cfg.crl} if cfg.crl else {}),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)
