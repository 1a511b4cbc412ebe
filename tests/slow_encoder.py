"""An encoder for `pefa-gpu --model slow_encoder:encode` in a subprocess (tests/ on PYTHONPATH):
hashed bag of words (:class:`textdata.BowEncoder`), with what it does steered by environment
variables so that a test knows where the process is:

    SLOW_ENCODER_LOG    file: one line per call, the number of texts asked for
    SLOW_ENCODER_BLOCK  after this many texts, the next call writes SLOW_ENCODER_LOG + ".blocked"
                        and sleeps (for a test to interrupt it there)
    SLOW_ENCODER_FAIL   set: any call raises (the texts must come from the cache)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from textdata import BowEncoder

_BOW = BowEncoder()
_done = 0


def encode(texts):
    global _done
    if os.environ.get("SLOW_ENCODER_FAIL"):
        raise RuntimeError(f"slow_encoder: asked for {len(texts)} texts")
    log = Path(os.environ["SLOW_ENCODER_LOG"])
    block = os.environ.get("SLOW_ENCODER_BLOCK")
    if block is not None and _done >= int(block):
        Path(f"{log}.blocked").write_text(f"{_done}\n")
        time.sleep(120)
    with open(log, "a") as f:
        f.write(f"{len(texts)}\n")
    _done += len(texts)
    return _BOW(texts)


encode.cache_key = "tests.slow_encoder/v1"
