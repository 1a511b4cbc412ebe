"""``python -m pefa_gpu``: the ``pefa-gpu`` command."""

import sys

from .cli import main

sys.exit(main())
