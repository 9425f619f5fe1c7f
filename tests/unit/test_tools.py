"""Tool calls (rollout/tools/): the `<tool_call>` parser, the registry's error observations, and the sandboxed
Python tool run for real (child processes with rlimits in their own network namespace, killed and cleaned)."""

from __future__ import annotations

import asyncio
import os
import random
import re
import resource
import signal
import time
from collections.abc import Mapping
from pathlib import Path

import psutil
import pytest
import uvloop

from rollout.tools import python_tool
from rollout.tools.calls import CallError, ToolCall, parse_calls, render_response
from rollout.tools.python_tool import PythonTool, SandboxLimits
from rollout.tools.registry import Param, ToolRegistry, ToolResult, ToolSetupError

# ---------------------------------------------------------------------------------------------- the parser


def test_calls_come_in_order_with_their_arguments_and_spans():
    text = (
        'Let me compute.<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call> and '
        '<tool_call>\n{"name": "calc", "arguments": {"x": 2, "nested": {"a": [1]}}}\n</tool_call> done'
    )
    first, second = parse_calls(text)
    assert first == ToolCall("python", {"code": "print(1)"}, first.start, first.end)
    assert second == ToolCall("calc", {"x": 2, "nested": {"a": [1]}}, second.start, second.end)
    assert text[first.start : first.end].startswith("<tool_call>") and text[first.start : first.end].endswith(
        "</tool_call>"
    )
    assert first.end < second.start


def test_a_turn_without_tags_has_no_calls_and_absent_arguments_are_empty():
    assert parse_calls('The answer is 4. {"name": "python"}') == []
    (call,) = parse_calls('<tool_call>{"name": "now"}</tool_call>')
    assert isinstance(call, ToolCall) and call.arguments == {}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "python", "arguments": {"code": 1}', "not valid JSON"),
        ("print(1)", "not valid JSON"),
        ('["python"]', "must be a JSON object .* got an array"),
        ('{"arguments": {}}', "needs a non-empty string 'name', got no name"),
        ('{"name": 7}', "needs a non-empty string 'name', got name a number"),
        ('{"name": "  "}', "needs a non-empty string 'name'"),
        (
            '{"name": "python", "arguments": "print(1)"}',
            "'arguments' of tool call 'python' must be a JSON object, got a string",
        ),
        ('{"name": "python", "args": {}}', "unknown keys 'args'"),
    ],
)
def test_a_malformed_call_is_an_error_in_its_place_naming_the_fault(body, message):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok"}}</tool_call>'
    bad, good = parse_calls(text)
    assert isinstance(bad, CallError)
    assert bad.start == 0 and bad.text == body
    assert re.search(message, bad.message), bad.message
    assert good == ToolCall("ok", {}, good.start, good.end)


def test_unclosed_and_unopened_tags_are_errors_naming_where_they_are():
    calls = parse_calls(
        'x </tool_call> <tool_call>{"name": "a"} <tool_call>{"name": "b"}</tool_call> <tool_call>{"name"'
    )
    assert [type(c) for c in calls] == [CallError, CallError, ToolCall, CallError]
    stray, unclosed, good, never = calls
    assert isinstance(stray, CallError) and "closes no <tool_call>" in stray.message and "character 2" in stray.message
    assert isinstance(unclosed, CallError) and "not closed before the next <tool_call>" in unclosed.message
    assert good == ToolCall("b", {}, good.start, good.end)
    assert isinstance(never, CallError) and "never closed" in never.message and never.text.endswith('{"name"')


def test_a_closing_tag_inside_a_string_is_written_with_json_s_escaped_slash():
    (call,) = parse_calls('<tool_call>{"name": "echo", "arguments": {"s": "<\\/tool_call>"}}</tool_call>')
    assert isinstance(call, ToolCall) and call.arguments == {"s": "</tool_call>"}


