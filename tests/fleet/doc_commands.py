"""The shell commands of the README and docs/*.md, as an operator would type them: the lines of
fenced code blocks (backslash continuations joined, trailing `# comments` dropped), and the
`cubectl ...` inside `$(...)`."""

import glob
import os
import re
import shlex
from dataclasses import dataclass

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


@dataclass
class Command:
    where: str
    text: str
    argv: list


def _lines(path):
    """(line number, logical line) of the fenced code blocks in `path`."""
    inside, pending, start = False, "", 0
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if line.lstrip().startswith("```"):
                inside, pending = not inside, ""
                continue
            if not inside:
                continue
            if not pending:
                start = n
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            yield start, (pending + line.strip()).strip()
            pending = ""


def _strip_comment(line):
    # A `#` that starts a word outside quotes starts a comment (shlex knows the quoting).
    lex = shlex.shlex(line, posix=True, punctuation_chars=False)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return " ".join(shlex.quote(t) for t in lex)
    except ValueError:
        return line


def commands():
    out = []
    for path in DOCS:
        rel = os.path.relpath(path, REPO)
        for n, line in _lines(path):
            for m in re.finditer(r"\$\((cubectl [^)]*)\)", line):
                out.append(Command(f"{rel}:{n}", m.group(1), shlex.split(m.group(1))))
            text = _strip_comment(line)
            if not text:
                continue
            try:
                argv = shlex.split(text)
            except ValueError:
                continue
            if argv and argv[0] in ("cubectl", "deploy/install.sh") or \
                    (len(argv) == 2 and argv[0] == "bash"):
                out.append(Command(f"{rel}:{n}", text, argv))
    return out


def install_command(flag):
    """The docs/install.md `deploy/install.sh` command with `flag` (e.g. "--compute")."""
    found = [c for c in commands()
             if c.where.startswith("docs/install.md") and c.argv[0] == "deploy/install.sh"
             and flag in c.argv]
    if not found:
        raise AssertionError(f"docs/install.md has no `deploy/install.sh {flag}` command")
    return found[0]
