"""The README's commands and CI's entry point must not drift apart."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick)


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    serve, test = commands
    assert "serving.server" in serve
    assert "pytest" in test


def test_ci_runs_the_readme_test_command_unchanged():
    test_command = _readme_commands()[1]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert test_command in ci.splitlines()


def test_no_file_is_much_longer_than_the_limit():
    long_files = []
    for top in ("model", "kernels_pallas", "sharding", "serving"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    if sum(1 for _ in open(path)) > 700:
                        long_files.append(path)
    assert not long_files
