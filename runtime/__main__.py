"""`python -m runtime serve [flags]`: the one-command way to run the server."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print("usage: python -m runtime serve [--model-path PATH] [--port N] ... (see --help)",
              file=sys.stderr)
        return 2
    print("ringserve: the server is not built yet (see the open issues)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
