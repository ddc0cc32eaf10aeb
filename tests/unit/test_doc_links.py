"""Every relative link in the README and docs/ reaches a file that exists, and a #heading that it has
(GitHub's anchors: lowercased, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # (a URL: not checked offline)
            path, _, anchor = target.partition("#")
            found = (page.parent / path).resolve() if path else page
            if not found.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and found.suffix == ".md" and anchor not in anchors(found):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
