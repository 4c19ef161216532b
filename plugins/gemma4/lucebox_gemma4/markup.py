"""Gemma 4's markup, as its chat templates write it: the tags of tool calls and thought channels, the string
quote of call arguments, and what ends a function's name (shared by the parser and the call grammar)."""

CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
QUOTE = '<|"|>'
CALL_PREFIX = "call:"
THOUGHT = "thought"  # the channel's name, on the line after `<|channel>`
NAME_LIMIT = 256  # a "name" or key longer than this is not one after all
NAME_STOP = frozenset(" \t\r\n<>{}[],:\"'")  # characters that end a function's name
