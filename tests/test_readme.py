"""README's two set-up commands exist, and CI runs exactly README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO_COMMAND = 'pip install -e ".[test]" && python -m kvcanary_jax demo'
TEST_COMMAND = 'pip install -e ".[test]" && pytest'


def _readme_commands() -> list[str]:
    """Every line of README's bash code blocks."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", readme, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_has_the_two_setup_commands():
    commands = _readme_commands()
    assert DEMO_COMMAND in commands
    assert TEST_COMMAND in commands


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^TEST_COMMAND='([^']*)'$", script, flags=re.M)
    assert match, "TEST_COMMAND='...' not found in .ci/run"
    assert match.group(1) == TEST_COMMAND
    assert match.group(1) in _readme_commands()
    assert re.search(r'bash -c "\$\{TEST_COMMAND\}"', script), ".ci/run must execute TEST_COMMAND"
