"""The local cluster launcher: real etcd members, replicas and agents as background processes.

`make demo` and the test fixtures use the same code.
"""
