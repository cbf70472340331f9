"""`kiln serve`: an OpenAI-compatible HTTP server over one shared AsyncLLM (see kiln/serve/cli.py)."""