def test_the_parser_never_raises_whatever_the_text():
    rng = random.Random(37)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"x"', "[", "]", "1e999", "\\", "\ud800", "\x00"]
    pieces += ["[" * 5000, '{"name": "a", "arguments": {"b": ' + "[" * 100000 + "]" * 100000 + "}}"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for call in parse_calls(text):
            assert isinstance(call, (ToolCall, CallError))


def test_a_result_is_rendered_inside_tool_response_tags():
    assert (
        render_response("exit status 0\nstdout:\n4") == "<tool_response>\nexit status 0\nstdout:\n4\n</tool_response>"
    )


# -------------------------------------------------------------------------------------------- the registry


class Adder:
    name = "add"
    description = "Add two integers."
    parameters = (Param("a", "integer", "first"), Param("b", "integer", "second"), Param("note", "string", "", False))

    async def call(self, arguments: Mapping[str, object]) -> ToolResult:
        a, b = arguments["a"], arguments["b"]
        assert isinstance(a, int) and isinstance(b, int)
        return ToolResult(self.name, str(a + b), is_error=False)


class Broken:
    name = "broken"
    description = "Always fails."
    parameters: tuple[Param, ...] = ()

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def call(self, arguments: Mapping[str, object]) -> ToolResult:
        raise self.exc


def _one(text: str) -> ToolCall | CallError:
    (call,) = parse_calls(text)
    return call


async def test_a_known_tool_with_fitting_arguments_runs():
    registry = ToolRegistry([Adder()])
    result = await registry.call(_one('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'))
    assert result == ToolResult("add", "42", is_error=False)


async def test_an_unknown_tool_is_an_observation_listing_the_tools():
    registry = ToolRegistry([Adder(), Broken(RuntimeError())])
    result = await registry.call(_one('<tool_call>{"name": "x"}</tool_call>'))
    assert result.is_error and result.text == "error: unknown tool 'x'; tools: add, broken"


async def test_missing_unexpected_and_wrongly_typed_arguments_are_each_named():
    registry = ToolRegistry([Adder()])
    call = _one('<tool_call>{"name": "add", "arguments": {"a": true, "c": 1, "note": 5}}</tool_call>')
    result = await registry.call(call)
    assert result.is_error
    assert result.text == (
        "error: tool 'add': missing argument 'b' (integer); argument 'a' must be integer, got boolean; "
        "unexpected argument 'c' (parameters: a, b, note); argument 'note' must be string, got integer"
    )


async def test_a_parse_error_is_an_observation():
    result = await ToolRegistry([Adder()]).call(_one("<tool_call>{nope}</tool_call>"))
    assert result.is_error and result.text.startswith("error: tool call is not valid JSON (")


async def test_a_failing_tool_is_an_observation_but_a_setup_error_stops_the_caller(caplog):
    registry = ToolRegistry([Broken(KeyError("k"))])
    result = await registry.call(ToolCall("broken"))
    assert result.is_error and result.text == "error: tool 'broken' failed: KeyError: 'k'"
    assert "tool 'broken' failed" in caplog.text
    with pytest.raises(ToolSetupError, match="no sandbox"):
        await ToolRegistry([Broken(ToolSetupError("no sandbox"))]).call(ToolCall("broken"))


def test_tools_need_unique_names_and_are_listed_as_function_schemas(tmp_path):
    registry = ToolRegistry([Adder(), PythonTool(tmp_path)])
    with pytest.raises(ValueError, match="'add' is registered twice"):
        registry.add(Adder())
    with pytest.raises(TypeError, match="is not a tool"):
        registry.add(object())  # type: ignore[arg-type]
    add, python = registry.schemas()
    assert add == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "first"},
                    "b": {"type": "integer", "description": "second"},
                    "note": {"type": "string", "description": ""},
                },
                "required": ["a", "b"],
            },
        },
    }
    assert python["function"]["parameters"]["required"] == ["code"]  # type: ignore[index]


# ------------------------------------------------------------------------------------- the python tool


