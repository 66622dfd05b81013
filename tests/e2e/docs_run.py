"""The docs as one shell session: every ```sh, ```bash and ```python block of the pages in PAGES, in order, turned
into one bash script that a reader could have typed (tests/e2e/test_docs_run.py runs it on one `make up`).

What the script does with a block:
- `sh` / `bash`: its lines, as written, in the one bash session (so an `export` or `source` holds for what follows);
- `python`: consecutive python blocks of one page (no shell block between them) run as one Python script (a page's
  later block uses the names an earlier one made), with the `python` on PATH at that point;
- a block right after `<!-- not run: REASON -->` is skipped; the reason is required and reported.

What stands in for the reader, and nothing else:
- `make up` starts in the background (a reader's first terminal), and the session waits for its banner;
- an `export` line whose values end in `...` (a placeholder: "the line X printed") becomes the last line of that
  shape the session has printed so far (make up's banner, `kcaas admin keys create`), setting the same variables;
- SUBSTITUTIONS rewrite the addresses and paths a page assumes (port 8000, the model's directory, var/) to the
  test's own.

Other fenced blocks must say what they are (`text`: output, diagrams, formats): `unlabelled_blocks` finds any that
does not, so a command cannot hide from the run in an unlabelled block.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = (
    "README.md",
    "docs/first-hour.md",
    "docs/admin-cli.md",
    "docs/sdk.md",
    "docs/vllm.md",
    "docs/sglang.md",
    "docs/routing.md",
    "docs/operations.md",
)
RUNNABLE = ("sh", "bash", "python")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
PLACEHOLDER_EXPORT = re.compile(r"^(\s*)export\s+((?:[A-Z_][A-Z0-9_]*=\S*\s*)+?)(\s+#.*)?$")
BANNER_END = "Ctrl-C stops everything"


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts (1-based line of its fence), its language and text."""

    page: str
    line: int
    lang: str
    text: str
    not_run: str | None  # the reason given in a `<!-- not run: ... -->` comment right before it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of `page` (a path relative to the repository), in order."""
    lines = (REPO / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end])
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        reason = NOT_RUN.search(before)
        found.append(Block(page, i + 1, lang, body + "\n", reason.group(1) if reason else None))
        i = end + 1
    return found


def unlabelled_blocks(pages: list[str]) -> list[str]:
    return [block.where for page in pages for block in blocks(page) if not block.lang]


def substitute(text: str, substitutions: dict[str, str]) -> str:
    for old, new in substitutions.items():
        text = text.replace(old, new)
    return text


def _shell_lines(block: Block, substitutions: dict[str, str]) -> list[str]:
    out = []
    for raw in substitute(block.text, substitutions).splitlines():
        placeholder = PLACEHOLDER_EXPORT.match(raw)
        if placeholder and "..." in placeholder.group(2):
            names = [assignment.split("=", 1)[0] for assignment in placeholder.group(2).split()]
            out.append(f'_printed="$(printed_export {" ".join(names)})"; eval "$_printed"  # {raw.strip()}')
        else:
            out.append(raw)
    return out


def session_script(pages: tuple[str, ...], substitutions: dict[str, str], prelude: str) -> tuple[str, list[Block]]:
    """The bash script running the pages' blocks in order, and the blocks it runs. `prelude` defines `make`,
    `printed_export` and the variables they use."""
    script, ran = [prelude], []
    python: list[Block] = []

    def flush_python() -> None:
        if python:
            source = "\n".join(substitute(b.text, substitutions) for b in python)
            script.append(f"echo '### python {', '.join(b.where for b in python)}'")
            script.append(f"python - <<'KCAAS_DOCS_PYTHON'\n{source}KCAAS_DOCS_PYTHON")
            python.clear()

    for page in pages:
        for block in blocks(page):
            if block.lang not in RUNNABLE or block.not_run:
                continue
            ran.append(block)
            if block.lang == "python":
                python.append(block)
                continue
            flush_python()
            script.append(f"echo '### {block.lang} {block.where}'")
            script.extend(_shell_lines(block, substitutions))
        flush_python()
    return "\n".join(script) + "\necho '### the docs ran to the end'\n", ran


def printed_export(names: list[str], logs: list[Path]) -> str:
    """The last `export` line printed in `logs` (searched in order, later ones first) that sets exactly `names`."""
    shape = re.compile(r"export((?:\s+[A-Z_][A-Z0-9_]*=\S+)+)")
    for log in reversed(logs):
        if not log.exists():
            continue
        for line in reversed(log.read_text(errors="replace").splitlines()):
            match = shape.search(line)
            if match and [a.split("=", 1)[0] for a in match.group(1).split()] == names:
                return "export" + match.group(1)
    raise SystemExit(f"no line `export {' '.join(n + '=...' for n in names)}` was printed before this step")


if __name__ == "__main__":  # printed-export NAME... : called by the session script (logs in KCAAS_DOCS_LOGS)
    import os

    assert sys.argv[1] == "printed-export", sys.argv
    print(printed_export(sys.argv[2:], [Path(p) for p in os.environ["KCAAS_DOCS_LOGS"].split(":")]))
