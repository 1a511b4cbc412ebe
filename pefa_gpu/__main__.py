"""``python -m pefa_gpu`` and the ``pefa-gpu`` command (:func:`run`)."""

import sys


def run() -> int:
    """:func:`pefa_gpu.cli.main`, and 130 without a traceback for a Ctrl-C before it catches
    one: while the command's modules are imported (numpy, ...) or its arguments parsed."""
    try:
        from .cli import main

        return main()
    except KeyboardInterrupt:
        print("pefa-gpu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(run())
