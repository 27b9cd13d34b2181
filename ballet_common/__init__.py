"""What the planner service and the devstack both need, and nothing else.

The planner's production code never imports ``devstack``, and ``devstack`` never imports
the planner's internals (``service``); the few pieces both use (token handling, redaction
of provider text) live here, so an image of the planner can leave the devstack out.
"""
