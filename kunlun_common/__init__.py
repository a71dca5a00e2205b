"""The small package shared by the control plane and the node agent (errors, names, TLS, logs)."""
