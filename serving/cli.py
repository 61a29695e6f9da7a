"""`ridgeline`: the console script (pyproject.toml's `[project.scripts]`).

    ridgeline serve MODEL [flags]     # = python -m serving.server MODEL [flags]

MODEL is a Ridgeline checkpoint directory, a Hugging Face checkpoint directory
or a Hugging Face Hub id (`serving.model_source`); the flags are the server's,
in Ridgeline's spelling (`--max_model_len`) or vLLM's (`--max-model-len`,
`serving.vllm_flags`).
"""

from __future__ import annotations

import sys

USAGE = "usage: ridgeline serve [MODEL] [flags]   (ridgeline serve --helpfull lists the flags)"


def main() -> None:
    """Dispatches the subcommand; `serve` runs the server with the remaining arguments."""
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if args else 2)
    if args[0] != "serve":
        sys.stderr.write(f"error: unknown command {args[0]!r}; {USAGE}\n")
        sys.exit(2)
    from serving import server

    sys.argv = ["ridgeline serve"] + args[1:]
    server.run()


if __name__ == "__main__":
    main()
