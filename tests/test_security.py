"""SECURITY.md's claims that code can check: autopar unpickles only on the native runtime's
local control channel (a Unix socket in a private folder, HMAC-authenticated) and between the
caller and its fork server (an anonymous socketpair), and the job token never appears on a
worker's command line or stays in its environment."""
import ast
import os
import stat
from pathlib import Path

import pytest

import autopar

ROOT = Path(autopar.__file__).resolve().parent


def _sources():
    """The package's .py files, through the symlinked folders (strategies/, runtime/, ...)."""
    for folder, _, names in os.walk(ROOT, followlinks=True):
        for name in sorted(names):
            if name.endswith(".py"):
                yield Path(folder) / name


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            yield (f.value.id + "." + f.attr) if isinstance(f, ast.Attribute) and \
                isinstance(f.value, ast.Name) else getattr(f, "id", getattr(f, "attr", ""))


def test_the_only_unpickling_is_the_control_channel():
    unpickling = {"pickle.loads", "pickle.load", "pickle.Unpickler", "marshal.loads",
                  "shelve.open", "numpy.load", "np.load"}
    found = {}
    for path in _sources():
        hits = unpickling & set(_calls(path))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {"runtime/wire.py": {"pickle.loads"},
                     "runtime/forkserver.py": {"pickle.loads"}}, found
    # the fork server's messages travel over a socketpair: nothing it could be reached by
    fork = (ROOT / "runtime" / "forkserver.py").read_text()
    assert "socket.socketpair(" in fork and not any(
        f".{call}(" in fork for call in ("bind", "listen", "connect", "accept")), fork
    # wire.recv is used on the Job's connections only, which are AF_UNIX
    users = {str(p.relative_to(ROOT)) for p in _sources()
             if "wire.recv" in p.read_text() and p.name != "wire.py"}
    assert users == {"runtime/launcher.py", "runtime/worker.py"}, users
    for name in users:
        text = (ROOT / name).read_text()
        assert 'family="AF_UNIX"' in text and "authkey=" in text, name


def worker_facts(comm):
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    return cmdline, "AUTOPAR_JOB_TOKEN" in os.environ


@pytest.mark.native
def test_the_job_token_is_private_and_the_control_socket_folder_too(monkeypatch):
    from autopar.runtime.launcher import Job
    modes, start = [], Job._start

    def watched(self, listener):              # the folder holds the socket while ranks connect
        modes.append(stat.S_IMODE(Path(self._dir.name).stat().st_mode))
        return start(self, listener)
    monkeypatch.setattr(Job, "_start", watched)
    with Job(2, timeout=5.0) as j:
        assert modes == [0o700]
        assert not Path(j._dir.name).exists()  # gone once every rank connected
        for cmdline, token_in_env in j.call(worker_facts, [(), ()]):
            assert j.token not in cmdline and not token_in_env
