"""llamaswap: a priority scheduler for one GPU behind an OpenAI-compatible LLM server."""

__version__ = "0.1.0"
