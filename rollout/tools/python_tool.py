"""The `python` tool: a model's code run in a fresh, limited, offline child process.

Each call starts `python -I -S -B` (isolated: no user site, no site-packages, no PYTHON* variables; the
standard library only) in a new session, with rlimits set in the child before exec: CPU seconds (SIGXCPU at
the limit, SIGKILL a second later), address space, open files, file size and, when asked, processes. The
child gets a new network namespace with no interface up (not even loopback), so any connection fails at
once; if this machine cannot make one (it takes root or CAP_SYS_ADMIN) the tool refuses with
`ToolSetupError` rather than run code with network. Its environment is built from nothing (no SLIPSTREAM_*,
no tokens); its working directory is a scratch directory made under `<run dir>/tools/python/` for the call and
removed after it. After the wall-clock limit its process group is killed; whatever it left behind (even a
process that left the group) is found by its network namespace and killed too. Output is captured up to a
byte budget per stream. Every outcome, a limit hit included, is a `ToolResult`: only a broken setup raises.

Left out: a filesystem jail. The child runs as the parent's user unless `user` names another (as root, an
account that can read `python`: e.g. nobody with /usr/bin/python3), so as root it can read and write what
root can and could leave the namespace; `user` is what makes the sandbox hold against hostile code.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import pwd
import resource
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollout.tools.registry import Param, ToolResult, ToolSetupError

_CLONE_NEWNET = 0x40000000
_MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)

# Waits for the parent's go byte on stdin (then stdin is /dev/null), runs the model's code as __main__ and
# reports, on the status pipe whose fd is argv[1], the limits that surface as Python exceptions (address
# space: MemoryError; file size: EFBIG, since Python ignores SIGXFSZ; the network it does not have: an unreachable
# network or a name that cannot be resolved).
_RUNNER = r"""
import errno, os, sys, traceback
if sys.stdin.buffer.read(1) != b"g":  # the go byte: the parent holds our namespace and pid before code runs
    os._exit(0)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
status, code = int(sys.argv[1]), sys.argv[2]
NETWORK = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN)
sys.argv = ["<tool>"]
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(code, "<tool>", "exec"), namespace)
except SystemExit:
    raise
except BaseException as exc:
    if isinstance(exc, MemoryError):
        os.write(status, b"memory")
    elif isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        os.write(status, b"fsize")
    elif isinstance(exc, OSError) and (exc.errno in NETWORK or type(exc).__name__ == "gaierror"):
        os.write(status, b"network")
    namespace.clear()  # frees what the code held, so the report below has memory to run in
    tb = exc.__traceback__.tb_next
    traceback.clear_frames(tb)
    traceback.print_exception(type(exc), exc, tb)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(1)
"""

_PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) != 0:
    sys.exit(os.strerror(ctypes.get_errno()))
"""

_netns_error: str | None = None
_netns_checked = False


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. `cpu_s` is CPU seconds (whole), `wall_s` the wall-clock limit after which the
    process group is killed, `memory_bytes` the address space, `file_bytes` the largest file it may write,
    `open_files` its descriptors, `processes` RLIMIT_NPROC (counted per user across the machine, so set it
    only with `user`; root ignores it), `output_bytes` what is kept of stdout and of stderr each, and
    `code_bytes` the longest code accepted."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_bytes: int = 256 * _MIB
    file_bytes: int = 16 * _MIB
    open_files: int = 64
    processes: int | None = None
    output_bytes: int = 8192
    code_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        checks = (
            ("cpu_s", self.cpu_s, 1, "whole CPU seconds, at least 1"),
            ("wall_s", self.wall_s, 0.1, "seconds, at least 0.1"),
            ("memory_bytes", self.memory_bytes, 64 * _MIB, "bytes, at least 64 MiB (the interpreter needs it)"),
            ("file_bytes", self.file_bytes, 0, "bytes, at least 0"),
            ("open_files", self.open_files, 16, "descriptors, at least 16"),
            ("output_bytes", self.output_bytes, 1, "bytes, at least 1"),
            ("code_bytes", self.code_bytes, 1, "bytes, at least 1 (argv caps it near 128 KiB)"),
        )
        for name, value, least, unit in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
                raise ValueError(f"python tool limit {name} = {value!r}: give {unit}")
        if not isinstance(self.cpu_s, int):
            raise ValueError(f"python tool limit cpu_s = {self.cpu_s!r}: give whole CPU seconds (RLIMIT_CPU)")
        if self.code_bytes > 120 * 1024:
            raise ValueError(f"python tool limit code_bytes = {self.code_bytes}: at most 122880 (one argv string)")
        if self.processes is not None and self.processes < 1:
            raise ValueError(f"python tool limit processes = {self.processes!r}: give at least 1, or None")


