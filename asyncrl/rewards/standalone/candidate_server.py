"""The candidate server: runs inside the sandbox and executes the candidate on request.

It never sees a test. It reads one JSON request per line from the request descriptor
and writes one reply per line to the reply descriptor (both named in the environment),
in the plain values of ``wire``. Requests:

  {"id", "op": "load", "timeout_s"}            run candidate.py's top level as module "solution"
  {"id", "op": "get", "names": [...]}          values of module-level names (objects -> handles)
  {"id", "op": "call", "target", "args", "kwargs", "timeout_s"}
                                                call a handle; reply the result and the
                                                arguments after the call (in-place changes)
  {"id", "op": "getattr", "target", "name"}     an attribute of a handle
  {"id", "op": "main", "stdin", "timeout_s"}    run candidate.py as __main__ with that
                                                stdin; reply its stdout

Replies: {"id", "value": ...} (and "args" for calls), {"id", "stdout": ...}, or
{"id", "error": {"type": "ValueError", "message": "..."}}. A request's ``timeout_s``
arms ITIMER_REAL, which raises TimeoutError in the candidate; a candidate that swallows
it simply stops answering, and the grader fails what is left.

Everything here shares the process with the candidate, which can rewrite any of it: the
design relies on nothing the server does being trusted. The grader only ever receives
plain values (what a candidate could return anyway) and keeps the tests to itself.
"""
import io
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire  # noqa: E402  (the standalone directory, then out of the program's way)

sys.path.pop(0)

MAX_STDOUT_BYTES = 16 * 1024 * 1024
CANDIDATE = "candidate.py"


class Handles:
    """Objects that stay in the sandbox, by number."""

    def __init__(self):
        self.objects = {}

    def add(self, obj) -> int:
        key = len(self.objects) + 1
        self.objects[key] = obj
        return key

    def get(self, key):
        if type(key) is not int or key not in self.objects:
            raise LookupError(f"no candidate object #{key}")
        return self.objects[key]


class BoundedOutput(io.TextIOBase):
    """A stdout that keeps at most MAX_STDOUT_BYTES, then raises (endless printing)."""

    def __init__(self):
        self.parts, self.size = [], 0

    def writable(self):
        return True

    def write(self, text):
        self.size += len(text)
        if self.size > MAX_STDOUT_BYTES:
            raise OSError("output limit reached")
        self.parts.append(text)
        return len(text)

    def getvalue(self) -> str:
        return "".join(self.parts)


def on_alarm(signum, frame):
    raise TimeoutError("test timed out")


def arm(timeout_s) -> None:
    if isinstance(timeout_s, (int, float)) and timeout_s > 0:
        signal.setitimer(signal.ITIMER_REAL, float(timeout_s))


def disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)


class Server:
    def __init__(self, source: str):
        self.source = source
        self.module = None
        self.handles = Handles()

    def load(self, request):
        self.module = {"__name__": "solution", "__file__": CANDIDATE}
        arm(request.get("timeout_s"))
        try:
            exec(compile(self.source, CANDIDATE, "exec"), self.module)
        finally:
            disarm()
        return {}

    def get(self, request):
        values = {}
        for name in request["names"]:
            if self.module is not None and type(name) is str and name in self.module:
                values[name] = wire.encode(self.module[name], self.handles)
        return {"value": {"$": "dict", "v": [[k, v] for k, v in values.items()]}}

    def call(self, request):
        target = self.handles.get(request["target"])
        args = wire.decode(request["args"], make_handle=self.handles.get)
        kwargs = wire.decode(request["kwargs"], make_handle=self.handles.get)
        arm(request.get("timeout_s"))
        try:
            value = target(*args, **kwargs)
        finally:
            disarm()
        return {"value": wire.encode(value, self.handles), "args": wire.encode(args, self.handles)}

    def getattr(self, request):
        return {"value": wire.encode(getattr(self.handles.get(request["target"]), request["name"]), self.handles)}

    def main(self, request):
        """Run the program as a script with ``stdin``; its stdout is the answer."""
        real = sys.stdin, sys.stdout
        sys.stdin = io.StringIO(str(request.get("stdin", "")))
        sys.stdout = captured = BoundedOutput()
        arm(request.get("timeout_s"))
        try:
            exec(compile(self.source, CANDIDATE, "exec"), {"__name__": "__main__", "__file__": CANDIDATE})
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
        finally:
            disarm()
            sys.stdin, sys.stdout = real
        return {"stdout": captured.getvalue()}


def describe(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err)[-1000:]}


def serve() -> None:
    requests = os.fdopen(int(os.environ["ASYNCRL_REQUEST_FD"]), "rb", buffering=0)
    replies = os.fdopen(int(os.environ["ASYNCRL_REPLY_FD"]), "wb", buffering=0)
    with open(CANDIDATE, encoding="utf-8") as fh:
        server = Server(fh.read())
    signal.signal(signal.SIGALRM, on_alarm)
    reader = io.BufferedReader(requests, buffer_size=1 << 16)
    while True:
        line = reader.readline(wire.MAX_LINE_BYTES + 1)
        if not line:
            return
        request_id = None
        try:
            request = wire.loads(line)
            request_id = request.get("id")
            op = request.get("op")
            if op not in ("load", "get", "call", "getattr", "main"):
                raise ValueError(f"unknown op {op!r}")
            reply = getattr(server, op)(request)
        except BaseException as err:  # the candidate's exceptions, SystemExit included
            reply = {"error": describe(err)}
        try:
            replies.write(wire.dumps({"id": request_id, **reply}))
        except (ValueError, OverflowError, RecursionError) as err:  # e.g. an int too long for JSON
            replies.write(wire.dumps({"id": request_id, "error": describe(err)}))


if __name__ == "__main__":
    serve()
