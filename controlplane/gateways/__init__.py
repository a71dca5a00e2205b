"""What the control plane keeps for the gateways: API keys and routing policies (goal state written
through GatewayService), read back by the replicas' config feed. The gateway process itself lives
in the top-level `gateway/` package; the two share only `kunlun_common.traffic`."""
