"""Node agent executor: runs engines in per-instance cgroups and sandboxes under a supervisor.

Building blocks (no control-plane integration here):

* `launch_plan` - from workload + allocation + device plugin answer to the exact engine process;
* `sandbox` - namespaces, private /tmp and /dev, environment allowlist; `detect_protections`;
* `cgroups` - per-instance cgroups on v1, v2 or hybrid hosts, OOM kill counter;
* `supervisor` - the detached per-instance supervisor and the agent API
  (`launch`, `adopt`, `stop`, `read_exit`).
"""
