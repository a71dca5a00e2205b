"""Development scripts (proto generation, wire-compatibility check)."""
