"""Node agent device plugins: config loading, vendor tool adapters and simulator stand-ins."""
