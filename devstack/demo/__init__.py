"""The built-in demo of `ballet-planner dev`: the demo scenario of the scripted model
(scenario.json, SPEC section 10) and the small demo project."""
