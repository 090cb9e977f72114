"""Benchmarks: what rendezvous does on this hardware (``python -m bench``; docs/benchmarks.md).

Importing the package is cheap: vLLM, NIXL and matplotlib load only in the commands that use them.
"""