@dataclass
class PythonTool:
    """The sandboxed Python tool of one run: scratch directories under `run_dir`/tools/python/."""

    run_dir: Path
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    network: str = "none"
    python: str = sys.executable
    user: str | None = None

    name = "python"
    description = (
        "Run Python 3 code (standard library only, no network, limited CPU time and memory) and see what it "
        "prints; print the values you need."
    )
    parameters: Sequence[Param] = (Param("code", "string", "Python source to run as a script"),)

    def __post_init__(self) -> None:
        if self.network != "none":
            raise ValueError(f"python tool network = {self.network!r}: the only mode is 'none' (no network)")
        self.run_dir = Path(self.run_dir)
        self._ids: tuple[int, int] | None = None
        if self.user is not None:
            if os.geteuid() != 0:
                raise ValueError(f"python tool user = {self.user!r}: switching user needs root; leave user unset")
            try:
                entry = pwd.getpwnam(self.user)
            except KeyError:
                raise ValueError(
                    f"python tool user = {self.user!r}: no such account; name one in /etc/passwd"
                ) from None
            self._ids = (entry.pw_uid, entry.pw_gid)

    async def call(self, arguments: Mapping[str, object]) -> ToolResult:
        code = arguments["code"]
        assert isinstance(code, str), "the registry checks argument types"
        return await self.run(code)

    async def run(self, code: str) -> ToolResult:
        """Run `code`; the result says what it printed, how it exited and which limit, if any, stopped it."""
        await _check_network_namespace()
        try:
            size = len(code.encode("utf-8"))
        except UnicodeEncodeError as exc:  # a lone surrogate, which JSON's \u escapes can carry
            return self._refuse(f"code is not valid Unicode at character {exc.start} ({exc.reason}); remove it")
        if size > self.limits.code_bytes:
            return self._refuse(f"code is {size} bytes; the limit is {self.limits.code_bytes}")
        if "\0" in code:
            return self._refuse("code contains a NUL character; remove it")
        parent = self.run_dir / "tools" / "python"
        parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="call-", dir=parent))
        try:
            if self._ids is not None:
                os.chown(scratch, *self._ids)
            status_r, status_w = os.pipe()
            try:
                return await self._run_in(scratch, code, status_r, status_w)
            finally:
                os.close(status_r)
        finally:
            shutil.rmtree(scratch)

    def _refuse(self, why: str) -> ToolResult:
        return ToolResult(self.name, f"error: {why}", is_error=True)

    async def _run_in(self, scratch: Path, code: str, status_r: int, status_w: int) -> ToolResult:
        """The call in `scratch`; it owns `status_w` (closed once the child has it) but not `status_r`."""
        limits = self.limits
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-I", "-S", "-B", "-c", _RUNNER, str(status_w), code,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=scratch,
                env=_scrubbed_env(scratch),
                start_new_session=True,
                pass_fds=(status_w,),
                preexec_fn=self._child_setup,
            )  # fmt: skip
        except OSError as exc:
            raise ToolSetupError(
                f"python tool: cannot start {self.python!r}: {exc}; set `python` to an interpreter"
            ) from exc
        finally:
            os.close(status_w)
        netns = _hold_namespace(proc.pid)
        # The leader's exit, seen through a pidfd: proc.wait() would also wait for its pipes, which a process
        # it left behind may hold open.
        try:
            leader: int | None = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            leader = None
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write(b"g")
        proc.stdin.close()
        readers = asyncio.gather(
            _read_capped(proc.stdout, limits.output_bytes), _read_capped(proc.stderr, limits.output_bytes)
        )
        timed_out = False
        try:
            try:
                await asyncio.wait_for(_until_readable(leader), limits.wall_s)
            except TimeoutError:
                timed_out = True
            _kill_everything(proc.pid, netns)
            try:
                (out, out_total), (err, err_total) = await asyncio.wait_for(readers, 5.0)
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                raise ToolSetupError(
                    "python tool: the child's output pipes stayed open after it was killed: a process escaped "
                    "its group and namespace; run the tool with `user` set to an unprivileged account"
                ) from None
        except BaseException:
            _kill_everything(proc.pid, netns)
            readers.cancel()
            raise
        finally:
            for fd in (netns, leader):
                if fd is not None:
                    os.close(fd)
        wall_s = loop.time() - started
        os.set_blocking(status_r, False)
        try:
            status = os.read(status_r, 64)
        except BlockingIOError:
            status = b""
        rc = proc.returncode
        assert rc is not None
        limit = self._limit_hit(rc, status, timed_out)
        stdout, stderr = _text(out, out_total), _text(err, err_total)
        exit_line = f"exit status {rc}" if rc >= 0 else f"killed by {_signal_name(-rc)}"
        lines = [f"error: {limit}"] if limit else []
        lines.append(exit_line)
        lines += [f"stdout:\n{stdout}"] if stdout else []
        lines += [f"stderr:\n{stderr}"] if stderr else []
        if not stdout and not stderr:
            lines.append("(no output)")
        return ToolResult(
            self.name,
            "\n".join(lines),
            is_error=limit is not None or rc != 0,
            exit_code=rc,
            stdout=stdout,
            stderr=stderr,
            limit=limit,
            wall_s=wall_s,
        )

    def _limit_hit(self, rc: int, status: bytes, timed_out: bool) -> str | None:
        limits = self.limits
        if timed_out:
            return f"wall time {limits.wall_s:g}s exceeded, killed"
        if rc == -signal.SIGXCPU:
            return f"cpu time limit {limits.cpu_s}s exceeded"
        if status == b"memory":
            return f"memory limit {limits.memory_bytes / _MIB:g} MiB exceeded"
        if status == b"fsize" or rc == -signal.SIGXFSZ:
            return f"file size limit {limits.file_bytes} bytes exceeded"
        if status == b"network":
            return "network access attempted; the tool has no network"
        return None

    def _child_setup(self) -> None:
        """Runs in the child between fork and exec (after setsid): namespace, limits, then the user."""
        if _libc.unshare(_CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
        limits = self.limits
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limits.processes is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        if self._ids is not None:
            uid, gid = self._ids
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)


