"""`kunlun-cli verify --layer 1..5 [--report DIR]`: the five acceptance layers, run against a live
cluster through the replicas' API (see README, "Acceptance: kunlun-cli verify").

Modules: `command` (flags, the run, cleanup), `layer1`..`layer5`, `deploy` (test workloads), `load`
(the bounded request burst), `sampler` (utilization over time), `report` + `svg` (the files).
"""
