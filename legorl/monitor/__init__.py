"""Monitoring: behaviour analytics, pass@k reports, run health and the live dashboard.

Everything here reads only shards (``legorl.core.shards``); nothing talks to a running stage.
"""
