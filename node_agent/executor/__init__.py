"""Node agent executor: runs the assigned engines in per-instance cgroups and sandboxes under supervisors.

* `manager` - the reconciler: assigned instances <-> running engines, adoption after an agent
  restart, stop on disconnect, the node's InstanceReport, simulated chip telemetry;
* `instance` - one instance's lifecycle: start, probe, restart with back-off, stop; its phases;
* `prepare` - from an assignment to a supervisor spec (plugin allocate, launch plan, engine choice
  and the test-engine fallback, cgroup limits, port);
* `probes` - HTTP health probe and first-token measurement;
* `launch_plan` - from workload + allocation + device plugin answer to the exact engine process;
* `sandbox` (+ `sandbox_init`) - namespaces, private /tmp and /dev, environment allowlist;
  `mount_view` - the engine's read-only file-system view; `confine` - user, capabilities,
  no_new_privs and the seccomp filter (`seccomp_policy`); `hardening` - what is on, off and why;
  `detect_protections`;
* `cgroups` - per-instance cgroups on v1, v2 or hybrid hosts, OOM kill counter;
* `supervisor` - the detached per-instance supervisor process; `supervisor_api` - the agent's side
  (`launch`, `adopt`, `stop`, `read_exit`, `reap`); `logfiles` - rotating engine logs and their readers.
"""
