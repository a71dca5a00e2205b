"""Kunlun Platform control plane: replicas, store, election, scheduling, API and CLI."""
