"""kunlun-installer: offline install, verify/repair, upgrade/rollback and `run` for one host.

Standard library only: it runs straight from the release wheel before any virtual environment exists.
"""