async def _check_network_namespace() -> None:
    """Whether this machine lets a child have its own network namespace; checked once, by a real child."""
    global _netns_checked, _netns_error
    if not _netns_checked:
        if not sys.platform.startswith("linux"):
            _netns_error = f"network namespaces are Linux only (this is {sys.platform})"
        else:
            probe = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                "-c",
                _PROBE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(probe.communicate(), 30)
            except TimeoutError:
                probe.kill()
                await probe.wait()
                raise ToolSetupError("python tool: the network namespace probe did not finish in 30 s") from None
            if probe.returncode != 0:
                _netns_error = f"unshare(CLONE_NEWNET) failed: {err.decode(errors='replace').strip()}"
        _netns_checked = True
    if _netns_error is not None:
        raise ToolSetupError(
            f"the python tool runs code only without network and cannot make a network namespace here: "
            f"{_netns_error}. Run the role as root or with CAP_SYS_ADMIN (a container: --cap-add SYS_ADMIN); "
            "`unshare --net true` shows whether it works"
        )


def _scrubbed_env(scratch: Path) -> dict[str, str]:
    """Built from nothing, so no secret of the run (SLIPSTREAM_*, tokens, keys) reaches the child."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LC_ALL": "C.UTF-8"}


def _hold_namespace(pid: int) -> int | None:
    """An fd of the child's network namespace (keeping it, and its inode number, alive until closed); None
    when the child is already gone or, impossibly, shares ours."""
    try:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    except OSError:
        return None
    ours = os.stat("/proc/self/ns/net")
    theirs = os.fstat(fd)
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        os.close(fd)
        return None
    return fd


def _kill_everything(pid: int, netns: int | None) -> None:
    """SIGKILL the child's process group, then every process still in its network namespace (one that left
    the group with setsid), until none is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if netns is None:
        return
    ns = os.fstat(netns)
    for _ in range(20):  # a process may fork while we look
        found = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{entry.name}/ns/net")
                if (st.st_dev, st.st_ino) == (ns.st_dev, ns.st_ino):
                    os.kill(int(entry.name), signal.SIGKILL)
                    found += 1
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        if not found:
            return


async def _until_readable(fd: int | None) -> None:
    """Wait until `fd` (a pidfd: its process exited) is readable; None is an fd that already was."""
    if fd is None:
        return
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _read_capped(stream: asyncio.StreamReader, budget: int) -> tuple[bytes, int]:
    """The first `budget` bytes of a stream and its total length; reads to the end so the writer never blocks."""
    kept = bytearray()
    total = 0
    while chunk := await stream.read(1 << 16):
        total += len(chunk)
        if len(kept) < budget:
            kept += chunk[: budget - len(kept)]
    return bytes(kept), total


def _text(kept: bytes, total: int) -> str:
    text = kept.decode("utf-8", errors="replace")
    return text if total == len(kept) else f"{text}\n[... {total - len(kept)} more bytes cut]"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