def _tool(tmp_path: Path, **limits) -> PythonTool:
    return PythonTool(tmp_path / "run", SandboxLimits(**limits))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _gone(pid: int, within_s: float = 3.0) -> bool:
    """Whether `pid` is gone (or a zombie waiting for init), waiting a little for init to reap it."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


async def test_code_runs_and_its_output_is_the_observation(tmp_path):
    registry = ToolRegistry([_tool(tmp_path)])
    call = _one('<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10**6)))"}}</tool_call>')
    result = await registry.call(call)
    assert (result.exit_code, result.stdout, result.stderr, result.limit, result.is_error) == (
        0,
        "499999500000\n",
        "",
        None,
        False,
    )
    assert result.text == "exit status 0\nstdout:\n499999500000\n"


async def test_an_exception_in_the_code_is_an_observation_with_its_traceback(tmp_path):
    result = await _tool(tmp_path).run("def f():\n    return 1 / 0\nf()")
    assert result.is_error and result.exit_code == 1 and result.limit is None
    assert 'File "<tool>", line 2, in f' in result.stderr and result.stderr.endswith(
        "ZeroDivisionError: division by zero\n"
    )


async def test_an_endless_loop_is_stopped_by_the_cpu_limit_within_it(tmp_path):
    tool = _tool(tmp_path, cpu_s=1, wall_s=60)
    cpu_before = _children_cpu_s()
    result = await tool.run("while True:\n    pass")
    cpu_used = _children_cpu_s() - cpu_before
    print(f"cpu loop: stopped after {result.wall_s:.2f}s wall, {cpu_used:.2f}s CPU")
    assert result.limit == "cpu time limit 1s exceeded" and result.exit_code == -signal.SIGXCPU
    assert result.text.startswith("error: cpu time limit 1s exceeded\nkilled by SIGXCPU")
    # SIGXCPU says the kernel stopped it at 1s of its own clock. rusage reads less on a loaded VM (0.74-0.98s
    # seen), so only the upper bound is tight; the lower one shows it ran for a while rather than died at start.
    assert 0.5 <= cpu_used <= 1.5
    assert result.wall_s is not None and result.wall_s < 60


async def test_allocating_past_the_memory_limit_is_stopped_and_said(tmp_path):
    # Bounded at 640 MB so that a sandbox without its memory limit fails this test instead of the machine.
    code = "x = []\nfor _ in range(64):\n    x.append(bytearray(10**7))\nprint('allocated', len(x))"
    result = await _tool(tmp_path, memory_bytes=256 << 20, wall_s=60).run(code)
    print(f"memory: stopped after {result.wall_s:.2f}s wall")
    assert result.limit == "memory limit 256 MiB exceeded" and result.exit_code == 1
    assert "allocated" not in result.stdout and result.stderr.endswith("MemoryError\n")
    assert result.text.startswith("error: memory limit 256 MiB exceeded\nexit status 1\nstderr:\nTraceback")


async def test_a_sleeper_is_killed_at_the_wall_limit_with_its_whole_process_group(tmp_path):
    code = (
        "import os, subprocess, sys, time\n"
        "helper = subprocess.Popen(['sleep', '100'])\n"
        "print(os.getpid(), helper.pid, flush=True)\n"
        "time.sleep(100)"
    )
    result = await _tool(tmp_path, wall_s=1.5).run(code)
    assert result.limit == "wall time 1.5s exceeded, killed" and result.exit_code == -signal.SIGKILL
    assert result.wall_s is not None and 1.5 <= result.wall_s < 6
    leader, helper = map(int, result.stdout.split())
    assert _gone(leader) and _gone(helper)
    survivors = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == leader and proc.status() != psutil.STATUS_ZOMBIE:
                survivors.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    assert not survivors


async def test_a_process_that_leaves_the_group_is_killed_too(tmp_path):
    code = (
        "import subprocess\n"
        "print(subprocess.Popen(['sleep', '100'], start_new_session=True).pid)"  # then exits at once
    )
    result = await _tool(tmp_path, wall_s=10).run(code)
    assert result.exit_code == 0 and result.limit is None
    assert _gone(int(result.stdout)), "the setsid'd sleep outlived the call"


async def test_a_cancelled_call_kills_its_child_and_removes_its_scratch(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(100)"
    task = asyncio.create_task(_tool(tmp_path, wall_s=60).run(code))
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.05)
    pid = int(pid_file.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _gone(pid)
    assert list((tmp_path / "run" / "tools" / "python").iterdir()) == []


async def test_the_network_is_unreachable_inside_and_a_connection_fails_fast(tmp_path):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): documentation only, never routed anywhere.
    code = (
        "import socket\n"
        "print(socket.if_nameindex())\n"
        "s = socket.socket()\n"
        "s.settimeout(20)\n"
        "s.connect(('192.0.2.1', 80))\n"
        "print('connected')"
    )
    result = await _tool(tmp_path, wall_s=30).run(code)
    print(f"network: failed after {result.wall_s:.2f}s")
    assert result.stdout == "[(1, 'lo')]\n"
    assert result.exit_code == 1 and result.stderr.endswith("OSError: [Errno 101] Network is unreachable\n")
    assert result.limit == "network access attempted; the tool has no network" and result.is_error
    assert result.wall_s is not None and result.wall_s < 5


async def test_files_go_to_a_scratch_dir_under_the_run_dir_that_is_removed_after(tmp_path):
    code = "import os\nopen('out.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(os.listdir('.'))"
    result = await _tool(tmp_path).run(code)
    cwd, listing = result.stdout.splitlines()
    assert Path(cwd).parent == tmp_path / "run" / "tools" / "python" and listing == "['out.txt']"
    assert not Path(cwd).exists()
    assert list((tmp_path / "run" / "tools" / "python").iterdir()) == []


async def test_writing_a_file_past_the_size_limit_is_stopped_and_said(tmp_path):
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (2 << 20))"
    result = await _tool(tmp_path, file_bytes=1 << 20).run(code)
    assert result.limit == "file size limit 1048576 bytes exceeded" and "File too large" in result.stderr


async def test_the_environment_carries_no_slipstream_variable_or_token(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_EXP", "secret-run")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    result = await _tool(tmp_path).run("import os\nprint(sorted(os.environ))")
    names = eval(result.stdout)  # noqa: S307 - a printed list of strings from our own child
    assert names == ["HOME", "LC_ALL", "PATH", "TMPDIR"]


async def test_output_is_cut_to_the_byte_budget_and_says_how_much_was_cut(tmp_path):
    result = await _tool(tmp_path, output_bytes=1000).run("print('a' * 100000)")
    assert result.stdout == "a" * 1000 + "\n[... 99001 more bytes cut]"
    assert result.exit_code == 0


async def test_code_over_its_size_limit_is_refused_as_an_observation(tmp_path):
    result = await _tool(tmp_path, code_bytes=100).run("x = 1\n" * 50)
    assert result.is_error and result.text == "error: code is 300 bytes; the limit is 100"
    assert not (tmp_path / "run" / "tools").exists()


@pytest.mark.skipif(
    not os.path.exists("/usr/bin/python3") or os.geteuid() != 0, reason="needs root and /usr/bin/python3"
)
async def test_as_another_user_the_code_cannot_read_the_run_s_files(tmp_path):
    secret = tmp_path / "run" / "secrets.json"
    secret.parent.mkdir(parents=True)
    secret.write_text("{}")
    secret.chmod(0o600)
    tool = PythonTool(tmp_path / "run", python="/usr/bin/python3", user="nobody")
    code = f"import os\nprint(os.getuid())\nopen('mine', 'w').write('ok')\nopen({str(secret)!r}).read()"
    result = await tool.run(code)
    assert result.stdout == "65534\n" and "PermissionError" in result.stderr


async def test_without_a_network_namespace_the_tool_refuses_and_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setattr(python_tool, "_netns_checked", False)
    monkeypatch.setattr(python_tool, "_netns_error", None)  # restored afterwards, like the flag
    monkeypatch.setattr(python_tool, "_PROBE", "import sys; sys.exit('Operation not permitted')")
    with pytest.raises(
        ToolSetupError, match=r"unshare\(CLONE_NEWNET\) failed: Operation not permitted\. Run the role as root"
    ):
        await _tool(tmp_path).run("print(1)")
    assert not (tmp_path / "run").exists()


def test_bad_limits_and_modes_are_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="cpu_s = 0: give whole CPU seconds"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="cpu_s = 1.5: give whole CPU seconds"):
        SandboxLimits(cpu_s=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_bytes = 1024: give bytes, at least 64 MiB"):
        SandboxLimits(memory_bytes=1024)
    with pytest.raises(ValueError, match="network = 'host': the only mode is 'none'"):
        PythonTool(tmp_path, network="host")
    with pytest.raises(ValueError, match="user = 'no-such-user-37': no such account"):
        PythonTool(tmp_path, user="no-such-user-37")


async def test_concurrent_calls_each_get_their_own_sandbox_and_cleaning_one_spares_the_others(tmp_path):
    tool = _tool(tmp_path, wall_s=20)
    slow = "import os, time\ntime.sleep(1.0)\nprint('slow', os.getpid())"
    quick = "import subprocess\nsubprocess.Popen(['sleep', '100'], start_new_session=True)\nprint('quick')"
    results = await asyncio.gather(tool.run(slow), *(tool.run(quick) for _ in range(3)))
    assert [r.exit_code for r in results] == [0, 0, 0, 0]
    assert results[0].stdout.startswith("slow ") and all(r.stdout == "quick\n" for r in results[1:])
    assert list((tmp_path / "run" / "tools" / "python").iterdir()) == []


async def test_the_code_reads_an_empty_stdin(tmp_path):
    result = await _tool(tmp_path).run("import sys\nprint(repr(sys.stdin.read()))")
    assert (result.exit_code, result.stdout) == (0, "''\n")


async def test_code_with_a_lone_surrogate_is_refused_as_an_observation(tmp_path):
    (call,) = parse_calls('<tool_call>{"name": "python", "arguments": {"code": "print(1) # \\ud800"}}</tool_call>')
    result = await ToolRegistry([_tool(tmp_path)]).call(call)
    assert result.is_error and result.text.startswith("error: code is not valid Unicode at character 11 (surrogates")


async def test_calls_leave_no_descriptor_open_in_the_caller(tmp_path):
    tool = _tool(tmp_path, wall_s=1)
    await tool.run("print(1)")  # the first call starts what lives on (the child watcher, the loop's pipes)
    before = len(os.listdir("/proc/self/fd"))
    for code in ("print(1)", "import time\ntime.sleep(5)", "1/0", "x = ' ' * 10**9"):
        await tool.run(code)
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_tool_works_in_uvloop_the_loop_the_generation_controller_runs(tmp_path):
    code = "import subprocess\nprint(subprocess.Popen(['sleep', '100'], start_new_session=True).pid)"

    async def calls() -> tuple[ToolResult, ToolResult]:
        tool = _tool(tmp_path, wall_s=1)
        return await tool.run(code), await tool.run("import time\ntime.sleep(100)")

    left_behind, sleeper = uvloop.run(calls())
    assert left_behind.exit_code == 0 and _gone(int(left_behind.stdout))
    assert sleeper.limit == "wall time 1s exceeded, killed"
