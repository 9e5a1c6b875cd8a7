"""Runs `main.py` (a model-written program) in the sandbox, as `python main.py` would.

argv: the user to become ("UID:GID" or "-"), memory bytes, CPU seconds, file bytes, open files, audit hook (1: no OS isolation, the
in-process hook is the only guard; 0: the OS sandbox is), and optionally `serve REQUEST_FD
REPLY_FD`: after the program ran, answer the test harness's requests for its names (calls,
attributes, items, iteration) until the harness hangs up. Everything here is the program's to
tamper with: the harness trusts nothing it says beyond plain values (plain_values.py).
"""

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import child_limits  # noqa: E402
import plain_values  # noqa: E402

BIG_GLOBAL = 64 * 1024  # bytes of JSON past which a global is sent as a handle


def install_audit_hook(root: str) -> None:
    """Without OS isolation: refuse network use, process spawning, killing other processes,
    raising limits and the usual write calls outside `root`. Best effort (it does not see
    dir_fd), which is why running without OS isolation needs an opt-in named unsafe."""
    def hook(event, args, root=root, real=os.path.realpath, fsdecode=os.fsdecode, sep=os.sep,
             isinstance=isinstance, paths=(str, bytes, os.PathLike),
             writes=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
        # Decisions use only literals and defaults bound at creation: the program can reach and
        # patch module globals, not these.
        if event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                             "os.fork", "os.kill", "signal.pthread_kill", "pty.", "ctypes.",
                             "resource.setrlimit", "resource.prlimit", "gc.get_")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in {"_posixsubprocess", "_ctypes", "_xxsubinterpreters",
                                             "_testcapi", "_testinternalcapi"}:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open":
            targets = args[:1] if isinstance(args[2], int) and args[2] & writes else ()
        elif event in {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                       "os.symlink", "os.truncate", "os.utime", "shutil.rmtree"}:
            targets = args[:2]
        else:
            return
        for path in targets:
            if isinstance(path, paths):
                path = fsdecode(real(path))
                if path != root and not path.startswith(root + sep):
                    raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed")
    sys.addaudithook(hook)


class Served:
    """The program's objects the harness holds handles to, and the answers to its requests."""

    def __init__(self) -> None:
        self.objects: list = []

    def out(self, value):
        return plain_values.encode(value, self.handle)

    def handle(self, obj) -> dict:
        self.objects.append(obj)
        return {"handle": len(self.objects) - 1}

    def into(self, data):
        return plain_values.decode(data, self.objects.__getitem__)

    def answer(self, request: dict) -> dict:
        op, target = request["op"], self.objects[request["handle"]]
        if op == "call":
            args = [self.into(a) for a in request["args"]]
            kwargs = {k: self.into(v) for k, v in request["kwargs"].items()}
            value = target(*args, **kwargs)
            # Arguments changed in place (a list sorted by the function) go back to the harness.
            after = {str(i): self.out(a) for i, a in enumerate(args) if type(a) in (list, dict, set)}
            after |= {k: self.out(v) for k, v in kwargs.items() if type(v) in (list, dict, set)}
            return {"value": self.out(value), "after": after}
        if op == "getattr":
            return {"value": self.out(getattr(target, request["name"]))}
        if op == "getitem":
            return {"value": self.out(target[self.into(request["key"])])}
        if op == "len":
            return {"value": len(target)}
        if op == "iter":
            return {"value": self.handle(iter(target))}
        if op == "next":
            return {"value": self.out(next(target))}
        raise ValueError(f"unknown request {op!r}")


def serve(namespace: dict, request_fd: int, reply_fd: int) -> None:
    served = Served()
    names = {}
    for name, value in namespace.items():
        if not name.startswith("__"):
            data = served.out(value)
            # A big global (a precomputed table) stays here, reachable by index and iteration.
            names[name] = data if len(json.dumps(data)) <= BIG_GLOBAL else served.handle(value)
    plain_values.send(reply_fd, {"names": names})
    while (request := plain_values.receive(request_fd)) is not None:
        try:
            reply = served.answer(request)
        except Exception as err:  # noqa: BLE001 - the program's exception is its answer
            reply = {"raised": [type(err).__name__, str(err)[:500]]}
        plain_values.send(reply_fd, reply)


def main() -> None:
    child_limits.become(sys.argv[1])
    memory, cpu, file_bytes, open_files, hook = (int(v) for v in sys.argv[2:7])
    serving = (int(sys.argv[8]), int(sys.argv[9])) if sys.argv[7:8] == ["serve"] else None
    child_limits.apply(memory, cpu, file_bytes, open_files)
    with open("main.py", "rb") as f:
        code = compile(f.read(), "main.py", "exec")
    module = types.ModuleType("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"], sys.argv = module, ["main.py"]
    if hook:
        install_audit_hook(os.path.realpath(os.getcwd()))  # last: nothing of the setup is refused
    exec(code, module.__dict__)
    if serving is not None:
        serve(module.__dict__, *serving)


main()
