"""The child of conftest.run_forked, in its own module: the fork server imports this one, not
conftest (whose torch.cuda.is_available() there would leave CUDA unusable in forked children)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def run(code: str, args: list[str], out: Path, err: Path, environ: dict, cwd: str) -> None:
    """The caller's environment and folder, stdout / stderr to files (native writes too), then
    ``code`` as ``__main__`` with ``sys.argv`` ['-c', *args] (SystemExit sets the exit status)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.argv = ["-c", *args]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
