"""The test harness: runs a row's tests (asserts) against a program that runs in another sandbox.

argv: the user to become ("UID:GID" or "-"), memory bytes, CPU seconds, file bytes, open files, REPLY_FD, REQUEST_FD, VERDICT_FD; the
tests are read from stdin. The program's top-level names appear here as plain values or as
stand-ins (`Remote`) whose calls, attributes, items and iteration are requests to the program
(run_program.py). The verdict ("pass", or "fail: why") is written to VERDICT_FD, which only
this process has: the program cannot read the tests, reach this process, or write the verdict.
"""

import builtins
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import child_limits  # noqa: E402
import plain_values  # noqa: E402


class ProgramBroke(BaseException):
    """The program broke the exchange (hung up, sent what is not a plain value). A
    BaseException, so that a test's `except Exception` cannot take it for an expected error;
    and remembered, so that not even `except BaseException` can."""

    first = None  # the reason of the first break

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        if ProgramBroke.first is None:
            ProgramBroke.first = reason


class ProgramError(Exception):
    """An exception of the program's that is not a built-in one (its own classes stay there)."""


class Link:
    def __init__(self, reply_fd: int, request_fd: int) -> None:
        self.reply_fd, self.request_fd = reply_fd, request_fd

    def receive(self):
        try:
            message = plain_values.receive(self.reply_fd)
        except (plain_values.NotPlain, OSError) as err:
            raise ProgramBroke(f"the program sent a bad message ({err})") from None
        if type(message) is not dict:
            raise ProgramBroke("the program hung up" if message is None else "the program sent a bad message")
        return message

    def ask(self, request: dict):
        try:
            plain_values.send(self.request_fd, request)
        except OSError:
            raise ProgramBroke("the program hung up") from None
        reply = self.receive()
        if "raised" in reply:
            raise program_exception(reply["raised"], request.get("op"))
        if "value" not in reply:
            raise ProgramBroke("the program sent a bad reply")
        return reply


# Exceptions that steer the harness's own control flow (map, zip and for loops end at a
# StopIteration): the program may raise them only where they mean that, ending an iteration.
_CONTROL_FLOW = ("StopIteration", "StopAsyncIteration")


def program_exception(raised, op: str) -> Exception:
    """The exception the program raised, as a built-in exception of that name if there is one."""
    if not (type(raised) is list and len(raised) == 2 and all(type(v) is str for v in raised)):
        raise ProgramBroke("the program sent a bad exception")
    name, message = raised
    kind = getattr(builtins, name, None)
    if name in _CONTROL_FLOW and not (op == "next" and name == "StopIteration"):
        kind = None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - a built-in that wants other arguments (UnicodeDecodeError)
            pass
    return ProgramError(f"{name}: {message}")


class Remote:
    """A program object that is not a plain value. Equal only to itself; no truth value."""

    __slots__ = ("_handle",)
    link: Link

    def __init__(self, handle: int) -> None:
        object.__setattr__(self, "_handle", handle)

    def _ask(self, op: str, **fields):
        return Remote.link.ask({"op": op, "handle": self._handle, **fields})

    def __call__(self, *args, **kwargs):
        reply = self._ask("call", args=[out(a) for a in args], kwargs={k: out(v) for k, v in kwargs.items()})
        after = reply.get("after", {})
        for key, original in [*((str(i), a) for i, a in enumerate(args)), *kwargs.items()]:
            if key in after and type(original) in (list, dict, set):
                changed = into(after[key])
                if type(changed) is type(original):  # the function changed its argument in place
                    if type(original) is list:
                        original[:] = changed
                    else:
                        original.clear()
                        original.update(changed)
        return into(reply["value"])

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return into(self._ask("getattr", name=name)["value"])

    def __getitem__(self, key):
        return into(self._ask("getitem", key=out(key))["value"])

    def __len__(self) -> int:
        value = self._ask("len")["value"]
        if type(value) is not int:
            raise ProgramBroke("the program sent a bad length")
        return value

    def __iter__(self):
        iterator = into(self._ask("iter")["value"])
        while True:
            try:
                yield into(iterator._ask("next")["value"])
            except StopIteration:
                return

    def __bool__(self):
        raise TypeError("the program returned an object that is not a plain value; it has no truth value here")

    def __repr__(self) -> str:
        return f"<program object {self._handle}>"


def into(data):
    try:
        return plain_values.decode(data, Remote)
    except plain_values.NotPlain as err:
        raise ProgramBroke(f"the program sent a bad value ({err})") from None


def out(value):
    def other(obj):
        if type(obj) is Remote:
            return {"handle": obj._handle}
        raise TypeError(f"tests can pass the program plain values and its own objects, not {type(obj).__name__}")
    return plain_values.encode(value, other)


def usable_name(name) -> bool:
    """Whether a name the program sent may be bound for the tests. Not a dunder (__builtins__
    would reach into the harness), not a built-in (a program's `abs`, `all` or `zip` would
    decide the tests' own checks), not a standard module (a `math` whose `isclose` always says
    yes, for tests that use math without importing it)."""
    return (type(name) is str and not name.startswith("__") and not hasattr(builtins, name)
            and name not in sys.stdlib_module_names)


def names_used(code) -> set[str]:
    """Every global or attribute name the compiled tests mention, nested functions included."""
    found = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            found |= names_used(const)
    return found


def verdict(tests: str, link: Link) -> str:
    names = link.receive().get("names")
    if type(names) is not dict:
        raise ProgramBroke("the program sent a bad list of names")
    try:
        code = compile(tests, "tests.py", "exec")
    except BaseException as err:  # noqa: BLE001 - the row's tests are data: they may not compile
        return f"fail: the tests do not compile: {type(err).__name__}: {str(err)[:200]}"
    # A program's function named like a built-in the tests call (a task "write pow") is not
    # bound for them, so they would check Python's own: the verdict cannot tell, so it fails.
    shadowed = sorted(name for name in names if type(name) is str and not name.startswith("__")
                      and hasattr(builtins, name) and name in names_used(code))
    if shadowed:
        return (f"fail: the program defines {shadowed[0]!r}, a built-in name the tests use, so the tests "
                "cannot tell the program's from Python's (name the task's function otherwise)")
    bound = {name: data for name, data in names.items() if usable_name(name)}
    if not bound.keys() & names_used(code):  # tests that check only Python itself pass any program
        return "fail: the tests use none of the program's names"
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    namespace |= {name: into(data) for name, data in bound.items()}
    try:
        exec(code, namespace)
    except ProgramBroke:
        raise
    except BaseException as err:  # noqa: BLE001 - any way the tests did not run to the end
        return f"fail: {type(err).__name__}: {str(err)[:200]}"
    if ProgramBroke.first is not None:  # the tests swallowed it
        raise ProgramBroke(ProgramBroke.first)
    return "pass"


def main() -> None:
    child_limits.become(sys.argv[1])
    memory, cpu, file_bytes, open_files, reply_fd, request_fd, verdict_fd = (int(v) for v in sys.argv[2:9])
    tests = sys.stdin.read()
    child_limits.apply(memory, cpu, file_bytes, open_files)
    Remote.link = Link(reply_fd, request_fd)
    try:
        result = verdict(tests, Remote.link)
    except ProgramBroke as err:
        result = f"fail: {err}"
    os.write(verdict_fd, " ".join(result.split()).encode()[:1000])


main()
