"""The one way into etcd. Nothing outside this package imports an etcd client."""

from controlplane.store.contract import (
    KV,
    Compare,
    DeleteOp,
    GetOp,
    Op,
    PutOp,
    Resync,
    StoreSettings,
    TxnResult,
    WatchEvent,
)
from controlplane.store.etcd import EtcdStore

__all__ = [
    "KV",
    "Compare",
    "DeleteOp",
    "EtcdStore",
    "GetOp",
    "Op",
    "PutOp",
    "Resync",
    "StoreSettings",
    "TxnResult",
    "WatchEvent",
]
