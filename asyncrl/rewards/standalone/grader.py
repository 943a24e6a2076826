"""The grader: a trusted process, outside the sandbox, that runs the tests.

Started by ``asyncrl.rewards.code`` as ``python -I -S grader.py`` with the test spec
on stdin and two pipe descriptors to the candidate server in the sandbox. It writes one
JSON verdict per test to its stdout, then ``{"done": true}``. Standard library only.

How a test runs:
  * ``{"input", "output"}`` (stdin/stdout): the server runs the program with that input
    and returns its stdout; the comparison happens here.
  * a Python snippet (``assert add(1, 2) == 3``, or HumanEval's ``check`` and a call):
    it is executed *here*, in a namespace holding the trusted ``code_prefix`` (the
    dataset's prompt: helper functions, imports) and, for every other name the tests
    use that the candidate defines, a ``Remote`` stand-in. Calling a stand-in sends the
    (plain) arguments to the sandbox and returns the (plain) result; an object that is
    not a plain value comes back as another ``Remote`` that supports only attribute
    access and calls: it equals nothing but itself and has no truth value, so a
    candidate's ``__eq__``/``__bool__`` never reaches a comparison made here.
    Functions of the prefix whose body is only a docstring (``pass``, ``...``, imports)
    are the stubs the response completes; they resolve to the candidate's.
  * each test has ``per_test_timeout_s`` (a SIGALRM here, and each call's remaining
    share is armed in the sandbox too). A server that stops answering fails the rest.
"""
import ast
import builtins
import json
import os
import resource
import select
import signal
import symtable
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire  # noqa: E402
from boot import add_site_packages  # noqa: E402

sys.path.pop(0)

GRACE_S = 0.5  # past a call's own deadline before the server counts as unresponsive


class SandboxGone(Exception):
    """The candidate server died or stopped answering."""


class TestTimeout(Exception):
    """The test used up its time."""


class Connection:
    """Request/reply over the two pipes; the reply must carry the request's id."""

    def __init__(self, request_fd: int, reply_fd: int):
        self.out = os.fdopen(request_fd, "wb", buffering=0)
        self.reply_fd = reply_fd
        self.buffer = b""
        self.next_id = 0
        self.dead = ""
        self.deadline = None  # the current test's, set by the runner

    def request(self, op: str, **fields):
        if self.dead:
            raise SandboxGone(self.dead)
        self.next_id += 1
        remaining = None if self.deadline is None else max(0.01, self.deadline - time.monotonic())
        message = {"id": self.next_id, "op": op, **fields}
        if remaining is not None:
            message["timeout_s"] = remaining
        try:
            self.out.write(wire.dumps(message))
        except (BrokenPipeError, OSError) as err:
            self.dead = f"the sandbox is gone ({type(err).__name__})"
            raise SandboxGone(self.dead) from None
        wait_until = None if remaining is None else time.monotonic() + remaining + GRACE_S
        while True:
            reply = wire.loads(self._line(wait_until))
            if reply.get("id") == self.next_id:
                return reply

    def _line(self, wait_until) -> bytes:
        while b"\n" not in self.buffer:
            timeout = None if wait_until is None else max(0.0, wait_until - time.monotonic())
            ready, _, _ = select.select([self.reply_fd], [], [], timeout)
            if not ready:
                self.dead = "the sandbox stopped answering"
                raise SandboxGone(self.dead)
            chunk = os.read(self.reply_fd, 1 << 16)
            if not chunk:
                self.dead = "the sandbox exited"
                raise SandboxGone(self.dead)
            self.buffer += chunk
            if len(self.buffer) > wire.MAX_LINE_BYTES:
                self.dead = "the sandbox sent an oversized reply"
                raise SandboxGone(self.dead)
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def raise_candidate_error(error) -> None:
    """Re-raise the candidate's exception here as the builtin of that name (so tests
    that expect, e.g., ValueError work), never as anything that could stop the grader."""
    kind = error.get("type") if isinstance(error, dict) else None
    message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    cls = getattr(builtins, kind, None) if isinstance(kind, str) else None
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, (TestTimeout, SandboxGone)):
        try:
            raise cls(message)
        except TypeError:  # exception classes that need other arguments (UnicodeError...)
            pass
    raise CandidateError(f"{kind}: {message}")


