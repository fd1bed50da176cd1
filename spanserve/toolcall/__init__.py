"""Tool calling: parsing model output into OpenAI tool calls, the grammars that constrain it, and the chat templates that describe tools."""
