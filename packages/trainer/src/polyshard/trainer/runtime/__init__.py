"""Processes: checks and the resolved config before launch (:mod:`.launch`), the worker entry point
(:mod:`.worker`), heartbeats (:mod:`.heartbeat`), dying with the launcher (:mod:`.lifetime`) and
injected faults (:mod:`.faults`)."""
