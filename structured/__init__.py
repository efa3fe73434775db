"""Structured output and tool calling, as text and grammar logic that runs in no particular
process: the grammar a request's fields ask for and its validation (grammars.py), the tools
of a chat request and the grammar a forced call needs (tools.py), the parsers that find tool
calls (tool_parsers.py) and reasoning (reasoning.py) in a model's text, whole or streamed."""
