"""What the checkout itself may not hold: names of folders that exist on one machine only.

A test that reads a file from such a folder skips silently everywhere else, and product code
that defaults to one fails for every other user: the files the tests need are fetched or made
into the cache (tests/fetched_files.py), and tools default to the cache too. The dated logs of
docs/perf-journal/ are a record of what was run where, kept as written, and llama.cpp's chat
templates are its data."""
import re
import subprocess

import pytest

from repo_paths import REPO

# Top-level folders that are one machine's (a home, a work tree, a mount, a package drop), not
# the system's (/usr, /etc, /proc, /dev, /tmp: the same on every Linux machine).
MACHINE_ROOTS = ("work", "root", "home", "Users", "mnt", "srv", "data", "opt", "scratch")
# Absolute: at a line's start or after a space, quote, '=', '(', ',', ':' or '[' (not a relative
# path's '<package>/data/', nor a URL's or '~/...'s second part).
MACHINE_PATH = re.compile(r"(?:^|(?<=[\s\"'`=(,:\[]))/(?:" + "|".join(MACHINE_ROOTS) + r")/[\w.$-]", re.M)
# Kept as written: the dated logs, llama.cpp's own chat templates (registry data), this file.
EXEMPT_PREFIXES = ("docs/perf-journal/", "tests/fixtures/templates/", "tests/test_repository.py")


def tracked_text_files():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        if not name or name.startswith(EXEMPT_PREFIXES):
            continue
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue                    # binary fixtures, or a file deleted in the work tree
        yield name, text


def test_no_tracked_file_names_a_machine_folder():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist): no list of tracked files")
    found = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for name, text in tracked_text_files() for m in MACHINE_PATH.finditer(text)]
    assert not found, "machine-specific folders named in tracked files:\n" + "\n".join(found)


@pytest.mark.parametrize("text, named", [
    ("path = '/work/models/x.gguf'", True),
    ("see /home/alice/llambda", True),
    ("PIP_FIND_LINKS=/opt/wheels", True),
    ("python tools/make_gguf.py -o /tmp/t.gguf", False),
    ("/usr/bin/python3 -m venv", False),
    ("https://example.org/work/x", False),
    ("~/work/notes", False),
    ("<package>/data/fake.gguf", False),
])
def test_the_pattern_tells_machine_folders_from_system_ones(text, named):
    assert bool(MACHINE_PATH.search(text)) == named


def test_the_layer_picture_names_the_modules_that_exist():
    """docs/architecture.md draws llambda/'s subpackages and their modules: every module it
    names exists, and every subpackage is drawn (a move that forgets the picture fails here)."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    picture = text.split("## The layers", 1)[1].split("```")[1]
    drawn, package = {}, None
    for line in picture.splitlines():
        branch = re.match(r"\s*[├└]── (\w+)(/?)\s", line)
        if branch:
            package = branch.group(1) if branch.group(2) else ""
        elif not re.match(r"\s*│\s", line):
            package = None
        if package is not None:
            names = re.findall(r"\b(\w+\.py)\b", line)
            drawn.setdefault(package, set()).update(names)
    llambda_dir = REPO / "llambda"
    missing = [f"llambda/{p + '/' if p else ''}{n}" for p, names in drawn.items() for n in names
               if not (llambda_dir / p / n).is_file()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    packages = {d.name for d in llambda_dir.iterdir() if (d / "__init__.py").is_file()}
    assert packages <= set(drawn), f"subpackages missing from the picture: {sorted(packages - set(drawn))}"
