"""README's two set-up commands exist, CI runs exactly the commands README and the manual show, every command and
link they show resolves, and their snippets run as written.

The front page is README.md; the manual is docs/*.md (built by mkdocs, whose --strict build checks the links between
its pages); the benchmark figures are benchmarks/README.md. Every ```bash block of those pages is checked here."""

import contextlib
import io
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib

import pytest

import kvcanary_jax as kc

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO_COMMAND = 'pip install -e ".[test]" && python -m kvcanary_jax demo'
TEST_COMMAND = 'pip install -e ".[test]" && pytest'
SGLANG_TEST_COMMAND = 'pip install -e ".[test,sglang-jax]" && pytest'
DOCS_COMMAND = 'pip install -e ".[docs]" && mkdocs build --strict'
README = "README.md"
PAGES = [README, *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "benchmarks/README.md"]


def _text(page: str) -> str:
    return (ROOT / page).read_text()


def _commands(page: str) -> list[str]:
    """Every command of a page's bash code blocks, one a line (a line ending in ``\\`` joined with the next)."""
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", _text(page), flags=re.S)
    joined = [re.sub(r"\\\n\s*", " ", block) for block in blocks]
    return [line.strip() for block in joined for line in block.splitlines() if line.strip()]


def _readme_commands() -> list[str]:
    return _commands(README)


def test_the_pages_exist_and_show_commands():
    assert len(PAGES) > 3 and all((ROOT / page).is_file() for page in PAGES), PAGES
    assert sum(len(_commands(page)) + len(_inline_commands(page)) for page in PAGES) > 20, "is the check reading them?"


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


def test_ci_runs_the_readme_sglang_jax_command():
    script = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^SGLANG_TEST_COMMAND='([^']*)'$", script, flags=re.M)
    assert match, "SGLANG_TEST_COMMAND='...' not found in .ci/run"
    assert match.group(1) == SGLANG_TEST_COMMAND
    assert SGLANG_TEST_COMMAND in _readme_commands()
    assert SGLANG_TEST_COMMAND in _commands("docs/sglang-jax.md")
    assert 'TEST_COMMAND="${SGLANG_TEST_COMMAND}"' in script, ".ci/run must run SGLANG_TEST_COMMAND in a leg"


def test_ci_builds_the_docs_with_the_command_the_manual_shows():
    script = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^DOCS_COMMAND='([^']*)'$", script, flags=re.M)
    assert match, "DOCS_COMMAND='...' not found in .ci/run"
    assert match.group(1) == DOCS_COMMAND
    assert DOCS_COMMAND in _commands("docs/development.md")
    assert re.search(r'bash -c "\$\{DOCS_COMMAND\} ', script), ".ci/run must execute DOCS_COMMAND"


def _help(argv: list[str]) -> str:
    """``python -m kvcanary_jax ARGV --help``, in this process."""
    from kvcanary_jax.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--")]


