"""kunlun-test-engine: an OpenAI-compatible test engine (not a model) for tests and benchmarks.

Run it with `python -m node_agent.testengine --port 30000 --served-model-name demo`.
"""

from node_agent.testengine.server import KunlunTestEngine, ServerSettings, main, parse_args, serve

__all__ = ["KunlunTestEngine", "ServerSettings", "main", "parse_args", "serve"]
