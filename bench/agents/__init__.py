"""The agent bench: the real OpenCode, Claude Code and Codex CLIs, several sessions each on
fewer slots than sessions, against llama-server directly and through prefixpin (issue 17).
``python bench/agents/run.py --help``."""
