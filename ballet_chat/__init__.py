"""The terminal chat client of the planner's Chat RPC (``ballet-planner chat``): the
session and its turns, line input, the interactive loop and what is printed."""
