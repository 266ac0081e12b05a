"""A chat request's bounds, checked by the API before it forwards one and by the engine on what it gets.

OpenAI's own limits: at most 16 choices, and 4 stop strings of at most 64 characters (each stop string
is searched for in the text after every token, so their size is the engine's time).
"""

MAX_N = 16
MAX_STOPS = 4
MAX_STOP_CHARS = 64
