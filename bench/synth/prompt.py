"""The agent's system prompt and its tool definitions (OpenAI ``tools`` schema).

Modelled on what coding agents send (OpenCode sends a ~9.5k-char system prompt and ten
tools, see docs/design.md §8); scaled down so the prompt plus the tools
is about 1.3k tokens, which SmolLM2 prefills in ~6 s on two cores.
"""

from __future__ import annotations

from typing import Any

JSON = dict[str, Any]

_GUIDELINES = """\
You are forge, an interactive command-line agent that helps users with software \
engineering tasks in the repository described below. Use the instructions below and the \
tools available to you to assist the user.

# Tone and style
Be concise and direct. Explain a non-trivial command before you run it, in one sentence. \
Answer in fewer than four lines unless the user asks for detail. Do not add preambles \
such as "Here is what I will do". Never invent file contents: read a file before you \
describe or edit it. Refer to code as `path:line` so the user can jump to it.

# Doing tasks
1. Search first. Use grep and glob to find the relevant files, and read them before \
editing. Prefer several small, targeted reads over one huge read.
2. Make the smallest change that fixes the problem. Follow the conventions of the \
surrounding code: naming, typing, error handling and test layout.
3. Verify. Run the project's tests or the narrowest command that proves the change \
works. If a check fails, read its output carefully before you change anything else.
4. Never commit, push or rewrite history unless the user asks you to.

# Tool use
- Call tools with exact, absolute paths under the working directory.
- You may call several tools in one message when the calls are independent.
- The edit tool replaces exactly one occurrence of old_string; include enough context \
to make it unique, and preserve indentation exactly.
- Long command output is truncated; rerun with a narrower filter rather than paging.
- Tool results may be shortened by the client in later turns; rely on your own notes.

# Code style
Write idiomatic, typed Python 3.11. Keep functions small and give them explaining names. \
Comments say why, not what. Do not add dependencies without asking. Tests use pytest \
with plain asserts and parametrize for tables of cases.
"""


def system_prompt(project: str, branch: str) -> str:
    """The full system message: guidelines plus the environment block of one session."""
    environment = (
        "<env>\n"
        f"Working directory: /home/dev/{project}\n"
        "Is directory a git repo: yes\n"
        f"Current branch: {branch}\n"
        "Platform: linux\n"
        "Shell: bash\n"
        "Python: 3.11.9 (.venv)\n"
        "</env>\n"
    )
    return _GUIDELINES + "\n" + environment


def _function(name: str, description: str, properties: JSON, required: list[str]) -> JSON:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


def _string(description: str) -> JSON:
    return {"type": "string", "description": description}


def _integer(description: str) -> JSON:
    return {"type": "integer", "description": description}


def tool_definitions() -> list[JSON]:
    """The five tools every session offers, in the client's canonical order."""
    return [
        _function(
            "read",
            "Read a file from the local filesystem. Returns the lines prefixed with their "
            "line numbers. Use offset and limit for large files.",
            {"path": _string("Absolute path of the file to read"),
             "offset": _integer("Line number to start reading from (1-based)"),
             "limit": _integer("Maximum number of lines to read")},
            ["path"],
        ),
        _function(
            "edit",
            "Replace exactly one occurrence of old_string with new_string in a file. Fails "
            "if old_string is missing or not unique.",
            {"path": _string("Absolute path of the file to modify"),
             "old_string": _string("The exact text to replace"),
             "new_string": _string("The replacement text")},
            ["path", "old_string", "new_string"],
        ),
        _function(
            "grep",
            "Search file contents with a regular expression. Returns matching lines as "
            "path:line: text, sorted by path.",
            {"pattern": _string("Regular expression to search for"),
             "path": _string("Directory to search in (defaults to the working directory)"),
             "include": _string("Glob of files to include, e.g. *.py")},
            ["pattern"],
        ),
        _function(
            "bash",
            "Run a shell command in the working directory and return its combined output "
            "and exit code. Output longer than 30000 characters is truncated.",
            {"command": _string("The command to run"),
             "description": _string("Five to ten words saying what the command does"),
             "timeout": _integer("Timeout in milliseconds (default 120000)")},
            ["command", "description"],
        ),
        _function(
            "glob",
            "Find files by name with a glob pattern such as src/**/*.py. Returns matching "
            "paths sorted by modification time.",
            {"pattern": _string("The glob pattern to match"),
             "path": _string("Directory to search in (defaults to the working directory)")},
            ["pattern"],
        ),
    ]