def _check_command(command: str, where: str) -> None:
    """One shown command: a known install, a CLI call whose sub-command and options exist, a script that exists."""
    for part in re.split(r"\s*(?:&&|\|)\s*", command):
        words = shlex.split(part, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
            words.pop(0)
        if not words or words[0] in {"pytest", "curl", "grep", "cd", "mkdocs"}:
            continue
        if words[0] == "pip":
            assert command in {DEMO_COMMAND, TEST_COMMAND, SGLANG_TEST_COMMAND, DOCS_COMMAND}, (
                f"{where}: an install command that .ci/run does not run: {command!r}"
            )
            extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            named = re.search(r"\.\[([^\]]*)\]", part).group(1).split(",")
            assert set(named) <= set(extras), f"{where}: extras {named} not all in pyproject's {sorted(extras)}"
            continue
        assert words[0] in {"python", "python3"}, (
            f"{where}: a command kind tests/test_readme.py does not know: {part!r}"
        )
        args = [w for w in words[1:] if w != "-u"]
        if args[:2] == ["-m", "kvcanary_jax"]:
            sub = args[2]
            subs = re.search(r"\{([^}]*)\}", _help([])).group(1).split(",")
            assert sub in subs, f"{where}: `python -m kvcanary_jax` has no sub-command {sub!r} (it has {subs})"
            if sub == "serve":
                from kvcanary_jax.integrations import sglang_serve_args

                _, unknown = sglang_serve_args.canary_parser().parse_known_args(args[4:])
                wrong = [w for w in unknown if w.startswith("--canary")]
                assert not wrong, f"{where}: `serve sglang-jax` has no options {wrong}"
            else:
                help_text = _help([sub])
                missing = [f for f in _flags(args[3:]) if f not in help_text]
                assert not missing, f"{where}: `python -m kvcanary_jax {sub}` has no options {missing}"
            continue
        script = ROOT / args[0]
        assert args[0].startswith("benchmarks/") and script.is_file(), f"{where}: no such script: {args[0]}"
        source = script.read_text()
        missing = [f for f in _flags(args[1:]) if f'"{f}"' not in source and f"'{f}'" not in source]
        assert not missing, f"{where}: {args[0]} defines no options {missing}"


def _inline_commands(page: str) -> list[str]:
    """The page's inline code that is a whole command: ``python -m kvcanary_jax ...`` or a benchmark script's run."""
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]
    return [s for s in spans if re.match(r"([A-Z_]+=\S* )*python3? (-u )?(-m kvcanary_jax|benchmarks/)", s)]


@pytest.mark.parametrize("page", PAGES)
def test_every_command_a_page_shows_exists(page):
    commands = _commands(page) + _inline_commands(page)
    for command in commands:
        _check_command(command, page)


def test_the_serve_command_is_the_same_on_the_front_page_and_in_the_manual():
    def serve_block(page):
        return [
            c for c in _commands(page) if c.startswith(("python -m kvcanary_jax serve", "python -m kvcanary_jax tiny"))
        ]

    readme = serve_block(README)
    assert readme, "README's ## Serve sglang-jax shows no serve command"
    # the manual opens with the front page's commands, then serves each model family (docs/serve.md#model-families)
    manual = serve_block("docs/serve.md")
    assert manual[: len(readme)] == readme, "docs/serve.md does not open with README's serve commands"
    assert len(manual) > len(readme) and all("--arch" in c or "serve" in c for c in manual[len(readme) :]), manual


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs and GitHub give a heading, for the headings used here)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text))


def _headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of each heading outside code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.*)", line)):
            found.append((len(m.group(1)), m.group(2)))
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_link_a_page_shows_resolves(page):
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / page).parent / path if path else ROOT / page
        assert file.exists(), f"{page}: link to a missing file: {target}"
        if anchor:
            slugs = {_slug(title) for _, title in _headings(file.read_text())}
            assert anchor in slugs, f"{page}: link to a missing heading: {target} (headings: {sorted(slugs)})"


def _section(page: str, heading: str) -> str:
    """The text under a page's heading (``## Title``), up to the next heading of its level or above."""
    level, lines, out = heading.index(" "), _text(page).splitlines(keepends=True), None
    fenced = False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#{1,6}) ", line)
        if out is None:
            out = [] if line.rstrip("\n") == heading else None
        elif m and len(m.group(1)) <= level:
            break
        else:
            out.append(line)
    assert out is not None, f"no heading {heading!r} in {page}"
    return "".join(out)


def _python_block(page: str, heading: str) -> str:
    """The first python code block under a page's heading."""
    blocks = re.findall(r"```python\n(.*?)```", _section(page, heading), flags=re.S)
    assert blocks, f"no python block under {heading!r} in {page}"
    return blocks[0]


def _run(code: str, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"docs ({name})", "exec"), {"__name__": f"readme_{name}"})
    return out.getvalue()


WRAP = ("docs/wrap.md", "## Wrapping a decode step")


def test_the_wrap_snippet_runs_as_written_and_is_clean():
    assert _run(_python_block(*WRAP), "wrap").strip().endswith("0 violations")


