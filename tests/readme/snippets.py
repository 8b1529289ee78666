"""README.md's fenced snippets, by their fence's info string.

`python3 tests/readme/snippets.py [--readme FILE] INFO CONTAINING` prints the one snippet whose
fence says INFO (sh, python, js, json, ...) and whose text contains CONTAINING, prefixed by a
line `# README.md:LINE`; it fails naming what it found if there is not exactly one.
tests/readme/run imports `extract`; systemd/package-check uses the command.
"""

import sys
from dataclasses import dataclass


@dataclass
class Snippet:
    line: int  # the line of the opening fence, 1-based
    info: str  # the fence's info string ("" for a bare fence)
    text: str  # the lines between the fences, each ending in "\n"

    def where(self):
        return f"README.md:{self.line} (```{self.info})"


def extract(path):
    """Every fenced block of `path` (``` fences at the start of a line), in order."""
    snippets, open_at, info, body = [], None, "", []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.startswith("```"):
                if open_at is None:
                    open_at, info, body = number, line[3:].strip(), []
                else:
                    snippets.append(Snippet(open_at, info, "".join(body)))
                    open_at = None
            elif open_at is not None:
                body.append(line)
    if open_at is not None:
        raise SystemExit(f"{path}:{open_at}: a fence that is never closed")
    return snippets


def main(argv):
    readme = "README.md"
    if argv[:1] == ["--readme"]:
        readme, argv = argv[1], argv[2:]
    if len(argv) != 2:
        raise SystemExit("usage: snippets.py [--readme FILE] INFO CONTAINING")
    info, containing = argv
    found = [s for s in extract(readme) if s.info == info and containing in s.text]
    if len(found) != 1:
        lines = ", ".join(str(s.line) for s in found) or "none"
        raise SystemExit(
            f"{readme}: {len(found)} ```{info} snippets contain {containing!r} (lines: {lines}); "
            "expected exactly one"
        )
    sys.stdout.write(f"# README.md:{found[0].line}\n{found[0].text}")


if __name__ == "__main__":
    main(sys.argv[1:])
