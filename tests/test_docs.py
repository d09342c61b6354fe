"""The documentation holds together: links resolve, the README stays short and keeps
CI's test command, and bench/README.md is what bench/readme.py generates from the
results (so no figure is copied by hand). Standard library only."""

from __future__ import annotations

import importlib.util
import json
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
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


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


# ------------------------------------------------------------------ generated docs and quoted figures
GENERATED = re.compile(r"<!-- generated:(\S+) -->.*?<!-- /generated:\1 -->", re.S)
#: A figure a reader takes for a measurement: a number with a unit of time, size, rate, share or ratio.
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?(?:%|x(?!\w)|ms\b|s\b|GB/s|MB/s|MiB\b|MB\b|GB\b)")
#: A unit (paragraph, list item, table row) that says its figures are no measurement is left out.
NOT_MEASURED = re.compile(r"design estimate|not a measurement|not measurements")
RESULT_FILE = re.compile(r"bench/results/([\w.-]+\.json)")


def load_gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def units(text: str) -> list[str]:
    """A page's prose cut into paragraphs, list items and table rows, without generated blocks and
    fenced code (inline code stays: :func:`without_code`; a code span may cross lines)."""
    text = GENERATED.sub("", text)
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|"):
            out += block.split("\n")
        else:
            out += re.split(r"\n(?=\s*[*-] )", block)
    return out


def without_code(unit: str) -> str:
    return re.sub(r"``.*?``|`[^`]*`", "", unit, flags=re.S)


def result_values(names: list[str] | None = None) -> tuple[list[float], str]:
    """Every number and every text in the results files (``names``: only those)."""
    numbers: list[float] = []
    texts: list[str] = []

    def walk(v):
        if isinstance(v, bool):
            return
        if isinstance(v, (int, float)):
            numbers.append(float(v))
        elif isinstance(v, str):
            texts.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    results = ROOT / "bench" / "results"
    for path in sorted(results.iterdir()):
        if names is not None and path.name not in names:
            continue
        if path.suffix == ".json":
            walk(json.loads(path.read_text()))
        elif path.suffix == ".txt":
            texts.append(path.read_text())
    return numbers, "\n".join(texts)


def held(figure: str, numbers: list[float], texts: str) -> bool:
    """A results value that prints as ``figure`` (to its decimals; a share also as a fraction), or the
    figure in a results file's text."""
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    x, half = float(figure), 0.5 * 10 ** -decimals * (1 + 1e-9)
    if any(abs(v - x) <= half or abs(100 * v - x) <= half for v in numbers):
        return True
    return re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", texts) is not None


def unheld_figures(files: list[Path] | None = None) -> list[str]:
    """'page: figure in "unit..."' for each figure no results file holds: a unit that names results
    files must find its figures in them; any other in some results file."""
    everything = result_values()
    bad = []
    for path in files or doc_files():
        if "<!-- Generated by" in path.read_text()[:300]:  # a whole page generated from a data file
            continue
        for unit in units(path.read_text()):
            if NOT_MEASURED.search(unit):
                continue
            cited = RESULT_FILE.findall(unit)
            numbers, texts = result_values(cited) if cited else everything
            for m in FIGURE.finditer(without_code(unit)):
                if not held(m.group(1), numbers, texts):
                    where = f"in {', '.join(cited)}" if cited else "in any results file"
                    bad.append(f"{path.name}: {m.group(0)!r} not {where}: {' '.join(unit.split())[:160]!r}")
    return bad


def test_generated_docs_are_what_the_script_writes_now():
    stale = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                           text=True, cwd=ROOT, timeout=60)
    assert stale.returncode == 0, stale.stderr


def test_every_figure_the_docs_quote_is_held_by_a_results_file():
    assert unheld_figures() == []


def test_the_figure_check_catches_a_stale_figure(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Overhead per step: 0.75% (`bench/results/overhead.json`), met.\n\n"
                    "A design estimate: 123.45 s.\n\n"
                    "Recovery: 2.87x faster (`bench/results/recovery.json`).\n\n"
                    "| stall | 98765.4 s |\n")
    bad = unheld_figures([page])
    assert len(bad) == 2, bad
    assert "'0.75%' not in overhead.json" in bad[0] and "'98765.4 s' not in any results file" in bad[1], bad


def test_every_page_that_speaks_of_device_memory_errors_says_what_cuda_does():
    gen = load_gen_docs()
    for path in doc_files():
        text = path.read_text()
        if path.name in ("support.md",) or not gen.speaks_of_uce(text):
            continue
        assert "<!-- generated:cuda-note -->" in text, f"{path.name} speaks of device memory errors without the CUDA note"


def test_every_setting_says_its_meaning_default_and_reader():
    """The settings page is generated from config_env.ENV: each entry a Setting with all three told
    (a plain string added there would leave the page without a default or a reader)."""
    spec = importlib.util.spec_from_file_location("config_env_check", ROOT / "trainguard" / "core" / "config_env.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for name, setting in module.ENV.items():
        assert name.startswith("TRAINGUARD_") and isinstance(setting, module.Setting), name
        assert setting.meaning and setting.default and setting.read_by, name
    page = (ROOT / "docs" / "settings.md").read_text()
    assert all(f"| `{name}` |" in page for name in module.ENV)
