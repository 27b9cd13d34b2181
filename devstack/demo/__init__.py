"""The built-in demo of `ballet-planner dev`: the demo scenario of the scripted model
(scenario.json, devstack/gateway/scripted.py) and the small demo project."""
