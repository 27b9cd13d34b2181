"""The planner server process: the composition root, serving, wiring, metrics, identity
and credentials, logs."""
