"""Laguna's tool-call tags, as its chat template writes them: what the parser reads and the grammar writes."""

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
NAME_LIMIT = 256  # a function "name" longer than this is not a call after all
