"""`python -c CODE ARGS` as a module, so a test can fork it from the preloaded forkserver
(`tests.helpers.preloaded.python_module("tests.helpers.code_main", CODE, *ARGS, log=...)`) instead of paying
torch's import in a fresh interpreter: CODE runs as `__main__` with `sys.argv == ["-c", *ARGS]`, as under
`python -c`. Only for processes the test starts, waits for and kills: a forked child runs the atexit handlers at
its end but not the interpreter's other finalizers, and its command line (/proc/PID/cmdline) is the forkserver's."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    code, sys.argv = sys.argv[1], ["-c", *sys.argv[2:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