def test_the_readme_wrap_excerpt_is_the_manuals_runnable_snippet():
    """README shows the core of docs/wrap.md's snippet: each of its code lines is one of the snippet's, in order (its
    comment-only lines excepted), so the front page cannot drift from the example a test runs."""
    excerpt = _python_block(README, "## Wrapping a decode step").splitlines()
    full = iter(_python_block(*WRAP).splitlines())
    for line in excerpt:
        if line.strip() and not line.lstrip().startswith("#"):
            assert any(line == other for other in full), (
                f"README's wrap line is not in docs/wrap.md's, in order: {line}"
            )


def test_the_wrap_snippet_catches_a_corrupted_slot():
    """The same snippet with one KV byte flipped after step 20: the monitor raises, naming the slot and request."""
    code = _python_block(*WRAP)
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
    page says so, with the defaults the code has."""
    page = _text(WRAP[0])
    c = kc.CanaryConfig()
    assert f"`check_lag_steps` steps later ({c.check_lag_steps} by default)" in page
    assert f"`health_check_every_n_steps` steps ({c.health_check_every_n_steps} by default)" in page
    assert f'**The default is `"{c.real_kv_hash_mode.name.lower()}"`**' in page


def test_the_core_ops_snippet_runs_as_written():
    _run(_python_block("docs/ops.md", "## The core ops in one screen"), "core_ops")


SGLANG = ("docs/sglang-jax.md", "# Wrap sglang-jax")


def test_the_sglang_jax_snippet_is_at_most_ten_lines():
    code = _python_block(*SGLANG)
    lines = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) <= 10, lines


@pytest.mark.usefixtures("xla_optimised")  # the engine runs many steps
def test_the_sglang_jax_snippet_runs_on_the_engine_and_is_clean():
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")
    namespace = {"__name__": "readme_sglang_jax"}
    exec(compile(_python_block(*SGLANG), "docs/sglang-jax.md", "exec"), namespace)
    guard = namespace["guard"]
    assert guard.steps >= 50 and guard.monitor.observed == []
    assert guard.final_check().write_index == 0


def test_the_readme_serve_block_runs_as_written_then_ctrl_c_prints_the_summary(tmp_path):
    """README's serve block, command by command, as a user types it on a small CPU machine: the tiny model, the
    server (its own process group, as in a terminal), the two curl commands; then a Ctrl-C. Only the port (and
    ``/tmp/tiny``) are replaced, so that runs beside this one do not collide."""
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port, model = str(s.getsockname()[1]), str(tmp_path / "tiny")
    lines = [c.replace("30000", port).replace("/tmp/tiny", model) for c in _commands(README)
             if c.startswith(("python -m kvcanary_jax tiny-model", "python -m kvcanary_jax serve", "curl"))]  # fmt: skip
    (tiny, serve), curls = lines[:2], lines[2:]
    assert "serve sglang-jax" in serve and len(curls) == 2, lines
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    python = lambda c: c.replace("python ", f"{sys.executable} ", 1)  # noqa: E731  (the test's interpreter)
    subprocess.run(python(tiny), shell=True, check=True, env=env, cwd=tmp_path)
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(python(serve), shell=True, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while subprocess.run(f"curl -sf localhost:{port}/health", shell=True).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(2)
        answer = subprocess.run(curls[0], shell=True, capture_output=True, text=True, check=True).stdout
        assert '"choices"' in answer and '"finish_reason"' in answer, answer
        metrics = subprocess.run(curls[1], shell=True, capture_output=True, text=True, check=True).stdout
        assert re.search(r"^kvcanary_violations_total 0\.0$", metrics, flags=re.M), metrics
        assert re.search(r"^kvcanary_protected_tokens_total [1-9]", metrics, flags=re.M), metrics
    finally:
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert re.search(r"kvcanary summary: violations=0 incidents=0 .* compiles_while_serving=0", text), text[-3000:]
