"""Structured outputs: constraints compiled to grammars (llguidance) and applied as a token
bitmask on the device before sampling."""
