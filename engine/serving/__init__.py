"""The OpenAI-compatible HTTP front end: routes, request models, response bodies, tool-call parsing.

It talks to the engine only through its client (`AsyncEngine` on a thread, `ProcessEngine` in a
process of its own) and reads the core's limits, tokenizer and SLO classes.
"""
