#!/usr/bin/env bash
# The whole-tree formatting pass, run once by hand (not by `make lint`, which only checks):
#   1. drop the `# fmt: skip` pragmas the hand-wrapped statements carried before ruff was the formatter (a pragma
#      with an explanation keeps the explanation: `# fmt: skip - never the token` becomes `# never the token`);
#   2. `ruff check --fix` (safe fixes only: import order, 3.11 spellings, unused imports);
#   3. `ruff format`.
# Afterwards `ruff check .` and `ruff format --check .` pass. Run it from anywhere in the repository; RUFF names the
# binary (default: the repository's .venv/bin/ruff, else `ruff` on PATH).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
RUFF="${RUFF:-}"
if [ -z "$RUFF" ]; then
    if [ -x .venv/bin/ruff ]; then RUFF=.venv/bin/ruff; else RUFF=ruff; fi
fi

git ls-files -z -- '*.py' | xargs -0 grep -lZ '# fmt: skip' | xargs -0 -r perl -pi -e '
    s/[ \t]*#[ \t]*fmt:[ \t]*skip[ \t]*$//;             # a bare pragma at the end of a line: gone
    s/#[ \t]*fmt:[ \t]*skip[ \t]*(?:-[ \t]*)?(?=\S)/# /;  # a pragma followed by a reason: the reason stays
'
"$RUFF" check --fix --quiet . || true  # what --fix cannot fix is reported by the checks below
"$RUFF" format --quiet .
"$RUFF" check .
"$RUFF" format --check .
