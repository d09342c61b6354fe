"""The documentation holds together: links resolve, the README stays short and keeps
CI's test command, and bench/README.md is what bench/readme.py generates from the
results (so no figure is copied by hand). Standard library only."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300
CI_MARK = "<!-- ci:test-command -->"

LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "integrations").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub makes in a markdown file (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_keep_code(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", path.read_text()))
    return out


def _prose_keep_code(text: str) -> list[str]:
    """Lines outside fenced blocks (headings keep their inline code)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def broken_links(files: list[Path] | None = None) -> list[str]:
    """'file: target (why)' for each relative link that does not resolve."""
    bad = []
    for path in files or doc_files():
        for target in LINK.findall(_prose(path.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no such anchor in {dest.relative_to(ROOT)})")
    return bad


def load_bench_readme():
    spec = importlib.util.spec_from_file_location("bench_readme", ROOT / "bench" / "readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_relative_link_in_the_docs_resolves():
    assert (ROOT / "docs").is_dir()
    assert broken_links() == []


def test_the_readme_is_short_and_keeps_ci_test_command():
    text = README.read_text()
    assert text.count("\n") <= README_MAX_LINES, f"README.md has {text.count(chr(10))} lines"
    lines = text.split("\n")
    assert CI_MARK in lines
    after = lines[lines.index(CI_MARK) + 1:]
    assert after[0].startswith("```")
    command = after[1:after.index("```", 1)]
    assert command and "pytest" in " ".join(command)


def test_bench_readme_is_generated_from_the_results():
    module = load_bench_readme()
    stale = "bench/README.md is stale or edited by hand: run python bench/readme.py"
    assert (ROOT / "bench" / "README.md").read_text() == module.render(), stale


def test_bench_readme_script_needs_no_framework():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'torch', 'mindspore', 'megatron', 'numpy'}:\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('r', 'bench/readme.py')\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.render().startswith('# Benchmark results')\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr


if __name__ == "__main__":
    problems = broken_links()
    print("\n".join(problems) or f"every relative link in {len(doc_files())} files resolves")
    sys.exit(1 if problems else 0)