class CandidateError(Exception):
    """An exception raised in the candidate that is not a builtin exception."""


class Remote:
    """A candidate object that stays in the sandbox. Supports calls and attributes only."""

    __slots__ = ("_key", "_conn")

    def __init__(self, key: int, conn: Connection):
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_conn", conn)

    def __call__(self, *args, **kwargs):
        conn = object.__getattribute__(self, "_conn")
        reply = conn.request("call", target=object.__getattribute__(self, "_key"),
                             args=wire.encode(list(args), _HandleArgs()), kwargs=wire.encode(kwargs, _HandleArgs()))
        if "error" in reply:
            raise_candidate_error(reply["error"])
        after = decode_value(reply.get("args"), conn)
        write_back(args, after)
        return decode_value(reply.get("value"), conn)

    def __getattr__(self, name):
        conn = object.__getattribute__(self, "_conn")
        reply = conn.request("getattr", target=object.__getattribute__(self, "_key"), name=name)
        if "error" in reply:
            raise_candidate_error(reply["error"])
        return decode_value(reply.get("value"), conn)

    def __setattr__(self, name, value):
        raise TypeError("a candidate object cannot be modified from the tests")

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError("a candidate object (not a plain value) has no truth value in the tests")

    def __repr__(self):
        return f"<candidate object #{object.__getattribute__(self, '_key')}>"


class _HandleArgs:
    """Arguments may carry Remote objects back to the sandbox as their handles."""

    def add(self, obj) -> int:
        if isinstance(obj, Remote):
            return object.__getattribute__(obj, "_key")
        raise wire.WireError(f"cannot send a {type(obj).__name__} to the candidate (only plain values)")


def decode_value(data, conn: Connection):
    return wire.decode(data, make_handle=lambda key: Remote(key, conn))


def write_back(args: tuple, after) -> None:
    """Arguments the candidate changed in place (lists, dicts, sets) change here too."""
    if not isinstance(after, list) or len(after) != len(args):
        return
    for mine, theirs in zip(args, after):
        if isinstance(mine, list) and isinstance(theirs, list):
            mine[:] = theirs
        elif isinstance(mine, dict) and isinstance(theirs, dict):
            mine.clear()
            mine.update(theirs)
        elif isinstance(mine, set) and isinstance(theirs, set):
            mine.clear()
            mine.update(theirs)


# -- names: what is trusted, what is the candidate's --------------------------------

