"""Kunlun node agent: device plugins, registration and heartbeats, executors.

It must not import `controlplane` (tests/test_layering.py enforces it): it shares only the
generated API and `kunlun_common` with the control plane.
"""
