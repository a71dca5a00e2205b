"""kunlun-gateway: the data plane. An OpenAI-compatible HTTP proxy in front of the inference engines.

It learns the routable instances from the replicas (`WorkloadService.WatchEndpoints`, pushed on
every change) and its API keys and routing policies from `GatewayService.WatchGatewayConfig`, with
a certificate of role `gateway`; it holds no etcd credentials.

    proxy.py     client side: asyncio.Protocol + httptools, routes, auth, JSON errors (the hot path)
    exchange.py  one proxied request: attempts, retry on another instance, timeout, relay
    upstream.py  pooled keep-alive connections to the engines, bytes forwarded as they arrive
    backends.py  the endpoint set per workload, passive ejection, active health checks
    routing.py   round_robin, least_outstanding (power of two choices), prefix_affinity
    feed.py      the control-plane feed with failover between replicas, registration heartbeat
    auth.py      API key checks (SHA-256 of the bearer token against the pushed hashes)
    httpclient.py  a small HTTP/1.1 client (health checks, sglang-router sync, tests, bench)
    routersync.py  optional: mirror the instances into an external sglang-router (/workers)
"""