def is_stub(node) -> bool:
    """A function whose body is only a docstring / pass / ``...`` / imports (HumanEval/115
    imports before its docstring): the response completes it."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for statement in node.body:
        if isinstance(statement, (ast.Pass, ast.Import, ast.ImportFrom)):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # a docstring or Ellipsis
        return False
    return True


def trusted_namespace(prefix: str) -> tuple[dict, set, str]:
    """(namespace of the prefix without its stubs, stub names, error) run here."""
    namespace = {"__name__": "__grader__", "__builtins__": builtins}
    if not prefix.strip():
        return namespace, set(), ""
    try:
        tree = ast.parse(prefix)
    except SyntaxError as err:
        return namespace, set(), f"code_prefix does not parse on its own ({err.msg}); its names come from the candidate"
    stubs = {node.name for node in tree.body if is_stub(node)}
    try:
        exec(compile(tree, "code_prefix.py", "exec"), namespace)
    except Exception as err:
        return {"__name__": "__grader__", "__builtins__": builtins}, set(), f"code_prefix raised {type(err).__name__}: {err}"
    for name in stubs:
        namespace.pop(name, None)
    return namespace, stubs, ""


def used_names(sources: list[str]) -> set:
    """The global names the tests read and do not define themselves (symtable: module
    scope reads, and implicit globals of nested functions)."""
    used = set()
    for source in sources:
        try:
            top = symtable.symtable(source, "test.py", "exec")
        except SyntaxError:
            continue
        bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
        pending = [top]
        while pending:
            table = pending.pop()
            for symbol in table.get_symbols():
                reads_global = symbol.is_referenced() and (table is top or symbol.is_global())
                if reads_global and symbol.get_name() not in bound:
                    used.add(symbol.get_name())
            pending.extend(table.get_children())
    return used


# -- running ----------------------------------------------------------------------

def on_alarm(signum, frame):
    raise TestTimeout("test timed out")


def same_output(got: str, want: str) -> bool:
    """Equal up to trailing whitespace per line and blank lines at the ends."""
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


class Runner:
    def __init__(self, spec: dict, conn: Connection, emit):
        self.spec, self.conn, self.emit = spec, conn, emit
        self.timeout_s = float(spec["per_test_timeout_s"])
        self.base = None  # namespace for snippet tests, built on first use
        self.setup_error = ""

    def run_all(self) -> None:
        for index, test in enumerate(self.spec["tests"]):
            self.conn.deadline = time.monotonic() + self.timeout_s
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s + 2 * GRACE_S)
            try:
                passed, error = self.run_one(test)
            except BaseException as err:  # the test's own assertion, a candidate error, a timeout...
                passed, error = False, f"{type(err).__name__}: {err}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                self.conn.deadline = None
            self.emit({"test": index, "passed": passed, "error": error[-500:]})

    def run_one(self, test) -> tuple[bool, str]:
        if isinstance(test, dict):
            reply = self.conn.request("main", stdin=str(test.get("input", "")))
            if "error" in reply:
                raise_candidate_error(reply["error"])
            got = reply.get("stdout")
            if not isinstance(got, str):
                return False, "the sandbox returned no stdout"
            want = str(test.get("output", ""))
            ok = same_output(got, want)
            return ok, "" if ok else f"expected {want[:200]!r}, got {got[:200]!r}"
        if self.base is None:
            self.base = self.namespace()
        if self.setup_error:
            return False, self.setup_error
        exec(compile(test, "test.py", "exec"), dict(self.base))
        return True, ""

    def namespace(self) -> dict:
        """The trusted prefix plus Remote stand-ins for the candidate's names."""
        base, stubs, prefix_error = trusted_namespace(self.spec.get("code_prefix", ""))
        reply = self.conn.request("load")
        if "error" in reply:
            error = reply["error"]
            self.setup_error = f"the program failed to load: {error.get('type')}: {error.get('message')}"
            return base
        snippets = [t for t in self.spec["tests"] if isinstance(t, str)]
        forced = stubs | set(filter(None, [self.spec.get("entry_point")]))
        wanted = (used_names(snippets) - set(dir(builtins)) - set(base)) | forced
        reply = self.conn.request("get", names=sorted(wanted))
        if "error" in reply:
            raise_candidate_error(reply["error"])
        values = decode_value(reply.get("value"), self.conn)
        if isinstance(values, dict):
            base.update({k: v for k, v in values.items() if isinstance(k, str) and k in wanted})
            for name in forced - set(values):
                base.pop(name, None)  # a stub the candidate did not define: a NameError, not the stub
        if prefix_error:
            base["__prefix_error__"] = prefix_error
        return base


def main() -> None:
    spec = json.loads(sys.stdin.read())
    add_site_packages()  # the tests may import what the installation has (started with -S)
    memory = int(spec.get("memory_bytes") or 0)
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    verdicts = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what the tests print goes nowhere, not into the verdicts
    sys.stdout = open(os.devnull, "w")
    signal.signal(signal.SIGALRM, on_alarm)
    conn = Connection(spec["request_fd"], spec["reply_fd"])
    Runner(spec, conn, lambda record: verdicts.write(json.dumps(record) + "\n")).run_all()
    verdicts.write(json.dumps({"done": True}) + "\n")


if __name__ == "__main__":
    main()
