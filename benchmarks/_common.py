"""Shared helpers for benchmarks: the stamp (machine, versions, date) and result writing."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

RESULTS = Path(__file__).resolve().parent / "results"
SHARED = Path(os.environ.get("PEFA_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SCIFACT = SHARED / "datasets" / "scifact"


def stamp() -> dict[str, Any]:
    """Machine, library versions and date, for every result file."""
    import numpy
    import scipy
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg_1_5_15": os.getloadavg(),
    }
    for mod in ("faiss", "cupy", "sentence_transformers", "pecos"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    return info


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_results(name: str, data: dict[str, Any], table_md: str) -> Path:
    """Write results/{name}.json (data + stamp) and results/{name}.md (stamp + table)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    st = stamp()
    (RESULTS / f"{name}.json").write_text(json.dumps({"stamp": st, **data}, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(stamp_line(st) + "\n\n" + table_md.rstrip() + "\n")
    return RESULTS / f"{name}.json"


def stamp_line(st: dict[str, Any]) -> str:
    """A result's first line: date, machine, load and versions from :func:`stamp`."""
    return (f"_{st['date']} · {st['processor']} ({st['cpus']} cpus) · "
            f"{'GPU ' + st['cuda_device'] if st['cuda_device'] else 'no GPU'} · "
            f"load {st['load_avg_1_5_15'][0]:.1f} · "
            f"torch {st['torch']}, numpy {st['numpy']}, scipy {st['scipy']}"
            + (f", faiss {st['faiss']}" if "faiss" in st else "") + "_")


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats printed with 4 decimals."""
    def cell(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


@contextmanager
def timer(out: dict[str, float], key: str) -> Iterator[None]:
    """Adds the wall time of the block, in seconds, to out[key]."""
    t = time.perf_counter()
    yield
    out[key] = out.get(key, 0.0) + time.perf_counter() - t
