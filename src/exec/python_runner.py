# airlock's runner for `protocol = "python"` tools, run in the sandboxed worker as
# `PYTHON -I -B -c RUNNER ENTRY [PATH]...`. It reads the json protocol's request on stdin,
# imports ENTRY (`package.module:function`) with each PATH first on sys.path, calls the
# function with the call's arguments as keyword arguments (and `session`, the request's
# session object, if the function has a parameter of that name), and writes ONE JSON object
# on its stdout, which the daemon checks (src/exec/protocol.rs, `python_reply`):
#   {"response": {...}}   a str (a text block) or a dict of the json protocol's response keys
#   {"result": value}     any other JSON value: the structured result
#   {"raised": {"type": "ValueError", "message": "..."}}   the import or the call raised
#   {"fault": "..."}      the return value cannot be sent (JSON cannot hold it)
# Nothing else reaches stdout: fd 1 is pointed at stderr before anything is imported, so a
# print() (or a child process) cannot corrupt the reply; the reply goes to a private dup.
import os
import sys

_reply_fd = os.dup(1)
os.dup2(2, 1)

import importlib
import inspect
import json
import traceback

_RESPONSE_KEYS = {"content", "state", "isError"}


def _type_name(e):
    t = type(e)
    if t.__module__ == "builtins":
        return t.__qualname__
    return t.__module__ + "." + t.__qualname__


def _reply(obj):
    try:
        data = json.dumps(obj, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        data = json.dumps({"fault": "the function returned %s" % e}).encode()
    view = memoryview(data)
    while view:
        n = os.write(_reply_fd, view)
        view = view[n:]


def _raised(e):
    traceback.print_exc()
    _reply({"raised": {"type": _type_name(e), "message": str(e)}})


def _call(request):
    entry = sys.argv[1]
    for p in reversed(sys.argv[2:]):
        if not os.path.isabs(p):
            # Relative to the working directory: the worker cannot search a directory above
            # it. importlib makes every sys.path entry absolute, so the directory is held
            # open and named through /proc/self/fd, which needs no search right above it.
            p = "/proc/self/fd/%d" % os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        sys.path.insert(0, p)
    module_name, _, attr = entry.partition(":")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError("%s is not callable" % entry)
    kwargs = dict(request.get("arguments") or {})
    kwargs.pop("session", None)
    session = request.get("session")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "session" in params and session is not None:
        kwargs["session"] = session
    return fn(**kwargs)


def _main():
    try:
        request = json.loads(sys.stdin.buffer.read())
        value = _call(request)
    except BaseException as e:
        _raised(e)
        return
    if isinstance(value, str):
        _reply({"response": {"content": [{"type": "text", "text": value}]}})
    elif value is None:
        _reply({"response": {}})
    elif isinstance(value, dict) and value and set(value) <= _RESPONSE_KEYS:
        _reply({"response": value})
    else:
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            _reply({"fault": "the function returned a value of type %s that JSON cannot hold (%s)"
                    % (type(value).__qualname__, e)})
            return
        _reply({"result": value})


_main()
sys.stdout.flush()
sys.stderr.flush()
