"""Processes: checks and the resolved config before launch (:mod:`.launch`), the worker entry point
(:mod:`.worker`), heartbeats (:mod:`.heartbeat`) and dying with the launcher (:mod:`.lifetime`)."""
