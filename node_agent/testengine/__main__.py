"""`python -m node_agent.testengine`: run kunlun-test-engine."""

import sys

from node_agent.testengine.server import main

sys.exit(main())
