"""Streaming parsers for model output: reasoning (<think>) and tool calls (<tool_call>)."""
