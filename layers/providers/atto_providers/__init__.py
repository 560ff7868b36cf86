"""Clients for Atto Cloud's paid upstream providers, each throttled through Redis.

Modules are imported on demand by the functions that need them (cold start): the
structured-output function imports only ``atto_providers.llm``.
"""
