"""README's two set-up commands exist, and CI runs exactly README's test command."""

import contextlib
import io
import pathlib
import re

import pytest

import kvcanary_jax as kc

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


def _python_block(section: str) -> str:
    """The first python code block under README's ``## <section>`` heading."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(f"## {section}\n")
    end = readme.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", readme[start : end if end > 0 else None], flags=re.S)
    assert blocks, f"no python block under '## {section}'"
    return blocks[0]


def _run(code: str, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md ({name})", "exec"), {"__name__": f"readme_{name}"})
    return out.getvalue()


def test_the_wrap_snippet_runs_as_written_and_is_clean():
    assert _run(_python_block("Wrapping a decode step"), "wrap").strip().endswith("0 violations")


def test_the_wrap_snippet_catches_a_corrupted_slot():
    """The same snippet with one KV byte flipped after step 20: the monitor raises, naming the slot and request."""
    code = _python_block("Wrapping a decode step")
    step_line = "    kv, state = step(kv, state, batch)\n"
    assert step_line in code
    corrupt = (
        step_line
        + "    if i == 20:\n        kv[0] = kc.testing.flip_kv_byte(kv[0], jnp.int32(5), page_size=PAGE_SIZE)\n"
    )
    with pytest.raises(kc.KvCanaryViolationError) as caught:
        _run(code.replace(step_line, corrupt), "wrap_corrupted")
    message = str(caught.value)
    assert "launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx=5 position=4" in message
    assert "  request: row=0 (batch entry 0) position expected=4 found=4" in message


def test_the_wrap_section_states_the_report_lag_the_health_period_and_the_real_kv_default():
    """Issue 31: a violation is heard of ``check_lag_steps`` steps late, a stalled launch up to
    ``health_check_every_n_steps`` late, and the default real-KV mode decides what a flipped KV byte does; the wrap
    section says so, with the defaults the code has."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Wrapping a decode step\n")
    section = readme[start : readme.index("\n## ", start + 1)]
    c = kc.CanaryConfig()
    assert f"`check_lag_steps` steps later ({c.check_lag_steps} by default)" in section
    assert f"`health_check_every_n_steps` steps ({c.health_check_every_n_steps} by default)" in section
    assert f'**The default is `"{c.real_kv_hash_mode.name.lower()}"`**' in section


def test_the_core_ops_snippet_runs_as_written():
    _run(_python_block("The core ops in one screen"), "core_ops")


SGLANG_TEST_COMMAND = 'pip install -e ".[test,sglang-jax]" && pytest'


def test_ci_runs_the_readme_sglang_jax_command():
    script = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^SGLANG_TEST_COMMAND='([^']*)'$", script, flags=re.M)
    assert match, "SGLANG_TEST_COMMAND='...' not found in .ci/run"
    assert match.group(1) == SGLANG_TEST_COMMAND
    assert SGLANG_TEST_COMMAND in _readme_commands()
    assert 'TEST_COMMAND="${SGLANG_TEST_COMMAND}"' in script, ".ci/run must run SGLANG_TEST_COMMAND in a leg"


def test_the_sglang_jax_snippet_is_at_most_ten_lines():
    code = _python_block("Wrap sglang-jax")
    lines = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) <= 10, lines


@pytest.mark.usefixtures("xla_optimised")  # the engine runs many steps
def test_the_sglang_jax_snippet_runs_on_the_engine_and_is_clean():
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")
    namespace = {"__name__": "readme_sglang_jax"}
    exec(compile(_python_block("Wrap sglang-jax"), "README.md (sglang-jax)", "exec"), namespace)
    guard = namespace["guard"]
    assert guard.steps >= 50 and guard.monitor.observed == []
    assert guard.final_check().write_index == 0
